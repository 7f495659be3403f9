"""Parameter trees as flat ``{"a/b/c": array}`` dicts, and the layer-list layout.

The flat form names every parameter by its path; the *layer-list layout* is the one
``scan_layers=false`` uses (``layers/layers/<i>/...``). Converting a scanned tree to it
gives a layout that is independent of the stacking strategy: HF conversion and the
strategy-parity tests compare parameters and gradients in this layout.
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


def unstack_layers(flat: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Scanned layout (``layers/layers/p`` with a leading layer axis) -> layer-list layout."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        if not path.startswith(LAYERS_PREFIX) or path[len(LAYERS_PREFIX) :].split("/")[0].isdigit():
            out[path] = value
            continue
        if value.shape[0] != num_layers:
            raise ValueError(f"{path}: leading axis {value.shape[0]} is not the layer count {num_layers}")
        rest = path[len(LAYERS_PREFIX) :]
        for i in range(num_layers):
            out[f"{LAYERS_PREFIX}{i}/{rest}"] = value[i]
    return out


def stack_layers(flat: dict[str, Any], num_layers: int, stack) -> dict[str, Any]:
    """Layer-list layout -> scanned layout; ``stack`` is np.stack or jnp.stack."""
    out: dict[str, Any] = {}
    per_layer: dict[str, list] = {}
    for path, value in flat.items():
        head = path[len(LAYERS_PREFIX) :].split("/", 1) if path.startswith(LAYERS_PREFIX) else None
        if head and head[0].isdigit():
            per_layer.setdefault(head[1], [None] * num_layers)[int(head[0])] = value
        else:
            out[path] = value
    for rest, values in per_layer.items():
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
            raise ValueError(f"{LAYERS_PREFIX}<i>/{rest}: missing layers {missing}")
        out[LAYERS_PREFIX + rest] = stack(values)
    return out


def layer_list_layout(state: Any, num_layers: int) -> dict[str, Any]:
    """Flat layer-list view of any model state or gradient tree (scanned or not)."""
    return unstack_layers(flatten(state), num_layers)
