"""DeepSeek multi-head latent attention (MLA), as HF ``DeepseekV3Attention`` computes it.

::

    q        = wq_b(q_norm(wq_a(x)))  or  wq(x)          -> [B, S, H, nope + rope]
    c, k_pe  = split(wkv_a(x), [kv_lora, rope])
    k_nope,v = split(wkv_b(kv_norm(c)), [nope, v])       -> [B, S, H, nope], [B, S, H, v]
    q_pe, k_pe = rope(q_pe), rope(k_pe)                   # one k_pe shared by every head
    out      = softmax((q . [k_nope | k_pe]) * (nope + rope)^-0.5 * m^2 + mask) v

``m^2`` is :func:`nnxtron.layers.rope.softmax_scale_multiplier` (YaRN ``mscale_all_dim``).

HF weight layout (``Linear`` kernels are ``[*in, *out]``, head-major)::

    q_a_proj.weight            [q_lora, D]           = wq_a.kernel.T
    q_b_proj.weight            [H*(nope+rope), q_lora] = wq_b.kernel.reshape(q_lora, -1).T
    q_proj.weight              [H*(nope+rope), D]    = wq.kernel.reshape(D, -1).T
    kv_a_proj_with_mqa.weight  [kv_lora+rope, D]     = wkv_a.kernel.T   (output order [c | k_pe])
    kv_b_proj.weight           [H*(nope+v), kv_lora] = wkv_b.kernel.reshape(kv_lora, -1).T
    o_proj.weight              [D, H*v]              = out.kernel.reshape(H*v, D).T
    q_a_layernorm.weight / kv_a_layernorm.weight     = q_norm.scale / kv_norm.scale

The two latent RMSNorms use eps 1e-6 whatever ``normalization_layer_epsilon`` is: HF builds
them as ``DeepseekV3RMSNorm(rank)`` with its default eps.

MLA always runs the einsum path (``attention=xla``): key and value head dims differ
(nope + rope vs v), which ``jax.nn.dot_product_attention`` does not take; ``attention=auto``
means ``xla`` here and the config rejects ``dot_product``/``cudnn`` with ``attention_type=mla``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nnxtron.config.schema import Config
from nnxtron.layers.attention import KEY_VALUE, QUERY, attend_sharded, configured_attention, masked_attention
from nnxtron.layers.kv_cache import CacheSpec, cache_mask, cache_size
from nnxtron.layers.linear import Linear
from nnxtron.layers.norms import RMSNorm
from nnxtron.layers.rope import RopeSpec, apply_rope, softmax_scale_multiplier
from nnxtron.parallel.ring_attention import ContextParallel
from nnxtron.parallel.sharding import constrain

LATENT_NORM_EPS = 1e-6  # HF DeepseekV3RMSNorm default; q_a_layernorm / kv_a_layernorm do not pass rms_norm_eps


class MLA(nnx.Module):
    """Multi-head latent attention over ``cfg.base_num_query_heads`` heads."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
        kw = dict(dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
        norm = dict(eps=LATENT_NORM_EPS, dtype=dtype, weight_dtype=weight_dtype)
        d, heads = cfg.base_emb_dim, cfg.base_num_query_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        qk_dim = self.nope + self.rope_dim
        self.q_lora = cfg.q_lora_rank
        if self.q_lora > 0:
            self.wq_a = Linear([d], [self.q_lora], ("embed", "q_lora"), **kw)
            self.q_norm = RMSNorm(self.q_lora, **norm)
            self.wq_b = Linear([self.q_lora], [heads, qk_dim], ("q_lora", "q_heads", "head_dim"), **kw)
        else:
            self.wq = Linear([d], [heads, qk_dim], ("embed", "q_heads", "head_dim"), **kw)
        self.wkv_a = Linear([d], [self.kv_lora + self.rope_dim], ("embed", "kv_lora"), **kw)
        self.kv_norm = RMSNorm(self.kv_lora, **norm)
        self.wkv_b = Linear([self.kv_lora], [heads, self.nope + self.v_dim], ("kv_lora", "q_heads", "head_dim"), **kw)
        self.out = Linear([heads, self.v_dim], [d], ("q_heads", "head_dim", "embed"), **kw)
        self.rope = RopeSpec.from_config(cfg, self.rope_dim)
        self.scale = qk_dim**-0.5 * softmax_scale_multiplier(self.rope)
        self.sliding_window = cfg.sliding_window_size
        self.context = ContextParallel.from_config(cfg)
        self.implementation = configured_attention(cfg)  # xla or splash (dk != dv rules out dot_product and cudnn)
        self.dtype = dtype

    def cache_spec(self, max_length: int) -> CacheSpec:
        """The latent cache: the compressed KV and the (already rotated) RoPE key per token,
        not the expanded heads."""
        entries = {"latent": ((self.kv_lora,), (None,)), "rope_key": ((1, self.rope_dim), (None, None))}
        return CacheSpec(cache_size(max_length, self.sliding_window), entries, self.dtype)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """``x`` [B, S, D], ``positions`` and ``segment_ids`` [B, S] -> [B, S, D]."""
        if self.q_lora > 0:
            q = self.wq_b(self.q_norm(self.wq_a(x)))
        else:
            q = self.wq(x)
        q = checkpoint_name(q, "query_proj")
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        q = jnp.concatenate([q_nope, apply_rope(q_pe, positions, self.rope)], axis=-1)

        latent = self.wkv_a(x)
        c, k_pe = latent[..., : self.kv_lora], latent[..., self.kv_lora :]
        k_pe = apply_rope(k_pe[:, :, None, :], positions, self.rope)  # one shared head
        if hasattr(self, "cache"):  # decoding: cache the latent and the RoPE key, expand every token
            cached, key_positions = self.cache.attended({"latent": c, "rope_key": k_pe}, positions, segment_ids != 0)
            c, k_pe = cached["latent"], cached["rope_key"]
        kv = self.wkv_b(self.kv_norm(c))  # [B, T, H, nope + v]
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, k_nope.shape[:-1] + k_pe.shape[-1:])], axis=-1)
        k = checkpoint_name(k, "key_proj")
        v = checkpoint_name(v, "value_proj")

        if hasattr(self, "cache"):
            q, k, v = constrain(q, QUERY), constrain(k, KEY_VALUE), constrain(v, KEY_VALUE)
            mask = cache_mask(positions, key_positions, self.sliding_window)
            out = constrain(masked_attention(q, k, v, mask, scale=self.scale, dtype=self.dtype), QUERY)
        else:
            kw = dict(scale=self.scale, sliding_window=self.sliding_window, dtype=self.dtype, context=self.context)
            out = attend_sharded(q, k, v, segment_ids, implementation=self.implementation, **kw)
        return checkpoint_name(self.out(checkpoint_name(out, "context")), "out_proj")
