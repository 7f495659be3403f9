"""Ring attention: context parallelism without gathering the sequence.

With the sequence of the activations sharded over the ``context`` mesh axis (C shards;
``activation_length`` -> ``context`` in ``logical_axis_rules``), ``ring_attention`` runs
under ``jax.shard_map``, manual over that axis only (batch and heads stay under XLA's
automatic sharding). Each device keeps its query chunk; the key/value chunks, with their
segment ids and global token indices, travel around the ring (``jax.lax.ppermute``, device
``i`` -> ``i + 1``) for C steps while the softmax is merged online (running max and sum in
float32, as flash attention does). No device ever holds more than one key/value chunk and
one ``[S/C, S/C]`` block of scores (per head). The backward pass is written by hand
(``jax.custom_vjp``): it recomputes each block's probabilities from the saved log-sum-exp,
accumulates ``dq`` locally and sends ``dk``/``dv`` around the ring with their chunk, one
more step bringing them home.

Masks (causal, ``sliding_window``, Llama 4 ``chunk_size``, packed segments) come from the
global token indices and segment ids, through ``visible`` — the function
``layers.attention.attention_mask`` itself uses. Numerics are those of
``masked_attention``: logits ``(q.k) * scale`` in the activation dtype, softmax in float32;
only the float32 rounding of the online merge differs. Key and value head dims may differ
(MLA). A block (or, with load balancing, a half-block) whose mask is all false is skipped
(``_when``, a loop run zero times or once: a ``lax.cond`` inside a scanned, differentiated layer
made JAX keep every block's scores for the backward pass); with causal masks, windows, chunks
and packed documents that is most of the blocks of the upper triangle.

Load balancing (``context_parallel_load_balance``): with contiguous chunks, device ``d``
sees ``d + 1`` of the C key/value chunks, so the causal work is uneven. Inside the
attention, the sequence is cut into 2C halves and device ``d`` takes halves ``d`` and
``2C - 1 - d`` (the zig-zag of MaxText's DUAL_CHUNK_SWAP; two ``ppermute``s of each of
q, k, v and the segment ids), the ring runs on that order with the original token indices
in the mask, and the output goes back to contiguous order (two more ``ppermute``s). Each
ring step then has exactly two of its four half-blocks visible on every device, the other
two are skipped: causal attention takes C/2 block-times instead of C. The reorder is local
to attention, so the rest of the model (losses, MoE routing order, MTP shifts) sees the
sequence in its own order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from nnxtron.config.options import CONTEXT_PARALLEL_STRATEGIES
from nnxtron.errors import ConfigError
from nnxtron.parallel.sharding import active_mesh, logical_to_spec, spec_axes, vmapped_axes

NEG = float(jnp.finfo(jnp.float32).min)  # the masked logit, as in masked_attention


@dataclass(frozen=True)
class ContextParallel:
    """How attention runs along the sequence: with the sequence sharded, ``strategy``
    ``ring`` or ``all_gather`` (``context_parallel_strategy``) and ``load_balance`` (the
    zig-zag order, ``context_parallel_load_balance``, read by the ring); ``query_block``
    (``attention_query_block``, > 0) runs the gathered attention over blocks of that many
    queries (``layers.attention.attend``)."""

    strategy: str = "all_gather"
    load_balance: bool = False
    query_block: int = 0

    def __post_init__(self):
        if self.strategy not in CONTEXT_PARALLEL_STRATEGIES:
            raise ConfigError(f"context_parallel_strategy={self.strategy!r} is not one of {CONTEXT_PARALLEL_STRATEGIES}")

    @classmethod
    def from_config(cls, cfg) -> ContextParallel:
        return cls(cfg.context_parallel_strategy, cfg.context_parallel_load_balance, cfg.attention_query_block)


def visible(q_idx: jax.Array, k_idx: jax.Array, sliding_window: int = 0, chunk_size: int = 0) -> jax.Array:
    """Boolean ``[Sq, Sk]``: key (global token index ``t``) is visible to query ``s`` iff
    ``t <= s``, with a window W > 0 ``s - t < W``, with chunks of C > 0 ``s // C == t // C``.
    ``sliding_window`` may be a traced scalar (a ``selected`` layer's, ``parallel/layer_kind.py``)."""
    q, k = q_idx[:, None], k_idx[None, :]
    mask = k <= q
    if isinstance(sliding_window, jax.Array):  # traced (a layer whose kind is data): 0 = no window
        mask = mask & ((sliding_window <= 0) | (q - k < sliding_window))
    elif sliding_window > 0:
        mask = mask & (q - k < sliding_window)
    if chunk_size > 0:
        mask = mask & (q // chunk_size == k // chunk_size)
    return mask


def sequence_axes() -> tuple[str, ...]:
    """The mesh axes (size > 1) that shard the sequence of the activations under the
    active mesh; () without one."""
    active = active_mesh()
    if active is None:
        return ()
    mesh, rules = active
    return spec_axes(logical_to_spec(("activation_batch", "activation_length"), rules, mesh)[1])


@dataclass(frozen=True)
class _Ring:
    """The static part of one ring attention call."""

    axis: str | tuple[str, ...]
    size: int
    scale: float
    dtype: jnp.dtype
    sliding_window: int
    chunk_size: int
    blocks: int  # query and key/value sub-blocks per chunk, each pair skipped on its own

    def shift(self, *xs: jax.Array) -> tuple[jax.Array, ...]:
        """Every array one step around the ring: device ``i`` sends to ``i + 1``."""
        perm = [(i, (i + 1) % self.size) for i in range(self.size)]
        return tuple(jax.lax.ppermute(x, self.axis, perm) for x in xs)


def _mask(ring: _Ring, q_seg, kv_seg, q_idx, kv_idx) -> jax.Array:
    """``[B, Sq, Sk]``: ``attention_mask`` of these query and key tokens."""
    same = q_seg[:, :, None] == kv_seg[:, None, :]
    return visible(q_idx, kv_idx, ring.sliding_window, ring.chunk_size)[None] & same


def _logits(ring: _Ring, q: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked float32 logits ``[B, Sq, K, G, Sk]`` of grouped ``q [B, Sq, K, G, dk]``."""
    s = jnp.einsum("bskgd,btkd->bskgt", q, k) * jnp.asarray(ring.scale, q.dtype)
    return jnp.where(mask[:, :, None, None], s.astype(jnp.float32), NEG)


def _forward_block(ring: _Ring, rows, cols, state, _, mask):
    """Merge one block into the online softmax state: the unnormalised output ``o [B, Sq, K, G, dv]``,
    the running max ``m`` and sum ``total`` ``[B, Sq, K, G]``."""
    o, m, total = state
    s = _logits(ring, rows["q"], cols["k"], mask)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(mask[:, :, None, None], jnp.exp(s - m_new[..., None]), 0.0)
    correction = jnp.exp(m - m_new)
    total = total * correction + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bskgt,btkd->bskgd", p.astype(ring.dtype), cols["v"], preferred_element_type=jnp.float32)
    return (o * correction[..., None] + pv, m_new, total), ()


def _backward_block(ring: _Ring, rows, cols, dq, dkv, mask):
    """Add one block's float32 ``dq`` and ``(dk, dv)``, recomputing the probabilities from the
    saved log-sum-exp; ``delta`` is ``sum(d_out * out)`` per query and head."""
    (dq,), (dk, dv) = dq, dkv
    q, k, v, do = rows["q"], cols["k"], cols["v"], rows["do"]
    p = jnp.where(mask[:, :, None, None], jnp.exp(_logits(ring, q, k, mask) - rows["lse"][..., None]), 0.0)
    dv = dv + jnp.einsum("bskgt,bskgd->btkd", p.astype(ring.dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bskgd,btkd->bskgt", do, v, preferred_element_type=jnp.float32)
    ds = (p * (dp - rows["delta"][..., None])).astype(ring.dtype) * jnp.asarray(ring.scale, ring.dtype)
    dq = dq + jnp.einsum("bskgt,btkd->bskgd", ds, k, preferred_element_type=jnp.float32)
    dk = dk + jnp.einsum("bskgt,bskgd->btkd", ds, q, preferred_element_type=jnp.float32)
    return (dq,), (dk, dv)


def _block(x: jax.Array, index, size: int, axis: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis)


def _put(x: jax.Array, part: jax.Array, index, axis: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, part, index * part.shape[axis], axis)


def _seq_axis(name: str) -> int:
    return 0 if name == "idx" else 1  # token indices [S]; every other array [B, S, ...]


def _when(pred: jax.Array, fn, *operands):
    """``fn(*operands)`` if ``pred`` else ``operands``: a loop that runs zero times or once."""

    def body(carry):
        return jnp.zeros((), bool), fn(*carry[1])

    return jax.lax.while_loop(lambda carry: carry[0], body, (pred, operands))[1]


def _visit_pairs(ring: _Ring, fn, rows: dict, cols: dict, row_acc: tuple, col_acc: tuple) -> tuple[tuple, tuple]:
    """``fn(rows_i, cols_j, row_acc_i, col_acc_j, mask) -> (row_acc_i, col_acc_j)`` on every pair of a
    query sub-block ``i`` and a key/value sub-block ``j`` (``ring.blocks`` of each along the
    sequence) whose mask is not all false; the others are skipped (``_when``)."""
    n = ring.blocks
    q_len, kv_len = rows["idx"].shape[0] // n, cols["idx"].shape[0] // n

    def pair(p, accs):
        row_acc, col_acc = accs
        i, j = p // n, p % n
        r = {name: _block(x, i, q_len, _seq_axis(name)) for name, x in rows.items()}
        c = {name: _block(x, j, kv_len, _seq_axis(name)) for name, x in cols.items()}
        ra, ca = tuple(_block(x, i, q_len, 1) for x in row_acc), tuple(_block(x, j, kv_len, 1) for x in col_acc)
        mask = _mask(ring, r["seg"], c["seg"], r["idx"], c["idx"])
        ra, ca = _when(jnp.any(mask), lambda a, b: fn(ring, r, c, a, b, mask), ra, ca)
        return tuple(_put(x, y, i, 1) for x, y in zip(row_acc, ra)), tuple(_put(x, y, j, 1) for x, y in zip(col_acc, ca))

    if n == 1:
        return pair(0, (row_acc, col_acc))
    return jax.lax.fori_loop(0, n * n, pair, (row_acc, col_acc))


def _ring_loop(ring: _Ring, fn, rows: dict, cols: dict, row_acc: tuple, col_acc: tuple) -> tuple[tuple, tuple]:
    """C steps of ``_visit_pairs``; between steps the key/value chunk ``cols`` and its
    accumulators ``col_acc`` move one device on. ``col_acc`` makes a last move after the
    last step, home to the device of its chunk."""
    names = tuple(cols)

    def step(carry, s):
        cols, row_acc, col_acc = carry
        row_acc, col_acc = _visit_pairs(ring, fn, rows, dict(zip(names, cols)), row_acc, col_acc)
        last = s == ring.size - 1
        cols = jax.lax.cond(last, lambda c: c, lambda c: ring.shift(*c), cols)
        return (cols, row_acc, ring.shift(*col_acc)), None

    (_, row_acc, col_acc), _ = jax.lax.scan(step, (tuple(cols.values()), row_acc, col_acc), jnp.arange(ring.size))
    return row_acc, col_acc


def _grouped(x: jax.Array, kv_heads: int) -> jax.Array:
    """``[B, S, N, d]`` -> ``[B, S, K, N / K, d]``: query heads grouped by their key/value head."""
    batch, seq, heads, dim = x.shape
    return x.reshape(batch, seq, kv_heads, heads // kv_heads, dim)


def _ring_forward(ring: _Ring, q, k, v, q_seg, kv_seg, q_idx, kv_idx):
    """(out [B, Sq, N, dv] in ``ring.dtype``, log-sum-exp [B, Sq, K, G] float32)."""
    qg = _grouped(q, k.shape[2])
    stats = qg.shape[:-1]
    init = (jnp.zeros((*stats, v.shape[-1]), jnp.float32), jnp.full(stats, NEG, jnp.float32), jnp.zeros(stats, jnp.float32))
    rows, cols = dict(q=qg, seg=q_seg, idx=q_idx), dict(k=k, v=v, seg=kv_seg, idx=kv_idx)
    (o, m, total), _ = _ring_loop(ring, _forward_block, rows, cols, init, ())
    out = o / total[..., None]
    return out.reshape(*q.shape[:3], v.shape[-1]).astype(ring.dtype), m + jnp.log(total)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_core(ring: _Ring, q, k, v, q_seg, kv_seg, q_idx, kv_idx):
    return _ring_forward(ring, q, k, v, q_seg, kv_seg, q_idx, kv_idx)[0]


def _ring_core_fwd(ring: _Ring, q, k, v, q_seg, kv_seg, q_idx, kv_idx):
    out, lse = _ring_forward(ring, q, k, v, q_seg, kv_seg, q_idx, kv_idx)
    return out, (q, k, v, q_seg, kv_seg, q_idx, kv_idx, out, lse)


def _ring_core_bwd(ring: _Ring, residuals, d_out):
    q, k, v, q_seg, kv_seg, q_idx, kv_idx, out, lse = residuals
    kv_heads = k.shape[2]
    qg, do = _grouped(q, kv_heads), _grouped(d_out.astype(ring.dtype), kv_heads)
    delta = jnp.sum(do.astype(jnp.float32) * _grouped(out, kv_heads).astype(jnp.float32), axis=-1)  # [B, Sq, K, G]
    rows = dict(q=qg, do=do, seg=q_seg, idx=q_idx, lse=lse, delta=delta)
    cols = dict(k=k, v=v, seg=kv_seg, idx=kv_idx)
    acc = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    (dq,), (dk, dv) = _ring_loop(ring, _backward_block, rows, cols, (jnp.zeros(qg.shape, jnp.float32),), acc)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_ring_core.defvjp(_ring_core_fwd, _ring_core_bwd)


def _zigzag_perms(size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Where the even and the odd half of each device's contiguous chunk go: half ``j`` of
    2C lands on device ``j`` if ``j < C`` else ``2C - 1 - j``."""
    dest = lambda j: j if j < size else 2 * size - 1 - j  # noqa: E731
    return [(d, dest(2 * d)) for d in range(size)], [(d, dest(2 * d + 1)) for d in range(size)]


def to_zigzag(x: jax.Array, axis, size: int, index: jax.Array) -> jax.Array:
    """Contiguous halves ``(2d, 2d + 1)`` on device ``d`` -> halves ``(d, 2C - 1 - d)`` (axis 1)."""
    first, second = jnp.split(x, 2, axis=1)
    even, odd = _zigzag_perms(size)
    from_even, from_odd = jax.lax.ppermute(first, axis, even), jax.lax.ppermute(second, axis, odd)
    d_even = index % 2 == 0  # half d has d's parity, half 2C - 1 - d the other one
    return jnp.concatenate([jnp.where(d_even, from_even, from_odd), jnp.where(d_even, from_odd, from_even)], axis=1)


def from_zigzag(x: jax.Array, axis, size: int, index: jax.Array) -> jax.Array:
    """The inverse of ``to_zigzag``."""
    low, high = jnp.split(x, 2, axis=1)
    d_even = index % 2 == 0
    even_half, odd_half = jnp.where(d_even, low, high), jnp.where(d_even, high, low)
    even, odd = _zigzag_perms(size)
    back = lambda perm: [(dst, src) for src, dst in perm]  # noqa: E731
    first, second = jax.lax.ppermute(even_half, axis, back(even)), jax.lax.ppermute(odd_half, axis, back(odd))
    return jnp.concatenate([first, second], axis=1)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float,
    dtype: jnp.dtype,
    sliding_window: int = 0,
    chunk_size: int = 0,
    load_balance: bool = False,
) -> jax.Array:
    """``masked_attention`` of ``q [B, S, N, dk]``, ``k [B, S, K, dk]``, ``v [B, S, K, dv]``
    with ``attention_mask(segment_ids, sliding_window, chunk_size)``, over the ring of the
    mesh axes that shard the sequence (``sequence_axes``; needs an active mesh)."""
    axes = sequence_axes()
    if not axes:
        raise ValueError("ring_attention needs an active mesh whose activation_length axes have size > 1")
    mesh, _ = active_mesh()
    size = math.prod(mesh.shape[a] for a in axes)
    seq = q.shape[1]
    shards = 2 * size if load_balance else size
    if seq % shards:
        raise ConfigError(
            f"ring attention over {size} context shards{' with context_parallel_load_balance' if load_balance else ''} "
            f"needs a sequence length divisible by {shards}, got {seq}"
        )
    axis = axes[0] if len(axes) == 1 else axes
    ring = _Ring(axis, size, float(scale), jnp.dtype(dtype), sliding_window, chunk_size, 2 if load_balance else 1)

    def body(q, k, v, seg):
        index = jax.lax.axis_index(axis)
        local = q.shape[1]
        if load_balance:
            q, k, v, seg = (to_zigzag(x, axis, size, index) for x in (q, k, v, seg))
            half = local // 2
            idx = jnp.concatenate([index * half + jnp.arange(half), (2 * size - 1 - index) * half + jnp.arange(half)])
        else:
            idx = index * local + jnp.arange(local)
        out = _ring_core(ring, q, k, v, seg, seg, idx, idx)
        return from_zigzag(out, axis, size, index) if load_balance else out

    spec = P(None, axis)
    manual = set(axes) | set(vmapped_axes())  # a pipeline's vmap adds its stage axis to the specs
    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec, axis_names=manual, check_vma=False)
    return fn(q, k, v, segment_ids)
