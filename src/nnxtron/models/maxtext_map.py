"""How a family's parameters are named in a MaxText checkpoint: ``Rule``s and ``MaxTextMap``.

A family that MaxText checkpoints convert to and from sets ``Family.maxtext`` to a
``MaxTextMap``: the rules of one layer of each kind, the top-level rules, the MaxText name of
decoder layer ``i`` and how many layers MaxText scans as one block. The generic machinery
(every entry of a model, scanning, the value conventions' arithmetic) is
``convert/maxtext_tree.py``; the pieces below are shared by the pre-norm families.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nnxtron.config.families import rules_for
from nnxtron.config.layout import LayerKind
from nnxtron.config.schema import Config
from nnxtron.errors import CheckpointError

# value conventions between MaxText's parametrisation and nnxtron's (``convert/maxtext_tree.py``)
NONE, QUERY, NORM_OFFSET, EMBED_SCALE = "", "query", "norm_offset", "embed_scale"
SCALE_PLUS_ONE = "scale_plus_one"  # MaxText multiplies by 1 + scale, nnxtron by scale (GPT-3's LayerNorm)
BIAS_COLLECTION = "MoEBiasVar"  # MaxText's nnx.Variable type of the router bias: its collection name


@dataclass(frozen=True)
class Rule:
    """One parameter: its MaxText name, its nnxtron name (relative to the layer or the model),
    the value convention between them, and whether nnxtron holds it as model state."""

    maxtext: str
    nnxtron: str
    convention: str = NONE
    state: bool = False

    def name(self, prefix: str) -> str:
        """The full MaxText name under layer (or module) ``prefix``; state in its collection."""
        return f"{BIAS_COLLECTION}/{prefix}/{self.maxtext}" if self.state else f"{prefix}/{self.maxtext}"


def top_rules(cfg: Config, embed: str = NONE, norm: str = NONE) -> tuple[Rule, ...]:
    """The embedding, the final norm and (untied) the output head, with their conventions."""
    rules = [
        Rule("token_embedder/embedding", "embed/embedding", embed),
        Rule("decoder/decoder_norm/scale", "final_norm/scale", norm),
    ]
    if not cfg.logits_via_embedding:
        rules.append(Rule("decoder/logits_dense/kernel", "logits/kernel"))
    return tuple(rules)


def layer_prefix(cfg: Config, layer: int) -> str:
    """MaxText's unscanned name of decoder layer ``layer`` (one list of layers)."""
    return f"decoder/layers_{layer}"


@dataclass(frozen=True)
class MaxTextMap:
    """A family's MaxText names: ``layer_rules(cfg, kind)`` for one layer, ``top_rules(cfg)``,
    ``layer_prefix(cfg, i)`` for layer ``i``; ``scan_cycle`` (a number, or one per config) > 1 or
    ``scan_blocks``: MaxText scans blocks of that many layers (``decoder/layers/layers_{j}/...``,
    also a block of one with ``scan_blocks``; ``block_layer`` names position ``j``: Qwen3.5's
    ``Qwen3_5ScannableBlock`` ``layer_{j}``) and the last ``L % scan_cycle`` in ``layers_remainder``."""

    layer_rules: Callable[[Config, LayerKind], tuple[Rule, ...]]
    top_rules: Callable[[Config], tuple[Rule, ...]] = top_rules
    layer_prefix: Callable[[Config, int], str] = layer_prefix
    scan_cycle: int | Callable[[Config], int] = 1
    scan_blocks: bool = False
    block_layer: str = "layers"  # position j of a scanned block is ``{block_layer}_{j}``
    # DeepSeek-V4: the first ``scan_prefix(cfg)`` layers stay unscanned (``decoder/layers_{i}``) in a
    # scanned tree, whose blocks MaxText names ``decoder/{scan_group}/layers_{j}``
    scan_prefix: Callable[[Config], int] | None = None
    scan_group: str = "layers"
    # a family's rewrite of the flat unscanned MaxText tree into the arrays its rules name (MaxText
    # arrays that nnxtron joins, splits or lays out otherwise), and back; None: the names as stored
    from_tree: Callable[[dict, Config], dict] | None = None
    to_tree: Callable[[dict, Config], dict] | None = None
    # a family whose scanned tree is not blocks of ``layers_{j}`` (Qwen3-Next: ``layers/{local_layers,
    # global_layer}`` with nested layer axes): its own scanned tree -> unscanned names, and back
    unscan: Callable[[dict, Config], dict] | None = None
    scan: Callable[[dict, Config], dict] | None = None

    def cycle(self, cfg: Config) -> int:
        """The layers of one scanned block of ``cfg``'s model."""
        return self.scan_cycle(cfg) if callable(self.scan_cycle) else self.scan_cycle


def attention_rules(cfg: Config) -> tuple[Rule, ...]:
    """MLA or query/key/value/out attention; the query kernel (and bias) folds ``1/sqrt(head_dim)`` in
    the families ``config/families.py`` marks ``maxtext_query_folded``. With ``attention_bias`` MaxText's
    ``DenseGeneral`` biases (``[heads, head_dim]`` / ``[emb_dim]``, as nnxtron's) sit beside the kernels:
    query, key and value, and out where the family's ``attention_out_bias`` says so (not Qwen2)."""
    if cfg.attention_type == "mla":
        names = ["wkv_a/kernel", "wkv_b/kernel", "kv_norm/scale", "out/kernel"]
        if cfg.q_lora_rank:
            names += ["wq_a/kernel", "wq_b/kernel", "q_norm/scale"]
        rules = [Rule(f"self_attention/{n}", f"attention/{n}") for n in names]
        if not cfg.q_lora_rank:  # the query without a LoRA: MaxText's `query`, nnxtron's (and HF's) `wq`
            rules.append(Rule("self_attention/query/kernel", "attention/wq/kernel"))
        return tuple(rules)
    query = QUERY if rules_for(cfg.decoder_block).maxtext_query_folded else NONE
    rules = [Rule("self_attention/query/kernel", "attention/query/kernel", query)]
    rules += [Rule(f"self_attention/{n}/kernel", f"attention/{n}/kernel") for n in ("key", "value", "out")]
    if cfg.attention_bias:
        rules.append(Rule("self_attention/query/bias", "attention/query/bias", query))
        biased = ("key", "value", "out") if rules_for(cfg.decoder_block).attention_out_bias else ("key", "value")
        rules += [Rule(f"self_attention/{n}/bias", f"attention/{n}/bias") for n in biased]
    return tuple(rules)


def mlp_rules(prefix: str, to: str) -> tuple[Rule, ...]:
    return tuple(Rule(f"{prefix}{n}/kernel", f"{to}{n}/kernel") for n in ("wi_0", "wi_1", "wo"))


def expert_rules(prefix: str) -> tuple[Rule, ...]:
    """A router and the routed experts' stacked kernels under ``prefix``."""
    return (Rule(f"{prefix}gate/kernel", "mlp/router/kernel"),) + tuple(
        Rule(f"{prefix}{n}", f"mlp/{n}") for n in ("wi_0", "wi_1", "wo")
    )


PRE_NORMS = (
    Rule("pre_self_attention_layer_norm/scale", "pre_attention_norm/scale"),
    Rule("post_self_attention_layer_norm/scale", "post_attention_norm/scale"),
)


def pre_norm_map(
    moe_rules: Callable[[Config], tuple[Rule, ...]] | None = None,
    layer_prefix: Callable[[Config, int], str] = layer_prefix,
) -> MaxTextMap:
    """The map of a ``PreNormBlock`` family: attention, two norms and a gated MLP, or
    ``moe_rules(cfg)`` in a MoE layer (None: the family has no MaxText MoE map)."""

    def layer_rules(cfg: Config, kind: LayerKind) -> tuple[Rule, ...]:
        if not kind.moe:
            return (*attention_rules(cfg), *PRE_NORMS, *mlp_rules("mlp/", "mlp/"))
        if moe_rules is None:
            raise CheckpointError(f"decoder_block={cfg.decoder_block} has MoE layers MaxText conversion does not cover")
        return (*attention_rules(cfg), *PRE_NORMS, *moe_rules(cfg))

    return MaxTextMap(layer_rules, layer_prefix=layer_prefix)
