"""What the config layer knows of a family beyond its name: one ``FamilyRules`` per family that
has any (no JAX; ``models/<family>`` holds the rest of the family, ``models/registry.py`` finds it).

A family with no row here has ``PLAIN``: no rules of its own. A row holds the family's cross-key
check (its own module, ``config/<family>.py``), the keys and values only it reads, and the facts
that translating a MaxText config (``maxtext_keys.py``) and checkpoint (``convert/maxtext*.py``) need.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nnxtron.config import deepseek4, gemma4, gpt3, gpt_oss, olmo3, qwen3_next, simple
from nnxtron.config.options import DECODER_BLOCKS
from nnxtron.errors import ConfigError

if TYPE_CHECKING:
    from nnxtron.config.schema import Config

TOPK_RENORMS = ("always", "score_func", "flag")  # FamilyRules.maxtext_topk_renorm


@dataclass(frozen=True)
class FamilyRules:
    """``check(cfg)`` runs when ``decoder_block`` is this family. ``own_keys``: keys only this family
    reads -> the value every other family must leave them at; ``own_values``: values of shared keys
    only this family takes (both checked by ``checks.check_family``). ``maxtext_query_folded``:
    MaxText's plain attention of this family folds ``1/sqrt(head_dim)`` into the query kernel;
    ``maxtext_topk_renorm``: when MaxText's router renormalises the top-k weights (``always``, by
    ``score_func``, or as the ``flag`` norm_topk_prob says); ``legacy_normalize_embedding_logits``:
    the tied-head normalisation of runs written before that key existed (``loader.LEGACY_VALUES``);
    ``attention_out_bias``: ``attention_bias`` gives the output projection a bias too (MaxText's rule; its
    and HF's Qwen2 bias the query, key and value projections only). ``maxtext_layers_per_layer``: one
    MaxText layer holds this many nnxtron layers, alternating sliding then global (Gemma 2: 2; its
    ``base_num_decoder_layers`` counts them); ``maxtext_post_norms``: the family's layers have the
    post-attention / post-MLP norms MaxText's ``use_post_attn_norm`` / ``use_post_ffw_norm`` switch;
    ``decodes``: the family's layers have attention, so it decodes with a key-value cache (MaxText's
    toy blocks have none: ``check_decodes``); ``layer_attention(cfg, i)``: the attention kind of layer ``i`` when the family fixes it
    (Qwen3-Next: ``linear`` or ``global``), with ``layer_period(cfg)`` the period of that pattern;
    ``maxtext_block_values``: what a MaxText ``decoder_block`` of the family implies (Qwen3-Next: q/k norms);
    ``query_gate``: the query projection also yields a per-head output gate as wide as the query (Qwen3-Next's
    gated attention: ``D x heads x head_dim`` more weights on each full-attention layer, ``config/flops.py``);
    ``maxtext_layer_pattern``: MaxText's block fixes its sliding / global layers (GPT-OSS:
    ``GPT_OSS_ATTENTION_PATTERN``), so a MaxText ``decoder_block`` of it sets ``sliding_window_pattern`` to this;
    ``maxtext_reads``: MaxText keys only this family's MaxText block reads (Gemma 4's global-layer shape and RoPE),
    passed on for it and dropped, unread as in MaxText, for the others (``maxtext_keys.py``); ``dense_shared_expert``:
    the MoE layers' shared expert is the layer's dense MLP, ``base_mlp_dim`` wide (Gemma 4, MaxText's
    ``get_shared_expert_mlp_dim``), not ``base_moe_mlp_dim`` (``config/flops.py``)."""

    check: Callable[[Config], None] | None = None
    own_keys: Mapping[str, Any] = field(default_factory=dict)
    own_values: Mapping[str, Any] = field(default_factory=dict)
    maxtext_query_folded: bool = False
    maxtext_topk_renorm: str = "always"
    legacy_normalize_embedding_logits: bool = False
    attention_out_bias: bool = True
    maxtext_layers_per_layer: int = 1
    maxtext_post_norms: bool = False
    decodes: bool = True
    layer_attention: Callable[[Config, int], str] | None = None
    layer_period: Callable[[Config], int] | None = None
    maxtext_block_values: Mapping[str, Any] = field(default_factory=dict)
    query_gate: bool = False
    maxtext_layer_pattern: int = 0
    maxtext_reads: frozenset[str] = frozenset()
    dense_shared_expert: bool = False


PLAIN = FamilyRules()
_FOLDED = FamilyRules(maxtext_query_folded=True)
_QWEN3_NEXT = FamilyRules(
    check=qwen3_next.check,
    own_keys=qwen3_next.OPTIONS_OFF,
    layer_attention=qwen3_next.layer_attention,
    layer_period=qwen3_next.period,
    maxtext_block_values={"use_qk_norm": True},  # MaxText's Qwen3-Next / Qwen3.5 attention always has its q/k norms
    query_gate=True,
)  # MaxText's plain Attention, without query_pre_attn_scalar
RULES: dict[str, FamilyRules] = {
    "llama2": _FOLDED,
    "mistral": _FOLDED,
    "mixtral": _FOLDED,
    "gemma": _FOLDED,  # MaxText's GemmaDecoderLayer: plain Attention, no query_pre_attn_scalar
    # MaxText's Gemma2DecoderLayer: plain Attention (folded even for gemma2-27b, HF query_pre_attn_scalar 144), a
    # (local, global) pair of layers per MaxText layer
    "gemma2": FamilyRules(maxtext_query_folded=True, maxtext_layers_per_layer=2, maxtext_post_norms=True),
    "qwen2": FamilyRules(attention_out_bias=False),
    "deepseek": FamilyRules(maxtext_topk_renorm="score_func"),
    "gemma3": FamilyRules(legacy_normalize_embedding_logits=True, maxtext_post_norms=True),
    # MaxText's Gemma4DecoderLayer: unscaled logits after its q/k norms, the sandwich norms, softmax over every expert
    # renormalised as norm_topk_prob says; its layer pattern fixed (GEMMA4_ATTENTION_PATTERN)
    "gemma4": FamilyRules(
        check=gemma4.check,
        own_keys=gemma4.OPTIONS_OFF,
        maxtext_topk_renorm="flag",
        maxtext_post_norms=True,
        maxtext_block_values={"use_qk_norm": True, "query_pre_attn_scalar": 1.0},
        maxtext_layer_pattern=gemma4.PATTERN,
        maxtext_reads=gemma4.MAXTEXT_KEYS,
        dense_shared_expert=True,
    ),
    "llama4": FamilyRules(maxtext_topk_renorm="flag"),
    "olmo3": FamilyRules(check=olmo3.check),  # its 3 sliding : 1 global layers
    "gpt_oss": FamilyRules(
        check=gpt_oss.check,
        own_keys=gpt_oss.OPTIONS_OFF,
        own_values={"mlp_activations": gpt_oss.ACTIVATIONS},
        maxtext_layer_pattern=gpt_oss.PATTERN,
    ),
    "qwen3_next": _QWEN3_NEXT,
    "qwen3_5": _QWEN3_NEXT,  # Qwen3.5's text decoder: Qwen3-Next's layers (MaxText's Qwen3_5DecoderLayer reuses them)
    "gpt3": FamilyRules(check=gpt3.check, own_values={"mlp_activations": ("gelu",)}),  # one activation: a plain MLP
    "simple": FamilyRules(check=simple.check, decodes=False),  # MaxText's toy blocks: no experts, no attention
    "simple_mlp": FamilyRules(check=simple.check, decodes=False),
    "deepseek4": FamilyRules(
        check=deepseek4.check,
        own_keys=deepseek4.OPTIONS_OFF,
        own_values={"attention_type": "compressed"},
        maxtext_topk_renorm="score_func",
    ),
}
if not set(RULES) <= set(DECODER_BLOCKS) or any(r.maxtext_topk_renorm not in TOPK_RENORMS for r in RULES.values()):
    raise ImportError(f"config/families.py: rules for {sorted(set(RULES) - set(DECODER_BLOCKS))} or an unknown renorm")


def rules_for(decoder_block: str) -> FamilyRules:
    """The family's rules (``PLAIN`` for a family without any, or a name no family has)."""
    return RULES.get(decoder_block, PLAIN) if isinstance(decoder_block, str) else PLAIN


def check_decodes(cfg: Config) -> None:
    """One error naming ``decoder_block`` when the family cannot decode (generate, serve, the sample
    after training): its layers have no attention, so nothing to cache."""
    if not rules_for(cfg.decoder_block).decodes:
        raise ConfigError(
            f"decoder_block={cfg.decoder_block} has no attention layer, so nothing to cache: it cannot decode "
            "(generate, serve); train and evaluate it, or use a block with attention"
        )
