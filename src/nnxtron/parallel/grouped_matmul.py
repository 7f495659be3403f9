"""Grouped matmul at its FLOP count on every backend: padded row blocks, one expert each.

``grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]`` equals
``jax.lax.ragged_dot``: rows ``start_g .. start_g + group_sizes[g] - 1`` (groups contiguous,
in order) are multiplied by ``rhs[g]``; rows past the last group give zero. ``ragged_dot``
is XLA's grouped matmul where the backend has a kernel (TPU); elsewhere (CPU, GPU) JAX
lowers it to a dense product that multiplies every row by every group, ``G`` times the
FLOPs, and its weight gradient expands both operands to ``[G, M, .]``.

The blocked form computes only the grouped rows:

1. each group's rows are padded up to a multiple of the block size ``b``, so that every
   block of ``b`` consecutive padded rows belongs to one group (``block_layout``; static
   bound: ``M + G (b - 1)`` rows, rounded up to whole blocks — the blocks past the last
   group hold zero rows);
2. each block is multiplied by its group's weights (``blocked_matmul``: a batched matmul
   with the weights gathered per block, ``chunk`` blocks at a time under ``lax.map``; the
   gather is recomputed in the backward pass instead of saved, and the weight gradient
   is the per-block products summed into their groups);
3. the padded rows are dropped.

``expert_ffn`` (``parallel/expert.py``) gathers the routed tokens straight into the padded
layout (``group_rows``), runs its three matmuls there and gathers the outputs back, so it
pads and unpads once per layer, not once per matmul.

Block size (``block_size``): the largest power of two ``<= M / (4 G)``, within ``[8, 512]``:
the padding adds at most ``G (b - 1) < M / 4`` rows (25 % of the FLOPs) while blocks stay
large enough for an efficient matmul. Chunk (``chunk_blocks``): as many blocks per
``lax.map`` step as keep the gathered weights under the larger of the weights themselves
and 64 MiB.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

MIN_BLOCK, MAX_BLOCK = 8, 512
GATHER_BUDGET_BYTES = 64 << 20
METHODS = ("ragged_dot", "blocked")


def resolve_grouped_matmul(value: str, backend: str, quantized: bool) -> str:
    """``grouped_matmul`` -> the method: ``auto`` is ``ragged_dot`` on TPU (XLA's grouped kernel) and
    under qwix quantization (which intercepts ``ragged_dot``), ``blocked`` elsewhere."""
    if value == "auto":
        return "ragged_dot" if backend == "tpu" or quantized else "blocked"
    if value not in METHODS:
        raise ValueError(f"grouped_matmul={value!r}; choose auto or one of {METHODS}")
    return value


def block_size(rows: int, groups: int) -> int:
    """Rows per block for ``rows`` grouped rows in ``groups`` groups (see the module docstring)."""
    target = max(rows // (4 * groups), 1)
    return min(max(1 << (target.bit_length() - 1), MIN_BLOCK), MAX_BLOCK)


def chunk_blocks(rhs_shape: tuple[int, ...], itemsize: int) -> int:
    """Blocks per ``lax.map`` step: gathered weights within max(``rhs`` bytes, 64 MiB)."""
    groups, k, n = rhs_shape
    per_block = k * n * itemsize
    return max(1, max(groups * per_block, GATHER_BUDGET_BYTES) // per_block)


class BlockLayout(NamedTuple):
    """Where the ``M`` grouped rows sit among the ``nb * b`` padded rows.

    ``block_group [nb]``: the group of each block (the last group for blocks past the end);
    ``source [nb * b]``: the row placed at each padded row (``M``, out of range, for padding);
    ``target [M]``: the padded row of each row (``nb * b``, out of range, for rows past the
    last group)."""

    block_group: jax.Array
    source: jax.Array
    target: jax.Array


def block_layout(group_sizes: jax.Array, rows: int, block: int) -> BlockLayout:
    """The padded layout of ``rows`` rows grouped by ``group_sizes [G]`` (sum <= rows)."""
    groups = group_sizes.shape[0]
    blocks = -(-(rows + groups * (block - 1)) // block)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    padded = (sizes + block - 1) // block * block
    padded_ends = jnp.cumsum(padded)
    padded_starts = padded_ends - padded
    block_group = jnp.searchsorted(padded_ends, jnp.arange(blocks, dtype=jnp.int32) * block, side="right")
    block_group = jnp.minimum(block_group, groups - 1).astype(jnp.int32)
    slot = jnp.arange(blocks * block, dtype=jnp.int32)
    group = block_group[slot // block]
    offset = slot - padded_starts[group]
    source = jnp.where(offset < sizes[group], starts[group] + offset, rows)
    row = jnp.arange(rows, dtype=jnp.int32)
    row_group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), groups - 1)
    target = jnp.where(row < ends[-1], padded_starts[row_group] + row - starts[row_group], blocks * block)
    return BlockLayout(block_group, source.astype(jnp.int32), target.astype(jnp.int32))


def take_rows(x: jax.Array, index: jax.Array, in_bounds: bool = False) -> jax.Array:
    """``x[index]`` along axis 0, zero where ``index`` is out of range; ``in_bounds``: every index
    is in range (a permutation), so the gather skips the bounds mask (on a TPU a select and a
    broadcast of the whole output per gather, docs/tpu.md)."""
    if in_bounds:
        return jnp.take(x, index, axis=0, mode="clip")
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def permute_rows(x: jax.Array, index: jax.Array, inverse: jax.Array, in_bounds: bool = False) -> jax.Array:
    """``take_rows(x, index)`` where ``index`` is one-to-one and ``inverse`` undoes it (``index[inverse[j]]
    == j`` wherever ``inverse[j]`` is in range, and every other row of ``x`` is taken by no index):
    its gradient is the gather ``take_rows(ct, inverse)``, not a scatter-add (slow on CPU).
    ``in_bounds``: both are permutations (``GroupedRows.in_bounds``)."""
    return take_rows(x, index, in_bounds)


def _permute_fwd(x, index, inverse, in_bounds):
    return take_rows(x, index, in_bounds), (index, inverse)


def _permute_bwd(in_bounds, res, ct):
    index, inverse = res
    return take_rows(ct, inverse, in_bounds), None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def gather_slots(x: jax.Array, index: jax.Array, inverse: jax.Array, slots: int, in_bounds: bool = False) -> jax.Array:
    """The rows of ``x [T, D]`` taken once per slot: ``permute_rows`` of ``x`` repeated slot-major
    (row ``j * T + t`` is ``x[t]``) without building the ``[slots * T, D]`` repeat. ``index`` takes
    rows of that repeat (out of range: a zero row); its gradient gathers each slot's rows back
    (``inverse``) and sums the slots. ``in_bounds``: both are permutations."""
    return _gather_slots(x, index, slots, in_bounds)


def _gather_slots(x: jax.Array, index: jax.Array, slots: int, in_bounds: bool) -> jax.Array:
    tokens = x.shape[0]
    if in_bounds:
        return take_rows(x, index % tokens, in_bounds=True)
    return take_rows(x, jnp.where(index < slots * tokens, index % tokens, tokens))


def _gather_slots_fwd(x, index, inverse, slots, in_bounds):
    return _gather_slots(x, index, slots, in_bounds), (inverse, x.shape[0])


def _gather_slots_bwd(slots, in_bounds, res, ct):
    inverse, tokens = res
    return take_rows(ct, inverse, in_bounds).reshape(slots, tokens, -1).sum(axis=0), None, None


gather_slots.defvjp(_gather_slots_fwd, _gather_slots_bwd)


def blocked_matmul(lhs: jax.Array, rhs: jax.Array, block_group: jax.Array) -> jax.Array:
    """``lhs [nb * b, K]`` (padded layout) -> ``[nb * b, N]``: block ``i`` times ``rhs[block_group[i]]``."""
    blocks = block_group.shape[0]
    block = lhs.shape[0] // blocks
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    chunk = chunk_blocks(rhs.shape, jnp.dtype(dtype).itemsize)

    @partial(jax.checkpoint, prevent_cse=False)  # recompute the gathered weights in the backward pass
    def one_block(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        rows, group = args
        return jnp.dot(rows, jnp.take(rhs, group, axis=0), preferred_element_type=dtype)

    out = jax.lax.map(one_block, (lhs.reshape(blocks, block, -1), block_group), batch_size=chunk)
    return out.reshape(blocks * block, -1)


class GroupedRows(NamedTuple):
    """Rows sorted by group for a grouped matmul: ``rows[i]`` is the input row at position ``i``
    (out of range: a zero row), ``restore[j]`` the position holding input row ``j`` (out of
    range: row ``j`` is in no group and its output is zero), ``matmul(lhs, rhs)`` the grouped
    matmul of ``lhs`` in that order with ``rhs [G, K, N]``. ``in_bounds``: ``rows`` and ``restore``
    are permutations (``ragged_dot``: rows in no group sort last and come out zero), so their
    gathers need no bounds mask."""

    rows: jax.Array
    restore: jax.Array
    matmul: Callable[[jax.Array, jax.Array], jax.Array]
    in_bounds: bool = False


def group_rows(keys: jax.Array, groups: int, method: str) -> GroupedRows:
    """Group the rows by ``keys [M]`` (``0 .. groups - 1``; ``groups``: in no group) for
    ``method`` ``ragged_dot`` (sorted, ``jax.lax.ragged_dot``) or ``blocked`` (sorted and
    padded to blocks, ``blocked_matmul``)."""
    rows = keys.shape[0]
    order = jnp.argsort(keys, stable=True).astype(jnp.int32)
    restore = jnp.zeros_like(order).at[order].set(jnp.arange(rows, dtype=jnp.int32))
    group_sizes = jnp.zeros((groups + 1,), jnp.int32).at[keys].add(1)[:groups]
    if method == "ragged_dot":
        return GroupedRows(order, restore, lambda lhs, rhs: jax.lax.ragged_dot(lhs, rhs, group_sizes), in_bounds=True)
    if method != "blocked":
        raise ValueError(f"grouped matmul method {method!r}; choose one of {METHODS}")
    layout = block_layout(group_sizes, rows, block_size(rows, groups))
    return GroupedRows(
        jnp.take(order, layout.source, mode="fill", fill_value=rows),
        layout.target[restore],
        lambda lhs, rhs: blocked_matmul(lhs, rhs, layout.block_group),
    )


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, block: int | None = None) -> jax.Array:
    """``jax.lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])`` computed blockwise
    (``block`` rows per block; default ``block_size``)."""
    rows, groups = lhs.shape[0], rhs.shape[0]
    layout = block_layout(group_sizes, rows, block or block_size(rows, groups))
    out = blocked_matmul(take_rows(lhs, layout.source), rhs, layout.block_group)
    return take_rows(out, layout.target)
