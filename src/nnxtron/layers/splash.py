"""Pallas splash attention (``attention=splash``, and ``auto`` on a TPU): a blockwise flash
kernel (``jax.experimental.pallas.ops.tpu.splash_attention``) that skips the blocks the
mask hides and never materialises the ``[S, S]`` scores.

What it computes is ``attend``'s masked softmax attention: key ``t`` is visible to query
``s`` iff ``t <= s``, both lie in the same packed segment and, with a window ``W > 0``,
``s - t < W`` (``LocalMask`` with a left window of ``W - 1``) or, with chunks of ``C > 0``,
``s // C == t // C`` (``ChunkedCausalMask``). Grouped-query heads share their key/value
head inside the kernel (no repeated K/V). The query is multiplied by ``scale`` before the
kernel (the kernel's logits are ``q . k``); logits and softmax statistics are float32.
Key and value head dims may differ (MLA: 192 and 128). ``soft_cap > 0`` is the kernel's own
``attn_logits_soft_cap``: logits ``cap * tanh(q . k / cap)`` before the mask (Gemma 2).

A sequence that is not a multiple of ``LANES`` is padded at its end (segment id -1, which no
real token has): the padded keys lie after every real query, so the causal mask hides them,
and the padded rows are cut from the output; any length runs with the same result. On a TPU the kernel is
compiled by Mosaic; on any other backend it runs in Pallas interpret mode (plain XLA ops,
slow), which is how CI proves the wiring without a TPU.

With an active mesh the kernel runs inside a ``shard_map``: each device attends over its
own batch rows and, where query and key/value heads shard over the same axes, its own
heads. The sequence is never sharded here (``ici_context_parallelism > 1`` is refused by
the config check).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
from jax.sharding import PartitionSpec as P

from nnxtron.parallel.sharding import active_mesh, logical_to_spec, spec_axes

LANES = 128  # the kernel's key/value blocks are multiples of this (the TPU's lane count)
BLOCKS = (1024, 512, 256, LANES)  # block sizes tried, largest first: the largest that divides the (padded) sequence
PAD_SEGMENT = -1  # the segment id of padded positions: no real token has it
# The backward pass as one kernel (dq accumulated in the dk/dv kernel) instead of two, each
# recomputing the probabilities. On a v5e chip (benchmarks/tpu_attention.py's block sweep, the
# 552M shape, blocks of 1024) forward + backward takes 7.1 ms against 8.8 ms with two kernels,
# the same error; the 552M train step 0.280 s against 0.288 s (MFU 52.2% against 50.8%).
FUSED_BACKWARD = True


def block_size(seq_len: int) -> int:
    """The query and key/value block of the kernel for a sequence of ``seq_len`` tokens
    (already padded to a multiple of ``LANES``): the largest of ``BLOCKS`` dividing it.
    On a v5e chip, forward + backward of the 552M Llama's attention (B4 H32 S2048 D64) takes
    8.8 / 9.6 / 17.4 / 46.4 ms with blocks of 1024 / 512 / 256 / 128
    (``benchmarks/tpu_attention.py``; MaxText's default is 512)."""
    return next(b for b in BLOCKS if seq_len % b == 0)


def padded_length(seq_len: int) -> int:
    """``seq_len`` rounded up to a multiple of ``LANES``."""
    return -(-seq_len // LANES) * LANES


def _kernel(
    heads: int,
    seq_len: int,
    sliding_window: int,
    chunk_size: int,
    interpret: bool,
    block: int | None,
    fused: bool,
    soft_cap: float = 0.0,
) -> kernel_lib.SplashAttentionKernel:
    """The splash kernel of ``heads`` query heads over ``seq_len`` (padded) tokens, made
    inside each trace: it holds the mask's block tables as arrays of that trace (the host
    work behind them is cached by the library's ``process_mask``)."""
    shape = (seq_len, seq_len)
    if chunk_size:
        mask = mask_lib.ChunkedCausalMask(shape, chunk_size)
    elif sliding_window:
        mask = mask_lib.LocalMask(shape, window_size=(sliding_window - 1, 0), offset=0)
    else:
        mask = mask_lib.CausalMask(shape)
    block = block or block_size(seq_len)
    blocks = kernel_lib.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=None if fused else block,  # the fused backward has no dq kernel of its own
        block_kv_dq=None if fused else block,
        use_fused_bwd_kernel=fused,
    )
    return kernel_lib.make_splash_mha(
        mask_lib.MultiHeadMask([mask] * heads),
        block_sizes=blocks,
        head_shards=1,
        q_seq_shards=1,
        residual_checkpoint_name="context",  # the forward's output and logsumexp: remat policies that save context keep them
        interpret=interpret,
        attn_logits_soft_cap=soft_cap or None,
    )


def _local_splash(
    q,
    k,
    v,
    segment_ids,
    *,
    sliding_window: int,
    chunk_size: int,
    interpret: bool,
    block: int | None,
    fused: bool,
    soft_cap: float = 0.0,
) -> jax.Array:
    """The kernel on one device's arrays: ``q [B, N, S, dk]`` (already scaled), ``k [B, K, S, dk]``,
    ``v [B, K, S, dv]``, ``segment_ids [B, S]`` (``S`` padded); returns ``[B, N, S, dv]``."""
    kernel = _kernel(q.shape[1], q.shape[2], sliding_window, chunk_size, interpret, block, fused, soft_cap)
    segments = kernel_lib.SegmentIds(q=segment_ids, kv=segment_ids)
    return jax.vmap(kernel, in_axes=(0, 0, 0, kernel_lib.SegmentIds(q=0, kv=0)))(q, k, v, segments)


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float,
    sliding_window: int = 0,
    chunk_size: int = 0,
    interpret: bool | None = None,
    block: int | None = None,
    fused_backward: bool | None = None,
    soft_cap: float = 0.0,
) -> jax.Array:
    """Splash attention of ``q [B, S, N, dk]``, ``k [B, S, K, dk]``, ``v [B, S, K, dv]``
    (``N`` a multiple of ``K``) under ``attention_mask(segment_ids, sliding_window,
    chunk_size)``; returns ``[B, S, N, dv]`` in ``q``'s dtype. ``interpret`` defaults to
    "not on a TPU"; ``block`` (a multiple of ``LANES`` dividing the padded length) overrides
    ``block_size`` and ``fused_backward`` :data:`FUSED_BACKWARD` (benchmarks); ``soft_cap > 0``
    caps the logits in the kernel (``attn_logits_soft_cap``)."""
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    seq = q.shape[1]
    pad = padded_length(seq) - seq
    q = (q * jnp.asarray(scale, q.dtype)).astype(q.dtype)
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # head-major: [B, heads, S, d]
    segment_ids = segment_ids.astype(jnp.int32)
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=PAD_SEGMENT)
    fused = FUSED_BACKWARD if fused_backward is None else fused_backward
    local = functools.partial(
        _local_splash,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
        interpret=interpret,
        block=block,
        fused=fused,
        soft_cap=soft_cap,
    )
    active = active_mesh()
    if active is None:
        out = local(q, k, v, segment_ids)
    else:
        out = _sharded(local, active, q, k, v, segment_ids)
    return jnp.swapaxes(out[:, :, :seq], 1, 2)


def _sharded(local, active, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """``local`` inside a ``shard_map`` manual over every mesh axis: batch rows split as
    ``activation_batch`` maps them; heads split where ``activation_heads`` and
    ``activation_kv_heads`` map to the same axes (else every device holds all heads)."""
    mesh, rules = active
    query = logical_to_spec(("activation_batch", "activation_heads"), rules, mesh)
    kv_heads = logical_to_spec(("activation_batch", "activation_kv_heads"), rules, mesh)[1]
    batch, heads = query[0], query[1] if query[1] == kv_heads else None
    ways = lambda entry: int(np.prod([mesh.shape[a] for a in spec_axes(entry)]))  # noqa: E731
    if q.shape[0] % ways(batch):
        batch = None
    if heads is not None and (q.shape[1] % ways(heads) or k.shape[1] % ways(heads)):
        heads = None
    head_major = P(batch, heads, None, None)
    fn = jax.shard_map(
        local, mesh=mesh, in_specs=(head_major, head_major, head_major, P(batch, None)), out_specs=head_major, check_vma=False
    )
    return fn(q, k, v, segment_ids)
