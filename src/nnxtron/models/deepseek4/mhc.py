"""Manifold-constrained hyper-connections (DeepSeek-V4): k residual streams mixed per sub-layer.

The residual is ``X [B, S, k, D]`` (the embedding repeated k = ``mhc_expansion_rate``
times). Around each sub-layer (attention, feed-forward) ``HyperConnection`` computes, from
the weightless-RMS-normalised flattened streams, in float32 (HF ``DeepseekV4HyperConnection``):

* ``pre = sigmoid(scale_0 * z_pre + b_pre) + eps`` — collapses the streams into the
  sub-layer input ``u = sum_j pre_j X_j``;
* ``post = 2 * sigmoid(scale_1 * z_post + b_post)`` — expands the sub-layer output ``y``;
* ``comb = sinkhorn(softmax(scale_2 * z_comb + b_comb))`` — a (near) doubly stochastic
  ``k x k`` mixing of the streams: ``X'_m = post_m * y + sum_j comb[j, m] X_j``.

Sinkhorn (``sinkhorn_iterations`` n): softmax over the last axis + eps, one column
normalisation, then n - 1 (row, column) normalisations, each dividing by (sum + eps).
``HyperHead`` collapses the streams once more before the final norm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nnxtron.layers.norms import l2_norm


def sinkhorn(logits: jax.Array, iterations: int, eps: float) -> jax.Array:
    """HF's Sinkhorn normalisation of ``logits [..., k, k]`` (float32)."""
    comb = jax.nn.softmax(logits, axis=-1) + eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

    def step(_, c: jax.Array) -> jax.Array:
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iterations - 1, step, comb)  # a loop, not 2n unrolled ops: small graphs


def _flat_normed(streams: jax.Array, eps: float) -> jax.Array:
    """The streams ``[B, S, k, D]`` flattened to ``[B, S, k*D]`` in float32, weightless RMS-normalised."""
    return l2_norm(streams.reshape(*streams.shape[:2], -1).astype(jnp.float32), eps)


class HyperConnection(nnx.Module):
    """The mixing weights of one sub-layer: ``fn [(2+k)k, k*D]``, ``base [(2+k)k]``, ``scale [3]`` (float32)."""

    def __init__(self, dim: int, streams: int, *, iterations: int, eps: float, norm_eps: float, rngs: nnx.Rngs):
        size = (2 + streams) * streams
        init = jax.nn.initializers.normal(stddev=0.02)
        self.fn = nnx.Param(init(rngs.params(), (size, streams * dim), jnp.float32), out_sharding=(None, "embed"))
        self.base = nnx.Param(jnp.zeros((size,), jnp.float32), out_sharding=(None,))
        self.scale = nnx.Param(jnp.ones((3,), jnp.float32), out_sharding=(None,))
        self.streams, self.iterations, self.eps, self.norm_eps = streams, iterations, eps, norm_eps

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``x [B, S, k, D]`` -> ``(post [B, S, k], comb [B, S, k, k], collapsed [B, S, D] in x.dtype)``."""
        k = self.streams
        z = _flat_normed(x, self.norm_eps) @ self.fn[...].T
        pre_w, post_w, comb_w = z[..., :k], z[..., k : 2 * k], z[..., 2 * k :]
        base = self.base[...]
        scale = self.scale[...]
        pre = jax.nn.sigmoid(pre_w * scale[0] + base[:k]) + self.eps
        post = 2.0 * jax.nn.sigmoid(post_w * scale[1] + base[k : 2 * k])
        comb_logits = comb_w.reshape(*comb_w.shape[:-1], k, k) * scale[2] + base[2 * k :].reshape(k, k)
        comb = sinkhorn(comb_logits, self.iterations, self.eps)
        collapsed = jnp.sum(pre[..., None] * x, axis=2).astype(x.dtype)
        return post, comb, collapsed


def expand(post: jax.Array, comb: jax.Array, y: jax.Array, x: jax.Array) -> jax.Array:
    """``X'_m = post_m * y + sum_j comb[j, m] X_j`` (weights cast to the stream dtype, as HF)."""
    dtype = x.dtype
    mixed = jnp.einsum("bsjm,bsjd->bsmd", comb.astype(dtype), x)
    return post.astype(dtype)[..., None] * y[:, :, None, :] + mixed


class HyperHead(nnx.Module):
    """The residual streams of the whole decoder: ``expand`` repeats the embeddings into the
    k streams; calling it collapses them before the final norm:
    ``h = sum_j (sigmoid(scale * z_j + b_j) + eps) X_j``."""

    def __init__(self, dim: int, streams: int, *, eps: float, norm_eps: float, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(stddev=0.02)
        self.fn = nnx.Param(init(rngs.params(), (streams, streams * dim), jnp.float32), out_sharding=(None, "embed"))
        self.base = nnx.Param(jnp.zeros((streams,), jnp.float32), out_sharding=(None,))
        self.scale = nnx.Param(jnp.ones((1,), jnp.float32), out_sharding=(None,))
        self.eps, self.norm_eps = eps, norm_eps
        self.streams = streams

    def expand(self, x: jax.Array) -> jax.Array:
        """``[B, S, D]`` -> ``[B, S, k, D]``: the embeddings copied into each stream."""
        return jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], self.streams, x.shape[-1]))

    def __call__(self, x: jax.Array) -> jax.Array:
        mixes = _flat_normed(x, self.norm_eps) @ self.fn[...].T
        pre = jax.nn.sigmoid(mixes * self.scale[...] + self.base[...]) + self.eps
        return jnp.sum(pre[..., None] * x, axis=2).astype(x.dtype)
