"""The kind of the layer running now, where it is data: one-layer blocks of kind ``selected``.

A stack of ``selected`` blocks (``config/layout.selected_stacks``: a sliding/global pattern
whose layers share one structure, pipelined where whole cycles do not fill the stages) holds
each block's kind as an array beside its stacked weights (``StackLayout.global_layers``).
The stack (``parallel/scan.py``, the pipeline's stages in ``parallel/pipeline.py``) reads
the flag of the block it applies — a scanned input, traced — and sets it here while the
block runs (``selected_layer``); the block's attention reads it (``current_is_global``) to
choose its window and RoPE table (``layers/attention.py``), as ``row_keys.layer_keys``
hands a layer its dropout keys.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from nnxtron.errors import ConfigError
from nnxtron.scoped import scoped

_is_global: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("nnxtron_layer_is_global", default=None)


def selected_layer(is_global: jax.Array | bool | None) -> contextlib.AbstractContextManager[None]:
    """While a block runs: whether it is a global-attention layer (a boolean scalar, traced
    or not); None for blocks whose kind is their structure."""
    return scoped(_is_global, None if is_global is None else jnp.asarray(is_global, jnp.bool_))


def current_is_global() -> jax.Array:
    """The flag set by ``selected_layer``; a ``selected`` layer applied outside a stack that
    sets it raises (it would not know its kind)."""
    flag = _is_global.get()
    if flag is None:
        raise ConfigError(
            "a layer of kind 'selected' (attention window and RoPE chosen per layer at run time) ran outside a "
            "stack that gives it its kind; apply it through its LayerStack / PipelinedStack"
        )
    return flag


def block_flags(global_layers: tuple[bool, ...], block_ids: jax.Array) -> jax.Array | None:
    """The flags of the blocks ``block_ids`` (indices in the unsplit stack); None without a table."""
    if not global_layers:
        return None
    return jnp.asarray(global_layers, jnp.bool_)[block_ids]
