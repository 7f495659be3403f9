"""GPT-3 (MaxText ``gpt3`` block): learned positions, LayerNorm with bias, fused QKV with bias.

Per layer (pre-LayerNorm, no RoPE)::

    q, k, v = split(norm_1(x) @ Wqkv + bqkv)        # fused kernel [D, 3, H, hd]
    h = x + (attn(q, k, v) @ Wo + bo)                # logits x head_dim^-0.5, causal
    y = h + (gelu_tanh(norm_2(h) @ Wi + bi) @ Wo2 + bo2)

The decoder adds learned position embeddings (``trainable_position_size``) to the token
embeddings, ends with a LayerNorm and ties the head to the token table. HF has no GPT-3
class; the reference is ``GPT2LMHeadModel`` (same topology), whose checkpoints import and
export directly: GPT-2 ``Conv1D`` weights are ``[in, out]`` with the nnxtron element
order (``c_attn [D, 3D]`` = ``[D, 3, H, hd]``), so the adaptor is a reshape. LayerNorm
scales are stored as HF does (``scale`` starts at 1); MaxText's Paxml-derived checkpoints
store ``scale - 1``.
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
from nnxtron.layers.attention import KEY_VALUE, QUERY, attend_sharded, attend_with_cache, configured_attention, key_value_cache
from nnxtron.layers.kv_cache import CacheSpec
from nnxtron.layers.linear import Linear
from nnxtron.layers.mlp import MLP
from nnxtron.layers.norms import LayerNorm
from nnxtron.models.family import Family, Golden, StrategyRow, WeightMap
from nnxtron.models.hf_common import hf_ties_head, optional_size
from nnxtron.models.maxtext_map import SCALE_PLUS_ONE, MaxTextMap, Rule
from nnxtron.models.maxtext_map import top_rules as maxtext_top_rules
from nnxtron.parallel.ring_attention import ContextParallel
from nnxtron.parallel.sharding import RESIDUAL, constrain


def layer_norm(cfg: Config, dim: int | None = None) -> LayerNorm:
    return LayerNorm(
        dim or cfg.base_emb_dim,
        eps=cfg.normalization_layer_epsilon,
        dtype=jnp.dtype(cfg.dtype),
        weight_dtype=jnp.dtype(cfg.weight_dtype),
    )


class FusedQKVAttention(nnx.Module):
    """Multi-head attention (as many kv heads as query heads) with one fused, biased QKV
    projection ``[D, 3, H, hd]`` and a biased output projection; no position encoding."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        dim, heads, head_dim = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.resolved_head_dim
        kw = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype), rngs=rngs, use_bias=True)
        self.qkv = Linear([dim], [3, heads, head_dim], ("embed", None, "q_heads", "head_dim"), **kw)
        self.out = Linear([heads, head_dim], [dim], ("q_heads", "head_dim", "embed"), **kw)
        self.scale = head_dim**-0.5
        self.implementation = configured_attention(cfg)  # without a cache; with one, the einsum path
        self.context = ContextParallel.from_config(cfg)
        self.dtype = jnp.dtype(cfg.dtype)

    def cache_spec(self, max_length: int) -> CacheSpec:
        _, heads, head_dim = self.qkv.out_shape
        return key_value_cache(max_length, heads, head_dim, self.dtype)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        qkv = checkpoint_name(self.qkv(x), "qkv_proj")
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if hasattr(self, "cache"):
            q, k, v = constrain(q, QUERY), constrain(k, KEY_VALUE), constrain(v, KEY_VALUE)
            out = attend_with_cache(self.cache, q, k, v, positions, segment_ids, scale=self.scale, dtype=self.dtype)
            out = constrain(out, QUERY)
        else:
            kw = dict(scale=self.scale, dtype=self.dtype, implementation=self.implementation, context=self.context)
            out = attend_sharded(q, k, v, segment_ids, sliding_window=0, **kw)
        return checkpoint_name(self.out(checkpoint_name(out, "context")), "out_proj")


class GPT3Block(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs, kind: LayerKind = PLAIN):
        if kind.moe or kind.attention != "global":
            raise ConfigError("decoder_block gpt3 has only dense, global-attention layers")
        self.pre_attention_norm = layer_norm(cfg)
        self.attention = FusedQKVAttention(cfg, rngs)
        self.pre_mlp_norm = layer_norm(cfg)
        self.mlp = MLP(
            cfg.base_emb_dim,
            cfg.base_mlp_dim,
            cfg.mlp_activations[0],
            dtype=jnp.dtype(cfg.dtype),
            weight_dtype=jnp.dtype(cfg.weight_dtype),
            rngs=rngs,
        )
        self.dropout_rate = cfg.dropout_rate

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, dropout_keys: dropout.Keys | None = None
    ) -> jax.Array:
        """With ``dropout_keys`` (training) the MLP's intermediate activations and the layer
        output are dropped, as in MaxText (``layers.dropout``)."""
        x = checkpoint_name(constrain(x, RESIDUAL), "decoder_layer_input")
        h = x + self.attention(self.pre_attention_norm(x), positions, segment_ids)
        y = h + self.mlp(self.pre_mlp_norm(h), dropout.site_dropout(dropout_keys, self.dropout_rate, dropout.MLP))
        return dropout.dropout(y, dropout_keys, self.dropout_rate, dropout.LAYER_OUTPUT)


LAYER_WEIGHTS = (
    WeightMap("pre_attention_norm/scale", "ln_1.weight"),
    WeightMap("pre_attention_norm/bias", "ln_1.bias"),
    WeightMap("attention/qkv/kernel", "attn.c_attn.weight", 1, conv1d=True),
    WeightMap("attention/qkv/bias", "attn.c_attn.bias", conv1d=True),
    WeightMap("attention/out/kernel", "attn.c_proj.weight", 2, conv1d=True),
    WeightMap("attention/out/bias", "attn.c_proj.bias"),
    WeightMap("pre_mlp_norm/scale", "ln_2.weight"),
    WeightMap("pre_mlp_norm/bias", "ln_2.bias"),
    WeightMap("mlp/wi/kernel", "mlp.c_fc.weight", 1, conv1d=True),
    WeightMap("mlp/wi/bias", "mlp.c_fc.bias"),
    WeightMap("mlp/wo/kernel", "mlp.c_proj.weight", 1, conv1d=True),
    WeightMap("mlp/wo/bias", "mlp.c_proj.bias"),
)


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    return LAYER_WEIGHTS


def top_weights(cfg: Config) -> tuple[WeightMap, ...]:
    maps = (
        WeightMap("embed/embedding", "transformer.wte.weight"),
        WeightMap("position_embed/embedding", "transformer.wpe.weight"),
        WeightMap("final_norm/scale", "transformer.ln_f.weight"),
        WeightMap("final_norm/bias", "transformer.ln_f.bias"),
    )
    # untied: HF GPT-2's own lm_head (tie_word_embeddings=false, e.g. an export of a normalized tied head)
    return maps if cfg.logits_via_embedding else (*maps, WeightMap("logits/kernel", "lm_head.weight", 1))


def _maxtext_norm(maxtext: str, nnxtron: str) -> tuple[Rule, Rule]:
    """MaxText's ``Gpt3LayerNorm``: ``scale`` multiplies as ``1 + scale`` (``SCALE_PLUS_ONE``), the bias as is."""
    return Rule(f"{maxtext}/scale", f"{nnxtron}/scale", SCALE_PLUS_ONE), Rule(f"{maxtext}/bias", f"{nnxtron}/bias")


def maxtext_layer_rules(cfg: Config, kind: LayerKind) -> tuple[Rule, ...]:
    """MaxText's ``Gpt3DecoderLayer`` (``fused_qkv=true``, as every MaxText GPT-3 config): the MLP's
    own pre-norm (``mlp/mlp_layer_norm``), one activation (``wi``); the query's ``1/sqrt(head_dim)``
    is applied at run time in both, so no kernel is rescaled."""
    rules = [*_maxtext_norm("pre_self_attention_norm", "pre_attention_norm")]
    rules += [Rule(f"self_attention/qkv_proj/{n}", f"attention/qkv/{n}") for n in ("kernel", "bias")]
    rules += [Rule(f"self_attention/out/{n}", f"attention/out/{n}") for n in ("kernel", "bias")]
    rules += _maxtext_norm("mlp/mlp_layer_norm", "pre_mlp_norm")
    rules += [Rule(f"mlp/{w}/{n}", f"mlp/{w}/{n}") for w in ("wi", "wo") for n in ("kernel", "bias")]
    return tuple(rules)


def maxtext_top_level(cfg: Config) -> tuple[Rule, ...]:
    """The token and learned position tables, the final LayerNorm (with its bias), the head if untied."""
    return (
        *maxtext_top_rules(cfg, norm=SCALE_PLUS_ONE),
        Rule("decoder/decoder_norm/bias", "final_norm/bias"),
        Rule("decoder/position_embedder/embedding", "position_embed/embedding"),
    )


UNSUPPORTED_GPT2 = {
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
    "scale_attn_weights": True,
}


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """nnxtron ``gpt3`` config values for an HF GPT-2 ``config.json``."""
    for key, supported in UNSUPPORTED_GPT2.items():
        if key in hf and bool(hf[key]) != supported:
            raise ConfigError(f"HF GPT-2 {key}={hf[key]} is not supported by decoder_block gpt3 (needs {supported})")
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"HF activation_function '{hf['activation_function']}' is not supported; only gelu_new (tanh gelu)")
    dim, heads = int(hf["n_embd"]), int(hf["n_head"])
    positions = int(hf["n_positions"])
    return {
        "decoder_block": "gpt3",
        "base_emb_dim": dim,
        "base_num_query_heads": heads,
        "base_num_kv_heads": heads,
        "head_dim": dim // heads,
        "base_mlp_dim": optional_size(hf, "n_inner", 4 * dim),  # 0: HF builds a 0-wide MLP
        "base_num_decoder_layers": int(hf["n_layer"]),
        "vocab_size": int(hf["vocab_size"]),
        "normalization_layer_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)),
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", True)),
        "normalize_embedding_logits": False,  # HF's tied head: x @ E^T
        "mlp_activations": ["gelu"],
        "trainable_position_size": positions,
        "max_position_embeddings": positions,
        "max_target_length": min(positions, 2048),
    }


def config_to_hf(cfg: Config) -> dict[str, Any]:
    if cfg.base_num_kv_heads != cfg.base_num_query_heads or cfg.resolved_head_dim * cfg.base_num_query_heads != cfg.base_emb_dim:
        raise ConfigError("HF GPT-2 needs base_num_kv_heads = base_num_query_heads and head_dim x heads = base_emb_dim")
    if tuple(cfg.mlp_activations) != ("gelu",) or not cfg.trainable_position_size:
        raise ConfigError("HF GPT-2 needs mlp_activations=[gelu] and trainable_position_size > 0")
    if cfg.final_logits_soft_cap:
        raise ConfigError("HF GPT-2 has no final_logits_soft_cap; export needs 0")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": cfg.base_emb_dim,
        "n_head": cfg.base_num_query_heads,
        "n_inner": cfg.base_mlp_dim,
        "n_layer": cfg.base_num_decoder_layers,
        "n_positions": cfg.trainable_position_size,
        "vocab_size": cfg.vocab_size,
        "layer_norm_epsilon": cfg.normalization_layer_epsilon,
        "activation_function": "gelu_new",
        "tie_word_embeddings": hf_ties_head(cfg),
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        **UNSUPPORTED_GPT2,
        "dtype": cfg.weight_dtype,
    }


FAMILIES = (
    Family(
        name="gpt3",
        hf_model_type="gpt2",
        hf_architecture="GPT2LMHeadModel",
        make_block=GPT3Block,
        layer_weights=layer_weights,
        top_weights=top_weights,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        make_final_norm=layer_norm,
        hf_layer_prefix="transformer.h.{i}.",
        goldens=(Golden("gpt2", "gpt2"),),  # HF GPT-2 through the adaptor
        maxtext=MaxTextMap(maxtext_layer_rules, maxtext_top_level),
        strategy_rows=(StrategyRow("gpt3-52k", True, "minimal", "fsdp2_context4", 2, (("base_num_decoder_layers", 3),)),),
    ),
)
