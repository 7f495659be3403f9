"""Dropout whose masks are a pure function of (seed, step, example row, layer, site).

Where it acts follows MaxText 0.2.5: the token embeddings (before learned position
embeddings are added), every decoder layer's output after its residual add, the
intermediate activations of every dense MLP, and the final-normed hidden states before
the output head; each mask is shared along axis -2 (``broadcast_dims=(-2,)``: the sequence
for ``[B, S, D]`` activations). Kept values are scaled by ``1 / (1 - rate)``.

The randomness is carried as a typed PRNG key per example row, ``[B]``, made once per train
step by ``parallel.row_keys.row_keys`` from the seed, the step number and the row's index in
the global batch. The keys travel with their rows (data sharding, gradient-accumulation and pipeline
microbatches), and each stack, block, layer and site folds in its index
(``parallel.row_keys.fold``), so a mask never depends on how the step is executed: scanned or unrolled layers,
pipelines, accumulation and meshes draw the same masks, and a resumed run draws the masks
of an uninterrupted one without storing any RNG state. No keys (eval, generation, or
dropout off) means no dropout and no random ops in the compiled step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp

from nnxtron.parallel.row_keys import Keys, fold

# site ids: what a mask is for, within a row (decoder level) or a layer
EMBED, HEAD, MTP = 0, 1, 2  # decoder level (MTP depth k folds k after MTP, then EMBED / HEAD / STACKS)
LAYER_OUTPUT, MLP = 0, 1  # within a layer
STACKS = 16  # decoder-level id of stack i is STACKS + i (stacks fold their block index after it)


def dropout_active(rate: float, enable: bool) -> bool:
    """Training draws dropout masks only when ``enable_dropout`` and ``dropout_rate`` > 0 (MaxText)."""
    return enable and rate > 0.0


def dropout(x: jax.Array, keys: Keys | None, rate: float, site: int, broadcast_dims: Sequence[int] = (-2,)) -> jax.Array:
    """Zero each element of ``x [B, ...]`` with probability ``rate`` (one mask per row, drawn
    from that row's key folded with ``site``, shared along ``broadcast_dims``) and scale the
    kept ones by ``1 / (1 - rate)``. The identity when ``keys`` is None or ``rate`` is 0."""
    if keys is None or rate == 0.0:
        return x
    if keys.shape != x.shape[:1]:
        raise ValueError(f"dropout: {keys.shape[0] if keys.ndim else 0} row keys for activations of shape {x.shape}")
    keep = 1.0 - rate
    shape = list(x.shape[1:])
    for dim in broadcast_dims:
        if dim >= 0:
            raise ValueError(f"dropout: broadcast_dims are counted from the end (negative), got {dim}")
        shape[dim] = 1
    mask = jax.vmap(lambda key: jax.random.bernoulli(key, keep, tuple(shape)))(fold(keys, site))
    return jax.lax.select(jnp.broadcast_to(mask, x.shape), x / jnp.asarray(keep, x.dtype), jnp.zeros_like(x))


def site_dropout(keys: Keys | None, rate: float, site: int) -> Callable[[jax.Array], jax.Array] | None:
    """``dropout`` at one site as a function of the activations (None when nothing drops),
    for a sub-module to apply at its own point (e.g. an MLP's intermediate activations)."""
    if keys is None or rate == 0.0:
        return None
    return partial(dropout, keys=keys, rate=rate, site=site)
