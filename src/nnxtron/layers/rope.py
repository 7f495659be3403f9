"""Rotary position embeddings: frequencies (default, linear, llama3, YaRN, Gemma 4's proportional) and both pair layouts.

Everything here follows HuggingFace transformers (``modeling_rope_utils.py``,
``DeepseekV3Attention``) to the float32 rounding of each step.

Pair layouts. ``interleave=False`` rotates pairs ``(i, i + d/2)`` (HF ``rotate_half``);
``interleave=True`` rotates pairs ``(2i, 2i + 1)`` in place. HF's DeepSeek-V3
``apply_rotary_pos_emb_interleave`` rotates the same pairs but writes its output
de-interleaved (``cat([even', odd'])``), i.e. a fixed permutation of ours. The permutation is
the same for q and k, so every q.k product, and hence the attention output, is identical.
Checked against transformers 5.24: HF's rotated q and k equal ours permuted by
``[0, 2, ..., d-2, 1, 3, ..., d-1]`` bit for bit; q.k then differs only in summation order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from nnxtron.config.options import ROPE_TYPES

if TYPE_CHECKING:
    from nnxtron.config.schema import Config


@dataclass(frozen=True)
class RopeSpec:
    """RoPE frequencies and layout; field names follow HF ``rope_parameters``.

    ``factor`` and ``original_max_position`` are shared by llama3 and yarn. ``mscale`` /
    ``mscale_all_dim`` follow Python truthiness as in HF: 0 means "absent".
    ``max_position`` is carried for completeness; HF 5.24 does not read it when ``factor``
    is set (MaxText applies the MLA mscale only when it exceeds ``original_max_position``).
    """

    head_dim: int
    theta: float
    interleave: bool = False  # False: pairs (i, i + d/2) ("rotate half"); True: (2i, 2i + 1)
    scaling: str = "default"  # "default" | "llama3" | "yarn"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    unit_attention_factor: bool = False  # cos/sin never scaled (HF DeepSeek-V4 forces attention_factor 1)
    proportion: float = 1.0  # Gemma 4's proportional RoPE: the share of the frequencies that rotate (``rotated_pairs``)

    @property
    def rotated_pairs(self) -> int:
        """Pairs ``(i, i + d/2)`` that rotate: ``int(proportion * d / 2)`` (HF's proportional RoPE, MaxText's
        ``Gemma4PartialRotaryEmbedding``); the other pairs keep frequency 0, so the rotation leaves them unchanged."""
        return int(self.proportion * self.head_dim // 2)

    @classmethod
    def from_config(cls, cfg: Config, head_dim: int, sliding: bool = False) -> RopeSpec:
        """The spec for ``cfg``'s rope fields, rotating ``head_dim`` dimensions: the share ``global_rope_proportion``
        of its frequencies, ``local_rope_proportion`` on a ``sliding`` layer (Gemma 4; 1 for every other family)."""
        return cls(
            head_dim=head_dim,
            theta=cfg.rope_max_timescale,
            interleave=cfg.rope_interleave,
            scaling=cfg.rope_type,
            factor=cfg.rope_scaling_factor,
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position=cfg.rope_original_max_position_embeddings,
            max_position=cfg.max_position_embeddings,
            beta_fast=cfg.beta_fast,
            beta_slow=cfg.beta_slow,
            mscale=cfg.mscale,
            mscale_all_dim=cfg.mscale_all_dim,
            truncate=cfg.rope_truncate,
            proportion=cfg.local_rope_proportion if sliding else cfg.global_rope_proportion,
        )


def inverse_frequencies(spec: RopeSpec) -> np.ndarray:
    """``theta^(-2i/d)`` in float32 (as HF computes it), with llama3/yarn scaling if requested; with a
    ``proportion`` below 1 only the first ``rotated_pairs`` keep theirs (the exponents still over the whole
    ``d``), the rest are 0 (HF ``_compute_proportional_rope_parameters``, default RoPE only)."""
    if spec.scaling not in ROPE_TYPES:
        raise ValueError(f"unknown RoPE scaling '{spec.scaling}'; supported: {', '.join(ROPE_TYPES)}")
    if spec.proportion != 1.0:
        if spec.scaling != "default":
            raise ValueError(f"proportional RoPE (proportion {spec.proportion}) has no {spec.scaling} scaling")
        inv = inverse_frequencies(replace(spec, proportion=1.0))
        return np.where(np.arange(inv.size) < spec.rotated_pairs, inv, np.float32(0.0)).astype(np.float32)
    exponents = np.arange(0, spec.head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(spec.head_dim)
    # torch's float32 pow is (nearly) correctly rounded; NumPy's float32 pow is often 1 ulp off,
    # which at position 16k moves angles by ~1e-3 rad. Power in float64, then round.
    pos_freqs = np.power(np.float64(spec.theta), exponents.astype(np.float64)).astype(np.float32)
    inv = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if spec.scaling == "llama3":
        return _llama3_scaling(inv, spec)
    if spec.scaling == "yarn":
        return _yarn_scaling(pos_freqs, spec)
    if spec.scaling == "linear":  # HF "linear": positions / factor (Gemma 3 global layers)
        return (inv / np.float32(spec.factor)).astype(np.float32)
    return inv


def _llama3_scaling(inv: np.ndarray, spec: RopeSpec) -> np.ndarray:
    low_wavelen = spec.original_max_position / spec.low_freq_factor
    high_wavelen = spec.original_max_position / spec.high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / np.float32(spec.factor), inv).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):  # low == high (Llama 4 Scout): no medium band, smooth unused
        smooth = (spec.original_max_position / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
        smoothed = (1 - smooth) * scaled / np.float32(spec.factor) + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def yarn_correction_range(spec: RopeSpec) -> tuple[float, float]:
    """HF ``find_correction_range(beta_fast, beta_slow, d, theta, original_max_position, truncate)``."""
    d, base, orig = spec.head_dim, spec.theta, spec.original_max_position

    def dim_for(rotations: float) -> float:
        return (d * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_for(spec.beta_fast), dim_for(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, d - 1)


def _yarn_scaling(pos_freqs: np.ndarray, spec: RopeSpec) -> np.ndarray:
    """HF ``_compute_yarn_parameters``: blend interpolated (``/factor``) and original frequencies."""
    f32 = np.float32
    extrapolation = (f32(1.0) / pos_freqs).astype(f32)
    interpolation = (f32(1.0) / (f32(spec.factor) * pos_freqs)).astype(f32)
    low, high = yarn_correction_range(spec)
    if low == high:
        high += 0.001  # HF: prevent a singular ramp
    ramp = np.clip((np.arange(spec.head_dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1).astype(f32)
    keep = (f32(1) - ramp).astype(f32)  # 1 = original frequency (high-frequency dims), 0 = interpolated
    return (interpolation * (f32(1) - keep) + extrapolation * keep).astype(f32)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """HF ``yarn_get_mscale`` / ``get_mscale``: ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(spec: RopeSpec) -> float:
    """The factor HF multiplies cos and sin by (``attention_scaling``); 1 except for yarn.

    yarn: ``m(factor, mscale) / m(factor, mscale_all_dim)`` when both are non-zero, else
    ``m(factor)`` (HF ignores ``mscale`` in that branch).
    """
    if spec.scaling != "yarn" or spec.unit_attention_factor:
        return 1.0
    if spec.mscale and spec.mscale_all_dim:
        return float(yarn_get_mscale(spec.factor, spec.mscale) / yarn_get_mscale(spec.factor, spec.mscale_all_dim))
    return yarn_get_mscale(spec.factor)


def softmax_scale_multiplier(spec: RopeSpec) -> float:
    """What HF ``DeepseekV3Attention`` multiplies ``qk_head_dim ** -0.5`` by (``yarn_apply_mscale``).

    ``m(factor, mscale_all_dim) ** 2`` for any non-default rope type with a non-zero
    ``mscale_all_dim``; 1 otherwise. Only MLA applies it.
    """
    if spec.scaling == "default" or not spec.mscale_all_dim:
        return 1.0
    mscale = yarn_get_mscale(spec.factor, spec.mscale_all_dim)
    return mscale * mscale


def apply_rope(x: jax.Array, positions: jax.Array, spec: RopeSpec) -> jax.Array:
    """Rotate ``x`` [B, S, N, hd] by ``positions`` [B, S].

    As HF: angles and cos/sin in float32, times ``attention_factor(spec)``, then cast to x.dtype.
    A spec narrower than ``x`` (partial RoPE, Qwen3-Next's ``partial_rotary_factor``) rotates the first
    ``spec.head_dim`` dims and passes the rest through (HF ``apply_rotary_pos_emb``'s ``q_pass``).
    """
    if spec.head_dim < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., : spec.head_dim], positions, spec), x[..., spec.head_dim :]], axis=-1)
    factor = attention_factor(spec)
    return _rotate(
        x, positions, jnp.asarray(inverse_frequencies(spec)), None if factor == 1.0 else jnp.float32(factor), spec.interleave
    )


def apply_selected_rope(x: jax.Array, positions: jax.Array, first: RopeSpec, second: RopeSpec, use_first: jax.Array) -> jax.Array:
    """``apply_rope`` with ``first`` where the boolean scalar ``use_first`` (traced: a layer whose
    kind is data, ``parallel/layer_kind.py``) holds, else ``second``: the frequencies and the
    attention factor are selected, then one rotation runs (the same values as ``apply_rope`` of
    the chosen spec). The specs must rotate the same dims the same way."""
    if (first.head_dim, first.interleave) != (second.head_dim, second.interleave) or first.head_dim != x.shape[-1]:
        raise ValueError(f"apply_selected_rope: {first} and {second} must both rotate all {x.shape[-1]} dims alike")
    inv = jnp.where(use_first, jnp.asarray(inverse_frequencies(first)), jnp.asarray(inverse_frequencies(second)))
    factors = attention_factor(first), attention_factor(second)
    factor = None if factors == (1.0, 1.0) else jnp.where(use_first, jnp.float32(factors[0]), jnp.float32(factors[1]))
    return _rotate(x, positions, inv.astype(jnp.float32), factor, first.interleave)


def _rotate(x: jax.Array, positions: jax.Array, inv: jax.Array, factor: jax.Array | None, interleave: bool) -> jax.Array:
    """``x`` rotated by the angles ``positions x inv`` (float32), cos/sin times ``factor`` when given."""
    angles = positions.astype(jnp.float32)[..., None] * inv  # [B, S, hd/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if factor is not None:
        cos, sin = cos * factor, sin * factor
    cos = cos.astype(x.dtype)[:, :, None, :]
    sin = sin.astype(x.dtype)[:, :, None, :]
    if interleave:
        even, odd = x[..., 0::2], x[..., 1::2]
        out = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
        return out.reshape(x.shape)
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
