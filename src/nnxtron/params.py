"""Parameter trees as flat ``{"a/b/c": array}`` dicts, and the layer-list layout.

The flat form names every parameter by its path; the *layer-list layout* is the one
``scan_layers=false`` uses (``layers/layers/<i>/...``). Converting a scanned tree to it
gives a layout that is independent of the stacking strategy: HF conversion and the
strategy-parity tests compare parameters and gradients in this layout.

A *layer group* is the ``layers/layers/`` part of a path, wherever it sits: the same
conversions apply to any tree that mirrors the parameters, e.g. the Adam moments of a
train state (``opt_state/1/0/mu/layers/layers/...``), so checkpoints can be converted
between the two layouts as a whole.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

LAYERS_PREFIX = "layers/layers/"


def path_str(path: tuple) -> str:
    """A jax key path as ``a/b/0/c``."""
    names = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                names.append(str(getattr(key, attr)))
                break
        else:
            names.append(str(key))
    return "/".join(names)


def flatten_with_treedef(tree: Any) -> tuple[dict[str, Any], Any]:
    """``({"a/b/c": leaf}, treedef)`` for any pytree; paths must be unique."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat = {path_str(path): leaf for path, leaf in leaves}
    if len(flat) != len(leaves):
        raise ValueError("pytree paths are not unique as strings")
    return flat, treedef


def flatten(tree: Any) -> dict[str, Any]:
    """``{"a/b/c": leaf}`` for an nnx.State or nested dict (Variables are unwrapped)."""
    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    return flatten_with_treedef(tree)[0]


LayerPath = tuple[str, int | None, str]  # (prefix, layer index or None when scanned, rest)


def split_layer_path(path: str) -> LayerPath | None:
    """``(prefix, index, rest)`` of a path with a layer group, else None.

    ``"opt_state/1/0/mu/layers/layers/3/mlp/wo/kernel"`` -> ``("opt_state/1/0/mu/", 3, "mlp/wo/kernel")``;
    a scanned path (no layer index after ``layers/layers/``) has index None.
    """
    if path.startswith(LAYERS_PREFIX):
        at = 0
    else:
        at = path.find("/" + LAYERS_PREFIX) + 1
        if at == 0:
            return None
    prefix, tail = path[:at], path[at + len(LAYERS_PREFIX) :]
    head, _, rest = tail.partition("/")
    if head.isdigit() and rest:
        return prefix, int(head), rest
    return prefix, None, tail


def layer_path(prefix: str, index: int | None, rest: str) -> str:
    """The inverse of ``split_layer_path``."""
    return f"{prefix}{LAYERS_PREFIX}{rest}" if index is None else f"{prefix}{LAYERS_PREFIX}{index}/{rest}"


def layer_groups(keys: Any, num_layers: int, scanned: bool) -> list[tuple[list[str], list[str]]]:
    """How to convert flat ``keys`` to the scanned (``scanned=True``) or layer-list layout.

    A list of ``(new keys, old keys)`` in the order of ``keys``: a key already in the wanted
    layout (or outside any layer group) maps to itself; to scan, one new key gathers the
    ``num_layers`` old per-layer keys in layer order; to unscan, the ``num_layers`` new keys
    come from one old stacked key. Raises ValueError when a layer is missing or out of range.
    """
    groups: list[tuple[list[str], list[str]]] = []
    stacked: dict[str, list[str | None]] = {}
    for key in keys:
        split = split_layer_path(key)
        if split is None or (split[1] is None) == scanned:
            groups.append(([key], [key]))
        elif scanned:
            prefix, index, rest = split
            new = layer_path(prefix, None, rest)
            if new not in stacked:
                stacked[new] = [None] * num_layers
                groups.append(([new], stacked[new]))  # filled in below, in place
            if index >= num_layers:
                raise ValueError(f"{key}: layer {index} is out of range for {num_layers} layers")
            stacked[new][index] = key
        else:
            prefix, _, rest = split
            groups.append(([layer_path(prefix, i, rest) for i in range(num_layers)], [key]))
    for new, olds in stacked.items():
        missing = [i for i, old in enumerate(olds) if old is None]
        if missing:
            prefix, _, rest = split_layer_path(new)
            raise ValueError(f"{prefix}{LAYERS_PREFIX}<i>/{rest}: missing layers {missing}")
    return groups


def convert_layers(flat: dict[str, Any], num_layers: int, scanned: bool, stack=None, unstack=None) -> dict[str, Any]:
    """Convert a flat dict to the scanned or layer-list layout (any prefix before ``layers/layers/``).

    ``stack(values) -> value`` (np.stack, jnp.stack...) builds a stacked leaf;
    ``unstack(value) -> values`` splits one (default: ``value[i]`` after checking that the
    leading axis is the layer count).
    """

    def default_unstack(key: str, value: Any) -> list:
        if value.shape[0] != num_layers:
            raise ValueError(f"{key}: leading axis {value.shape[0]} is not the layer count {num_layers}")
        return [value[i] for i in range(num_layers)]

    out: dict[str, Any] = {}
    for new, old in layer_groups(flat, num_layers, scanned):
        if new == old:
            out[new[0]] = flat[old[0]]
        elif scanned:
            out[new[0]] = stack([flat[k] for k in old])
        else:
            values = default_unstack(old[0], flat[old[0]]) if unstack is None else list(unstack(flat[old[0]]))
            out.update(zip(new, values, strict=True))
    return out


def detect_layout(flat: dict[str, Any]) -> tuple[bool | None, int]:
    """``(scanned, num_layers)`` of a flat tree of arrays (or shape structs); (None, 0) without layers.

    Scanned when a layer group has no layer index; its leading axis is the layer count.
    """
    indices: set[int] = set()
    for key, value in flat.items():
        split = split_layer_path(key)
        if split is None:
            continue
        if split[1] is None:
            return True, int(value.shape[0])
        indices.add(split[1])
    return (False, max(indices) + 1) if indices else (None, 0)


def unstack_layers(flat: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Scanned layout (``.../layers/layers/p`` with a leading layer axis) -> layer-list layout."""
    return convert_layers(flat, num_layers, scanned=False)


def stack_layers(flat: dict[str, Any], num_layers: int, stack) -> dict[str, Any]:
    """Layer-list layout -> scanned layout; ``stack`` is np.stack or jnp.stack."""
    return convert_layers(flat, num_layers, scanned=True, stack=stack)


def layer_list_layout(state: Any, num_layers: int) -> dict[str, Any]:
    """Flat layer-list view of any model state or gradient tree (scanned or not)."""
    return unstack_layers(flatten(state), num_layers)
