"""Attention variants vs NumPy references: Qwen3 qk-norm (RMSNorm per head, before RoPE).

The same module was checked against transformers 5.24 ``Qwen3Attention`` (GQA 4/2, hd 16,
θ 1e6, positions 120-126, random norm weights): max |Δ| 3.4e-7 in float32.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxtron.layers.attention import Attention
from nnxtron.layers.rope import RopeSpec, inverse_frequencies
from tests.unit.test_rope import numpy_rope

D, H, K, HD, EPS = 32, 4, 2, 16, 1e-6
SPEC = RopeSpec(head_dim=HD, theta=1e6)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float = EPS) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def make(qk_norm: bool, seed: int = 0, eps: float = EPS) -> Attention:
    with nnx.use_eager_sharding(False):
        attn = Attention(
            D,
            H,
            K,
            HD,
            SPEC,
            sliding_window=0,
            qk_norm="rms" if qk_norm else "none",
            norm_eps=eps,
            dtype=jnp.float32,
            weight_dtype=jnp.float32,
            rngs=nnx.Rngs(seed),
        )
    if qk_norm:  # non-uniform weights: with all-ones weights the norm commutes with the rotation
        rng = np.random.default_rng(seed + 1)
        attn.query_norm.scale[...] = jnp.asarray(1 + 0.5 * rng.normal(size=HD), jnp.float32)
        attn.key_norm.scale[...] = jnp.asarray(1 + 0.5 * rng.normal(size=HD), jnp.float32)
    return attn


def reference(attn: Attention, x, positions, segments, qk_norm: str, eps: float = EPS) -> np.ndarray:
    """HF Qwen3 eager attention in float64; ``qk_norm`` in {"none", "before_rope", "after_rope"}."""
    w = {name: np.asarray(getattr(attn, name).kernel[...], np.float64) for name in ("query", "key", "value", "out")}
    q, k, v = (np.einsum("bsd,dnh->bsnh", x, w[n]) for n in ("query", "key", "value"))
    inv = inverse_frequencies(SPEC).astype(np.float64)
    norms = (np.asarray(attn.query_norm.scale[...]), np.asarray(attn.key_norm.scale[...])) if qk_norm != "none" else None
    if qk_norm == "before_rope":
        q, k = rms_norm(q, norms[0], eps), rms_norm(k, norms[1], eps)
    q, k = numpy_rope(q, positions, inv, False), numpy_rope(k, positions, inv, False)
    if qk_norm == "after_rope":
        q, k = rms_norm(q, norms[0], eps), rms_norm(k, norms[1], eps)
    k, v = np.repeat(k, H // K, axis=2), np.repeat(v, H // K, axis=2)  # head n uses kv head n // (H / K)
    scores = np.einsum("bsnh,btnh->bnst", q, k) * HD**-0.5
    seq = x.shape[1]
    visible = np.tril(np.ones((seq, seq), bool))[None] & (segments[:, :, None] == segments[:, None, :])
    scores = np.where(visible[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ctx = np.einsum("bnst,btnh->bsnh", probs, v)
    return np.einsum("bsnh,nhd->bsd", ctx, w["out"])


def inputs(seed: int = 3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, 9, D))
    positions = np.stack([np.arange(100, 109), np.r_[np.arange(4), np.arange(5)]]).astype(np.int32)
    segments = np.stack([np.ones(9), np.r_[np.ones(4), np.full(5, 2)]]).astype(np.int32)  # row 1: two packed docs
    return x, positions, segments


def run(attn: Attention, x, positions, segments) -> np.ndarray:
    return np.asarray(attn(jnp.asarray(x, jnp.float32), jnp.asarray(positions), jnp.asarray(segments)))


def test_qk_norm_matches_qwen3_reference_and_not_norm_after_rope():
    attn = make(qk_norm=True)
    x, positions, segments = inputs()
    out = run(attn, x, positions, segments)
    # float32 vs float64 reference: measured max |diff| 4.3e-7 on outputs up to 1.8
    np.testing.assert_allclose(out, reference(attn, x, positions, segments, "before_rope"), atol=5e-6)
    assert np.abs(out - reference(attn, x, positions, segments, "after_rope")).max() > 1e-2
    assert np.abs(out - reference(attn, x, positions, segments, "none")).max() > 1e-2


def test_qk_norm_param_paths_and_off_by_default():
    on = nnx.to_flat_state(nnx.state(make(qk_norm=True), nnx.Param))
    paths = {"/".join(map(str, path)) for path, _ in on}
    assert {"query_norm/scale", "key_norm/scale"} <= paths
    off = make(qk_norm=False)
    assert not any("norm" in "/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(off, nnx.Param)))
    x, positions, segments = inputs()
    np.testing.assert_allclose(run(off, x, positions, segments), reference(off, x, positions, segments, "none"), atol=5e-6)


def test_qk_norm_eps_is_used():
    attn = make(qk_norm=True, eps=5.0)  # large enough to change the output visibly
    x, positions, segments = inputs()
    out = run(attn, x, positions, segments)
    np.testing.assert_allclose(out, reference(attn, x, positions, segments, "before_rope", eps=5.0), atol=5e-6)
    assert np.abs(out - reference(attn, x, positions, segments, "before_rope")).max() > 1e-2
