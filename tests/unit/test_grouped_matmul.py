"""The blocked grouped matmul (``parallel/grouped_matmul.py``) == ``jax.lax.ragged_dot``: output and
both gradients in float32, with empty groups, one group taking every row, rows past the last
group, several ``lax.map`` steps; it runs at its FLOP count where ragged_dot does not (CPU); the
row permutation's gather gradient; ``grouped_matmul`` selection and its config checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnxtron.config.loader import load_config
from nnxtron.errors import ConfigError
from nnxtron.parallel import grouped_matmul as gm
from tests.parity.test_expert_parallel import _mesh, _run
from tests.unit.test_moe import inputs, make

M, K, N = 40, 8, 12
SIZES = {  # group sizes of 5 groups over M = 40 rows
    "uneven": [9, 0, 17, 3, 11],  # all rows, an empty group
    "one_group": [0, 0, 40, 0, 0],  # one group takes everything
    "tail": [6, 0, 7, 2, 0],  # 25 rows past the last group: zero output, zero gradient
    "none": [0, 0, 0, 0, 0],
}


def _operands(seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    keys = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(keys[0], (M, K))
    rhs = jax.random.normal(keys[1], (5, K, N))
    return lhs, rhs, jax.random.normal(keys[2], (M, N))


def _value_and_grads(matmul, lhs, rhs, cot):
    """``sum(sin(out) * cot)`` and its gradients with respect to both operands."""
    loss = lambda lhs, rhs: jnp.sum(jnp.sin(matmul(lhs, rhs)) * cot)  # noqa: E731
    out = jax.jit(matmul)(lhs, rhs)
    return out, jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(lhs, rhs)


@pytest.mark.parametrize("block", [None, 1, 4, 16])
@pytest.mark.parametrize("case", sorted(SIZES))
def test_blocked_equals_ragged_dot(case, block):
    lhs, rhs, cot = _operands()
    sizes = jnp.asarray(SIZES[case], jnp.int32)
    ref = _value_and_grads(lambda a, b: jax.lax.ragged_dot(a, b, sizes), lhs, rhs, cot)
    got = _value_and_grads(lambda a, b: gm.grouped_matmul(a, b, sizes, block), lhs, rhs, cot)
    for name, g, r in zip(("out", "loss", "dlhs", "drhs"), jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5, err_msg=name)
    used = int(sum(SIZES[case]))
    assert not np.asarray(got[0][used:]).any() and not np.asarray(got[1][1][0][used:]).any()  # rows past every group
    empty = [g for g, size in enumerate(SIZES[case]) if size == 0]
    assert not np.asarray(got[1][1][1][np.asarray(empty, int)]).any()  # no gradient for an empty group


def test_blocked_in_several_map_steps(monkeypatch):
    """A budget of zero bytes: ``chunk_blocks`` blocks per step (the group count, 5): 23 blocks of 2
    rows in 4 steps + a remainder of 3 blocks."""
    monkeypatch.setattr(gm, "GATHER_BUDGET_BYTES", 0)
    lhs, rhs, cot = _operands(1)
    sizes = jnp.asarray(SIZES["uneven"], jnp.int32)
    assert gm.chunk_blocks(rhs.shape, 4) == 5 and gm.block_layout(sizes, M, 2).block_group.shape == (23,)
    ref = _value_and_grads(lambda a, b: jax.lax.ragged_dot(a, b, sizes), lhs, rhs, cot)
    got = _value_and_grads(lambda a, b: gm.grouped_matmul(a, b, sizes, 2), lhs, rhs, cot)
    jax.tree.map(lambda g, r: np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5), got, ref)


def test_block_layout_places_each_group_in_its_own_blocks():
    sizes = jnp.asarray([3, 0, 6, 1], jnp.int32)
    layout = gm.block_layout(sizes, 12, 4)  # bound: 12 + 4 * 3 = 24 rows = 6 blocks
    np.testing.assert_array_equal(layout.block_group, [0, 2, 2, 3, 3, 3])  # past the end: the last group
    source = np.asarray(layout.source).reshape(6, 4)
    np.testing.assert_array_equal(source[:4], [[0, 1, 2, 12], [3, 4, 5, 6], [7, 8, 12, 12], [9, 12, 12, 12]])
    assert (source[4:] == 12).all()
    np.testing.assert_array_equal(layout.target, [0, 1, 2, 4, 5, 6, 7, 8, 9, 12, 24, 24])  # rows 10, 11: no group


def test_block_size_rule():
    assert gm.block_size(1024, 16) == 16  # deepseek3-tiny, 1 x 128 tokens x 8 of 16 experts
    assert gm.block_size(4096, 8) == 128
    assert gm.block_size(40, 5) == gm.MIN_BLOCK and gm.block_size(1 << 20, 8) == gm.MAX_BLOCK
    assert gm.block_size(2000, 10) == 32  # a power of two <= 2000 / 40


def _flops(matmul, *args) -> tuple[float, float]:
    """XLA's FLOP count of ``matmul`` and of the gradient of its sum."""
    fwd = jax.jit(matmul).lower(*args).compile().cost_analysis()["flops"]
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(matmul(*a)), argnums=(0, 1))).lower(*args).compile().cost_analysis()
    return fwd, grad["flops"]


def test_blocked_runs_at_its_flop_count():
    """Compiled FLOPs (XLA's cost analysis, this backend): blocked <= 1.5x the grouped rows' FLOPs
    (padding <= 25 %, plus the gathers), forward and gradient; ragged_dot on CPU multiplies every row
    by every group (measured: 8.3x forward, 17x gradient for 8 groups)."""
    rows, k, n, groups = 512, 32, 48, 8
    lhs, rhs = jnp.ones((rows, k)), jnp.ones((groups, k, n))
    sizes = jnp.asarray([100, 0, 80, 60, 72, 50, 90, 60], jnp.int32)
    ideal = 2 * rows * k * n
    fwd, grad = _flops(lambda a, b: gm.grouped_matmul(a, b, sizes), lhs, rhs)
    assert fwd <= 1.5 * ideal and grad <= 3 * ideal, (fwd / ideal, grad / ideal)
    if jax.default_backend() == "cpu":
        fwd, grad = _flops(lambda a, b: jax.lax.ragged_dot(a, b, sizes), lhs, rhs)
        assert fwd >= groups * ideal and grad >= 2 * groups * ideal, (fwd / ideal, grad / ideal)


@pytest.mark.parametrize("method", gm.METHODS)
def test_permute_rows_gradient_is_the_gather_gradient(method):
    """``group_rows``' ``rows`` / ``restore`` undo each other, so ``permute_rows``' gather gradient
    equals ``take_rows``' scatter-add gradient, both ways (into the layout and back). Where the
    grouping says its gathers are in bounds (``ragged_dot``: no bounds mask), both are permutations."""
    keys = jnp.asarray([2, 0, 3, 2, 1, 3, 0, 2, 3, 3, 2, 0], jnp.int32)  # 3: in no group
    grouped = gm.group_rows(keys, 3, method)
    assert grouped.in_bounds == (method == "ragged_dot")
    if grouped.in_bounds:
        for perm in (grouped.rows, grouped.restore):
            np.testing.assert_array_equal(np.sort(np.asarray(perm)), np.arange(keys.shape[0]))
    x = jax.random.normal(jax.random.key(0), (12, 5))
    for index, inverse, rows in ((grouped.rows, grouped.restore, 12), (grouped.restore, grouped.rows, grouped.rows.shape[0])):
        y = x if rows == 12 else jax.random.normal(jax.random.key(1), (rows, 5))
        cot = jax.random.normal(jax.random.key(2), (index.shape[0], 5))
        got = jax.grad(lambda a, i=index, j=inverse, c=cot: jnp.sum(gm.permute_rows(a, i, j, grouped.in_bounds) * c))(y)
        ref = jax.grad(lambda a, i=index, c=cot: jnp.sum(gm.take_rows(a, i) * c))(y)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    out = gm.take_rows(gm.take_rows(x, grouped.rows), grouped.restore)
    valid = np.asarray(keys) < 3
    np.testing.assert_array_equal(np.asarray(out)[valid], np.asarray(x)[valid])
    if method == "blocked":  # ragged_dot's rows past every group are sorted, not dropped
        assert not np.asarray(out)[~valid].any()


@pytest.mark.parametrize("method", gm.METHODS)
def test_gather_slots_is_the_gather_of_the_slot_major_repeat(method):
    """``gather_slots(x, rows, restore, k)`` equals ``take_rows`` of ``x`` repeated slot-major
    (row ``j * T + t`` is ``x[t]``), value and gradient (its own: gather each slot back, sum)."""
    tokens, k = 4, 3
    keys = jnp.asarray([2, 0, 3, 2, 1, 3, 0, 2, 3, 3, 2, 0], jnp.int32)  # [k * T], slot-major; 3: in no group
    grouped = gm.group_rows(keys, 3, method)
    x = jax.random.normal(jax.random.key(0), (tokens, 5))
    cot = jax.random.normal(jax.random.key(1), (grouped.rows.shape[0], 5))
    repeated = lambda a: gm.take_rows(jnp.tile(a, (k, 1)), grouped.rows)  # noqa: E731
    got = gm.gather_slots(x, grouped.rows, grouped.restore, k, grouped.in_bounds)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(repeated(x)))
    grad = jax.grad(lambda a: jnp.sum(gm.gather_slots(a, grouped.rows, grouped.restore, k, grouped.in_bounds) * cot))(x)
    ref = jax.grad(lambda a: jnp.sum(repeated(a) * cot))(x)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref), rtol=1e-6, atol=1e-6)


# --- selection: grouped_matmul=auto | ragged_dot | blocked -------------------------------------------
@pytest.mark.parametrize(
    ("value", "backend", "quantized", "method"),
    [("auto", "tpu", False, "ragged_dot"), ("auto", "cpu", False, "blocked"), ("auto", "gpu", False, "blocked"),
     ("auto", "cpu", True, "ragged_dot"), ("blocked", "tpu", False, "blocked"), ("ragged_dot", "cpu", False, "ragged_dot")],
)  # fmt: skip
def test_resolve_grouped_matmul(value, backend, quantized, method):
    assert gm.resolve_grouped_matmul(value, backend, quantized) == method


@pytest.mark.parametrize("mesh", [None, "ep2_fsdp4"])
@pytest.mark.parametrize("value", ["auto", "ragged_dot", "blocked"])
def test_moe_layer_runs_the_grouped_matmul_it_reads(value, mesh):
    """The layer's gradient program holds ``ragged_dot`` exactly when ``grouped_matmul`` resolves to it,
    without a mesh and under expert parallelism (the ``shard_map`` body)."""
    overrides = dict(ici_expert_parallelism=2, ici_fsdp_parallelism=4) if mesh else {}
    moe, cfg = make(grouped_matmul=value, **overrides)
    method = gm.resolve_grouped_matmul(value, jax.default_backend(), False)
    assert moe.grouped_matmul == method
    x = inputs(batch=8, seq=4)
    jaxpr = str(jax.make_jaxpr(lambda x: _run(cfg, moe, x, x, _mesh(mesh) if mesh else None))(x))
    assert ("ragged_dot_general" in jaxpr) == (method == "ragged_dot"), method


@pytest.mark.parametrize(
    ("args", "message"),
    [(["moe_compute=dense", "grouped_matmul=blocked"], "grouped_matmul=blocked applies to moe_compute=grouped only"),
     (["use_qwix_quantization=true", "quantization=int8", "grouped_matmul=blocked"], "grouped_matmul=blocked cannot be quantized")],
)  # fmt: skip
def test_grouped_matmul_config_checks(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model_name=mixtral-tiny", *args])
    load_config(None, ["model_name=mixtral-tiny", *args[:-1], "grouped_matmul=auto"])
