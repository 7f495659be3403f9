"""Products in a low-precision compute dtype, multiplied and summed in float32.

``einsum(spec, a, b)`` (two operands) and ``contract_last(x, w, n)`` (``x @ w`` over the last
``n`` axes of ``x`` and the first ``n`` of ``w``) compute, for bfloat16 / float16 operands, the
function of a ``dtype`` x ``dtype`` -> ``dtype`` product accumulated in float32 — the result and
both gradients rounded to the operands' dtype — but ask XLA for a float32 product and cast it,
in the forward pass and in both products of the backward pass (a ``custom_vjp``). On a CPU
with bfloat16 matrix units (AMX, AVX512-BF16) XLA runs bfloat16 x bfloat16 -> float32 products
4-5x faster than bfloat16 -> bfloat16 ones, and JAX's own gradient of a float32-result product
would multiply the float32 cotangent by a bfloat16 operand (the slow mixed path). This is
done on the CPU backend (``FLOAT32_BACKENDS``), where it is measured; TPU and GPU keep the plain
product, which XLA accumulates in float32 there and rounds inside the matmul. Other operand
dtypes take the plain product, and so does every product inside ``plain_products()`` (qwix's
quantized matmuls intercept ``dot_general`` / ``einsum`` themselves).

A product without batch indices (an index of both operands and of the result) is named
``WEIGHT_PRODUCT`` (``checkpoint_name``): remat policies that keep "dots without batch
dimensions" (``minimal`` and its variants, ``parallel/remat.py``) keep these too, which they
cannot recognise inside a ``custom_vjp``.
"""

from __future__ import annotations

import contextlib
import contextvars
import string
from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from nnxtron.parallel.remat import WEIGHT_PRODUCT
from nnxtron.scoped import scoped

FLOAT32_BACKENDS = ("cpu",)  # where the float32-result path is measured to pay
LOW_PRECISION = (jnp.bfloat16, jnp.float16)
_plain = contextvars.ContextVar("nnxtron_plain_products", default=False)


def plain_products(plain: bool = True) -> contextlib.AbstractContextManager[None]:
    """Within this context (at trace time) ``einsum`` and ``contract_last`` are the plain products
    when ``plain`` (inside an enclosing plain context they stay plain)."""
    return scoped(_plain, plain or _plain.get())


def _rounded(spec: str, a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _float32_einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return _rounded(spec, a, b, a.dtype)


def _forward(spec: str, a: jax.Array, b: jax.Array):
    return _float32_einsum(spec, a, b), (a, b)


def _indices(spec: str) -> tuple[str, str, str]:
    """The two operands' and the result's indices of ``"ab,bc->ac"``."""
    inputs, out = spec.replace(" ", "").split("->")
    a_idx, b_idx = inputs.split(",")
    return a_idx, b_idx, out


def _backward(spec: str, residuals: tuple[jax.Array, jax.Array], g: jax.Array):
    a, b = residuals
    a_idx, b_idx, out = _indices(spec)
    g = g.astype(a.dtype)  # the cotangent of a low-precision result: exact
    return _rounded(f"{out},{b_idx}->{a_idx}", g, b, a.dtype), _rounded(f"{a_idx},{out}->{b_idx}", a, g, b.dtype)


_float32_einsum.defvjp(_forward, _backward)


def _checked(spec: str) -> tuple[str, str, str]:
    """``spec``'s operand and result indices; each operand index must appear in the other operand
    or the result (an index summed inside one operand has no product to transpose)."""
    a_idx, b_idx, out = _indices(spec)
    for own, other in ((a_idx, b_idx), (b_idx, a_idx)):
        if len(set(own)) != len(own) or not set(own) <= set(other) | set(out):
            raise ValueError(f"einsum {spec!r}: each index once per operand, and in the other operand or the result")
    return a_idx, b_idx, out


def _float32_path(a: jax.Array, b: jax.Array) -> bool:
    return a.dtype == b.dtype and a.dtype in LOW_PRECISION and not _plain.get() and jax.default_backend() in FLOAT32_BACKENDS


def einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, a, b)`` (explicit ``->``, no ellipsis) in the operands' dtype."""
    if not _float32_path(a, b):
        return jnp.einsum(spec, a, b)
    a_idx, b_idx, out = _checked(spec)
    y = _float32_einsum(f"{a_idx},{b_idx}->{out}", a, b)
    return y if set(a_idx) & set(b_idx) & set(out) else checkpoint_name(y, WEIGHT_PRODUCT)


def contract_last(x: jax.Array, w: jax.Array, n: int) -> jax.Array:
    """``x [..., *in] @ w [*in, *out]`` over the ``n`` = ``len(in)`` axes, in the operands' dtype
    (the plain path is one ``dot_general``, the op qwix quantizes in a ``Linear``)."""
    if not _float32_path(x, w):
        return jax.lax.dot_general(x, w, ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ())))
    letters = string.ascii_letters[: x.ndim + w.ndim - n]
    x_idx, w_idx = letters[: x.ndim], letters[x.ndim - n : x.ndim + w.ndim - n]
    return einsum(f"{x_idx},{w_idx}->{x_idx[: x.ndim - n]}{w_idx[n:]}", x, w)
