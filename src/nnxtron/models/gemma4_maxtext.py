"""Gemma 4's MaxText checkpoint names (MaxText 0.2.5 ``decoder_block=gemma4``, ``models/gemma4.py``).

A MaxText layer (``Gemma4DecoderLayer``) is ``pre_self_attention_norm``, ``post_self_attention_norm``,
``pre_ffw_norm``, ``post_ffw_norm`` (plain scales, as nnxtron's and HF's: stored as they are),
``self_attention/{query, key, value, out}/kernel`` (heads split as nnxtron's; no ``value`` on a global layer with
``share_kv_projections``; nothing folded: MaxText's logits are unscaled after the q/k norms),
``self_attention/{query_norm, key_norm}/scale`` and ``layer_scalar``; its MLP ``mlp/{wi_0, wi_1, wo}/kernel``, or
with experts ``mlp/moe_block/shared_experts/...`` (the same MLP), ``mlp/moe_block/MoeBlock_0/{gate/kernel, wi_0,
wi_1, wo, per_expert_scale}``, ``mlp/pre_forward_scale_2`` (the router's scale) and
``mlp/{pre_feedforward_layernorm_2, post_feedforward_layernorm_1, post_feedforward_layernorm_2}/scale``. The
embedding table holds MaxText's ``sqrt(emb_dim)`` input scale (``EMBED_SCALE``), as Gemma 3's.

Scanned (``Gemma4ScannableBlock``: five sliding layers, then the global one) under ``decoder/scanned_blocks``
(``models/maxtext_nested.py``: the nested layer axes), the last ``L % 6`` layers in
``decoder/layers_remainder/local_layers``. MaxText's pattern is fixed: a config with another
``sliding_window_pattern`` has no MaxText checkpoint (refused by name).
"""

from __future__ import annotations

from nnxtron.config.gemma4 import PATTERN
from nnxtron.config.layout import LayerKind, attention_shape
from nnxtron.config.schema import Config
from nnxtron.errors import CheckpointError
from nnxtron.models.maxtext_map import EMBED_SCALE, MaxTextMap, Rule, attention_rules, mlp_rules
from nnxtron.models.maxtext_map import top_rules as maxtext_top_rules
from nnxtron.models.maxtext_nested import nested_scan

NORMS = tuple(
    Rule(f"{maxtext}/scale", f"{ours}/scale")
    for maxtext, ours in (
        ("pre_self_attention_norm", "pre_attention_norm"),
        ("post_self_attention_norm", "post_attention_norm"),
        ("pre_ffw_norm", "pre_ffw_norm"),
        ("post_ffw_norm", "post_ffw_norm"),
    )
) + tuple(Rule(f"self_attention/{n}_norm/scale", f"attention/{n}_norm/scale") for n in ("query", "key"))
MOE = "mlp/moe_block/"
EXPERTS = (
    *mlp_rules(f"{MOE}shared_experts/", "mlp/"),
    Rule(f"{MOE}MoeBlock_0/gate/kernel", "experts/router/kernel"),
    *(Rule(f"{MOE}MoeBlock_0/{n}", f"experts/{n}") for n in ("wi_0", "wi_1", "wo", "per_expert_scale")),
    Rule("mlp/pre_forward_scale_2", "experts/router_scale"),
    Rule("mlp/pre_feedforward_layernorm_2/scale", "experts/pre_norm/scale"),
    Rule("mlp/post_feedforward_layernorm_1/scale", "post_mlp_norm/scale"),
    Rule("mlp/post_feedforward_layernorm_2/scale", "experts/post_norm/scale"),
)


def layer_rules(cfg: Config, kind: LayerKind) -> tuple[Rule, ...]:
    """One layer of ``kind``: no value kernel on a global layer with ``share_kv_projections``."""
    if cfg.sliding_window_pattern != PATTERN:
        raise CheckpointError(
            f"MaxText's gemma4 block fixes a global layer every {PATTERN}th (GEMMA4_ATTENTION_PATTERN); a model with "
            f"sliding_window_pattern={cfg.sliding_window_pattern} has no MaxText checkpoint"
        )
    attention = attention_rules(cfg)
    if attention_shape(cfg, kind)[2]:  # the values are the key projection
        attention = tuple(rule for rule in attention if rule.nnxtron != "attention/value/kernel")
    feed_forward = EXPERTS if kind.moe else mlp_rules("mlp/", "mlp/")
    return (*attention, *NORMS, Rule("layer_scalar", "layer_scalar"), *feed_forward)


def top_level(cfg: Config) -> tuple[Rule, ...]:
    """The table carries MaxText's ``sqrt(emb_dim)`` input scale (``EMBED_SCALE``); the final norm is a plain one."""
    return maxtext_top_rules(cfg, embed=EMBED_SCALE)


unscan, scan = nested_scan("scanned_blocks", lambda cfg: PATTERN)
MAXTEXT = MaxTextMap(layer_rules, top_level, unscan=unscan, scan=scan)
