"""Pipeline parallelism: a scanned layer stack run as a GPipe or circular schedule.

The stack's stacked weights ``[P, ...]`` are viewed as ``[repeats, stages, lps, ...]``
with the ``stage`` mesh axis on the stage dimension (``config.pipeline`` says which
block runs where and when). Every iteration:

1. stage 0 takes the current activation of its microbatch from a buffer ``[M, mb, ...]``
   (the input on the first repeat, the last stage's output after that; each stage holds
   a copy, ``[stages, M, mb, ...]``, and only stage 0's is used, so the buffer never
   crosses stages); every other stage takes what the previous stage produced (``shift``);
2. all stages run at once: ``jax.vmap`` over the stage dimension with
   ``spmd_axis_name="stage"`` of a scan over the stage's blocks — the plain decoder's
   block application (``parallel.scan``) with each block's weights read by index
   (``_indexed_stack``: scanning over them as ``xs`` costs a copy of the stage's weights
   per iteration under ``vmap``), each stage on the weights of its current repeat;
3. the outputs move one stage on (a roll along the stage axis, i.e. a collective
   permute), the last stage's output, which the roll brings to stage 0, goes back into
   its buffer, and each stage's
   non-trainable state (router bias, expert-load counters, hash tables…) is written back
   for the repeat it used — only when that stage held a real microbatch, so bubbles
   never mutate state.

Parameters are read-only inputs; non-trainable state is carried through the loop.
Auxiliary losses are summed over the real (stage, microbatch) pairs and averaged over the
microbatches, as gradient accumulation does with equal token counts.

Outside the pipeline the ``stage`` axis is one more data-parallel axis (see the
``activation_batch`` rule); inside it the microbatches are split over the other batch
axes only, so the stage axis is stripped from the rules while the pipeline runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnxtron.config.pipeline import PipelineSpec
from nnxtron.errors import ConfigError
from nnxtron.parallel.microbatch import merge_microbatches, split_microbatches
from nnxtron.parallel.remat import OFFLOAD_DST, RematSpec, jax_policy
from nnxtron.parallel.row_keys import Keys, fold
from nnxtron.parallel.scan import Aux, LayerStack, _apply_layer, add_stack_axis, apply_stacked, remove_stack_axis
from nnxtron.parallel.sharding import Rules, activate, active_mesh, logical_to_spec, spmd_axes, variable_names

STAGE = "stage"
# per-stage offload: a repeat's weights fetched from host memory, and what a round keeps for its backward pass
STAGE_WEIGHTS = "pipeline_stage_weights"
ITERATION_INPUTS = "pipeline_iteration_inputs"


def without_axis(rules: Rules, axis: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``rules`` with mesh axis ``axis`` removed from every entry."""
    return tuple((name, tuple(a for a in axes if a != axis)) for name, axes in rules)


class PipelinedStack(LayerStack):
    """A scanned ``LayerStack`` whose blocks run as ``pipeline`` over the ``stage`` mesh axis.

    The parameters are exactly a scanned stack's (same paths, same ``[P, ...]`` layout),
    so checkpoints and HF conversion do not change. The schedule runs when the active
    mesh (``parallel.sharding.activate``) has a ``stage`` axis of ``pipeline.stages``
    devices (a mesh with another number of ``stage`` devices is refused).

    With no active mesh at all, ``sequential_without_mesh`` decides, explicitly:

    * ``True`` (the default, what ``models/decoder.py`` builds): the blocks are applied in
      order — the same function, which the parity tests prove. Callers rely on it: a model
      built from a pipelined config and run outside any mesh (an eager forward on one
      device, the sequential reference of ``tests/unit/test_pipeline.py``, the full forward
      that ``tests/parity/test_kv_cache.py`` compares cached decoding with, scoring);
    * ``False``: the call raises ``ConfigError`` naming what is missing (a mesh with a
      ``stage`` axis, ``ici_pipeline_parallelism``) instead of running without the schedule.
    """

    def __init__(
        self,
        make_block: Callable[[nnx.Rngs], nnx.Module],
        num_layers: int,
        *,
        key: jax.Array,
        remat: RematSpec,
        axis_name: str,
        pipeline: PipelineSpec,
        unroll: bool = False,
        sequential_without_mesh: bool = True,
    ):
        """``unroll``: each stage applies its blocks in a Python loop (``scan_layers=false``),
        not a scan; the weights stay stacked either way (the stage axis shards them).
        ``sequential_without_mesh``: with no active mesh, apply the blocks in order (True) or
        refuse (False); see the class docstring."""
        if num_layers != pipeline.blocks:
            raise ValueError(f"the pipeline schedules {pipeline.blocks} blocks but the stack has {num_layers}")
        super().__init__(make_block, num_layers, key=key, scan=True, remat=remat, axis_name=axis_name, unroll=unroll)
        self.pipeline = pipeline
        self.sequential_without_mesh = sequential_without_mesh

    def __call__(self, x: jax.Array, *args: Any, dropout_keys: Keys | None = None) -> tuple[jax.Array, Aux]:
        active = active_mesh()
        if active is None:
            if not self.sequential_without_mesh:
                raise ConfigError(
                    f"the pipelined stack '{self.axis_name}' runs its {self.pipeline.stages}-stage schedule over a mesh "
                    f"with a '{STAGE}' axis of {self.pipeline.stages} devices, and no mesh is active: build it with "
                    f"parallel.mesh.make_mesh(cfg) (ici_pipeline_parallelism x dcn_pipeline_parallelism = "
                    f"{self.pipeline.stages}) and call it under parallel.sharding.activate(mesh, rules), or build the "
                    "stack with sequential_without_mesh=True to apply its blocks in order"
                )
            return super().__call__(x, *args, dropout_keys=dropout_keys)
        mesh, rules = active
        stages = mesh.shape.get(STAGE, 1)
        if stages != self.pipeline.stages:
            raise ValueError(f"the mesh has {stages} '{STAGE}' devices but the pipeline has {self.pipeline.stages} stages")
        graphdef, params, rest = nnx.split(self.layers, nnx.Param, ...)
        y, aux, new_rest = run_pipeline(
            graphdef, params, rest, x, args, self.pipeline, self.remat, self.axis_name, mesh, rules, dropout_keys, self.unroll
        )
        nnx.update(self.layers, new_rest)
        return y, aux


def _staged_spec(mesh: Mesh, rules: Rules, ndim: int) -> NamedSharding:
    """[stages, microbatch rows, length, ...] activations: stage axis, then the batch rules."""
    batch = tuple(logical_to_spec(("activation_batch", "activation_length"), rules, mesh))
    return NamedSharding(mesh, PartitionSpec(STAGE, *batch[: ndim - 1], *(None,) * max(ndim - 3, 0)))


def _buffer_spec(mesh: Mesh, rules: Rules, ndim: int) -> NamedSharding:
    """[stages, microbatches, microbatch rows, length, ...] buffer: stage axis, then the batch rules."""
    batch = tuple(logical_to_spec(("activation_batch", "activation_length"), rules, mesh))
    return NamedSharding(mesh, PartitionSpec(STAGE, None, *batch[: ndim - 2], *(None,) * max(ndim - 4, 0)))


def _weight_spec(
    variable: nnx.Variable, mesh: Mesh, rules: Rules, drop_fsdp: bool, *, repeat_axis: bool = True, memory_kind: str | None = None
) -> NamedSharding:
    """[repeats, stages, lps, ...] stage weights (``[stages, lps, ...]`` without ``repeat_axis``) of the
    stack variable ``variable`` (``[P, ...]``): the stage axis on the stage dimension, the rest by its names."""
    names = variable_names(variable)
    rank = len(variable.shape) - 1
    rest = list(logical_to_spec(names[1:], rules, mesh)) if names is not None else [None] * rank
    if drop_fsdp:  # pipeline_fsdp_ag_once: gathered over fsdp once, before the iterations
        keep = [tuple(a for a in ((e,) if isinstance(e, str) else e) if a != "fsdp") if e else () for e in rest]
        rest = [None if not e else e[0] if len(e) == 1 else e for e in keep]
    lead = (None, STAGE) if repeat_axis else (STAGE,)
    return NamedSharding(mesh, PartitionSpec(*lead, None, *rest), memory_kind=memory_kind)


def _is_variable(node: Any) -> bool:
    return isinstance(node, nnx.Variable)


def _to_stages(
    state: nnx.State, spec: PipelineSpec, mesh: Mesh, rules: Rules, drop_fsdp: bool, memory_kind: str | None = None
) -> nnx.State:
    """[P, ...] stacked variables -> [repeats, stages, lps, ...] placed on the stage axis
    (block ``(r * stages + s) * lps + j`` at ``[r, s, j]``); ``memory_kind`` host keeps them in host memory."""

    def one(variable: nnx.Variable) -> nnx.Variable:
        value = variable.get_value()
        staged = value.reshape(spec.repeats, spec.stages, spec.layers_per_stage, *value.shape[1:])
        sharding = _weight_spec(variable, mesh, rules, drop_fsdp, memory_kind=memory_kind)
        place = jax.lax.with_sharding_constraint if memory_kind is None else jax.device_put
        return variable.replace(place(staged, sharding))

    return jax.tree.map(one, state, is_leaf=_is_variable)


def _device_mover(params: nnx.State, mesh: Mesh, rules: Rules, drop_fsdp: bool, repeat_axis: bool) -> Callable:
    """A function moving staged weights (``[repeats, stages, lps, ...]``, or one repeat's
    ``[stages, lps, ...]`` without ``repeat_axis``) of the stack ``params`` into device memory."""
    specs = jax.tree.map(lambda v: _weight_spec(v, mesh, rules, drop_fsdp, repeat_axis=repeat_axis), params, is_leaf=_is_variable)

    def move(staged: nnx.State) -> nnx.State:
        return jax.tree.map(lambda v, sh: v.replace(jax.device_put(v.get_value(), sh)), staged, specs, is_leaf=_is_variable)

    return move


def _from_stages(state: nnx.State, blocks: int) -> nnx.State:
    return jax.tree.map(lambda v: v.reshape(blocks, *v.shape[3:]), state)


def _for_stages(state: nnx.State, repeat_ids: jax.Array | None) -> nnx.State:
    """Each stage's [lps, ...] slice of its current repeat: [stages, lps, ...].

    ``repeat_ids`` None (one repeat, GPipe) takes repeat 0 statically: a slice of a
    loop-invariant input stays loop-invariant, so autodiff does not keep a copy of the
    stage weights for every iteration."""
    if repeat_ids is None:
        return jax.tree.map(lambda w: w[0], state)
    return jax.tree.map(lambda w: jax.vmap(lambda ws, r: ws[r], in_axes=(1, 0))(w, repeat_ids), state)


def _pick(weights: nnx.State | tuple[nnx.State, nnx.State], choice: jax.Array | None) -> nnx.State:
    """Each stage's ``[lps, ...]`` weights for this iteration: ``_for_stages`` by repeat id, or, for
    per-stage offload, from a pair (previous repeat, current repeat) on device by ``choice``
    (per stage: True = current)."""
    if not isinstance(weights, tuple):
        return _for_stages(weights, choice)
    previous, current = weights
    one = jax.vmap(lambda p, c, use: jnp.where(use, c, p))
    return jax.tree.map(lambda p, c: one(p, c, choice), previous, current)


def _write_back(state: nnx.State, repeat_ids: jax.Array, new: nnx.State, valid: jax.Array) -> nnx.State:
    """Store each stage's new non-trainable state for its repeat, where the stage was not in a bubble."""
    old_leaves, treedef = jax.tree.flatten(state)
    new_leaves = jax.tree.leaves(new)
    if len(old_leaves) != len(new_leaves):
        raise ValueError("a pipeline stage changed the structure of its non-trainable state")

    def one(ws: jax.Array, r: jax.Array, n: jax.Array, v: jax.Array) -> jax.Array:
        return ws.at[r].set(jnp.where(v, n.astype(ws.dtype), ws[r]))

    put = jax.vmap(one, in_axes=(1, 0, 0, 0), out_axes=1)
    return jax.tree.unflatten(treedef, [put(w, repeat_ids, n, valid) for w, n in zip(old_leaves, new_leaves, strict=True)])


def _indexed_stack(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rest: nnx.State,
    x: jax.Array,
    args: tuple,
    remat: RematSpec,
    axis_name: str,
    dropout_keys: Keys | None,
    block_ids: jax.Array | None,
) -> tuple[jax.Array, Aux, nnx.State]:
    """``apply_stacked`` (scanned, ``remat`` per block) with the parameters read by index inside
    the scan body instead of scanned over as ``xs``.

    Under the stage ``vmap`` a scan's ``xs`` are moved to ``[lps, stages, ...]``: XLA copies
    the stage's whole weights into that layout (and the weight gradients back) in every
    pipeline iteration. Indexed, the weights stay ``[stages, lps, ...]``, loop-invariant (so
    a per-block checkpoint keeps the index, not a copy of the block's weights), and their
    gradient is written into its slice of one accumulator. Non-trainable state is small and
    still scanned (it is also an output)."""
    lps = jax.tree.leaves(params)[0].shape[0]

    def layer(p: nnx.State, j: jax.Array, r: nnx.State, h: jax.Array, keys: Keys | None) -> tuple:
        w = jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(v, j, 0, keepdims=False), p)
        state = nnx.merge_state(remove_stack_axis(w, axis_name), remove_stack_axis(r, axis_name))
        return _apply_layer(graphdef, state, h, args, keys)

    policy = jax_policy(remat)
    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)

    def body(h: jax.Array, xs: tuple) -> tuple:
        j, r, block_id = xs
        keys = None if block_id is None else fold(dropout_keys, block_id)
        y, aux, new_rest = layer(params, j, r, h, keys)
        return y, (aux, new_rest)

    y, (aux, new_rest) = jax.lax.scan(body, x, (jnp.arange(lps), rest, block_ids))
    return y, {name: jnp.sum(value, axis=0) for name, value in aux.items()}, add_stack_axis(new_rest, axis_name)


def run_pipeline(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rest: nnx.State,
    x: jax.Array,
    args: tuple,
    spec: PipelineSpec,
    remat: RematSpec,
    axis_name: str,
    mesh: Mesh,
    rules: Rules,
    dropout_keys: Keys | None = None,
    unroll: bool = False,
) -> tuple[jax.Array, Aux, nnx.State]:
    """Apply the stacked blocks (``params`` + ``rest``, leading axis ``axis_name``) to
    ``x [B, ...]`` by the schedule ``spec``; ``args`` are per-row arrays ``[B, ...]``
    (positions, segment ids, token ids) that travel with their microbatch, and so do the
    per-row ``dropout_keys`` (``parallel.row_keys``): the block at ``[repeat, stage, j]`` folds
    in its stack index ``(repeat * stages + stage) * lps + j``, as the unpipelined stack does.

    ``unroll``: each stage applies its ``layers_per_stage`` blocks in a Python loop (the
    unscanned stage body of ``scan_layers=false``) instead of a scan.

    Returns the output ``[B, ...]``, the aux losses (mean over microbatches of their sum
    over blocks) and the new stacked non-trainable state."""
    stages, micro, repeats, delay = spec.stages, spec.microbatches, spec.repeats, spec.delay
    inner = without_axis(rules, STAGE)
    layer_remat = remat if spec.remat_layers else RematSpec("none")

    lps = spec.layers_per_stage

    def run_stage(p: nnx.State, r: nnx.State, h: jax.Array, a: tuple, keys: Keys | None, first: jax.Array | None) -> tuple:
        ids = None if keys is None else first + jnp.arange(lps, dtype=jnp.int32)
        if unroll:
            return apply_stacked(graphdef, nnx.merge_state(p, r), h, a, layer_remat, axis_name, keys, ids, unroll=unroll)
        return _indexed_stack(graphdef, p, r, h, a, layer_remat, axis_name, keys, ids)

    run_stages = jax.vmap(run_stage, spmd_axis_name=STAGE)

    with activate(mesh, inner), spmd_axes(STAGE):
        keys_part = {} if dropout_keys is None else {"dropout_keys": dropout_keys}
        parts = split_microbatches({"x": x, **{f"arg{i}": a for i, a in enumerate(args)}, **keys_part}, micro)
        micro_args = tuple(parts[f"arg{i}"] for i in range(len(args)))
        micro_keys = parts.get("dropout_keys")
        host = spec.host_weights  # per-stage offload: the weights stay in host memory until their repeat
        staged_params = _to_stages(
            params, spec, mesh, inner, drop_fsdp=spec.fsdp_ag_once and not host, memory_kind=OFFLOAD_DST if host else None
        )
        if host and repeats == 1:  # GPipe: every stage uses its weights in every iteration
            staged_params = _device_mover(params, mesh, inner, spec.fsdp_ag_once, repeat_axis=True)(staged_params)
            host = False
        staged_rest = _to_stages(rest, spec, mesh, inner, drop_fsdp=False)
        stage_ids = jnp.arange(stages)
        place = lambda h: jax.lax.with_sharding_constraint(h, _staged_spec(mesh, inner, h.ndim))  # noqa: E731
        # the microbatch buffer [stages, M, mb, ...]: one copy per stage, on the stage's devices.
        # Only stage 0's copy is read and written meaningfully (the others take the same
        # updates and are discarded): a buffer shared by the stages would need the last
        # stage's output sent to every stage (an all-reduce) and its index every iteration
        keep = lambda b: jax.lax.with_sharding_constraint(b, _buffer_spec(mesh, inner, b.ndim))  # noqa: E731
        read = jax.vmap(lambda b, m: jax.lax.dynamic_index_in_dim(b, m, 0, keepdims=False))
        put = jax.vmap(lambda b, v, m: jax.lax.dynamic_update_index_in_dim(b, v, m, 0))

        def compute(
            weights: nnx.State | tuple,
            state: nnx.State,
            h: jax.Array,
            a: tuple,
            choice: jax.Array | None,
            repeat_ids: jax.Array | None,
            keys: tuple,
        ) -> tuple:
            """The stages' work in one iteration, on the weights (``_pick(weights, choice)``) and
            state of their repeats; ``keys``: () or (each stage's dropout keys, each stage's first
            block index)."""
            stage_weights = _pick(weights, choice)
            return run_stages(stage_weights, _for_stages(state, repeat_ids), h, a, *(keys or (None, None)))

        # per-iteration remat wraps the stages' work only: the checkpoint keeps its inputs
        # (activations, repeat ids, the small non-trainable state), never the microbatch
        # buffer, and the stage weights are loop-invariant
        policy = jax_policy(remat) if spec.remat_iterations else None
        if policy is not None:
            compute = jax.checkpoint(compute, policy=policy, prevent_cse=not spec.scan_iterations)

        def first_blocks(repeat_ids: jax.Array) -> jax.Array:
            """Each stage's first block index in the stack: block ``(r * stages + s) * lps + j``."""
            return ((repeat_ids * stages + stage_ids) * lps).astype(jnp.int32)

        def iteration(carry: tuple, t: jax.Array, weights: nnx.State | tuple, current: jax.Array | None) -> tuple:
            """One step of the schedule at iteration ``t``; ``weights``: the staged weights, or
            under per-stage offload the pair on device (repeat ``current`` - 1, repeat ``current``)."""
            buffer, shift, previous, state, aux_sum = carry
            item = t - delay * stage_ids  # what each stage works on (see config.pipeline)
            valid = (item >= 0) & (item < micro * repeats)
            item = jnp.clip(item, 0, micro * repeats - 1)
            micro_ids, repeat_ids = item % micro, item // micro
            # every stage reads its own copy of the buffer (only stage 0 keeps it, see below)
            first = read(buffer, micro_ids)
            is_first = (stage_ids == 0).reshape(stages, *(1,) * (shift.ndim - 1))
            h = place(jnp.where(is_first, first, shift))
            a = tuple(place(jnp.take(m, micro_ids, axis=0)) for m in micro_args)
            keys = () if micro_keys is None else (place(jnp.take(micro_keys, micro_ids, axis=0)), first_blocks(repeat_ids))
            by_repeat = repeat_ids if repeats > 1 else None
            choice = by_repeat if current is None else repeat_ids == current
            if current is not None:  # per-stage offload: what a round's backward pass keeps (see below)
                h, a, state_in = jax.tree.map(lambda v: checkpoint_name(v, ITERATION_INPUTS), (h, a, state))
            else:
                state_in = state
            y, aux, new_state = compute(weights, state_in, h, a, choice, by_repeat, keys)
            y = place(y)
            state = _write_back(state, repeat_ids, new_state, valid)
            aux_sum = {name: aux_sum[name] + jnp.sum(jnp.where(valid, value, 0.0)) for name, value in aux.items()}
            sent = y if delay == 1 else previous  # delayed forwarding: last iteration's outputs move on
            shift = place(jnp.roll(sent, 1, axis=0))
            # the last stage's output, moved one stage on (the shift itself without delay),
            # reaches stage 0's buffer; the last stage's item is a function of t alone, so no
            # stage reads another stage's ids
            arrived = shift if delay == 1 else place(jnp.roll(y, 1, axis=0))
            last = t - delay * (stages - 1)
            last_micro = jnp.clip(last, 0, micro * repeats - 1) % micro
            last_ids = jnp.full((stages,), last_micro)
            done = read(buffer, last_ids)
            buffer = keep(put(buffer, jnp.where((last >= 0) & (last < micro * repeats), arrived, done), last_ids))
            return buffer, shift, y if delay > 1 else previous, state, aux_sum

        def run_iterations(
            carry: tuple, first: jax.Array, count: int, weights: nnx.State | tuple, current: jax.Array | None = None
        ) -> tuple:
            if spec.scan_iterations:
                step = lambda c, t: (iteration(c, t, weights, current), None)  # noqa: E731
                return jax.lax.scan(step, carry, first + jnp.arange(count))[0]
            for u in range(count):
                carry = iteration(carry, first + u, weights, current)
            return carry

        zeros = place(jnp.zeros((stages, *parts["x"].shape[1:]), x.dtype))
        first_ids = jnp.zeros(stages, jnp.int32)
        first_args = tuple(jnp.take(m, first_ids, axis=0) for m in micro_args)
        first_keys = () if micro_keys is None else (jnp.take(micro_keys, first_ids, axis=0), first_ids)
        if host:
            to_device = _device_mover(params, mesh, inner, spec.fsdp_ag_once, repeat_axis=False)
            fetch = lambda w: checkpoint_name(to_device(w), STAGE_WEIGHTS)  # noqa: E731
            first = jax.tree.map(lambda w: w[0], staged_params)
            on_first = lambda w, *a: compute((fetch(w), fetch(w)), *a)  # noqa: E731
            aux_names = jax.eval_shape(on_first, first, staged_rest, zeros, first_args, first_ids == 0, first_ids, first_keys)[1]
        else:
            by_repeat = first_ids if repeats > 1 else None
            shapes = jax.eval_shape(compute, staged_params, staged_rest, zeros, first_args, by_repeat, by_repeat, first_keys)
            aux_names = shapes[1]
        buffer = keep(jnp.broadcast_to(parts["x"][None], (stages, *parts["x"].shape)))
        carry = (buffer, zeros, zeros, staged_rest, {name: jnp.zeros((), jnp.float32) for name in aux_names})
        if host:
            # per-stage offload: round r brings repeat r's weights to device, and repeat r - 1's,
            # which a stage s is still on for its first delay * s iterations of the round
            # (config.pipeline needs M > delay * (stages - 1)); the backward pass fetches them
            # again rather than keeping every repeat's device copy as a residual
            def one_round(c: tuple, xs: tuple) -> tuple:
                r, weights, previous = xs
                return run_iterations(c, r * micro, micro, (fetch(previous), fetch(weights)), r)

            def drain(c: tuple, weights: nnx.State) -> tuple:
                last = fetch(weights)
                return run_iterations(c, jnp.int32(repeats * micro), spec.tail_iterations, (last, last), jnp.int32(repeats - 1))

            refetch = jax.checkpoint_policies.save_only_these_names(ITERATION_INPUTS)
            one_round = jax.checkpoint(one_round, policy=refetch, prevent_cse=False)
            drain = jax.checkpoint(drain, policy=refetch, prevent_cse=False)
            previous = jax.tree.map(lambda w: jnp.roll(w, 1, axis=0), staged_params)  # [r] = repeat r - 1 (host)
            if spec.scan_repeats:
                step = lambda c, xs: (one_round(c, xs), None)  # noqa: E731
                carry = jax.lax.scan(step, carry, (jnp.arange(repeats), staged_params, previous))[0]
            else:
                for r in range(repeats):
                    at = lambda tree, r=r: jax.tree.map(lambda w: w[r], tree)  # noqa: E731
                    carry = one_round(carry, (jnp.int32(r), at(staged_params), at(previous)))
            carry = drain(carry, jax.tree.map(lambda w: w[repeats - 1], staged_params))
        else:
            if spec.scan_repeats:
                step = lambda c, r: (run_iterations(c, r * micro, micro, staged_params), None)  # noqa: E731
                carry = jax.lax.scan(step, carry, jnp.arange(repeats))[0]
            else:
                for r in range(repeats):
                    carry = run_iterations(carry, jnp.int32(r * micro), micro, staged_params)
            carry = run_iterations(carry, jnp.int32(repeats * micro), spec.tail_iterations, staged_params)
        buffer, _, _, state, aux_sum = carry
        y = merge_microbatches(buffer[0])
    aux = {name: value / micro for name, value in aux_sum.items()}
    return y, aux, _from_stages(state, spec.blocks)
