"""Logical axis names -> mesh axes.

Every parameter carries its logical axis names in the flax ``out_sharding`` metadata
(e.g. ``("embed", "mlp")``); activations are constrained at block boundaries with
``constrain(x, names)``. ``logical_axis_rules`` in the config maps names to mesh axes.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnxtron.errors import ConfigError
from nnxtron.params import flatten
from nnxtron.scoped import scoped

Rules = Sequence[tuple[str, Sequence[str]]]
SHARDING_KEY = "out_sharding"
RESIDUAL = ("activation_batch", "activation_length", "activation_embed")  # logical axes of the residual stream [B, S, D]

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar("nnxtron_sharding", default=None)


def spec_axes(entry: str | Sequence[str] | None) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (``None``, one axis name, or several)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def logical_to_spec(names: Sequence[str | None], rules: Rules, mesh: Mesh) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec; a mesh axis is used at most once."""
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name in names:
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ConfigError(f"logical axis '{name}' has no entry in logical_axis_rules; add [{name}, [...]]")
        axes = tuple(a for a in table[name] if a in mesh.shape and a not in used and mesh.shape[a] > 1)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def variable_names(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names recorded on a variable, or None if it has none."""
    names = variable.get_metadata().get(SHARDING_KEY)
    return None if names is None else tuple(names)


def _check_divisible(path: str, shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> None:
    for dim, (size, axes) in enumerate(zip(shape, spec)):
        if axes is None:
            continue
        axes = (axes,) if isinstance(axes, str) else axes
        ways = math.prod(mesh.shape[a] for a in axes)
        if size % ways:
            raise ConfigError(
                f"parameter {path} dimension {dim} (size {size}) does not divide over mesh axes "
                f"{'x'.join(axes)} ({ways} ways); change the ici_*_parallelism sizes or logical_axis_rules"
            )


def state_shardings(state: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings for an (abstract) nnx.State, from each variable's logical names."""

    def one(path, variable):
        names = variable_names(variable)
        shape = tuple(variable.shape)
        if names is None:
            spec = PartitionSpec()
        else:
            if len(names) != len(shape):
                raise ValueError(f"{_path(path)}: sharding names {names} do not match rank {len(shape)}")
            spec = logical_to_spec(names, rules, mesh)
            _check_divisible(_path(path), shape, spec, mesh)
        return variable.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _path(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path if getattr(k, "name", None) != "value")


def activate(mesh: Mesh, rules: Rules) -> contextlib.AbstractContextManager[None]:
    """Make ``constrain`` shard activations over ``mesh`` (use around tracing)."""
    return scoped(_ACTIVE, (mesh, rules))


_SPMD_AXES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("nnxtron_spmd_axes", default=())


def spmd_axes(*axes: str) -> contextlib.AbstractContextManager[None]:
    """Declare mesh axes that a surrounding ``jax.vmap(..., spmd_axis_name=...)`` maps (the
    pipeline's ``stage``): a ``shard_map`` that is manual over only some axes must be
    manual over these too, because vmap adds them to its specs."""
    return scoped(_SPMD_AXES, _SPMD_AXES.get() + axes)


def vmapped_axes() -> tuple[str, ...]:
    """The mesh axes declared by the innermost ``spmd_axes`` contexts (empty outside them)."""
    return _SPMD_AXES.get()


def active_mesh() -> tuple[Mesh, Rules] | None:
    """The (mesh, rules) set by ``activate`` around the current trace, or None."""
    return _ACTIVE.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrain an activation to the sharding its logical names map to (no-op without a mesh)."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, rules, mesh)))


MODEL_AXES = ("fsdp", "tensor", "context", "expert", "stage")  # axes that split parameters (not data)


def unsharded_report(abstract_params: Any, param_shardings: Any, mesh: Mesh) -> tuple[float, list[tuple[str, tuple, str, int]]]:
    """Fraction of parameter elements not split over any active model axis, and the
    offenders ``(path, shape, spec, elements)`` from largest to smallest.

    An axis is active when the mesh has it with size > 1. With no active model axis
    (one device, or pure data parallelism) nothing can be sharded and the fraction is 0.
    """
    active = {axis for axis in MODEL_AXES if mesh.shape.get(axis, 1) > 1}
    if not active:
        return 0.0, []
    shapes, specs = flatten(abstract_params), flatten(param_shardings)
    total, offenders = 0, []
    for path, value in shapes.items():
        size = math.prod(value.shape)
        total += size
        used = {a for entry in specs[path].spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}
        if not used & active:
            offenders.append((path, tuple(value.shape), str(specs[path].spec), size))
    offenders.sort(key=lambda row: -row[3])
    return sum(row[3] for row in offenders) / max(total, 1), offenders


def check_unsharded(abstract_params: Any, param_shardings: Any, mesh: Mesh, tolerance: float) -> float:
    """Raise if more than ``tolerance`` of the parameter elements are left unsharded."""
    fraction, offenders = unsharded_report(abstract_params, param_shardings, mesh)
    if fraction > tolerance:
        worst = "; ".join(f"{path} {shape} {spec}" for path, shape, spec, _ in offenders[:3])
        raise ConfigError(
            f"{100 * fraction:.1f}% of parameter elements are not sharded over any model axis (sharding_tolerance="
            f"{tolerance}); largest: {worst}; fix logical_axis_rules or the mesh, or raise sharding_tolerance"
        )
    return fraction
