"""Parameter trees as flat ``{"a/b/c": array}`` dicts, and the layer-list layout.

The flat form names every parameter by its path; the *layer-list layout* is the one
``scan_layers=false`` uses (``<stack>/layers/<i>/...``). Converting a scanned tree to it
gives a layout that is independent of the stacking strategy: HF conversion and the
strategy-parity tests compare parameters and gradients in this layout.

A *layer group* is the ``<stack>/layers/`` part of a path, wherever it sits, where
``<stack>`` is a stack name (``layers`` or ``<kind>_layers``, e.g. DeepSeek's
``dense_layers`` and ``moe_layers``): the same conversions apply to any tree that
mirrors the parameters, e.g. the Adam moments of a train state
(``opt_state/1/0/mu/layers/layers/...``), so checkpoints can be converted between the
two layouts as a whole. Layer counts are one int for every stack or a dict per stack.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx

STACK_PATTERN = re.compile(r"(?:^|/)(layers|[A-Za-z0-9_]*[A-Za-z0-9]_layers)/layers/")
LayerCounts = int | Mapping[str, int]  # one count for every stack, or per stack name


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


LayerPath = tuple[str, int | None, str]  # (group, layer index or None when scanned, rest)


def stack_name(group: str) -> str:
    """The stack of a layer group: ``"opt_state/mu/moe_layers/layers/"`` -> ``"moe_layers"``."""
    return group.rstrip("/").split("/")[-2]


def layer_count(num_layers: LayerCounts, group: str) -> int:
    """The layer count of ``group``'s stack."""
    if isinstance(num_layers, int):
        return num_layers
    name = stack_name(group)
    if name not in num_layers:
        raise ValueError(f"{group}: no layer count for stack '{name}' (known: {sorted(num_layers)})")
    return int(num_layers[name])


def split_layer_path(path: str) -> LayerPath | None:
    """``(group, index, rest)`` of a path with a layer group, else None.

    ``"opt_state/1/0/mu/layers/layers/3/mlp/wo/kernel"`` -> ``("opt_state/1/0/mu/layers/layers/", 3, "mlp/wo/kernel")``;
    a scanned path (no layer index after the group) has index None.
    """
    match = STACK_PATTERN.search(path)
    if match is None:
        return None
    group, tail = path[: match.end()], path[match.end() :]
    head, _, rest = tail.partition("/")
    if head.isdigit() and rest:
        return group, int(head), rest
    return group, None, tail


def layer_path(group: str, index: int | None, rest: str) -> str:
    """The inverse of ``split_layer_path``."""
    return f"{group}{rest}" if index is None else f"{group}{index}/{rest}"


def layer_groups(keys: Any, num_layers: LayerCounts, scanned: bool) -> list[tuple[list[str], list[str]]]:
    """How to convert flat ``keys`` to the scanned (``scanned=True``) or layer-list layout.

    A list of ``(new keys, old keys)`` in the order of ``keys``: a key already in the wanted
    layout (or outside any layer group) maps to itself; to scan, one new key gathers the
    stack's count of old per-layer keys in layer order; to unscan, that many new keys
    come from one old stacked key. Raises ValueError when a layer is missing or out of range.
    """
    groups: list[tuple[list[str], list[str]]] = []
    stacked: dict[str, list[str | None]] = {}
    for key in keys:
        split = split_layer_path(key)
        if split is None or (split[1] is None) == scanned:
            groups.append(([key], [key]))
            continue
        group, index, rest = split
        count = layer_count(num_layers, group)
        if scanned:
            new = layer_path(group, None, rest)
            if new not in stacked:
                stacked[new] = [None] * count
                groups.append(([new], stacked[new]))  # filled in below, in place
            if index >= count:
                raise ValueError(f"{key}: layer {index} is out of range for {count} layers")
            stacked[new][index] = key
        else:
            groups.append(([layer_path(group, i, rest) for i in range(count)], [key]))
    for new, olds in stacked.items():
        missing = [i for i, old in enumerate(olds) if old is None]
        if missing:
            group, _, rest = split_layer_path(new)
            raise ValueError(f"{group}<i>/{rest}: missing layers {missing}")
    return groups


def convert_layers(flat: dict[str, Any], num_layers: LayerCounts, scanned: bool, stack=None, unstack=None) -> dict[str, Any]:
    """Convert a flat dict to the scanned or layer-list layout (any prefix before a layer group).

    ``stack(values) -> value`` (np.stack, jnp.stack...) builds a stacked leaf;
    ``unstack(value) -> values`` splits one (default: ``value[i]`` after checking that the
    leading axis is the layer count).
    """

    def default_unstack(key: str, value: Any) -> list:
        count = layer_count(num_layers, split_layer_path(key)[0])
        if value.shape[0] != count:
            raise ValueError(f"{key}: leading axis {value.shape[0]} is not the layer count {count}")
        return [value[i] for i in range(count)]

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


def detect_layout(flat: dict[str, Any]) -> tuple[bool | None, dict[str, int]]:
    """``(scanned, {stack: layer count})`` of a flat tree of arrays (or shape structs);
    ``(None, {})`` without layers.

    Scanned when a layer group has no layer index; its leading axis is the layer count.
    """
    counts: dict[str, int] = {}
    scanned: bool | None = None
    for key, value in flat.items():
        split = split_layer_path(key)
        if split is None:
            continue
        group, index, _ = split
        name = stack_name(group)
        if index is None:
            scanned = True
            counts[name] = int(value.shape[0])
        elif scanned is None or not scanned:
            scanned = False
            counts[name] = max(counts.get(name, 0), index + 1)
    return scanned, counts


def unstack_layers(flat: dict[str, Any], num_layers: LayerCounts) -> dict[str, Any]:
    """Scanned layout (``.../<stack>/layers/p`` with a leading layer axis) -> layer-list layout."""
    return convert_layers(flat, num_layers, scanned=False)


def rename_stacks(flat: dict[str, Any], moves: Mapping[str, tuple[str, int]]) -> dict[str, Any]:
    """Layer-list paths of each stack ``s`` in ``moves`` renamed to ``moves[s] = (stack,
    first index)``: ``.../s/layers/i/...`` -> ``.../stack/layers/(first + i)/...``; other paths kept."""
    renamed = {}
    for path, value in flat.items():
        split = split_layer_path(path)
        if split is not None and split[1] is not None and stack_name(split[0]) in moves:
            group, index, rest = split
            stack = stack_name(group)
            name, first = moves[stack]
            path = layer_path(f"{group[: group.rindex(f'{stack}/layers/')]}{name}/layers/", first + index, rest)
        renamed[path] = value
    return renamed


def restack(flat: dict[str, Any], source: Sequence[Any], target: Sequence[Any]) -> dict[str, Any]:
    """Layer-list paths of the stacks ``source`` renamed to where ``target`` holds the same model
    layer (both ``config.layout.StackLayout`` sequences over the same layers: ``name``,
    ``num_layers``, ``layers_per_block``, ``hf_layer``, ``sub_path``): e.g. a pipeline's one-layer
    blocks ``layers/layers/7/...`` to the cycle layout's ``remainder_layers/layers/0/cycle/1/...``,
    or a partial pipeline's ``unpipelined_layers`` back into the main stack. Other paths are kept;
    a layer missing from ``target`` raises."""
    where = {}
    for stack in target:
        for block in range(stack.num_layers):
            for position in range(stack.layers_per_block):
                where[stack.hf_layer(block, position)] = (stack.name, block, stack.sub_path(position))
    by_name = {stack.name: stack for stack in source}
    moved = {}
    for path, value in flat.items():
        split = split_layer_path(path)
        if split is None or split[1] is None or stack_name(split[0]) not in by_name:
            moved[path] = value
            continue
        group, block, rest = split
        stack = by_name[stack_name(group)]
        position = 0
        if stack.layers_per_block > 1:  # ".../cycle/<j>/rest"
            _, index, rest = rest.split("/", 2)
            position = int(index)
        layer = stack.hf_layer(block, position)
        if layer not in where:
            raise ValueError(f"restack: {path} is model layer {layer}, which the target stacks do not hold")
        name, new_block, sub = where[layer]
        prefix = group[: group.rindex(f"{stack.name}/layers/")]
        moved[layer_path(f"{prefix}{name}/layers/", new_block, "".join(f"{part}/" for part in sub) + rest)] = value
    return moved


def layer_list_layout(state: Any, num_layers: LayerCounts) -> dict[str, Any]:
    """Flat layer-list view of any model state or gradient tree (scanned or not)."""
    return unstack_layers(flatten(state), num_layers)
