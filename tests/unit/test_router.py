"""Router math vs an independent NumPy reference (HF transformers semantics)."""

import jax
import numpy as np
import pytest

from nnxtron.layers.router import RouterSpec, load_balance_loss, route


def _topk(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values per row, ties to the lower index."""
    return np.stack([np.argsort(-row, kind="stable")[:k] for row in values])


def ref_route(logits, bias, func, k, norm, scale, groups=-1, keep_groups=-1):
    """NumPy (float64) version of HF's routers (Mixtral/Qwen3-MoE softmax, DeepSeek sigmoid/sqrtsoftplus)."""
    x = logits.astype(np.float64)
    if func == "softmax":
        e = np.exp(x - x.max(-1, keepdims=True))
        s = e / e.sum(-1, keepdims=True)
    elif func == "sigmoid":
        s = 1 / (1 + np.exp(-x))
    else:
        s = np.sqrt(np.log1p(np.exp(x)))
    choice = s + (0 if bias is None else bias)
    if groups > 0:
        t, n = choice.shape
        g = choice.reshape(t, groups, n // groups)
        gscore = np.sort(g, -1)[..., ::-1][..., :2].sum(-1)
        mask = np.zeros((t, groups), bool)
        np.put_along_axis(mask, _topk(gscore, keep_groups), True, -1)
        choice = np.where(mask[:, :, None], g, -np.inf).reshape(t, n)
    idx = _topk(choice, k)
    w = np.take_along_axis(s, idx, -1)
    if norm:
        w = w / (w.sum(-1, keepdims=True) + (0.0 if func == "softmax" else 1e-20))
    probs = s if func == "softmax" else s / s.sum(-1, keepdims=True)
    return w * scale, idx, probs


def _check(spec, logits, bias, **ref_kw):
    w, idx, probs = route(logits, bias, spec)
    rw, ridx, rprobs = ref_route(np.asarray(logits), None if bias is None else np.asarray(bias), **ref_kw)
    np.testing.assert_array_equal(np.asarray(idx), ridx)
    np.testing.assert_allclose(np.asarray(w), rw, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(probs), rprobs, rtol=2e-6, atol=1e-7)
    return np.asarray(w), np.asarray(idx)


LOGITS = np.random.default_rng(0).normal(size=(32, 8)).astype(np.float32) * 2
BIAS = np.random.default_rng(1).normal(size=(8,)).astype(np.float32) * 0.3


@pytest.mark.parametrize("func", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_route_matches_numpy(func, norm, with_bias):
    scale = 2.5 if with_bias else 1.0
    spec = RouterSpec(8, 3, func, norm_topk_prob=norm, scaling_factor=scale)
    bias = BIAS if with_bias else None
    _check(spec, LOGITS, bias, func=func, k=3, norm=norm, scale=scale)
    if with_bias:  # the bias must change the selection on this data (else it is untested)
        _, plain = route(LOGITS, None, spec)[:2]
        assert not np.array_equal(np.asarray(route(LOGITS, bias, spec)[1]), np.asarray(plain))


def test_scaling_factor_multiplies_weights():
    base = np.asarray(route(LOGITS, None, RouterSpec(8, 2, "sigmoid", norm_topk_prob=True))[0])
    scaled = np.asarray(route(LOGITS, None, RouterSpec(8, 2, "sigmoid", norm_topk_prob=True, scaling_factor=2.5))[0])
    np.testing.assert_allclose(scaled, 2.5 * base, rtol=1e-6)
    np.testing.assert_allclose(base.sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("func", ["sigmoid", "sqrtsoftplus"])
def test_group_limited_matches_numpy(func):
    spec = RouterSpec(8, 3, func, norm_topk_prob=True, scaling_factor=2.5, n_groups=4, topk_groups=2)
    _check(spec, LOGITS, BIAS, func=func, k=3, norm=True, scale=2.5, groups=4, keep_groups=2)
    plain = RouterSpec(8, 3, func, norm_topk_prob=True, scaling_factor=2.5)
    assert not np.array_equal(np.asarray(route(LOGITS, BIAS, spec)[1]), np.asarray(route(LOGITS, BIAS, plain)[1]))


def test_group_limiting_changes_selection_and_breaks_ties_low():
    """Logits 0 (every score 0.5) and a crafted bias: the choice values per group of 2 are
    g0 [0.9, 0], g1 [0.6, 0.6], g2 [0.55, 0.55], g3 [0, 0] (+0.5). Plain top-2 takes expert 0
    and then 2 (tie with 3 -> lower index); keeping the 2 best groups (g1, g2) excludes
    expert 0 and gives [2, 3]. The second bias ties groups g0 and g2: the lower group wins."""
    bias = np.array([[0.9, 0, 0.6, 0.6, 0.55, 0.55, 0, 0], [0.6, 0.6, 0, 0, 0.6, 0.6, 0.7, 0.7]], np.float32)
    logits = np.zeros((1, 8), np.float32)
    plain = RouterSpec(8, 2, "sigmoid", norm_topk_prob=True)
    grouped = RouterSpec(8, 2, "sigmoid", norm_topk_prob=True, n_groups=4, topk_groups=2)
    assert route(logits, bias[0], plain)[1].tolist() == [[0, 2]]
    w, idx, _ = route(logits, bias[0], grouped)
    assert idx.tolist() == [[2, 3]]
    np.testing.assert_allclose(np.asarray(w), [[0.5, 0.5]])  # pre-bias scores, renormalised
    # group sums g0 2.2, g1 1.0, g2 2.2, g3 2.4 -> keep g3 and g0 (tie with g2 -> lower); g2 would give [6, 7, 4]
    grouped1 = RouterSpec(8, 3, "sigmoid", n_groups=4, topk_groups=2)
    assert route(logits, bias[1], grouped1)[1].tolist() == [[6, 7, 0]]


def test_ties_select_lower_index():
    logits = np.zeros((2, 6), np.float32)
    for func in ("softmax", "sigmoid", "sqrtsoftplus"):
        assert route(logits, None, RouterSpec(6, 3, func))[1].tolist() == [[0, 1, 2]] * 2


def test_llama4_input_scaling_mode():
    spec = RouterSpec(8, 1, "sigmoid", norm_topk_prob=True, scaling_factor=1.0, scales_input=True)
    w, idx, probs = route(LOGITS, None, spec)
    ridx = np.argmax(LOGITS, -1)[:, None]
    np.testing.assert_array_equal(np.asarray(idx), ridx)
    expected = 1 / (1 + np.exp(-np.take_along_axis(LOGITS.astype(np.float64), ridx, -1)))
    np.testing.assert_allclose(np.asarray(w), expected, rtol=1e-6)  # not renormalised to 1
    s = 1 / (1 + np.exp(-LOGITS.astype(np.float64)))
    np.testing.assert_allclose(np.asarray(probs), s / s.sum(-1, keepdims=True), rtol=2e-6)


def test_load_balance_loss_matches_numpy():
    _, idx, probs = route(LOGITS, None, RouterSpec(8, 3, "softmax"))
    idx, probs = np.asarray(idx), np.asarray(probs, np.float64)
    f = np.bincount(idx.ravel(), minlength=8) / idx.size
    expected = 8 * np.sum(f * probs.mean(0))
    np.testing.assert_allclose(float(load_balance_loss(idx, probs)), expected, rtol=1e-6)
    # perfectly balanced uniform routing gives exactly 1
    uniform = np.full((8, 8), 1 / 8, np.float32)
    assert float(load_balance_loss(np.arange(8)[:, None], uniform)) == pytest.approx(1.0, rel=1e-6)


def test_route_jits_with_traced_bias():
    spec = RouterSpec(8, 2, "sigmoid", norm_topk_prob=True, n_groups=2, topk_groups=1)
    eager = route(LOGITS, BIAS, spec)
    jitted = jax.jit(route, static_argnums=2)(LOGITS, BIAS, spec)
    for a, b in zip(eager, jitted):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
