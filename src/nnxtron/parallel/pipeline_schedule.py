"""The pipeline schedule, one iteration at a time: what each stage holds and where activations go.

Notation (``config.pipeline``): ``S`` stages, ``M`` microbatches, ``R`` repeats, ``d`` = 2 with
delayed activation forwarding, else 1; arrays indexed by stage have a leading ``[S]`` axis.

* **Slots.** At iteration ``t`` stage ``s`` holds item ``i = t - d * s``: microbatch
  ``i mod M`` on repeat ``i // M``, or a bubble when ``i`` is outside ``[0, M * R)``.
  GPipe (``R = 1``): stage ``s`` works on microbatch ``t - d * s`` for ``t`` in
  ``[d * s, d * s + M)``. Circular: after microbatch ``M - 1`` of repeat ``r`` a stage goes on
  with microbatch 0 of repeat ``r + 1``.
* **Inputs.** Stage 0 reads its microbatch from the buffer ``[M, mb, ...]`` (the input on
  repeat 0, the last stage's output of the previous repeat after that); stage ``s > 0``
  takes the shift, what stage ``s - 1`` passed on.
* **Passing on.** Outputs move one stage on (a roll along the stage axis: a collective
  permute). Without delay the shift read at ``t + 1`` is the outputs of ``t``; with delay
  it is those of ``t - 1``, so a hop takes ``d`` iterations and stage ``s + 1`` gets item
  ``i`` at ``t + d``, as the slots say.
* **Collecting.** The last stage finishes item ``t - d * (S - 1)`` at iteration ``t``; its
  output, which the roll brings to stage 0, is written at once into the buffer at that
  item's microbatch. Stage 0 reads it back ``M`` items later, on the next repeat, which is
  after the write because ``M >= d * (S - 1) + 1`` (``config.pipeline`` checks it).
* **State.** Each stage's new non-trainable state is written back for the repeat it ran,
  only when its slot was real: bubbles never mutate state. Aux losses are summed over the
  real slots.

The buffer is held once per stage (``[S, M, mb, ...]``, on that stage's devices) and only
stage 0's copy is read meaningfully (the others take the same updates and are discarded):
a buffer shared by the stages would need the last stage's output sent to every stage (an
all-reduce) and its index every iteration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnxtron.config.pipeline import PipelineSpec
from nnxtron.parallel.scan import Aux
from nnxtron.parallel.sharding import Rules, logical_to_spec

STAGE = "stage"


class Slots(NamedTuple):
    """What each stage holds at one iteration, ``[S]`` each."""

    micro_ids: jax.Array  # its microbatch (0 in a bubble before the first item)
    repeat_ids: jax.Array  # the repeat it runs
    valid: jax.Array  # a real item, not a bubble


class Schedule:
    """The index arithmetic of ``spec``'s schedule (see the module docstring)."""

    def __init__(self, spec: PipelineSpec):
        self.spec = spec
        self.stage_ids = jnp.arange(spec.stages)
        self.items = spec.microbatches * spec.repeats  # (microbatch, repeat) pairs a stage works on

    def slots(self, t: jax.Array) -> Slots:
        """Stage ``s`` at iteration ``t``: item ``i = t - d * s``, microbatch ``i mod M`` on
        repeat ``i // M``, valid when ``0 <= i < M * R`` (bubbles are clipped to a real item)."""
        micro = self.spec.microbatches
        item = t - self.spec.delay * self.stage_ids
        valid = (item >= 0) & (item < self.items)
        item = jnp.clip(item, 0, self.items - 1)
        return Slots(item % micro, item // micro, valid)

    def finished(self, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(microbatch ids [S], real)``: the microbatch of the item ``t - d * (S - 1)`` the last
        stage finishes at ``t`` (the same id for every stage's copy of the buffer: a function of
        ``t`` alone, so no stage reads another stage's ids), and whether that item is real."""
        last = t - self.spec.delay * (self.spec.stages - 1)
        last_micro = jnp.clip(last, 0, self.items - 1) % self.spec.microbatches
        return jnp.full((self.spec.stages,), last_micro), (last >= 0) & (last < self.items)

    def first_blocks(self, repeat_ids: jax.Array) -> jax.Array:
        """Each stage's first block in the stack on its repeat ``r``: ``(r * S + s) * lps``."""
        stages, lps, stage_ids = self.spec.stages, self.spec.layers_per_stage, self.stage_ids
        return ((repeat_ids * stages + stage_ids) * lps).astype(jnp.int32)

    def is_first_stage(self, ndim: int) -> jax.Array:
        """``[S, 1, ...]`` (rank ``ndim``): True on stage 0."""
        return (self.stage_ids == 0).reshape(self.spec.stages, *(1,) * (ndim - 1))


class Placement:
    """Sharding constraints of the per-stage arrays: the stage axis, then the batch rules."""

    def __init__(self, mesh: Mesh, rules: Rules):
        self.mesh, self.rules = mesh, rules
        self._batch = tuple(logical_to_spec(("activation_batch", "activation_length"), rules, mesh))

    def stages(self, h: jax.Array) -> jax.Array:
        """``[S, microbatch rows, length, ...]``: activations, one microbatch per stage."""
        spec = PartitionSpec(STAGE, *self._batch[: h.ndim - 1], *(None,) * max(h.ndim - 3, 0))
        return jax.lax.with_sharding_constraint(h, NamedSharding(self.mesh, spec))

    def buffer(self, b: jax.Array) -> jax.Array:
        """``[S, M, microbatch rows, length, ...]``: each stage's copy of the microbatch buffer."""
        spec = PartitionSpec(STAGE, None, *self._batch[: b.ndim - 2], *(None,) * max(b.ndim - 4, 0))
        return jax.lax.with_sharding_constraint(b, NamedSharding(self.mesh, spec))


def read_buffer(buffer: jax.Array, micro_ids: jax.Array) -> jax.Array:
    """``buffer [S, M, ...]`` at ``micro_ids [S]``: each stage's copy read at its own index."""
    return jax.vmap(lambda b, m: jax.lax.dynamic_index_in_dim(b, m, 0, keepdims=False))(buffer, micro_ids)


def stage_activations(buffer: jax.Array, shift: jax.Array, slots: Slots, schedule: Schedule) -> jax.Array:
    """The activations each stage runs on: stage 0 its microbatch from the buffer, every other
    stage the shift (what the previous stage passed on)."""
    first = read_buffer(buffer, slots.micro_ids)  # every stage reads its own copy (only stage 0's is kept)
    return jnp.where(schedule.is_first_stage(shift.ndim), first, shift)


def pass_on(
    y: jax.Array, previous: jax.Array, delay: int, place: Callable[[jax.Array], jax.Array]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(shift, arrived, previous)`` after the stages produced ``y [S, ...]``.

    ``shift``: what each stage takes next iteration, the outputs rolled one stage on (the last
    stage's to stage 0, where it is unused); with delay (``d`` = 2) the outputs of the iteration
    before, ``previous``, move instead and ``y`` becomes the new ``previous``. ``arrived``: ``y``
    rolled one stage on at once, whose stage-0 entry is the last stage's finished output."""
    sent = y if delay == 1 else previous  # delayed forwarding: last iteration's outputs move on
    shift = place(jnp.roll(sent, 1, axis=0))
    arrived = shift if delay == 1 else place(jnp.roll(y, 1, axis=0))
    return shift, arrived, y if delay > 1 else previous


def collect(
    buffer: jax.Array, arrived: jax.Array, t: jax.Array, schedule: Schedule, keep: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """Write the last stage's output of iteration ``t`` (``arrived``, rolled to stage 0) into the
    buffer at its microbatch, when it finished a real item (``Schedule.finished``)."""
    last_ids, real = schedule.finished(t)
    done = read_buffer(buffer, last_ids)
    put = jax.vmap(lambda b, v, m: jax.lax.dynamic_update_index_in_dim(b, v, m, 0))
    return keep(put(buffer, jnp.where(real, arrived, done), last_ids))


def write_back(state: nnx.State, repeat_ids: jax.Array, new: nnx.State, valid: jax.Array) -> nnx.State:
    """Store each stage's new non-trainable state (``new``, ``[S, lps, ...]``) for its repeat in
    ``state`` (``[R, S, lps, ...]``), where the stage was not in a bubble."""
    old_leaves, treedef = jax.tree.flatten(state)
    new_leaves = jax.tree.leaves(new)
    if len(old_leaves) != len(new_leaves):
        raise ValueError("a pipeline stage changed the structure of its non-trainable state")

    def one(ws: jax.Array, r: jax.Array, n: jax.Array, v: jax.Array) -> jax.Array:
        return ws.at[r].set(jnp.where(v, n.astype(ws.dtype), ws[r]))

    put = jax.vmap(one, in_axes=(1, 0, 0, 0), out_axes=1)
    return jax.tree.unflatten(treedef, [put(w, repeat_ids, n, valid) for w, n in zip(old_leaves, new_leaves, strict=True)])


def add_valid(aux_sum: Aux, aux: Aux, valid: jax.Array) -> Aux:
    """``aux_sum`` plus each aux loss ``[S]`` summed over the stages with a real slot."""
    return {name: aux_sum[name] + jnp.sum(jnp.where(valid, value, 0.0)) for name, value in aux.items()}
