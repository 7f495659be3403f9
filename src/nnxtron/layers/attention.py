"""Grouped-query attention with causal, sliding-window and packed-segment masks, optional qk-norm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nnxtron.layers.linear import Linear
from nnxtron.layers.norms import RMSNorm
from nnxtron.layers.rope import RopeSpec, apply_rope
from nnxtron.parallel.sharding import constrain


def attention_mask(segment_ids: jax.Array, sliding_window: int = 0) -> jax.Array:
    """Boolean [B, S, S] mask: causal, same packed segment, optional sliding window.

    Key ``t`` is visible to query ``s`` iff ``t <= s``, both lie in the same segment and,
    with a window W > 0, ``s - t < W`` (the current token plus W - 1 previous ones).
    """
    seq = segment_ids.shape[-1]
    q_idx = jnp.arange(seq)[:, None]
    k_idx = jnp.arange(seq)[None, :]
    visible = k_idx <= q_idx
    if sliding_window > 0:
        visible = visible & (q_idx - k_idx < sliding_window)
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
) -> jax.Array:
    """Masked softmax attention (HF eager semantics); queries share key/value heads in groups.

    ``q`` [B, S, N, dk], ``k`` [B, S, K, dk], ``v`` [B, S, K, dv] with N a multiple of K;
    logits are ``(q.k) * scale`` in the activation dtype, the softmax runs in float32.
    Returns [B, S, N, dv].
    """
    batch, seq, heads, dk = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, dk)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k) * jnp.asarray(scale, q.dtype)
    mask = attention_mask(segment_ids, sliding_window)[:, None, None]
    scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    return jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(batch, seq, heads, v.shape[-1])


class Attention(nnx.Module):
    """Multi-head attention with ``num_kv_heads`` shared key/value heads (GQA).

    Weights keep HF semantics: the query is not pre-scaled; logits are multiplied by
    ``head_dim ** -0.5`` after the q.k product and the softmax runs in float32.
    ``qk_norm`` (Qwen3): RMSNorm over ``head_dim`` of every query and key head, with one
    weight per projection (``query_norm``/``key_norm``), applied BEFORE RoPE.
    """

    def __init__(
        self,
        emb_dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope: RopeSpec,
        *,
        sliding_window: int,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        dtype: jnp.dtype,
        weight_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        kw = dict(dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
        self.query = Linear([emb_dim], [num_heads, head_dim], ("embed", "q_heads", "head_dim"), **kw)
        self.key = Linear([emb_dim], [num_kv_heads, head_dim], ("embed", "kv_heads", "head_dim"), **kw)
        self.value = Linear([emb_dim], [num_kv_heads, head_dim], ("embed", "kv_heads", "head_dim"), **kw)
        self.out = Linear([num_heads, head_dim], [emb_dim], ("q_heads", "head_dim", "embed"), **kw)
        if qk_norm:
            norm = dict(eps=norm_eps, dtype=dtype, weight_dtype=weight_dtype)
            self.query_norm = RMSNorm(head_dim, **norm)
            self.key_norm = RMSNorm(head_dim, **norm)
        self.qk_norm = qk_norm
        self.head_dim = head_dim
        self.rope = rope
        self.sliding_window = sliding_window
        self.dtype = dtype

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        q = checkpoint_name(self.query(x), "query_proj")
        k = checkpoint_name(self.key(x), "key_proj")
        if self.qk_norm:
            q, k = self.query_norm(q), self.key_norm(k)
        q, k = apply_rope(q, positions, self.rope), apply_rope(k, positions, self.rope)
        v = checkpoint_name(self.value(x), "value_proj")
        q = constrain(q, ("activation_batch", "activation_length", "activation_heads", None))
        # context parallelism: queries stay sharded over the sequence; keys/values are gathered
        k = constrain(k, ("activation_batch", "activation_kv_length", "activation_kv_heads", None))
        v = constrain(v, ("activation_batch", "activation_kv_length", "activation_kv_heads", None))
        out = attend(q, k, v, segment_ids, scale=self.head_dim**-0.5, sliding_window=self.sliding_window, dtype=self.dtype)
        out = constrain(out, ("activation_batch", "activation_length", "activation_heads", None))
        return checkpoint_name(self.out(checkpoint_name(out, "context")), "out_proj")
