"""Normalisation layers: RMSNorm (standard and Gemma's zero-centred form), weightless L2
norm (Llama 4 qk-norm) and LayerNorm with bias (GPT-3)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

if TYPE_CHECKING:
    from nnxtron.config.schema import Config


def _normalise(x32: jax.Array, eps: float) -> jax.Array:
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
    """``x * rsqrt(mean(x^2) + eps)`` in float32, cast back (HF ``Llama4TextL2Norm``): no weight."""
    return _normalise(x.astype(jnp.float32), eps).astype(x.dtype)


class RMSNorm(nnx.Module):
    """HF-style RMSNorm over the last axis.

    Standard (Llama): normalise in float32, cast to ``dtype``, multiply by ``scale``.
    ``zero_centered`` (Gemma): ``scale`` starts at 0 and the output is
    ``(normed * (1 + scale))`` computed in float32, then cast — HF ``Gemma3RMSNorm``.
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float,
        dtype: jnp.dtype,
        weight_dtype: jnp.dtype,
        zero_centered: bool = False,
        rngs: nnx.Rngs | None = None,
    ):
        init = jnp.zeros if zero_centered else jnp.ones
        self.scale = nnx.Param(init((dim,), weight_dtype), out_sharding=("norm",))
        self.eps = eps
        self.dtype = dtype
        self.zero_centered = zero_centered

    def __call__(self, x: jax.Array) -> jax.Array:
        normed = _normalise(x.astype(jnp.float32), self.eps)
        if self.zero_centered:
            return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(self.dtype)
        return self.scale[...].astype(self.dtype) * normed.astype(self.dtype)


class LayerNorm(nnx.Module):
    """``(x - mean) * rsqrt(var + eps) * scale + bias`` over the last axis, in float32, cast to
    ``dtype`` (HF ``nn.LayerNorm``; ``scale`` starts at 1)."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype, weight_dtype: jnp.dtype, rngs: nnx.Rngs | None = None):
        self.scale = nnx.Param(jnp.ones((dim,), weight_dtype), out_sharding=("norm",))
        self.bias = nnx.Param(jnp.zeros((dim,), weight_dtype), out_sharding=("norm",))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        centred = x32 - mean
        var = jnp.mean(centred * centred, axis=-1, keepdims=True)
        out = centred * jax.lax.rsqrt(var + self.eps) * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return out.astype(self.dtype)


def rms_norm(cfg: Config, dim: int | None = None, zero_centered: bool = False) -> RMSNorm:
    """An RMSNorm over ``dim`` (default ``base_emb_dim``) with the config's eps and dtypes
    (``zero_centered``: Gemma's ``1 + w``)."""
    return RMSNorm(
        dim or cfg.base_emb_dim,
        eps=cfg.normalization_layer_epsilon,
        dtype=jnp.dtype(cfg.dtype),
        weight_dtype=jnp.dtype(cfg.weight_dtype),
        zero_centered=zero_centered,
    )
