"""Llama 2 / 3 / 3.1 and Mistral: block, layer layout (one homogeneous stack), HF maps.

Block (HF ``LlamaDecoderLayer``)::

    h = x + o(attn(rope(q(norm_in(x))), rope(k(.)), v(.)))
    y = h + down(silu(gate(norm_post(h))) * up(norm_post(h)))

Mistral is the same block; its sliding window comes from ``sliding_window_size``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.layers.attention import Attention
from nnxtron.layers.mlp import GatedMLP
from nnxtron.layers.norms import RMSNorm
from nnxtron.layers.rope import RopeSpec
from nnxtron.models.registry import Family, WeightMap, register
from nnxtron.parallel.sharding import constrain

RESIDUAL = ("activation_batch", "activation_length", "activation_embed")


def rope_spec(cfg: Config) -> RopeSpec:
    return RopeSpec(
        head_dim=cfg.resolved_head_dim,
        theta=cfg.rope_max_timescale,
        interleave=cfg.rope_interleave,
        scaling=cfg.rope_type,
        factor=cfg.rope_scaling_factor,
        low_freq_factor=cfg.rope_low_freq_factor,
        high_freq_factor=cfg.rope_high_freq_factor,
        original_max_position=cfg.rope_original_max_position_embeddings,
    )


class LlamaBlock(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
        norm = dict(eps=cfg.normalization_layer_epsilon, dtype=dtype, weight_dtype=weight_dtype)
        self.pre_attention_norm = RMSNorm(cfg.base_emb_dim, **norm)
        self.attention = Attention(
            cfg.base_emb_dim,
            cfg.base_num_query_heads,
            cfg.base_num_kv_heads,
            cfg.resolved_head_dim,
            rope_spec(cfg),
            sliding_window=cfg.sliding_window_size,
            dtype=dtype,
            weight_dtype=weight_dtype,
            rngs=rngs,
        )
        self.post_attention_norm = RMSNorm(cfg.base_emb_dim, **norm)
        self.mlp = GatedMLP(
            cfg.base_emb_dim, cfg.base_mlp_dim, cfg.mlp_activations[0], dtype=dtype, weight_dtype=weight_dtype, rngs=rngs
        )

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        x = checkpoint_name(constrain(x, RESIDUAL), "decoder_layer_input")
        h = x + self.attention(self.pre_attention_norm(x), positions, segment_ids)
        return h + self.mlp(self.post_attention_norm(h))


LAYER_WEIGHTS = (
    WeightMap("pre_attention_norm/scale", "input_layernorm.weight"),
    WeightMap("attention/query/kernel", "self_attn.q_proj.weight", 1),
    WeightMap("attention/key/kernel", "self_attn.k_proj.weight", 1),
    WeightMap("attention/value/kernel", "self_attn.v_proj.weight", 1),
    WeightMap("attention/out/kernel", "self_attn.o_proj.weight", 2),
    WeightMap("post_attention_norm/scale", "post_attention_layernorm.weight"),
    WeightMap("mlp/wi_0/kernel", "mlp.gate_proj.weight", 1),
    WeightMap("mlp/wi_1/kernel", "mlp.up_proj.weight", 1),
    WeightMap("mlp/wo/kernel", "mlp.down_proj.weight", 1),
)


def top_weights(cfg: Config) -> tuple[WeightMap, ...]:
    maps = [WeightMap("embed/embedding", "model.embed_tokens.weight"), WeightMap("final_norm/scale", "model.norm.weight")]
    if not cfg.logits_via_embedding:
        maps.append(WeightMap("logits/kernel", "lm_head.weight", 1))
    return tuple(maps)


def _rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
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
    else:
        raise ConfigError(f"HF rope_type '{kind}' is not supported for Llama/Mistral; supported: default, llama3")
    return out


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """nnxtron config values for an HF Llama/Mistral ``config.json``."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"HF hidden_act '{hf['hidden_act']}' is not supported; only silu")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"HF {flag}=true is not supported by decoder_block llama2/mistral")
    heads = int(hf["num_attention_heads"])
    values = {
        "decoder_block": "mistral" if hf["model_type"] == "mistral" else "llama2",
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
    values.update(_rope_from_hf(hf))
    return values


def config_to_hf(cfg: Config) -> dict[str, Any]:
    if cfg.rope_interleave:
        raise ConfigError("rope_interleave=true has no HF Llama/Mistral equivalent; export needs rope_interleave=false")
    mistral = cfg.decoder_block == "mistral"
    rope: dict[str, Any] = {"rope_theta": cfg.rope_max_timescale, "rope_type": cfg.rope_type}
    if cfg.rope_type == "llama3":
        rope.update(
            factor=cfg.rope_scaling_factor,
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
        )
    hf: dict[str, Any] = {
        "architectures": ["MistralForCausalLM" if mistral else "LlamaForCausalLM"],
        "model_type": "mistral" if mistral else "llama",
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
        "rope_parameters": rope,
        "max_position_embeddings": max(cfg.max_target_length, cfg.rope_original_max_position_embeddings),
        "dtype": cfg.weight_dtype,
    }
    if mistral:
        hf["sliding_window"] = cfg.sliding_window_size or None
    elif cfg.sliding_window_size:
        raise ConfigError("sliding_window_size > 0 has no HF Llama equivalent; use decoder_block=mistral")
    else:
        hf.update(attention_bias=False, mlp_bias=False)
    return hf


for _name, _type, _arch in (("llama2", "llama", "LlamaForCausalLM"), ("mistral", "mistral", "MistralForCausalLM")):
    register(
        (_name,),
        Family(
            name=_name,
            hf_model_type=_type,
            hf_architecture=_arch,
            make_block=LlamaBlock,
            layer_weights=LAYER_WEIGHTS,
            top_weights=top_weights,
            config_from_hf=config_from_hf,
            config_to_hf=config_to_hf,
        ),
    )
