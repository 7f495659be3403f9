"""Rotary position embeddings: frequencies (default, llama3-scaled) and both pair layouts."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class RopeSpec:
    head_dim: int
    theta: float
    interleave: bool = False  # False: pairs (i, i + d/2) ("rotate half"); True: (2i, 2i + 1)
    scaling: str = "default"  # "default" | "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


def inverse_frequencies(spec: RopeSpec) -> np.ndarray:
    """``theta^(-2i/d)`` in float32 (as HF computes it), with llama3 scaling if requested."""
    exponents = np.arange(0, spec.head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(spec.head_dim)
    inv = (1.0 / np.power(np.float32(spec.theta), exponents)).astype(np.float32)
    if spec.scaling == "llama3":
        inv = _llama3_scaling(inv, spec)
    elif spec.scaling != "default":
        raise ValueError(f"unknown RoPE scaling '{spec.scaling}'")
    return inv


def _llama3_scaling(inv: np.ndarray, spec: RopeSpec) -> np.ndarray:
    low_wavelen = spec.original_max_position / spec.low_freq_factor
    high_wavelen = spec.original_max_position / spec.high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / np.float32(spec.factor), inv).astype(np.float32)
    smooth = (spec.original_max_position / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / np.float32(spec.factor) + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, spec: RopeSpec) -> jax.Array:
    """Rotate ``x`` [B, S, N, hd] by ``positions`` [B, S]; cos/sin are cast to x.dtype (HF)."""
    inv = jnp.asarray(inverse_frequencies(spec))
    angles = positions.astype(jnp.float32)[..., None] * inv  # [B, S, hd/2]
    cos = jnp.cos(angles).astype(x.dtype)[:, :, None, :]
    sin = jnp.sin(angles).astype(x.dtype)[:, :, None, :]
    if spec.interleave:
        even, odd = x[..., 0::2], x[..., 1::2]
        out = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
        return out.reshape(x.shape)
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
