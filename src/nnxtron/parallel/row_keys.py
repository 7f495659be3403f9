"""Per-row PRNG keys: randomness that travels with the example rows of a batch.

The train step makes one typed PRNG key per row of the global batch from the seed and the
step number (``row_keys``); the ``[B]`` key array is split, sharded and microbatched with
its rows like any per-row input, and whoever draws from it folds in where it is — its stack,
block, layer and site (``fold``). A draw is then a pure function of (seed, step, row, place),
the same under every execution strategy and on resume, with no RNG state to store. Used by
dropout (``layers/dropout.py``). While a layer runs, its keys are also ``current_layer_keys()``
(``layer_keys``), for modules it does not hand them to (LoRA's adapters, ``layers/lora.py``).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from nnxtron.scoped import scoped

STREAM = 0x44524F50  # folded into the seed so row keys never reuse the weight-initialisation key

Keys = jax.Array  # [B] typed PRNG keys, one per example row


def row_keys(seed: int, step: jax.Array, rows: int) -> Keys:
    """The keys of one step's ``rows`` rows: ``fold_in(fold_in(fold_in(key(seed), STREAM), step), row)``."""
    step_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), STREAM), step)
    return jax.vmap(lambda row: jax.random.fold_in(step_key, row))(jnp.arange(rows, dtype=jnp.uint32))


def fold(keys: Keys | None, data: int | jax.Array) -> Keys | None:
    """Fold ``data`` (a stack, block, layer or site index) into every row's key; None stays None."""
    if keys is None:
        return None
    return jax.vmap(lambda key: jax.random.fold_in(key, data))(keys)


_layer: contextvars.ContextVar[Keys | None] = contextvars.ContextVar("nnxtron_layer_keys", default=None)


def layer_keys(keys: Keys | None) -> contextlib.AbstractContextManager[None]:
    """While a layer runs: its per-row keys (None: nothing drops), read by ``current_layer_keys``."""
    return scoped(_layer, keys)


def current_layer_keys() -> Keys | None:
    """The keys of the layer running now (``layer_keys``), or None outside a layer."""
    return _layer.get()
