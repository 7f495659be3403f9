"""The written tie rule of every top-k in the models (``layers/router.py``): the router's experts,
the group limit's groups and the DeepSeek-V4 indexer's entries. Equal values go in index order,
-0.0 equals +0.0, -inf follows every finite value and NaN comes last."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnxtron.layers.router import RouterSpec, group_limit, route, top_k
from nnxtron.models.deepseek4.compressed import Indexer

NEG_ZERO = np.float32(-0.0)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_signed_zeros_tie_and_break_by_index(jit: bool) -> None:
    """``lax.top_k`` ranks +0.0 above -0.0 (it would pick [1, 3, 0]); the rule picks [0, 1, 2]."""
    x = jnp.array([[NEG_ZERO, 0.0, NEG_ZERO, 0.0, -1.0]], jnp.float32)
    fn = jax.jit(top_k, static_argnums=1) if jit else top_k
    values, idx = fn(x, 3)
    assert idx.tolist() == [[0, 1, 2]]
    assert not np.signbit(np.asarray(values)).any()  # the values come back as +0.0
    assert jax.lax.top_k(x, 3)[1].tolist() == [[1, 3, 0]]  # the order the rule replaces


def test_equal_values_go_in_index_order_then_minus_inf_then_nan() -> None:
    x = jnp.array([[np.nan, -np.inf, 0.5, -np.inf, 0.5, 0.25, np.nan]], jnp.float32)
    values, idx = top_k(x, 7)
    assert idx.tolist() == [[2, 4, 5, 1, 3, 0, 6]]
    np.testing.assert_array_equal(np.asarray(values)[0, :5], [0.5, 0.5, 0.25, -np.inf, -np.inf])


def test_router_ties_break_by_expert_index_with_signed_zero_bias() -> None:
    """Equal scores plus biases of -0.0 and +0.0: the lower experts are chosen."""
    logits = jnp.zeros((1, 6), jnp.float32)
    bias = jnp.array([0.0, NEG_ZERO, 0.0, NEG_ZERO, 0.0, NEG_ZERO], jnp.float32)
    for func in ("sigmoid", "sqrtsoftplus"):
        assert route(logits, bias, RouterSpec(6, 4, func))[1].tolist() == [[0, 1, 2, 3]]


def test_group_limit_ties_break_by_group_index() -> None:
    """Four groups of two, all group scores equal (one with -0.0 members): the first two groups stay."""
    choice = jnp.array([[0.0, 0.0, NEG_ZERO, NEG_ZERO, 0.0, 0.0, NEG_ZERO, 0.0]], jnp.float32)
    kept = np.isfinite(np.asarray(group_limit(choice, 4, 2)))
    assert kept.tolist() == [[True, True, True, True, False, False, False, False]]


def test_indexer_ties_break_by_window_index() -> None:
    """A ReLU score times a negative head weight is -0.0; it ties with +0.0 and the earlier windows win."""
    scores = jnp.array([[[NEG_ZERO, 0.0, NEG_ZERO, 0.0, 1.0, NEG_ZERO]]], jnp.float32)  # [B, S, N]
    visible = jnp.array([[[True, True, True, True, True, False]]])
    chosen = Indexer._select(SimpleNamespace(topk=3), scores, visible)
    assert np.asarray(chosen).tolist() == [[[True, True, False, False, True, False]]]
