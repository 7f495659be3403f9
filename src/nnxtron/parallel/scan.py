"""The single layer-stacking primitive: stack layers, scan them, remat them.

``LayerStack`` holds ``num_layers`` blocks built by one factory. With ``scan=True`` their
parameters are stacked along a leading axis (named ``layers`` in each variable's
sharding annotation) and applied by one compiled body under ``jax.lax.scan`` (or, with
``unroll=True``, by a Python loop over the stacked blocks: the storage a pipeline needs
with ``scan_layers=false``'s program); with ``scan=False`` they are a plain list applied
in a Python loop. All paths build layer ``i`` from the same key and apply the same remat
policy, so they compute the same function. Non-parameter state (e.g. MoE expert-load counters) is carried out of the
scan and written back, never dropped.

A block returns either its output ``y`` or ``(y, aux)`` with ``aux`` a dict of float
scalars (e.g. a load-balance loss); the stack returns ``(x, aux)`` with each entry
summed over its layers, so auxiliary outputs are explicit values, never side channels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnxtron.parallel.layer_kind import block_flags, selected_layer
from nnxtron.parallel.remat import RematSpec, jax_policy
from nnxtron.parallel.row_keys import Keys, fold, layer_keys
from nnxtron.parallel.sharding import SHARDING_KEY

STACK_AXIS = "layers"


def is_stack_axis(name: str | None) -> bool:
    """Stacking axes are named ``layers`` or ``<something>_layers`` (e.g. ``moe_layers``)."""
    return name is not None and (name == STACK_AXIS or name.endswith("_layers"))


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _rename(tree: Any, edit: Callable[[str, nnx.Variable], tuple[str, ...] | None]) -> Any:
    def one(path, variable):
        names = variable.get_metadata().get(SHARDING_KEY)
        where = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        new = edit(where, variable) if names is not None else None
        if new is None:
            return variable
        out = variable.replace(variable.get_raw_value())
        out.set_metadata(**{SHARDING_KEY: new})
        return out

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_variable)


def add_stack_axis(tree: Any, axis_name: str = STACK_AXIS, axis: int = 0) -> Any:
    """Insert ``axis_name`` into each variable's sharding names at ``axis``.

    The values must already carry the stacked axis (rank = len(names) + 1); anything else
    raises, so metadata and values can never silently disagree.
    """

    def edit(where: str, variable: nnx.Variable) -> tuple[str, ...]:
        names = tuple(variable.get_metadata()[SHARDING_KEY])
        ndim = len(variable.shape)
        if ndim != len(names) + 1:
            raise ValueError(
                f"add_stack_axis: {where} has rank {ndim} but sharding names {names}; "
                f"expected rank {len(names) + 1} after stacking"
            )
        return names[:axis] + (axis_name,) + names[axis:]

    return _rename(tree, edit)


def remove_stack_axis(tree: Any, axis_name: str = STACK_AXIS, axis: int = 0) -> Any:
    """Remove ``axis_name`` (at ``axis``) from each variable's sharding names.

    The values must already be unstacked (rank = len(names) - 1) and the name at ``axis``
    must be ``axis_name``; anything else raises.
    """

    def edit(where: str, variable: nnx.Variable) -> tuple[str, ...]:
        names = tuple(variable.get_metadata()[SHARDING_KEY])
        ndim = len(variable.shape)
        if len(names) <= axis or names[axis] != axis_name:
            raise ValueError(f"remove_stack_axis: {where} sharding names {names} have no '{axis_name}' at axis {axis}")
        if ndim != len(names) - 1:
            raise ValueError(
                f"remove_stack_axis: {where} has rank {ndim} but sharding names {names}; "
                f"expected rank {len(names) - 1} after unstacking"
            )
        return names[:axis] + names[axis + 1 :]

    return _rename(tree, edit)


Aux = dict[str, jax.Array]


def _apply_layer(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    x: jax.Array,
    args: tuple,
    dropout_keys: Keys | None = None,
    is_global: jax.Array | None = None,
) -> tuple[jax.Array, Aux, nnx.State]:
    """Pure application of one layer: its output, aux dict and non-parameter state.
    ``dropout_keys``: the layer's per-row keys (``layers.dropout``); None = no dropout.
    ``is_global``: a ``selected`` block's kind (``parallel/layer_kind.py``); None for the others."""
    layer = nnx.merge(graphdef, state)
    with layer_keys(dropout_keys), selected_layer(is_global):  # LoRA's adapter dropout reads the keys (layers/lora.py)
        out = layer(x, *args) if dropout_keys is None else layer(x, *args, dropout_keys=dropout_keys)
    y, aux = out if isinstance(out, tuple) else (out, {})
    return y, {name: jnp.asarray(value, jnp.float32) for name, value in aux.items()}, nnx.state(layer, nnx.Not(nnx.Param))


def sum_aux(*parts: Aux) -> Aux:
    """Add aux dicts entry by entry (names missing from a part count as zero)."""
    total: Aux = {}
    for part in parts:
        for name, value in part.items():
            total[name] = total[name] + value if name in total else value
    return total


def _with_remat(fn: Callable, spec: RematSpec, *, in_scan: bool) -> Callable:
    """Wrap one layer application in jax.checkpoint. CSE prevention is only needed outside
    a scan (inside, the loop already stops XLA from merging the recomputation away)."""
    policy = jax_policy(spec)
    if policy is None:
        return fn
    return jax.checkpoint(fn, policy=policy, prevent_cse=not in_scan, static_argnums=(0,))


class LayerStack(nnx.Module):
    """``num_layers`` blocks from ``make_block(rngs)``, scanned or unrolled."""

    def __init__(
        self,
        make_block: Callable[[nnx.Rngs], nnx.Module],
        num_layers: int,
        *,
        key: jax.Array,
        scan: bool,
        remat: RematSpec,
        axis_name: str = STACK_AXIS,
        first_block: int = 0,
        unroll: bool = False,
        global_layers: tuple[bool, ...] = (),
    ):
        """Block ``i`` is built from ``fold_in(key, first_block + i)``: a stack that continues
        another (the blocks after a partial pipeline) gets the weights it would have had there.
        ``unroll`` (with ``scan``): apply the stacked blocks in a Python loop, not a scan.
        ``global_layers``: for a stack of ``selected`` blocks, each block's kind by its index in
        the unsplit stack (``StackLayout.global_layers``), handed to block ``i`` as data."""
        jax_policy(remat)  # validate the name early
        if not is_stack_axis(axis_name):
            raise ValueError(f"stack axis name '{axis_name}' must be 'layers' or end with '_layers'")
        self.axis_name = axis_name
        self.num_layers = num_layers
        self.first_block = first_block
        self.scan = scan
        self.unroll = unroll
        self.remat = remat
        self.global_layers = tuple(global_layers)
        keys = jnp.stack([jax.random.fold_in(key, first_block + i) for i in range(num_layers)])
        if scan:
            graphdef, _ = nnx.split(nnx.eval_shape(lambda: make_block(nnx.Rngs(0))))
            stacked = jax.vmap(lambda k: nnx.split(make_block(nnx.Rngs(k)))[1])(keys)
            self.layers = nnx.merge(graphdef, add_stack_axis(stacked, axis_name))
        else:
            self.layers = nnx.List([make_block(nnx.Rngs(keys[i])) for i in range(num_layers)])

    def block_ids(self) -> jax.Array:
        """Each block's index in the unsplit stack (what its dropout keys fold in)."""
        return self.first_block + jnp.arange(self.num_layers, dtype=jnp.int32)

    def __call__(self, x: jax.Array, *args: Any, dropout_keys: Keys | None = None) -> tuple[jax.Array, Aux]:
        """Apply every layer in order; ``args`` are passed unchanged to each layer.
        ``dropout_keys``: the stack's per-row keys; block ``i`` gets them folded with
        ``first_block + i`` (None = no dropout).

        Returns the output and the blocks' aux entries summed over the layers.
        """
        if not self.scan:
            apply = _with_remat(_apply_layer, self.remat, in_scan=False)
            auxes = []
            for i, layer in enumerate(self.layers):
                graphdef, state = nnx.split(layer)
                flag = self.global_layers[self.first_block + i] if self.global_layers else None
                x, aux, rest = apply(graphdef, state, x, args, fold(dropout_keys, self.first_block + i), flag)
                nnx.update(layer, rest)
                auxes.append(aux)
            return x, sum_aux(*auxes)
        graphdef, state = nnx.split(self.layers)
        ids = None if dropout_keys is None else self.block_ids()
        flags = block_flags(self.global_layers, self.block_ids())
        x, aux, new_rest = apply_stacked(
            graphdef, state, x, args, self.remat, self.axis_name, dropout_keys, ids, unroll=self.unroll, flags=flags
        )
        nnx.update(self.layers, new_rest)
        return x, aux


def apply_stacked(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    x: jax.Array,
    args: tuple,
    remat: RematSpec,
    axis_name: str,
    dropout_keys: Keys | None = None,
    block_ids: jax.Array | None = None,
    *,
    unroll: bool = False,
    flags: jax.Array | None = None,
) -> tuple[jax.Array, Aux, nnx.State]:
    """Scan the stacked blocks in ``state`` (leading axis ``axis_name``) over ``x``, each
    wrapped in ``remat``; ``unroll``: the same body in a Python loop over the blocks (each
    block a separate piece of the program, as ``scan_layers=false`` builds it). With
    ``dropout_keys`` (per-row keys) block ``i`` draws its masks from them folded with
    ``block_ids[i]`` (its index in the unsplit stack). Returns the output, the aux entries
    summed over the blocks and the new stacked non-parameter state. ``flags [P]``: each
    ``selected`` block's kind (``parallel/layer_kind.py``), scanned with its weights."""
    apply = _with_remat(_apply_layer, remat, in_scan=not unroll)

    def body(carry, xs):
        layer_state, block_id, flag = xs
        keys = None if block_id is None else fold(dropout_keys, block_id)
        y, aux, rest = apply(graphdef, remove_stack_axis(layer_state, axis_name), carry, args, keys, flag)
        return y, (aux, rest)

    if (dropout_keys is None) != (block_ids is None):
        raise ValueError("apply_stacked: dropout_keys and block_ids go together")
    if unroll:
        outputs = []
        for i in range(jax.tree.leaves(state)[0].shape[0]):
            x, out = body(x, jax.tree.map(lambda a, i=i: a[i], (state, block_ids, flags)))
            outputs.append(out)
        stacked_aux, stacked_rest = jax.tree.map(lambda *parts: jnp.stack(parts), *outputs)
    else:
        x, (stacked_aux, stacked_rest) = jax.lax.scan(body, x, (state, block_ids, flags))
    return x, {name: jnp.sum(value, axis=0) for name, value in stacked_aux.items()}, add_stack_axis(stacked_rest, axis_name)
