"""Grouped-query attention with causal, sliding-window and packed-segment masks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nnxtron.layers.linear import Linear
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


class Attention(nnx.Module):
    """Multi-head attention with ``num_kv_heads`` shared key/value heads (GQA).

    Weights keep HF semantics: the query is not pre-scaled; logits are multiplied by
    ``head_dim ** -0.5`` after the q.k product and the softmax runs in float32.
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
        dtype: jnp.dtype,
        weight_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        kw = dict(dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
        self.query = Linear([emb_dim], [num_heads, head_dim], ("embed", "q_heads", "head_dim"), **kw)
        self.key = Linear([emb_dim], [num_kv_heads, head_dim], ("embed", "kv_heads", "head_dim"), **kw)
        self.value = Linear([emb_dim], [num_kv_heads, head_dim], ("embed", "kv_heads", "head_dim"), **kw)
        self.out = Linear([num_heads, head_dim], [emb_dim], ("q_heads", "head_dim", "embed"), **kw)
        self.num_kv_heads = num_kv_heads
        self.groups = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.rope = rope
        self.sliding_window = sliding_window
        self.dtype = dtype

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        batch, seq, _ = x.shape
        q = apply_rope(checkpoint_name(self.query(x), "query_proj"), positions, self.rope)
        k = apply_rope(checkpoint_name(self.key(x), "key_proj"), positions, self.rope)
        v = checkpoint_name(self.value(x), "value_proj")
        q = constrain(q, ("activation_batch", "activation_length", "activation_heads", None))
        # context parallelism: queries stay sharded over the sequence; keys/values are gathered
        k = constrain(k, ("activation_batch", "activation_kv_length", "activation_kv_heads", None))
        v = constrain(v, ("activation_batch", "activation_kv_length", "activation_kv_heads", None))
        q = q.reshape(batch, seq, self.num_kv_heads, self.groups, self.head_dim)
        scores = jnp.einsum("bskgd,btkd->bkgst", q, k) * jnp.asarray(self.head_dim**-0.5, q.dtype)
        mask = attention_mask(segment_ids, self.sliding_window)[:, None, None]
        scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out = jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(batch, seq, self.groups * self.num_kv_heads, self.head_dim)
        out = constrain(out, ("activation_batch", "activation_length", "activation_heads", None))
        return checkpoint_name(self.out(checkpoint_name(out, "context")), "out_proj")
