"""Pipeline stage weights: where they live and how each stage reads those of its repeat.

The stack's ``[P, ...]`` variables are viewed as ``[R, S, lps, ...]`` (block
``(r * S + s) * lps + j`` at ``[r, s, j]``) with the ``stage`` mesh axis on ``S``. At an
iteration stage ``s`` needs its ``[lps, ...]`` slice of the repeat it runs
(``pipeline_schedule.Slots``). The schedule's one loop asks a ``WeightFeed`` for the weights of
each round (the ``M`` iterations from ``r * M``, when stage 0 runs repeat ``r``) and of the
drain (the last ``d * (S - 1)`` iterations); the feed says where the weights come from:

* ``DeviceWeights``: all repeats on device for the whole schedule, loop-invariant; each
  stage reads its repeat by index (GPipe: repeat 0, statically);
* ``HostWeights`` (per-stage offload, ``parameter_memory_host_offload`` with ``R > 1``): the
  weights stay in host memory; round ``r`` moves repeat ``r`` to the device and repeat
  ``r - 1``, which stage ``s`` is still on for its first ``d * s`` iterations of the round
  (``M > d * (S - 1)``, so no stage is further behind); each stage picks one of the pair.
  The backward pass fetches them again rather than keeping every repeat's device copy as
  a residual: a round saves only its iterations' inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnxtron.config.pipeline import PipelineSpec
from nnxtron.parallel.pipeline_schedule import STAGE
from nnxtron.parallel.remat import OFFLOAD_DST
from nnxtron.parallel.sharding import Rules, logical_to_spec, variable_names

# per-stage offload: a repeat's weights fetched from host memory, and what a round keeps for its backward pass
STAGE_WEIGHTS = "pipeline_stage_weights"
ITERATION_INPUTS = "pipeline_iteration_inputs"

Weights = nnx.State | tuple[nnx.State, nnx.State]  # all repeats, or a (previous repeat, current repeat) pair


def _is_variable(node: Any) -> bool:
    return isinstance(node, nnx.Variable)


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


def to_stages(
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


def from_stages(state: nnx.State, blocks: int) -> nnx.State:
    """[repeats, stages, lps, ...] -> the stack's [P, ...]."""
    return jax.tree.map(lambda v: v.reshape(blocks, *v.shape[3:]), state)


def device_mover(params: nnx.State, mesh: Mesh, rules: Rules, drop_fsdp: bool, repeat_axis: bool) -> Callable:
    """A function moving staged weights (``[repeats, stages, lps, ...]``, or one repeat's
    ``[stages, lps, ...]`` without ``repeat_axis``) of the stack ``params`` into device memory."""
    specs = jax.tree.map(lambda v: _weight_spec(v, mesh, rules, drop_fsdp, repeat_axis=repeat_axis), params, is_leaf=_is_variable)

    def move(staged: nnx.State) -> nnx.State:
        return jax.tree.map(lambda v, sh: v.replace(jax.device_put(v.get_value(), sh)), staged, specs, is_leaf=_is_variable)

    return move


def for_stages(state: nnx.State, repeat_ids: jax.Array | None) -> nnx.State:
    """Each stage's [lps, ...] slice of its current repeat: [stages, lps, ...].

    ``repeat_ids`` None (one repeat, GPipe) takes repeat 0 statically: a slice of a
    loop-invariant input stays loop-invariant, so autodiff does not keep a copy of the
    stage weights for every iteration."""
    if repeat_ids is None:
        return jax.tree.map(lambda w: w[0], state)
    return jax.tree.map(lambda w: jax.vmap(lambda ws, r: ws[r], in_axes=(1, 0))(w, repeat_ids), state)


def pick(weights: Weights, choice: jax.Array | None) -> nnx.State:
    """Each stage's ``[lps, ...]`` weights for this iteration: ``for_stages`` by repeat id, or, for
    per-stage offload, from a pair (previous repeat, current repeat) on device by ``choice``
    (per stage: True = current)."""
    if not isinstance(weights, tuple):
        return for_stages(weights, choice)
    previous, current = weights
    one = jax.vmap(lambda p, c, use: jnp.where(use, c, p))
    return jax.tree.map(lambda p, c: one(p, c, choice), previous, current)


class RoundWeights(NamedTuple):
    """The stage weights the iterations of one round read."""

    weights: Weights
    current: jax.Array | None  # per-stage offload: the round's repeat (the pair is repeat current - 1, current)

    def choice(self, repeat_ids: jax.Array, by_repeat: jax.Array | None) -> jax.Array | None:
        """How ``pick`` finds each stage's weights: ``by_repeat`` (its repeat id, None for GPipe)
        on device; under offload, whether the stage runs the current repeat (else the previous)."""
        return by_repeat if self.current is None else repeat_ids == self.current

    def saved_inputs(self, tree: Any) -> Any:
        """Under offload, ``tree`` (an iteration's inputs) named as what a round's backward pass
        keeps (``HostWeights.checkpointed``); on device, ``tree`` as it is."""
        if self.current is None:
            return tree
        return jax.tree.map(lambda v: checkpoint_name(v, ITERATION_INPUTS), tree)


class WeightFeed(Protocol):
    """Where the schedule's loop gets each round's weights (see the module docstring).

    ``per_round``: a tree with a leading ``[R]`` axis the repeat scan slices (None: nothing);
    ``at(r)`` is its slice ``r`` for the unrolled loop; ``round(r, per_round[r])`` the weights
    of round ``r``; ``drain(last)`` those of the drain; ``checkpointed`` wraps a round;
    ``same_every_round``: every round and the drain read the same weights."""

    per_round: Any
    last: Any
    same_every_round: bool

    def at(self, r: int) -> Any: ...
    def round(self, r: jax.Array, sliced: Any) -> RoundWeights: ...
    def drain(self, last: Any) -> RoundWeights: ...
    def checkpointed(self, fn: Callable) -> Callable: ...


class DeviceWeights:
    """All repeats ``[R, S, lps, ...]`` on device, the same for every round."""

    per_round = None
    last = None
    same_every_round = True

    def __init__(self, staged: nnx.State):
        self.staged = staged

    def at(self, r: int) -> None:
        return None

    def round(self, r: jax.Array, sliced: None) -> RoundWeights:
        return RoundWeights(self.staged, None)

    def drain(self, last: None) -> RoundWeights:
        return RoundWeights(self.staged, None)

    def checkpointed(self, fn: Callable) -> Callable:
        return fn


class HostWeights:
    """Per-stage offload: ``[R, S, lps, ...]`` in host memory; round ``r`` fetches the pair
    (repeat ``r - 1``, repeat ``r``) with ``fetch``, the drain repeat ``R - 1``."""

    same_every_round = False

    def __init__(self, staged: nnx.State, fetch: Callable[[nnx.State], nnx.State], repeats: int):
        self.fetch, self.repeats = fetch, repeats
        previous = jax.tree.map(lambda w: jnp.roll(w, 1, axis=0), staged)  # [r] = repeat r - 1 (host)
        self.per_round = (staged, previous)
        self.last = jax.tree.map(lambda w: w[repeats - 1], staged)

    def at(self, r: int) -> tuple[nnx.State, nnx.State]:
        return jax.tree.map(lambda w: w[r], self.per_round)

    def round(self, r: jax.Array, sliced: tuple[nnx.State, nnx.State]) -> RoundWeights:
        current, previous = sliced
        return RoundWeights((self.fetch(previous), self.fetch(current)), r)

    def drain(self, last: nnx.State) -> RoundWeights:
        weights = self.fetch(last)
        return RoundWeights((weights, weights), jnp.int32(self.repeats - 1))

    def checkpointed(self, fn: Callable) -> Callable:
        """``fn`` (a round) rematerialized from its iterations' inputs: the backward pass fetches
        the round's weights again instead of keeping them as residuals."""
        refetch = jax.checkpoint_policies.save_only_these_names(ITERATION_INPUTS)
        return jax.checkpoint(fn, policy=refetch, prevent_cse=False)


def stage_weights(params: nnx.State, spec: PipelineSpec, mesh: Mesh, rules: Rules) -> WeightFeed:
    """The stack's parameters ``[P, ...]`` staged, and the feed that brings them to the stages."""
    host = spec.host_weights  # per-stage offload: the weights stay in host memory until their repeat
    staged = to_stages(
        params, spec, mesh, rules, drop_fsdp=spec.fsdp_ag_once and not host, memory_kind=OFFLOAD_DST if host else None
    )
    if not host:
        return DeviceWeights(staged)
    if spec.repeats == 1:  # GPipe: every stage uses its weights in every iteration
        return DeviceWeights(device_mover(params, mesh, rules, spec.fsdp_ag_once, repeat_axis=True)(staged))
    to_device = device_mover(params, mesh, rules, spec.fsdp_ag_once, repeat_axis=False)
    return HostWeights(staged, lambda w: checkpoint_name(to_device(w), STAGE_WEIGHTS), spec.repeats)
