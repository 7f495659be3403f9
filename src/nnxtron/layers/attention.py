"""Grouped-query attention: causal, sliding-window, chunked and packed-segment masks; qk-norms;
NoPE layers with temperature tuning (Llama 4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nnxtron.infer.cache import CacheSpec, TokenCache, cache_mask, cache_size
from nnxtron.layers.linear import Linear
from nnxtron.layers.norms import RMSNorm, l2_norm
from nnxtron.layers.rope import RopeSpec, apply_rope
from nnxtron.parallel.sharding import constrain

QK_NORMS = ("none", "rms", "gemma", "l2")


def attention_mask(segment_ids: jax.Array, sliding_window: int = 0, chunk_size: int = 0) -> jax.Array:
    """Boolean [B, S, S] mask: causal, same packed segment, optional sliding window or chunks.

    Key ``t`` is visible to query ``s`` iff ``t <= s``, both lie in the same segment and,
    with a window W > 0, ``s - t < W`` (the current token plus W - 1 previous ones); with
    chunks of C > 0 (Llama 4), ``s // C == t // C`` (aligned chunks of the sequence index).
    """
    seq = segment_ids.shape[-1]
    q_idx = jnp.arange(seq)[:, None]
    k_idx = jnp.arange(seq)[None, :]
    visible = k_idx <= q_idx
    if sliding_window > 0:
        visible = visible & (q_idx - k_idx < sliding_window)
    if chunk_size > 0:
        visible = visible & (q_idx // chunk_size == k_idx // chunk_size)
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    return visible[None] & same_segment


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float,
    sliding_window: int,
    dtype: jnp.dtype,
    chunk_size: int = 0,
) -> jax.Array:
    """Masked softmax attention (HF eager semantics); queries share key/value heads in groups.

    ``q`` [B, S, N, dk], ``k`` [B, S, K, dk], ``v`` [B, S, K, dv] with N a multiple of K;
    logits are ``(q.k) * scale`` in the activation dtype, the softmax runs in float32.
    Returns [B, S, N, dv].
    """
    return masked_attention(q, k, v, attention_mask(segment_ids, sliding_window, chunk_size), scale=scale, dtype=dtype)


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float, dtype: jnp.dtype) -> jax.Array:
    """``attend`` with an explicit boolean mask ``[B, S, T]`` (``k``/``v`` hold T tokens)."""
    batch, seq, heads, dk = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, dk)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k) * jnp.asarray(scale, q.dtype)
    scores = jnp.where(mask[:, None, None], scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    return jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(batch, seq, heads, v.shape[-1])


def attend_with_cache(
    cache: TokenCache,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float,
    dtype: jnp.dtype,
    sliding_window: int = 0,
    chunk_size: int = 0,
) -> jax.Array:
    """Decoding: attend over the cached tokens and the new ones (then cache the new ones).
    ``segment_ids`` 0 marks padding (never cached, never attended to)."""
    kv, key_positions = cache.extend({"key": k, "value": v}, positions, segment_ids != 0)
    mask = cache_mask(positions, key_positions, sliding_window, chunk_size)
    return masked_attention(q, kv["key"], kv["value"], mask, scale=scale, dtype=dtype)


def key_value_cache(
    max_length: int, kv_heads: int, head_dim: int, dtype: jnp.dtype, sliding_window: int = 0, chunk_size: int = 0
) -> CacheSpec:
    """The cache of grouped-query attention: keys and values per token."""
    entry = ((kv_heads, head_dim), ("kv_heads", "head_dim"))
    return CacheSpec(cache_size(max_length, sliding_window, chunk_size), {"key": entry, "value": entry}, dtype)


class Attention(nnx.Module):
    """Multi-head attention with ``num_kv_heads`` shared key/value heads (GQA).

    Weights keep HF semantics: the query is not pre-scaled; logits are multiplied by
    ``scale`` (default ``head_dim ** -0.5``) after the q.k product and the softmax runs in
    float32. ``rope=None`` is a NoPE layer. ``qk_norm`` normalises every query and key
    head over ``head_dim``:

    * ``"rms"`` (Qwen3): RMSNorm with one weight per projection (``query_norm``/``key_norm``), before RoPE;
    * ``"gemma"`` (Gemma 3): the same with zero-centred ``(1 + w)`` weights, before RoPE;
    * ``"l2"`` (Llama 4): weightless, after RoPE, only on RoPE layers.

    ``temperature_tuning=(floor_scale, scale)`` (Llama 4 NoPE layers) multiplies q by
    ``log1p(floor((position + 1) / floor_scale)) * scale + 1`` (computed in float32).
    """

    def __init__(
        self,
        emb_dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope: RopeSpec | None,
        *,
        sliding_window: int = 0,
        chunk_size: int = 0,
        qk_norm: str = "none",
        norm_eps: float = 1e-6,
        scale: float | None = None,
        temperature_tuning: tuple[float, float] | None = None,
        dtype: jnp.dtype,
        weight_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={qk_norm!r} is not one of {QK_NORMS}")
        kw = dict(dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
        self.query = Linear([emb_dim], [num_heads, head_dim], ("embed", "q_heads", "head_dim"), **kw)
        self.key = Linear([emb_dim], [num_kv_heads, head_dim], ("embed", "kv_heads", "head_dim"), **kw)
        self.value = Linear([emb_dim], [num_kv_heads, head_dim], ("embed", "kv_heads", "head_dim"), **kw)
        self.out = Linear([num_heads, head_dim], [emb_dim], ("q_heads", "head_dim", "embed"), **kw)
        if qk_norm in ("rms", "gemma"):
            norm = dict(eps=norm_eps, dtype=dtype, weight_dtype=weight_dtype, zero_centered=qk_norm == "gemma")
            self.query_norm = RMSNorm(head_dim, **norm)
            self.key_norm = RMSNorm(head_dim, **norm)
        self.qk_norm = qk_norm
        self.norm_eps = norm_eps
        self.scale = head_dim**-0.5 if scale is None else scale
        self.rope = rope
        self.sliding_window = sliding_window
        self.chunk_size = chunk_size
        self.temperature_tuning = temperature_tuning
        self.dtype = dtype

    def cache_spec(self, max_length: int) -> CacheSpec:
        heads, head_dim = self.key.out_shape
        return key_value_cache(max_length, heads, head_dim, self.dtype, self.sliding_window, self.chunk_size)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        q = checkpoint_name(self.query(x), "query_proj")
        k = checkpoint_name(self.key(x), "key_proj")
        if self.qk_norm in ("rms", "gemma"):
            q, k = self.query_norm(q), self.key_norm(k)
        if self.rope is not None:
            q, k = apply_rope(q, positions, self.rope), apply_rope(k, positions, self.rope)
        if self.qk_norm == "l2":
            q, k = l2_norm(q, self.norm_eps), l2_norm(k, self.norm_eps)
        if self.temperature_tuning is not None:
            floor_scale, scale = self.temperature_tuning
            factor = jnp.log1p(jnp.floor((positions.astype(jnp.float32) + 1.0) / floor_scale)) * scale + 1.0
            q = (q * factor[:, :, None, None]).astype(q.dtype)
        v = checkpoint_name(self.value(x), "value_proj")
        q = constrain(q, ("activation_batch", "activation_length", "activation_heads", None))
        # context parallelism: queries stay sharded over the sequence; keys/values are gathered
        k = constrain(k, ("activation_batch", "activation_kv_length", "activation_kv_heads", None))
        v = constrain(v, ("activation_batch", "activation_kv_length", "activation_kv_heads", None))
        window = dict(sliding_window=self.sliding_window, chunk_size=self.chunk_size)
        if hasattr(self, "cache"):
            out = attend_with_cache(self.cache, q, k, v, positions, segment_ids, scale=self.scale, dtype=self.dtype, **window)
        else:
            out = attend(q, k, v, segment_ids, scale=self.scale, dtype=self.dtype, **window)
        out = constrain(out, ("activation_batch", "activation_length", "activation_heads", None))
        return checkpoint_name(self.out(checkpoint_name(out, "context")), "out_proj")
