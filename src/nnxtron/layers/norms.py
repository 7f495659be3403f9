"""Normalisation layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """HF-style RMSNorm: normalise in float32, cast to ``dtype``, multiply by the scale."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype, weight_dtype: jnp.dtype, rngs: nnx.Rngs | None = None):
        self.scale = nnx.Param(jnp.ones((dim,), weight_dtype), out_sharding=("norm",))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(self.dtype) * normed.astype(self.dtype)
