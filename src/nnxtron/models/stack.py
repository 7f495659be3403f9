"""The block a layer stack scans: one layer, or one cycle of differently-kinded layers.

Which layers form a stack and a block is decided by ``config/layout.py``; this module
builds the block modules for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from nnxtron.config.layout import LayerKind, StackLayout
from nnxtron.errors import ConfigError
from nnxtron.parallel.row_keys import Keys, fold, layer_keys
from nnxtron.parallel.scan import sum_aux


class CycleBlock(nnx.Module):
    """One cycle of differently-kinded layers applied in order; returns ``(y, aux)`` summed."""

    def __init__(self, make_layer: Callable[[nnx.Rngs, LayerKind], nnx.Module], kinds: tuple[LayerKind, ...], rngs: nnx.Rngs):
        key = rngs.params()
        self.cycle = nnx.List([make_layer(nnx.Rngs(jax.random.fold_in(key, j)), kind) for j, kind in enumerate(kinds)])

    def __call__(self, x: jax.Array, *args: Any, dropout_keys: Keys | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``dropout_keys``: the block's per-row keys; layer ``j`` of the cycle gets them folded with ``j``."""
        parts = []
        for j, layer in enumerate(self.cycle):
            keys = None if dropout_keys is None else fold(dropout_keys, j)
            with layer_keys(keys):  # LoRA's adapter dropout reads them (layers/lora.py)
                out = layer(x, *args) if keys is None else layer(x, *args, dropout_keys=keys)
            x, aux = out if isinstance(out, tuple) else (out, {})
            parts.append(aux)
        return x, sum_aux(*parts)


def make_stack_block(
    make_layer: Callable[[nnx.Rngs, LayerKind], nnx.Module], layout: StackLayout
) -> Callable[[nnx.Rngs], nnx.Module]:
    """The block factory of a stack: the layer itself, or a ``CycleBlock`` of its kinds. A
    ``selected`` layer (its kind is data: ``config/layout.selected_stacks``) must hold the
    same variables as the sliding and the global layer it stands for — checked here (abstractly),
    never assumed."""
    if layout.layers_per_block == 1:
        if layout.kinds[0].attention == "selected":
            check_selectable(make_layer, layout.kinds[0])
        return lambda rngs: make_layer(rngs, layout.kinds[0])
    return lambda rngs: CycleBlock(make_layer, layout.kinds, rngs)


def check_selectable(make_layer: Callable[[nnx.Rngs, LayerKind], nnx.Module], kind: LayerKind) -> None:
    """Raise unless the layers of ``kind`` with attention ``selected``, ``sliding`` and ``global``
    have the same variables (paths, shapes, dtypes)."""

    def variables(attention: str) -> dict:
        layer = nnx.eval_shape(lambda: make_layer(nnx.Rngs(0), dataclasses.replace(kind, attention=attention)))
        return {path: (value.shape, value.dtype) for path, value in nnx.to_flat_state(nnx.state(layer))}

    selected = variables("selected")
    for attention in ("sliding", "global"):
        if variables(attention) != selected:
            raise ConfigError(
                f"the {attention} layer's variables differ from the one-layer block whose kind is data "
                "(config/layout.selected_stacks); this family cannot pipeline layers with the kind as data"
            )
