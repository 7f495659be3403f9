"""RoPE frequencies and factors vs NumPy transcriptions of the HF formulas.

References: transformers ``modeling_rope_utils._compute_yarn_parameters`` /
``_compute_llama3_parameters`` and ``deepseek_v3.yarn_apply_mscale`` (checked against
transformers 5.24: inverse frequencies bit-equal for 1151 of 1152 yarn settings, the other one
1 ulp off where torch's float32 pow is not correctly rounded).
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from nnxtron.layers.rope import (
    RopeSpec,
    apply_rope,
    attention_factor,
    inverse_frequencies,
    softmax_scale_multiplier,
    yarn_correction_range,
)
from tests.conftest import tiny_config

# DeepSeek-V3 rope_scaling (ARCHITECTURES §8) on its 64 rotary dimensions
DS3 = dict(theta=1e4, factor=40.0, original_max_position=4096, max_position=163840, beta_fast=32.0, beta_slow=1.0)


def yarn_inv_freq_reference(d: int, theta: float, factor: float, orig: int, beta_fast: float, beta_slow: float) -> np.ndarray:
    """HF yarn inverse frequencies, written out in float64 (truncate=True)."""
    base = theta ** (np.arange(0, d, 2) / d)

    def corr(rotations):
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    keep = 1 - np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)
    return (1 / (factor * base)) * (1 - keep) + (1 / base) * keep


def numpy_rope(x: np.ndarray, positions: np.ndarray, inv: np.ndarray, interleave: bool, scale: float = 1.0) -> np.ndarray:
    """Rotate [B, S, N, d] in float64; interleave=True rotates (2i, 2i+1) in place."""
    angles = positions[..., None].astype(np.float64) * inv
    cos, sin = (scale * np.cos(angles))[:, :, None], (scale * np.sin(angles))[:, :, None]
    if interleave:
        a, b = x[..., 0::2], x[..., 1::2]
        return np.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def test_yarn_correction_range_deepseek3():
    # d ln(4096 / (2 pi beta)) / (2 ln 1e4): beta_fast 32 -> 10.472 (floor 10), beta_slow 1 -> 22.513 (ceil 23)
    assert yarn_correction_range(RopeSpec(head_dim=64, scaling="yarn", **DS3)) == (10, 23)
    untruncated = yarn_correction_range(RopeSpec(head_dim=64, scaling="yarn", truncate=False, **DS3))
    np.testing.assert_allclose(untruncated, (10.47224, 22.51344), atol=1e-5)


@pytest.mark.parametrize("d, theta, factor, orig", [(64, 1e4, 40.0, 4096), (128, 1e6, 4.0, 32768), (16, 1e4, 8.0, 256)])
def test_yarn_inverse_frequencies_match_hf_formula(d, theta, factor, orig):
    spec = RopeSpec(head_dim=d, theta=theta, scaling="yarn", factor=factor, original_max_position=orig)
    got = inverse_frequencies(spec)
    assert got.dtype == np.float32
    expected = yarn_inv_freq_reference(d, theta, factor, orig, 32.0, 1.0)
    np.testing.assert_allclose(got, expected, rtol=3e-7)
    # fast dims keep the plain frequency, slow dims are interpolated by the full factor
    plain = inverse_frequencies(RopeSpec(head_dim=d, theta=theta))
    low, high = yarn_correction_range(spec)
    np.testing.assert_array_equal(got[: int(low) + 1], plain[: int(low) + 1])
    np.testing.assert_allclose(got[int(high) :], plain[int(high) :] / factor, rtol=1e-6)


def test_yarn_attention_factor_and_softmax_multiplier():
    m40 = 0.1 * math.log(40) + 1  # 1.3689 (ARCHITECTURES §8)
    assert m40 == pytest.approx(1.3688879454)
    ds3 = RopeSpec(head_dim=64, scaling="yarn", mscale=1.0, mscale_all_dim=1.0, **DS3)
    assert attention_factor(ds3) == 1.0  # m(40, 1) / m(40, 1)
    assert softmax_scale_multiplier(ds3) == pytest.approx(m40**2, rel=1e-12)
    # mscale_all_dim absent (0): HF falls back to m(factor) on cos/sin and no softmax multiplier
    no_all_dim = RopeSpec(head_dim=64, scaling="yarn", mscale=1.0, mscale_all_dim=0.0, **DS3)
    assert attention_factor(no_all_dim) == pytest.approx(m40, rel=1e-12)
    assert softmax_scale_multiplier(no_all_dim) == 1.0
    # mscale absent (0) but mscale_all_dim set: HF also takes the m(factor) branch on cos/sin
    no_mscale = RopeSpec(head_dim=64, scaling="yarn", mscale=0.0, mscale_all_dim=1.0, **DS3)
    assert attention_factor(no_mscale) == pytest.approx(m40, rel=1e-12)
    assert softmax_scale_multiplier(no_mscale) == pytest.approx(m40**2, rel=1e-12)
    mixed = RopeSpec(head_dim=64, scaling="yarn", mscale=0.707, mscale_all_dim=1.0, **DS3)
    assert attention_factor(mixed) == pytest.approx((0.0707 * math.log(40) + 1) / m40, rel=1e-12)
    # factor <= 1: every mscale is 1; default rope: no multiplier even with mscale_all_dim set
    assert softmax_scale_multiplier(RopeSpec(head_dim=64, theta=1e4, scaling="yarn", factor=1.0, mscale_all_dim=1.0)) == 1.0
    assert softmax_scale_multiplier(RopeSpec(head_dim=64, theta=1e4, mscale_all_dim=1.0)) == 1.0
    assert attention_factor(RopeSpec(head_dim=64, theta=1e4, scaling="llama3")) == 1.0


@pytest.mark.parametrize("interleave", [False, True])
def test_apply_rope_yarn_matches_numpy_including_cos_sin_factor(interleave):
    spec = RopeSpec(head_dim=16, theta=1e4, scaling="yarn", factor=40.0, original_max_position=256, interleave=interleave)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 6, 3, 16)).astype(np.float32)
    positions = rng.integers(100, 300, size=(2, 6)).astype(np.int32)
    inv = yarn_inv_freq_reference(16, 1e4, 40.0, 256, 32.0, 1.0)
    expected = numpy_rope(x.astype(np.float64), positions, inv, interleave, scale=0.1 * math.log(40) + 1)
    np.testing.assert_allclose(apply_rope(jnp.asarray(x), jnp.asarray(positions), spec), expected, atol=2e-5)


def test_interleaved_equals_hf_deinterleaved_output_permuted():
    """HF DeepSeek-V3 writes cat([even', odd']); ours keeps pairs in place: same q.k."""
    spec = RopeSpec(head_dim=8, scaling="yarn", interleave=True, mscale_all_dim=1.0, **DS3)
    rng = np.random.default_rng(1)
    q, k = (rng.normal(size=(1, 5, 2, 8)).astype(np.float32) for _ in range(2))
    positions = np.arange(200, 205, dtype=np.int32)[None]
    inv = inverse_frequencies(spec).astype(np.float64)
    angles = positions[..., None] * inv
    cos, sin = np.cos(angles)[:, :, None], np.sin(angles)[:, :, None]

    def hf_interleave(x):  # transformers apply_rotary_pos_emb_interleave
        a, b = x[..., 0::2], x[..., 1::2]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    ours_q, ours_k = (np.asarray(apply_rope(jnp.asarray(t), jnp.asarray(positions), spec)) for t in (q, k))
    perm = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])
    np.testing.assert_allclose(ours_q[..., perm], hf_interleave(q), atol=1e-5)
    np.testing.assert_allclose(
        np.einsum("bsnd,btnd->bnst", ours_q, ours_k), np.einsum("bsnd,btnd->bnst", hf_interleave(q), hf_interleave(k)), atol=1e-5
    )
    # and it is not the rotate-half layout
    half = np.asarray(
        apply_rope(jnp.asarray(q), jnp.asarray(positions), RopeSpec(head_dim=8, scaling="yarn", mscale_all_dim=1.0, **DS3))
    )
    assert np.abs(half - ours_q).max() > 1e-2


def test_default_and_llama3_frequencies_unchanged():
    d, theta = 128, 500000.0
    plain = inverse_frequencies(RopeSpec(head_dim=d, theta=theta))
    np.testing.assert_allclose(plain, theta ** (-np.arange(0, d, 2) / d), rtol=1e-7)
    # HF _compute_llama3_parameters, float64
    wavelen = 2 * math.pi / plain.astype(np.float64)
    scaled = np.where(wavelen > 8192, plain / 8, plain)
    smooth = (8192 / wavelen - 1) / (4 - 1)
    medium = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    expected = np.where(medium, (1 - smooth) * scaled / 8 + smooth * scaled, scaled)
    got = inverse_frequencies(RopeSpec(head_dim=d, theta=theta, scaling="llama3"))
    assert medium.any() and (wavelen > 8192).any()
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    positions = np.arange(7, dtype=np.int32)[None]
    x = np.random.default_rng(2).normal(size=(1, 7, 1, d)).astype(np.float32)
    out = apply_rope(jnp.asarray(x), jnp.asarray(positions), RopeSpec(head_dim=d, theta=theta, scaling="llama3"))
    np.testing.assert_allclose(out, numpy_rope(x.astype(np.float64), positions, expected, False), atol=1e-5)


def test_unknown_scaling_raises():
    with pytest.raises(ValueError, match="unknown RoPE scaling 'dynamic'"):
        inverse_frequencies(RopeSpec(head_dim=8, theta=1e4, scaling="dynamic"))


def test_linear_scaling_divides_every_frequency():
    """HF "linear" (Gemma 3 global layers): inv_freq / factor, i.e. positions / factor."""
    plain = inverse_frequencies(RopeSpec(head_dim=16, theta=1e6))
    scaled = inverse_frequencies(RopeSpec(head_dim=16, theta=1e6, scaling="linear", factor=8.0))
    np.testing.assert_array_equal(scaled, (plain / np.float32(8)).astype(np.float32))


def test_llama3_scaling_with_equal_factors_has_no_medium_band():
    """Llama 4 Scout's rope_scaling has low_freq_factor == high_freq_factor == 1: frequencies
    with wavelength above original_max_position are divided by the factor, the rest kept."""
    spec = RopeSpec(head_dim=16, theta=5e5, scaling="llama3", factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
                    original_max_position=64)  # fmt: skip
    plain = inverse_frequencies(RopeSpec(head_dim=16, theta=5e5))
    got = inverse_frequencies(spec)
    long = 2 * np.pi / plain > 64
    assert long.any() and (~long).any() and np.isfinite(got).all()
    np.testing.assert_array_equal(got, np.where(long, plain / np.float32(16), plain).astype(np.float32))


def test_from_config_reads_every_rope_field():
    cfg = tiny_config(
        "llama2-tiny",
        rope_type="yarn",
        rope_max_timescale=12345.0,
        rope_interleave=True,
        rope_scaling_factor=16.0,
        rope_low_freq_factor=2.0,
        rope_high_freq_factor=5.0,
        rope_original_max_position_embeddings=1024,
        max_position_embeddings=16384,
        beta_fast=24.0,
        beta_slow=2.0,
        mscale=0.5,
        mscale_all_dim=0.75,
    )
    assert RopeSpec.from_config(cfg, 6) == RopeSpec(
        head_dim=6,
        theta=12345.0,
        interleave=True,
        scaling="yarn",
        factor=16.0,
        low_freq_factor=2.0,
        high_freq_factor=5.0,
        original_max_position=1024,
        max_position=16384,
        beta_fast=24.0,
        beta_slow=2.0,
        mscale=0.5,
        mscale_all_dim=0.75,
    )
