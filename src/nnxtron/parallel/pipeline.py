"""Pipeline parallelism: a scanned layer stack run as a GPipe or circular schedule.

The stack's stacked weights ``[P, ...]`` are viewed as ``[repeats, stages, lps, ...]``
with the ``stage`` mesh axis on the stage dimension (``config.pipeline`` says which
block runs where and when; ``pipeline_weights`` stages them and brings each round its
weights, from device or host memory). Every iteration (``pipeline_schedule`` has the
arithmetic: which microbatch and repeat each stage holds at iteration ``t``):

1. stage 0 takes the current activation of its microbatch from a buffer ``[M, mb, ...]``
   (the input on the first repeat, the last stage's output after that; each stage holds
   a copy, ``[stages, M, mb, ...]``, and only stage 0's is used, so the buffer never
   crosses stages); every other stage takes what the previous stage produced (``shift``);
2. all stages run at once (``stage_step``): ``jax.vmap`` over the stage dimension with
   ``spmd_axis_name="stage"`` of a scan over the stage's blocks — the plain decoder's
   block application (``parallel.scan``) with each block's weights read by index
   (``_indexed_stack``: scanning over them as ``xs`` costs a copy of the stage's weights
   per iteration under ``vmap``), each stage on the weights of its current repeat;
3. the outputs move one stage on (``pass_on``: a roll along the stage axis, i.e. a
   collective permute), the last stage's output, which the roll brings to stage 0, goes
   back into its buffer (``collect``), and each stage's non-trainable state (router bias,
   expert-load counters, hash tables…) is written back for the repeat it used
   (``write_back``) — only when that stage held a real microbatch, so bubbles never
   mutate state.

The iterations run in rounds of ``M`` (stage 0 on one repeat), then a drain of
``d * (S - 1)``: one loop (``_Run.rounds``) whether the weights are on device or
fetched from host memory a repeat at a time.

Parameters are read-only inputs; non-trainable state is carried through the loop.
Auxiliary losses are summed over the real (stage, microbatch) pairs and averaged over the
microbatches, as gradient accumulation does with equal token counts.

Outside the pipeline the ``stage`` axis is one more data-parallel axis (see the
``activation_batch`` rule); inside it the microbatches are split over the other batch
axes only, so the stage axis is stripped from the rules while the pipeline runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from nnxtron.config.pipeline import PipelineSpec
from nnxtron.errors import ConfigError
from nnxtron.parallel.layer_kind import block_flags
from nnxtron.parallel.microbatch import merge_microbatches, split_microbatches
from nnxtron.parallel.pipeline_schedule import (
    STAGE,
    Placement,
    Schedule,
    add_valid,
    collect,
    pass_on,
    stage_activations,
    write_back,
)
from nnxtron.parallel.pipeline_weights import (
    RoundWeights,
    WeightFeed,
    Weights,
    for_stages,
    from_stages,
    pick,
    stage_weights,
    to_stages,
)
from nnxtron.parallel.remat import RematSpec, jax_policy
from nnxtron.parallel.row_keys import Keys, fold
from nnxtron.parallel.scan import Aux, LayerStack, _apply_layer, add_stack_axis, apply_stacked, remove_stack_axis
from nnxtron.parallel.sharding import Rules, activate, active_mesh, spmd_axes


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
        global_layers: tuple[bool, ...] = (),
    ):
        """``unroll``: each stage applies its blocks in a Python loop (``scan_layers=false``),
        not a scan; the weights stay stacked either way (the stage axis shards them).
        ``sequential_without_mesh``: with no active mesh, apply the blocks in order (True) or
        refuse (False); see the class docstring. ``global_layers``: a stack of ``selected`` blocks'
        kinds (``LayerStack``), read by each stage for the blocks it applies."""
        if num_layers != pipeline.blocks:
            raise ValueError(f"the pipeline schedules {pipeline.blocks} blocks but the stack has {num_layers}")
        super().__init__(
            make_block,
            num_layers,
            key=key,
            scan=True,
            remat=remat,
            axis_name=axis_name,
            unroll=unroll,
            global_layers=global_layers,
        )
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
            graphdef,
            params,
            rest,
            x,
            args,
            self.pipeline,
            self.remat,
            self.axis_name,
            mesh,
            rules,
            dropout_keys,
            self.unroll,
            self.global_layers,
        )
        nnx.update(self.layers, new_rest)
        return y, aux


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
    flags: jax.Array | None = None,
) -> tuple[jax.Array, Aux, nnx.State]:
    """``apply_stacked`` (scanned, ``remat`` per block) with the parameters read by index inside
    the scan body instead of scanned over as ``xs``.

    Under the stage ``vmap`` a scan's ``xs`` are moved to ``[lps, stages, ...]``: XLA copies
    the stage's whole weights into that layout (and the weight gradients back) in every
    pipeline iteration. Indexed, the weights stay ``[stages, lps, ...]``, loop-invariant (so
    a per-block checkpoint keeps the index, not a copy of the block's weights), and their
    gradient is written into its slice of one accumulator. Non-trainable state is small and
    still scanned (it is also an output), and so are the ``selected`` blocks' kinds ``flags``."""
    lps = jax.tree.leaves(params)[0].shape[0]

    def layer(p: nnx.State, j: jax.Array, r: nnx.State, h: jax.Array, keys: Keys | None, flag: jax.Array | None) -> tuple:
        w = jax.tree.map(lambda v: jax.lax.dynamic_index_in_dim(v, j, 0, keepdims=False), p)
        state = nnx.merge_state(remove_stack_axis(w, axis_name), remove_stack_axis(r, axis_name))
        return _apply_layer(graphdef, state, h, args, keys, flag)

    policy = jax_policy(remat)
    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)

    def body(h: jax.Array, xs: tuple) -> tuple:
        j, r, block_id, flag = xs
        keys = None if block_id is None else fold(dropout_keys, block_id)
        y, aux, new_rest = layer(params, j, r, h, keys, flag)
        return y, (aux, new_rest)

    y, (aux, new_rest) = jax.lax.scan(body, x, (jnp.arange(lps), rest, block_ids, flags))
    return y, {name: jnp.sum(value, axis=0) for name, value in aux.items()}, add_stack_axis(new_rest, axis_name)


class Microbatches(NamedTuple):
    """The inputs split into ``M`` microbatches (``parallel.microbatch``), leading axis ``[M]``."""

    x: jax.Array  # [M, mb, ...]
    args: tuple[jax.Array, ...]  # per-row arrays (positions, segment ids, token ids)
    keys: Keys | None  # per-row dropout keys

    @classmethod
    def split(cls, x: jax.Array, args: tuple, dropout_keys: Keys | None, count: int) -> Microbatches:
        keys_part = {} if dropout_keys is None else {"dropout_keys": dropout_keys}
        parts = split_microbatches({"x": x, **{f"arg{i}": a for i, a in enumerate(args)}, **keys_part}, count)
        return cls(parts["x"], tuple(parts[f"arg{i}"] for i in range(len(args))), parts.get("dropout_keys"))


class Carry(NamedTuple):
    """What one iteration hands the next."""

    buffer: jax.Array  # [S, M, mb, ...]: each stage's copy of the microbatch buffer (stage 0's is used)
    shift: jax.Array  # [S, mb, ...]: what each stage takes from the previous one
    previous: jax.Array  # [S, mb, ...]: the outputs of the iteration before (delayed forwarding)
    state: nnx.State  # [R, S, lps, ...]: the stack's non-trainable state
    aux_sum: Aux  # aux losses summed over the real slots


StageStep = Callable[..., tuple[jax.Array, Aux, nnx.State]]


def stage_step(
    graphdef: nnx.GraphDef,
    spec: PipelineSpec,
    remat: RematSpec,
    axis_name: str,
    unroll: bool,
    global_layers: tuple[bool, ...] = (),
) -> StageStep:
    """All stages' work in one iteration, ``(weights, state, h, args, choice, repeat_ids, keys,
    first) -> (y, aux, new state)``, each ``[S, ...]``: every stage applies its ``lps`` blocks to its
    activations ``h`` at once (``jax.vmap`` over the stage axis with ``spmd_axis_name``), on the
    weights ``pipeline_weights.pick(weights, choice)`` and the state of its repeat.

    ``keys``: each stage's dropout keys, or None; ``first``: each stage's first block index (its
    blocks' dropout keys fold it in; a stack of ``selected`` blocks reads their kinds from
    ``global_layers`` by it: ``parallel/layer_kind.py``). ``unroll``:
    the blocks in a Python loop (``scan_layers=false``; ``scan_layers_per_stage=false`` too),
    else ``_indexed_stack``. Per-iteration
    remat wraps this step only: the checkpoint keeps its inputs (activations, repeat ids, the
    small non-trainable state), never the microbatch buffer, and the stage weights are
    loop-invariant."""
    layer_remat = remat if spec.remat_layers else RematSpec("none")
    lps = spec.layers_per_stage
    unroll = unroll or not spec.scan_stage_layers  # scan_layers=false, or scan_layers_per_stage=false

    def run_stage(p: nnx.State, r: nnx.State, h: jax.Array, a: tuple, keys: Keys | None, first: jax.Array) -> tuple:
        blocks = first + jnp.arange(lps, dtype=jnp.int32)
        ids = None if keys is None else blocks
        flags = block_flags(global_layers, blocks)
        if unroll:
            state = nnx.merge_state(p, r)
            return apply_stacked(graphdef, state, h, a, layer_remat, axis_name, keys, ids, unroll=unroll, flags=flags)
        return _indexed_stack(graphdef, p, r, h, a, layer_remat, axis_name, keys, ids, flags)

    run_stages = jax.vmap(run_stage, spmd_axis_name=STAGE)

    def step(
        weights: Weights,
        state: nnx.State,
        h: jax.Array,
        a: tuple,
        choice: jax.Array | None,
        repeat_ids: jax.Array | None,
        keys: Keys | None,
        first: jax.Array,
    ) -> tuple:
        return run_stages(pick(weights, choice), for_stages(state, repeat_ids), h, a, keys, first)

    policy = jax_policy(remat) if spec.remat_iterations else None
    if policy is not None:
        step = jax.checkpoint(step, policy=policy, prevent_cse=not spec.scan_iterations)
    return step


@dataclass(frozen=True)
class _Run:
    """One run of the schedule on its inputs: the loops over rounds and iterations, and one iteration."""

    spec: PipelineSpec
    schedule: Schedule
    placement: Placement
    micro: Microbatches
    step: StageStep

    def start(self, state: nnx.State, feed: WeightFeed) -> Carry:
        """The carry before iteration 0: the buffer holds the inputs, the aux sums are zero."""
        micro, stages = self.micro, self.spec.stages
        zeros = self.placement.stages(jnp.zeros((stages, *micro.x.shape[1:]), micro.x.dtype))

        def first_aux() -> Aux:  # the step's aux losses on iteration 0's inputs (abstractly: only their names)
            ids = jnp.zeros(stages, jnp.int32)
            by_repeat = ids if self.spec.circular else None
            args = tuple(jnp.take(m, ids, axis=0) for m in micro.args)
            keys = None if micro.keys is None else jnp.take(micro.keys, ids, axis=0)
            weights = feed.round(jnp.int32(0), feed.at(0))
            return self.step(weights.weights, state, zeros, args, weights.choice(ids, by_repeat), by_repeat, keys, ids)[1]

        buffer = self.placement.buffer(jnp.broadcast_to(micro.x[None], (stages, *micro.x.shape)))
        aux_sum = {name: jnp.zeros((), jnp.float32) for name in jax.eval_shape(first_aux)}
        return Carry(buffer, zeros, zeros, state, aux_sum)

    def iteration(self, carry: Carry, t: jax.Array, weights: RoundWeights) -> Carry:
        """Iteration ``t`` (``pipeline_schedule``): the stages take their inputs, run, write back
        their state, and pass their outputs on; the last stage's output goes into the buffer."""
        spec, place = self.spec, self.placement.stages
        slots = self.schedule.slots(t)
        h = place(stage_activations(carry.buffer, carry.shift, slots, self.schedule))
        a = tuple(place(jnp.take(m, slots.micro_ids, axis=0)) for m in self.micro.args)
        keys = None if self.micro.keys is None else place(jnp.take(self.micro.keys, slots.micro_ids, axis=0))
        first = self.schedule.first_blocks(slots.repeat_ids)
        by_repeat = slots.repeat_ids if spec.circular else None
        choice = weights.choice(slots.repeat_ids, by_repeat)
        h, a, state_in = weights.saved_inputs((h, a, carry.state))
        y, aux, new_state = self.step(weights.weights, state_in, h, a, choice, by_repeat, keys, first)
        y = place(y)
        state = write_back(carry.state, slots.repeat_ids, new_state, slots.valid)
        aux_sum = add_valid(carry.aux_sum, aux, slots.valid)
        shift, arrived, previous = pass_on(y, carry.previous, spec.delay, place)
        buffer = collect(carry.buffer, arrived, t, self.schedule, self.placement.buffer)
        return Carry(buffer, shift, previous, state, aux_sum)

    def iterations(self, carry: Carry, first: jax.Array, count: int, weights: RoundWeights) -> Carry:
        """Iterations ``first .. first + count - 1``: a scan, or a Python loop (``scan_pipeline_iterations``)."""
        if self.spec.scan_iterations:
            step = lambda c, t: (self.iteration(c, t, weights), None)  # noqa: E731
            return jax.lax.scan(step, carry, first + jnp.arange(count))[0]
        for u in range(count):
            carry = self.iteration(carry, first + u, weights)
        return carry

    def rounds(self, carry: Carry, feed: WeightFeed) -> Carry:
        """The whole schedule, ``M * R + d * (S - 1)`` iterations: round ``r`` runs iterations
        ``[r * M, (r + 1) * M)`` on ``feed.round``'s weights (a scan over the rounds, or a Python
        loop: ``scan_pipeline_repeats``), then the drain runs the last ``d * (S - 1)``.

        With both loops scanned (``scan_pipeline_repeats``, ``scan_pipeline_iterations``) and the
        same weights every round (on device), the rounds and the drain are one scan over every
        iteration (MaxText's program): the repeats are scanned all the same, and the backward pass keeps one float32 accumulator of the stage weights' gradient
        — each loop's backward pass starts its own and adds it to the enclosing one after (for
        llama3.1-8b GPipe on 8 devices, 3.3 GiB of the 12.1 GiB of temporaries; docs/pipeline.md)."""
        micro, repeats = self.spec.microbatches, self.spec.repeats
        if self.spec.scan_repeats and self.spec.scan_iterations and feed.same_every_round:
            every = repeats * micro + self.spec.tail_iterations
            return self.iterations(carry, jnp.int32(0), every, feed.round(jnp.int32(0), feed.at(0)))

        def one_round(c: Carry, xs: tuple) -> Carry:
            r, sliced = xs
            return self.iterations(c, r * micro, micro, feed.round(r, sliced))

        def drain(c: Carry, last: Any) -> Carry:
            return self.iterations(c, jnp.int32(repeats * micro), self.spec.tail_iterations, feed.drain(last))

        one_round, drain = feed.checkpointed(one_round), feed.checkpointed(drain)
        if self.spec.scan_repeats:
            step = lambda c, xs: (one_round(c, xs), None)  # noqa: E731
            carry = jax.lax.scan(step, carry, (jnp.arange(repeats), feed.per_round))[0]
        else:
            for r in range(repeats):
                carry = one_round(carry, (jnp.int32(r), feed.at(r)))
        return drain(carry, feed.last)


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
    global_layers: tuple[bool, ...] = (),
) -> tuple[jax.Array, Aux, nnx.State]:
    """Apply the stacked blocks (``params`` + ``rest``, leading axis ``axis_name``) to
    ``x [B, ...]`` by the schedule ``spec``; ``args`` are per-row arrays ``[B, ...]``
    (positions, segment ids, token ids) that travel with their microbatch, and so do the
    per-row ``dropout_keys`` (``parallel.row_keys``): the block at ``[repeat, stage, j]`` folds
    in its stack index ``(repeat * stages + stage) * lps + j``, as the unpipelined stack does.

    ``unroll``: each stage applies its ``layers_per_stage`` blocks in a Python loop (the
    unscanned stage body of ``scan_layers=false``) instead of a scan. ``global_layers``: the
    kinds of a stack of ``selected`` blocks (``parallel/layer_kind.py``), read per block.

    Returns the output ``[B, ...]``, the aux losses (mean over microbatches of their sum
    over blocks) and the new stacked non-trainable state."""
    inner = without_axis(rules, STAGE)
    with activate(mesh, inner), spmd_axes(STAGE):
        micro = Microbatches.split(x, args, dropout_keys, spec.microbatches)
        feed = stage_weights(params, spec, mesh, inner)
        state = to_stages(rest, spec, mesh, inner, drop_fsdp=False)
        run = _Run(
            spec,
            Schedule(spec),
            Placement(mesh, inner),
            micro,
            stage_step(graphdef, spec, remat, axis_name, unroll, global_layers),
        )
        carry = run.rounds(run.start(state, feed), feed)
        y = merge_microbatches(carry.buffer[0])
    aux = {name: value / spec.microbatches for name, value in carry.aux_sum.items()}
    return y, aux, from_stages(carry.state, spec.blocks)
