"""Gemma 3 (text decoder): sliding-window / global layers in a 5:1 pattern, sandwich norms.

HF ``Gemma3ForCausalLM`` (``model_type: gemma3_text``). Per layer::

    a = attn(norm_in(x))            # q/k Gemma RMSNorm before RoPE; logits x query_pre_attn_scalar^-0.5
    h = x + norm_post_attn(a)
    y = h + norm_post_ffw(down(gelu_tanh(gate(norm_pre_ffw(h))) * up(.)))

Every RMSNorm is Gemma's zero-centred ``x_hat * (1 + w)`` computed in float32. Layer
``i`` is global iff ``(i + 1) % sliding_window_pattern == 0`` (6 in the releases), else
sliding-window with its own RoPE base (``local_rope_max_timescale``, unscaled); global
layers use ``rope_max_timescale`` with linear scaling. Token embeddings are multiplied by
``sqrt(emb_dim)`` rounded to the table's dtype (as HF); the head is tied and
``final_logits_soft_cap`` applies when set. Scanned as blocks of whole patterns plus a
``remainder_layers`` block (``config/layout.py``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nnxtron.config.layout import PLAIN, LayerKind
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.layers import dropout
from nnxtron.layers.attention import gqa_attention
from nnxtron.layers.mlp import GatedMLP
from nnxtron.layers.norms import RMSNorm, rms_norm
from nnxtron.models.family import Family, Golden, StrategyRow, WeightMap
from nnxtron.models.hf_common import (
    common_config_to_hf,
    gated_mlp_weights,
    hf_layer_types,
    hf_ties_head,
    optional_size,
    refuse_attention_soft_cap,
    top_weights,
)
from nnxtron.models.maxtext_map import EMBED_SCALE, NORM_OFFSET, MaxTextMap, Rule, attention_rules, mlp_rules
from nnxtron.models.maxtext_map import top_rules as maxtext_top_rules
from nnxtron.parallel.sharding import RESIDUAL, constrain


def gemma_norm(cfg: Config, dim: int | None = None) -> RMSNorm:
    """Gemma's zero-centred RMSNorm (``1 + w``, float32)."""
    return rms_norm(cfg, dim, zero_centered=True)


class Gemma3Block(nnx.Module):
    """One Gemma 3 layer of ``kind`` (sliding or global attention)."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs, kind: LayerKind = PLAIN):
        if kind.moe:
            raise ConfigError("decoder_block gemma3 has no MoE layers; set num_experts=1")
        self.pre_attention_norm = gemma_norm(cfg)
        self.attention = gqa_attention(cfg, rngs, kind, qk_norm="rms_zero_centered")
        self.post_attention_norm = gemma_norm(cfg)
        self.pre_ffw_norm = gemma_norm(cfg)
        self.mlp = GatedMLP(
            cfg.base_emb_dim,
            cfg.base_mlp_dim,
            cfg.mlp_activations[0],
            dtype=jnp.dtype(cfg.dtype),
            weight_dtype=jnp.dtype(cfg.weight_dtype),
            rngs=rngs,
        )
        self.post_ffw_norm = gemma_norm(cfg)
        self.dropout_rate = cfg.dropout_rate

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, dropout_keys: dropout.Keys | None = None
    ) -> jax.Array:
        """With ``dropout_keys`` (training) the MLP's intermediate activations and the layer
        output are dropped, as in MaxText (``layers.dropout``)."""
        x = checkpoint_name(constrain(x, RESIDUAL), "decoder_layer_input")
        h = x + self.post_attention_norm(self.attention(self.pre_attention_norm(x), positions, segment_ids))
        hidden = self.mlp(self.pre_ffw_norm(h), dropout.site_dropout(dropout_keys, self.dropout_rate, dropout.MLP))
        return dropout.dropout(h + self.post_ffw_norm(hidden), dropout_keys, self.dropout_rate, dropout.LAYER_OUTPUT)


LAYER_WEIGHTS = (
    WeightMap("pre_attention_norm/scale", "input_layernorm.weight"),
    WeightMap("attention/query/kernel", "self_attn.q_proj.weight", 1),
    WeightMap("attention/key/kernel", "self_attn.k_proj.weight", 1),
    WeightMap("attention/value/kernel", "self_attn.v_proj.weight", 1),
    WeightMap("attention/out/kernel", "self_attn.o_proj.weight", 2),
    WeightMap("attention/query_norm/scale", "self_attn.q_norm.weight"),
    WeightMap("attention/key_norm/scale", "self_attn.k_norm.weight"),
    WeightMap("post_attention_norm/scale", "post_attention_layernorm.weight"),
    WeightMap("pre_ffw_norm/scale", "pre_feedforward_layernorm.weight"),
    WeightMap("post_ffw_norm/scale", "post_feedforward_layernorm.weight"),
) + gated_mlp_weights("mlp", "mlp")


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    return LAYER_WEIGHTS


MAXTEXT_CYCLE = 6  # MaxText's GEMMA3_ATTENTION_PATTERN length: the layers of one scanned block
_MAXTEXT_NORMS = ("pre_self_attention_norm", "post_self_attention_norm", "pre_ffw_norm", "post_ffw_norm")
_NORMS = ("pre_attention_norm", "post_attention_norm", "pre_ffw_norm", "post_ffw_norm")


def maxtext_layer_rules(cfg: Config, kind: LayerKind) -> tuple[Rule, ...]:
    """MaxText's Gemma 3 layer: its norms store ``w`` where nnxtron stores ``w - 1`` (``NORM_OFFSET``)."""
    rules = [Rule(f"{a}/scale", f"{b}/scale", NORM_OFFSET) for a, b in zip(_MAXTEXT_NORMS, _NORMS, strict=True)]
    rules += [Rule(f"self_attention/{n}_norm/scale", f"attention/{n}_norm/scale", NORM_OFFSET) for n in ("query", "key")]
    return (*attention_rules(cfg), *rules, *mlp_rules("mlp/", "mlp/"))


def maxtext_top_level(cfg: Config) -> tuple[Rule, ...]:
    """The table carries MaxText's ``sqrt(emb_dim)`` input scale (``EMBED_SCALE``); the final norm is Gemma's."""
    return maxtext_top_rules(cfg, embed=EMBED_SCALE, norm=NORM_OFFSET)


def _rope_of(hf: dict[str, Any], layer_type: str) -> dict[str, Any]:
    rope = (hf.get("rope_parameters") or {}).get(layer_type)
    if rope is None:  # transformers 4.x: rope_theta / rope_local_base_freq / rope_scaling
        if layer_type == "sliding_attention":
            return {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10000.0)}
        return {"rope_theta": hf.get("rope_theta", 1000000.0), **(hf.get("rope_scaling") or {"rope_type": "default"})}
    return rope


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """nnxtron config values for an HF ``gemma3_text`` ``config.json``."""
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if hf.get(key):
            raise ConfigError(f"HF Gemma 3 {key}={hf[key]} is not supported by decoder_block gemma3")
    if hf.get("attention_bias"):
        raise ConfigError("HF attention_bias=true is not supported by decoder_block gemma3")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_new"):
        raise ConfigError(f"HF hidden_activation '{hf['hidden_activation']}' is not supported; only gelu_pytorch_tanh")
    layers = int(hf["num_hidden_layers"])
    pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
    expected = hf_layer_types(layers, pattern)
    if list(hf.get("layer_types") or expected) != expected:
        raise ConfigError(
            f"HF layer_types {hf['layer_types']} is not the pattern 'global every {pattern}th layer'; "
            "decoder_block gemma3 supports only that pattern"
        )
    local, full = _rope_of(hf, "sliding_attention"), _rope_of(hf, "full_attention")
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"HF Gemma 3 sliding-layer rope_type '{local['rope_type']}' is not supported; only default")
    full_type = full.get("rope_type", "default")
    if full_type not in ("default", "linear"):
        raise ConfigError(f"HF Gemma 3 global-layer rope_type '{full_type}' is not supported; use default or linear")
    heads, width = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    return {
        "decoder_block": "gemma3",
        "base_emb_dim": width,
        "base_num_query_heads": heads,
        "base_num_kv_heads": optional_size(hf, "num_key_value_heads", heads),
        "head_dim": optional_size(hf, "head_dim", width // heads),
        "base_mlp_dim": int(hf["intermediate_size"]),
        "base_num_decoder_layers": layers,
        "vocab_size": int(hf["vocab_size"]),
        "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", True)),
        "normalize_embedding_logits": True,  # HF's tied head: MaxText's table holds sqrt(emb_dim), divided again
        "final_logits_soft_cap": float(hf.get("final_logit_softcapping") or 0.0),
        "mlp_activations": ["gelu", "linear"],
        "use_qk_norm": True,
        "query_pre_attn_scalar": float(hf["query_pre_attn_scalar"]),
        "sliding_window_size": int(hf["sliding_window"]),
        "sliding_window_pattern": pattern,
        "local_rope_max_timescale": float(local["rope_theta"]),
        "rope_max_timescale": float(full["rope_theta"]),
        "rope_type": full_type,
        "rope_scaling_factor": float(full.get("factor", 1.0)),
        "rope_interleave": False,
        "max_position_embeddings": optional_size(hf, "max_position_embeddings", 131072, zero_is_default=True),
    }


def config_to_hf(cfg: Config) -> dict[str, Any]:
    if cfg.num_experts > 1 or cfg.attention_type != "global" or cfg.rope_interleave or cfg.nope_layer_interval:
        raise ConfigError("HF Gemma 3 has no MoE, MLA, interleaved RoPE or NoPE layers; export a plain gemma3 config")
    refuse_attention_soft_cap(cfg, "Gemma 3")
    if not cfg.sliding_window_pattern or not cfg.use_qk_norm or cfg.rope_type not in ("default", "linear"):
        raise ConfigError("HF Gemma 3 needs sliding_window_pattern > 0, use_qk_norm=true and rope_type default or linear")
    hf = common_config_to_hf(cfg, "gemma3_text", "Gemma3ForCausalLM")
    del hf["hidden_act"]
    full = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_max_timescale}
    if cfg.rope_type == "linear":
        full["factor"] = cfg.rope_scaling_factor
    hf.update(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.resolved_head_dim,
        sliding_window=cfg.sliding_window_size,
        layer_types=hf_layer_types(cfg.base_num_decoder_layers, cfg.sliding_window_pattern),
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.local_rope_max_timescale or cfg.rope_max_timescale},
            "full_attention": full,
        },
        final_logit_softcapping=cfg.final_logits_soft_cap or None,
        attn_logit_softcapping=None,
        tie_word_embeddings=hf_ties_head(cfg, input_scale=True),  # the input scale sqrt(emb_dim): normalize is HF's
        max_position_embeddings=cfg.max_position_embeddings,
    )
    return hf


FAMILIES = (
    Family(
        name="gemma3",
        hf_model_type="gemma3_text",
        hf_architecture="Gemma3ForCausalLM",
        make_block=Gemma3Block,
        layer_weights=layer_weights,
        top_weights=top_weights,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        make_final_norm=gemma_norm,
        scale_embeddings=True,
        maxtext=MaxTextMap(maxtext_layer_rules, maxtext_top_level, scan_cycle=MAXTEXT_CYCLE),
        hf_multimodal_type="gemma3",
        hf_vision_prefixes=("vision_tower.", "multi_modal_projector."),
        goldens=(Golden("gemma3", "gemma3"),),
        strategy_rows=(StrategyRow("gemma3-tiny", True, "full", "fsdp4_tensor2", 2),),  # 8 layers = a 6-layer cycle + 2
    ),
)
