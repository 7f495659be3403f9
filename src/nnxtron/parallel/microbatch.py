"""Microbatches: split a batch into k interleaved microbatches and put them back.

Used by gradient accumulation (``train.step.compute_gradients``) and by the pipeline
(``parallel.pipeline``): both see the same microbatches for the same k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nnxtron.parallel.sharding import constrain

Batch = dict[str, jax.Array]


def split_microbatches(batch: Batch, k: int) -> Batch:
    """[B, ...] -> [k, B/k, ...]: microbatch i is rows i, i+k, i+2k, ... of the batch.

    The strided assignment is what keeps every shard where it is: the batch dim is split
    into contiguous blocks of B/n rows over the n data x fsdp shards, and reshaping to
    [B/k, k, ...] keeps those blocks on dim 0 (B/k divides over the shards — checked by
    ``derive``), so each microbatch is sharded over the batch axes exactly like the full
    batch and the split moves no data between devices. (Contiguous microbatches, rows
    [i*B/k, (i+1)*B/k), would live on only n/k of the devices and need an all-to-all.)
    The assignment does not depend on the mesh, so every mesh sees the same microbatches.
    """
    rows = {v.shape[0] for v in batch.values()}
    if len(rows) != 1 or next(iter(rows)) % k:
        raise ValueError(f"{k} microbatches do not divide the batch rows {sorted(rows)}")

    def one(x: jax.Array) -> jax.Array:
        x = jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)
        return constrain(x, (None, "activation_batch", "activation_length")[: x.ndim] + (None,) * max(x.ndim - 3, 0))

    return {key: one(value) for key, value in batch.items()}


def merge_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of ``split_microbatches`` for one array: [k, B/k, ...] -> [B, ...]."""
    k, rows = x.shape[:2]
    return jnp.swapaxes(x, 0, 1).reshape(k * rows, *x.shape[2:])
