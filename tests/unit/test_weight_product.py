"""``layers/matmul.contract_last``: bfloat16 weight products asked of XLA as float32 products and
cast (forward and both gradient products), equal to the plain ``dot_general`` up to the order of
the float32 sums; float32 operands and ``plain_products()`` take the plain path; remat
``minimal`` keeps these products as it keeps plain dots."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from nnxtron.layers import matmul
from nnxtron.layers.matmul import WEIGHT_PRODUCT, contract_last, plain_products
from nnxtron.parallel.remat import RematSpec, jax_policy


def _operands(dtype, x_shape=(2, 5, 12), w_shape=(12, 7)):
    kx, kw = jax.random.split(jax.random.key(0))
    return jax.random.normal(kx, x_shape).astype(dtype), jax.random.normal(kw, w_shape).astype(dtype)


def _plain(x, w, n):
    return lax.dot_general(x, w, ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ())))


def _value_and_grads(product, x, w, n):
    def objective(x, w):
        y = product(x, w, n)
        return jnp.sum(jnp.sin(y.astype(jnp.float32))), y

    (_, y), grads = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(x, w)
    return y, *grads


def _dots(jaxpr) -> list:
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is lax.dot_general_p:
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found.extend(_dots(sub))
    return found


@pytest.mark.parametrize("shapes", [((2, 5, 12), (12, 7), 1), ((3, 8), (8, 4, 6), 1), ((2, 4, 3, 5), (3, 5, 6), 2)])
def test_bfloat16_values_and_gradients_equal_the_plain_product(shapes):
    x_shape, w_shape, n = shapes
    x, w = _operands(jnp.bfloat16, x_shape, w_shape)
    ours = _value_and_grads(contract_last, x, w, n)
    plain = _value_and_grads(_plain, x, w, n)
    for a, b in zip(ours, plain, strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16 and a.shape == b.shape
        # the same float32 sums in another order, rounded to bfloat16: at most one rounding step apart
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2**-7, atol=1e-6)


def test_every_product_is_bfloat16_in_float32_out():
    x, w = _operands(jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x, w: _value_and_grads(contract_last, x, w, 1))(x, w).jaxpr
    dots = _dots(jaxpr)
    assert len(dots) == 3  # the forward product and the two gradient products
    for eqn in dots:
        assert [v.aval.dtype for v in eqn.invars] == [jnp.bfloat16, jnp.bfloat16]
        assert eqn.params["preferred_element_type"] == jnp.float32


def test_float32_operands_and_plain_products_take_the_plain_dot():
    for dtype, plain in ((jnp.float32, False), (jnp.bfloat16, True)):
        x, w = _operands(dtype)
        with plain_products(plain):
            jaxpr = jax.make_jaxpr(lambda x, w: _value_and_grads(contract_last, x, w, 1))(x, w).jaxpr
            got = _value_and_grads(contract_last, x, w, 1)
        assert "custom_vjp" not in str(jaxpr)
        assert all(eqn.params["preferred_element_type"] in (None, dtype) for eqn in _dots(jaxpr))
        for a, b in zip(got, _value_and_grads(_plain, x, w, 1), strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_an_enclosing_plain_context_stays_plain():
    """The decoder opens ``plain_products(use_qwix_quantization)``; a caller's plain context wins."""
    x, w = _operands(jnp.bfloat16)
    with plain_products(True), plain_products(False):
        jaxpr = jax.make_jaxpr(lambda x, w: contract_last(x, w, 1))(x, w).jaxpr
    assert "custom_vjp" not in str(jaxpr)
    with plain_products(False):
        assert "custom_vjp" in str(jax.make_jaxpr(lambda x, w: contract_last(x, w, 1))(x, w).jaxpr)


def test_other_backends_keep_the_plain_product(monkeypatch):
    """TPU and GPU accumulate bfloat16 products in float32 themselves: the plain op stays there."""
    monkeypatch.setattr(matmul, "FLOAT32_BACKENDS", ("tpu",))
    x, w = _operands(jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x, w: _value_and_grads(contract_last, x, w, 1))(x, w).jaxpr
    assert "custom_vjp" not in str(jaxpr) and all(
        e.params["preferred_element_type"] in (None, jnp.bfloat16) for e in _dots(jaxpr)
    )


@pytest.mark.parametrize("policy", ["minimal", "minimal_with_context", "minimal_offloaded"])
def test_minimal_policies_keep_the_weight_products(policy, capsys):
    x, w1 = _operands(jnp.bfloat16, (4, 8), (8, 16))
    w2 = _operands(jnp.bfloat16, (4, 16), (16, 8))[1]

    def block(x, w1, w2):
        return jnp.sum(jnp.sin(contract_last(jnp.sin(contract_last(x, w1, 1)), w2, 1)).astype(jnp.float32))

    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(block, policy=jax_policy(RematSpec(policy))), x, w1, w2)
    saved = capsys.readouterr().out
    kept = "bf16<host>[" if policy.endswith("offloaded") else f"named '{WEIGHT_PRODUCT}'"
    assert saved.count(kept) == 2, saved  # both products (the sines' inputs) kept or offloaded, not recomputed
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(block, policy=jax_policy(RematSpec("full"))), x, w1, w2)
    assert WEIGHT_PRODUCT not in capsys.readouterr().out
