"""Llama 2 / 3 / 3.1 and Mistral: the pre-norm decoder block, its HF weight and config maps.

Block (HF ``LlamaDecoderLayer``)::

    h = x + o(attn(rope(q(norm_in(x))), rope(k(.)), v(.)))
    y = h + down(silu(gate(norm_post(h))) * up(norm_post(h)))

Mistral is the same block; its sliding window comes from ``sliding_window_size``.
The block is shared by the other pre-norm families: its attention is GQA (with
``use_qk_norm`` for Qwen3) or MLA (``attention_type=mla``, DeepSeek), and its
feed-forward is the gated MLP or, for MoE layers, the routed ``MoE`` (Mixtral, Qwen3-MoE,
DeepSeek). MoE blocks return ``(y, aux)`` with the MoE's auxiliary losses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.layers.attention import Attention, configured_attention
from nnxtron.layers.mla import MLA
from nnxtron.layers.mlp import GatedMLP
from nnxtron.layers.moe import MoE
from nnxtron.layers.rope import RopeSpec
from nnxtron.models.pattern import PLAIN, LayerKind
from nnxtron.models.registry import Family, WeightMap, register, rms_norm
from nnxtron.parallel.sharding import constrain

RESIDUAL = ("activation_batch", "activation_length", "activation_embed")


def gqa_attention(cfg: Config, rngs: nnx.Rngs, kind: LayerKind, qk_norm: str = "rms") -> Attention:
    """The GQA attention of a layer of ``kind``.

    ``qk_norm`` is what ``use_qk_norm`` means for the family (``rms``, ``gemma`` or
    ``l2``; ``l2`` applies on RoPE layers only, as in Llama 4). Sliding layers of a
    ``sliding_window_pattern`` use ``local_rope_max_timescale`` (unscaled) when set;
    NoPE layers take ``temperature_tuning``. ``cfg.attention`` is resolved per layer for
    this backend (``auto`` is never ``cudnn`` on a chunked layer).
    """
    head_dim = cfg.resolved_head_dim
    rope = RopeSpec.from_config(cfg, head_dim) if kind.rope else None
    if rope is not None and kind.attention == "sliding" and cfg.sliding_window_pattern and cfg.local_rope_max_timescale:
        rope = RopeSpec(head_dim=head_dim, theta=cfg.local_rope_max_timescale, interleave=cfg.rope_interleave)
    norm = qk_norm if cfg.use_qk_norm and (kind.rope or qk_norm != "l2") else "none"
    tuning = (
        (cfg.temperature_tuning_floor_scale, cfg.temperature_tuning_scale) if cfg.temperature_tuning and not kind.rope else None
    )
    return Attention(
        cfg.base_emb_dim,
        cfg.base_num_query_heads,
        cfg.base_num_kv_heads,
        head_dim,
        rope,
        sliding_window=cfg.sliding_window_size if kind.attention == "sliding" else 0,
        chunk_size=cfg.chunk_attn_window_size if kind.attention == "chunked" else 0,
        qk_norm=norm,
        norm_eps=cfg.normalization_layer_epsilon,
        scale=cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else None,
        temperature_tuning=tuning,
        implementation=configured_attention(cfg, chunked=kind.attention == "chunked"),
        dtype=jnp.dtype(cfg.dtype),
        weight_dtype=jnp.dtype(cfg.weight_dtype),
        rngs=rngs,
    )


class LlamaBlock(nnx.Module):
    """Pre-norm attention + pre-norm feed-forward; ``kind.moe`` selects the routed MoE feed-forward.

    ``qk_norm``: what ``use_qk_norm`` means for the family (see ``gqa_attention``).
    """

    def __init__(self, cfg: Config, rngs: nnx.Rngs, kind: LayerKind = PLAIN, qk_norm: str = "rms"):
        dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
        self.pre_attention_norm = rms_norm(cfg)
        if cfg.attention_type == "mla":
            self.attention = MLA(cfg, rngs)
        else:
            self.attention = gqa_attention(cfg, rngs, kind, qk_norm)
        self.post_attention_norm = rms_norm(cfg)
        if kind.moe:
            self.mlp = MoE(cfg, rngs)
        else:
            self.mlp = GatedMLP(
                cfg.base_emb_dim, cfg.base_mlp_dim, cfg.mlp_activations[0], dtype=dtype, weight_dtype=weight_dtype, rngs=rngs
            )
        self.moe = kind.moe

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array | tuple[jax.Array, dict]:
        x = checkpoint_name(constrain(x, RESIDUAL), "decoder_layer_input")
        h = x + self.attention(self.pre_attention_norm(x), positions, segment_ids)
        if not self.moe:
            return h + self.mlp(self.post_attention_norm(h))
        y, aux = self.mlp(self.post_attention_norm(h))
        return h + y, aux


NORM_WEIGHTS = (
    WeightMap("pre_attention_norm/scale", "input_layernorm.weight"),
    WeightMap("post_attention_norm/scale", "post_attention_layernorm.weight"),
)
GQA_WEIGHTS = (
    WeightMap("attention/query/kernel", "self_attn.q_proj.weight", 1),
    WeightMap("attention/key/kernel", "self_attn.k_proj.weight", 1),
    WeightMap("attention/value/kernel", "self_attn.v_proj.weight", 1),
    WeightMap("attention/out/kernel", "self_attn.o_proj.weight", 2),
)
QK_NORM_WEIGHTS = (
    WeightMap("attention/query_norm/scale", "self_attn.q_norm.weight"),
    WeightMap("attention/key_norm/scale", "self_attn.k_norm.weight"),
)


def gated_mlp_weights(prefix: str, hf_prefix: str) -> tuple[WeightMap, ...]:
    """A GatedMLP at ``prefix`` <-> HF ``{hf_prefix}.{gate,up,down}_proj``."""
    return (
        WeightMap(f"{prefix}/wi_0/kernel", f"{hf_prefix}.gate_proj.weight", 1),
        WeightMap(f"{prefix}/wi_1/kernel", f"{hf_prefix}.up_proj.weight", 1),
        WeightMap(f"{prefix}/wo/kernel", f"{hf_prefix}.down_proj.weight", 1),
    )


LAYER_WEIGHTS = NORM_WEIGHTS + GQA_WEIGHTS + gated_mlp_weights("mlp", "mlp")


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    return LAYER_WEIGHTS


def top_weights(cfg: Config) -> tuple[WeightMap, ...]:
    maps = [WeightMap("embed/embedding", "model.embed_tokens.weight"), WeightMap("final_norm/scale", "model.norm.weight")]
    if not cfg.logits_via_embedding:
        maps.append(WeightMap("logits/kernel", "lm_head.weight", 1))
    return tuple(maps)


def rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """nnxtron RoPE values from an HF config (transformers 5 ``rope_parameters`` or 4.x keys)."""
    rope = dict(hf.get("rope_parameters") or {})
    if not rope:  # transformers 4.x layout
        rope = dict(hf.get("rope_scaling") or {})
        rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    out: dict[str, Any] = {"rope_max_timescale": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if kind == "default":
        out["rope_type"] = "default"
    elif kind == "llama3":
        out.update(
            rope_type="llama3",
            rope_scaling_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    elif kind == "yarn":
        if rope.get("truncate", True) is not True or rope.get("attention_factor") is not None:
            raise ConfigError("HF yarn rope_parameters with truncate=false or an explicit attention_factor are not supported")
        out.update(
            rope_type="yarn",
            rope_scaling_factor=float(rope["factor"]),
            rope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            max_position_embeddings=int(hf.get("max_position_embeddings") or rope["original_max_position_embeddings"]),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            mscale=float(rope.get("mscale") or 0.0),  # 0 = absent (HF semantics)
            mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
        )
    else:
        raise ConfigError(f"HF rope_type '{kind}' is not supported; supported: default, llama3, yarn")
    return out


def rope_to_hf(cfg: Config) -> dict[str, Any]:
    """The HF ``rope_parameters`` of ``cfg``."""
    rope: dict[str, Any] = {"rope_theta": cfg.rope_max_timescale, "rope_type": cfg.rope_type}
    if cfg.rope_type == "llama3":
        rope.update(
            factor=cfg.rope_scaling_factor,
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
        )
    elif cfg.rope_type == "yarn":
        rope.update(
            factor=cfg.rope_scaling_factor,
            original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
            beta_fast=cfg.beta_fast,
            beta_slow=cfg.beta_slow,
            mscale=cfg.mscale,
            mscale_all_dim=cfg.mscale_all_dim,
        )
    return rope


def common_config_from_hf(hf: dict[str, Any], decoder_block: str) -> dict[str, Any]:
    """The config values every pre-norm family reads the same way from an HF ``config.json``."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"HF hidden_act '{hf['hidden_act']}' is not supported; only silu")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"HF {flag}=true is not supported by decoder_block {decoder_block}")
    heads = int(hf["num_attention_heads"])
    values = {
        "decoder_block": decoder_block,
        "base_emb_dim": int(hf["hidden_size"]),
        "base_num_query_heads": heads,
        "base_num_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "head_dim": int(hf.get("head_dim") or hf["hidden_size"] // heads),
        "base_mlp_dim": int(hf["intermediate_size"]),
        "base_num_decoder_layers": int(hf["num_hidden_layers"]),
        "vocab_size": int(hf["vocab_size"]),
        "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
        "sliding_window_size": int(hf.get("sliding_window") or 0),
        "rope_interleave": False,
        "mlp_activations": ["silu", "linear"],
    }
    values.update(rope_from_hf(hf))
    return values


def common_config_to_hf(cfg: Config, model_type: str, architecture: str) -> dict[str, Any]:
    """The HF ``config.json`` entries shared by the pre-norm families."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": cfg.base_emb_dim,
        "num_attention_heads": cfg.base_num_query_heads,
        "num_key_value_heads": cfg.base_num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "intermediate_size": cfg.base_mlp_dim,
        "num_hidden_layers": cfg.base_num_decoder_layers,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.normalization_layer_epsilon,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.logits_via_embedding,
        "rope_parameters": rope_to_hf(cfg),
        "max_position_embeddings": max(cfg.max_target_length, cfg.max_position_embeddings),
        "attention_bias": False,
        "dtype": cfg.weight_dtype,
    }


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """nnxtron config values for an HF Llama/Mistral ``config.json``."""
    return common_config_from_hf(hf, "mistral" if hf["model_type"] == "mistral" else "llama2")


PATTERN_FIELDS = (
    "sliding_window_pattern",
    "nope_layer_interval",
    "chunk_attn_window_size",
    "temperature_tuning",
    "trainable_position_size",
    "query_pre_attn_scalar",
    "local_rope_max_timescale",
)


def check_exportable(cfg: Config, family: str, *, moe: bool = False, qk_norm: bool = False, mla: bool = False) -> None:
    """Raise when ``cfg`` uses a feature the HF class of ``family`` lacks (a Llama-style one)."""
    for name in PATTERN_FIELDS:
        if getattr(cfg, name):
            raise ConfigError(f"{name} has no HF {family} equivalent; export needs {name}=0/false (or a family that has it)")
    if cfg.interleave_moe_layer_step != 1:
        raise ConfigError(f"interleave_moe_layer_step has no HF {family} equivalent; export needs 1")
    if cfg.rope_type == "linear":
        raise ConfigError(f"rope_type=linear is not exported for HF {family}; use default, llama3 or yarn")
    if cfg.num_experts > 1 and not moe:
        raise ConfigError(f"num_experts > 1 has no HF {family} equivalent; export a MoE family (mixtral, qwen3_moe, deepseek)")
    if cfg.use_qk_norm != qk_norm:
        raise ConfigError(f"HF {family} needs use_qk_norm={str(qk_norm).lower()}")
    if (cfg.attention_type == "mla") != mla:
        raise ConfigError(f"HF {family} needs attention_type={'mla' if mla else 'global'}")


def config_to_hf(cfg: Config) -> dict[str, Any]:
    check_exportable(cfg, "Llama/Mistral")
    if cfg.rope_interleave:
        raise ConfigError("rope_interleave=true has no HF Llama/Mistral equivalent; export needs rope_interleave=false")
    mistral = cfg.decoder_block == "mistral"
    hf = common_config_to_hf(cfg, "mistral" if mistral else "llama", "MistralForCausalLM" if mistral else "LlamaForCausalLM")
    if mistral:
        hf["sliding_window"] = cfg.sliding_window_size or None
        del hf["attention_bias"]
    elif cfg.sliding_window_size:
        raise ConfigError("sliding_window_size > 0 has no HF Llama equivalent; use decoder_block=mistral")
    else:
        hf["mlp_bias"] = False
    return hf


def register_pre_norm_family(
    name: str,
    hf_model_type: str,
    hf_architecture: str,
    layer_weights: Callable[[Config, LayerKind], tuple[WeightMap, ...]],
    config_from_hf: Callable[[dict[str, Any]], dict[str, Any]],
    config_to_hf: Callable[[Config], dict[str, Any]],
) -> None:
    """Register a family built from ``LlamaBlock`` with the Llama top-level weights."""
    register(
        (name,),
        Family(
            name=name,
            hf_model_type=hf_model_type,
            hf_architecture=hf_architecture,
            make_block=LlamaBlock,
            layer_weights=layer_weights,
            top_weights=top_weights,
            config_from_hf=config_from_hf,
            config_to_hf=config_to_hf,
        ),
    )


register_pre_norm_family("llama2", "llama", "LlamaForCausalLM", layer_weights, config_from_hf, config_to_hf)
register_pre_norm_family("mistral", "mistral", "MistralForCausalLM", layer_weights, config_from_hf, config_to_hf)
