"""Jitted train and eval steps over split state, with explicit shardings and donation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnxtron.config.schema import Config
from nnxtron.data.packing import BATCH_KEYS
from nnxtron.layers.dropout import dropout_active
from nnxtron.layers.moe import update_router_bias
from nnxtron.models.loss import cross_entropy_sum
from nnxtron.parallel.microbatch import split_microbatches
from nnxtron.parallel.row_keys import row_keys
from nnxtron.parallel.sharding import activate, constrain, logical_to_spec
from nnxtron.params import flatten_with_treedef
from nnxtron.train.dpo import DPOSettings, dpo_sums, sequence_logprobs
from nnxtron.train.state import ModelSetup, TrainState, host_to_device

Batch = dict[str, jax.Array]


def batch_sharding(cfg: Config, model_setup: ModelSetup) -> dict[str, NamedSharding]:
    spec = logical_to_spec(("activation_batch", "activation_length"), cfg.logical_axis_rules, model_setup.mesh)
    sharding = NamedSharding(model_setup.mesh, spec)
    return {key: sharding for key in BATCH_KEYS}


# --------------------------------------------------------------------------- gradients
#
# The objective of one batch is   J = CE_token_mean + sum_name aux_losses[name]
# where a model may return ``DecoderOutput.aux["losses"] = {name: scalar}``: already
# weighted auxiliary losses, each a mean over the tokens of the rows it saw (e.g. MoE
# load balancing, MTP). With gradient accumulation (k microbatches) the batch objective
# is the same large-batch quantity:
#
#     J = ( sum_i loss_sum_i  +  sum_i tokens_i * aux_i ) / T,     T = sum_i tokens_i
#
# i.e. every microbatch's aux loss is weighted by its token share tokens_i / T, exactly
# like its cross-entropy tokens, so k = 1 and k > 1 agree when the aux losses are token
# means over the loss-mask tokens. (If the whole batch has no target token, T is clamped
# to 1 as in ``cross_entropy`` and each microbatch's aux loss gets weight 1/k.)
# With ``use_dpo`` the same holds with DPO's loss summed over pairs in place of the
# cross-entropy sum and pairs in place of tokens (T = the batch's pairs).


class Gradients(NamedTuple):
    """What ``compute_gradients`` returns for one (global) batch."""

    loss: jax.Array  # the batch loss (float32 scalar; aux losses excluded): token-mean cross-entropy, or DPO's pair mean
    tokens: jax.Array  # number of target tokens counted (sum of loss_mask)
    grads: Any  # d J / d params, same tree and dtypes as params (J includes the aux losses)
    rest: Any  # the model's non-parameter state after the batch (carried through the microbatches)
    aux: dict[str, jax.Array]  # each aux loss as a batch value (token-share weighted over microbatches)
    stats: dict[str, jax.Array]  # the objective's own statistics as batch means (DPO: rewards, accuracy)


class Reference(NamedTuple):
    """DPO's frozen reference model: the parameters and model state the run started from
    (with LoRA: the starting adapters, on the same frozen base)."""

    params: Any
    rest: Any


class Extras(NamedTuple):
    """What the steps take beside the state and the batch, the same for the whole run
    (``step_extras``): LoRA's frozen base parameters and DPO's reference model."""

    frozen: Any = None
    reference: Reference | None = None


NO_EXTRAS = Extras()


def _aux_losses(out: Any) -> dict[str, jax.Array]:
    aux = getattr(out, "aux", None) or {}
    return {name: jnp.asarray(value, jnp.float32) for name, value in dict(aux.get("losses", {})).items()}


def _apply(graphdef: nnx.GraphDef, params: Any, rest: Any, batch: Batch, frozen: Any = None):
    """Run the model on ``batch`` (``frozen``: LoRA's base parameters). Returns (output, new
    non-parameter state)."""
    model = nnx.merge(graphdef, params, rest) if frozen is None else nnx.merge(graphdef, params, frozen, rest)
    extra = (batch.get("positions"), batch.get("segment_ids"), batch.get("targets"), batch.get("loss_mask"))
    keys = batch.get("dropout_keys")  # per-row dropout keys: training with dropout only
    out = model(batch["inputs"], *extra) if keys is None else model(batch["inputs"], *extra, dropout_keys=keys)
    return out, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))


def _constrain_tree(tree: Any, shardings: Any | None) -> Any:
    return tree if shardings is None else jax.lax.with_sharding_constraint(tree, shardings)


class _Objective:
    """The loss of a batch's output in "sum" units: ``(loss sum, count, target tokens, statistic sums)``;
    the batch loss is ``loss sum / count`` (count: target tokens for cross-entropy, pairs for DPO)."""

    def __init__(self, graphdef: nnx.GraphDef, reference: Reference | None, dpo: DPOSettings | None, frozen: Any = None) -> None:
        if (reference is None) != (dpo is None):
            raise ValueError("DPO needs both its settings and the reference model")
        self.graphdef, self.reference, self.dpo, self.frozen = graphdef, reference, dpo, frozen

    def count(self, batch: Batch) -> jax.Array:
        """The count of a whole batch (the divisor of the accumulated sums)."""
        if self.dpo is not None:
            return jnp.float32(batch["inputs"].shape[0] // 2)
        mask = batch.get("loss_mask")
        return jnp.float32(batch["targets"].size) if mask is None else jnp.sum(mask.astype(jnp.float32))

    def __call__(self, out: Any, batch: Batch) -> tuple[jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
        mask = batch.get("loss_mask")
        if self.dpo is None:
            loss_sum, tokens = cross_entropy_sum(out.logits, batch["targets"], mask)
            return loss_sum, tokens, tokens, {}
        plain = {key: value for key, value in batch.items() if key != "dropout_keys"}  # the reference drops nothing
        reference_out, _ = _apply(self.graphdef, self.reference.params, self.reference.rest, plain, self.frozen)
        policy = sequence_logprobs(out.logits, batch["targets"], mask)
        loss_sum, pairs, stats = dpo_sums(policy, sequence_logprobs(reference_out.logits, batch["targets"], mask), self.dpo)
        return loss_sum, pairs, jnp.sum(mask.astype(jnp.float32)), stats


def compute_gradients(
    graphdef: nnx.GraphDef,
    params: Any,
    rest: Any,
    batch: Batch,
    accumulation_steps: int = 1,
    *,
    grad_shardings: Any | None = None,
    reference: Reference | None = None,
    dpo: DPOSettings | None = None,
    frozen: Any = None,
) -> Gradients:
    """Loss, token count, gradients, new non-parameter state and aux losses of one batch.

    ``accumulation_steps`` = k > 1 splits the batch into k microbatches
    (``split_microbatches``) and runs them one after the other under ``jax.lax.scan``,
    accumulating the loss sum, the count (target tokens), the gradient of the summed
    objective (in float32) and the count-weighted aux losses, and carrying the model's
    non-parameter state from one microbatch to the next; everything is divided by the
    total count at the end, so the result is the large-batch mean step, not
    a mean of per-microbatch means. k = 1 differentiates the whole batch directly.

    With ``dpo`` (and its frozen ``reference``) the loss is DPO's (``train.dpo``): the
    count is the pairs, and each microbatch runs the reference model on its rows too.
    ``frozen``: LoRA's base parameters (``params`` are then the adapters, the only gradients).

    ``grad_shardings``: shardings of the parameters (a tree like ``params``), applied to
    the gradient accumulator. Call inside ``parallel.sharding.activate`` to shard
    activations (and the microbatches) by the logical rules.
    """
    k = int(accumulation_steps)
    if k < 1:
        raise ValueError(f"accumulation_steps must be >= 1, got {k}")
    terms = _Objective(graphdef, reference, dpo, frozen)
    if k == 1:

        def objective(params):
            out, new_rest = _apply(graphdef, params, rest, batch, frozen)
            loss_sum, count, tokens, stats = terms(out, batch)
            norm = jnp.maximum(count, 1.0)
            loss = loss_sum / norm
            aux = _aux_losses(out)
            total = loss + sum(aux.values()) if aux else loss
            return total, (loss, tokens, new_rest, aux, {name: value / norm for name, value in stats.items()})

        (_, (loss, tokens, new_rest, aux, stats)), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return Gradients(loss, tokens, grads, new_rest, aux, stats)

    micro = split_microbatches(batch, k)
    total_count = terms.count(batch)
    norm = jnp.maximum(total_count, 1.0)

    def objective(params, rest, mb):
        out, new_rest = _apply(graphdef, params, rest, mb, frozen)
        loss_sum, count, tokens, stats = terms(out, mb)
        # aux weight in "sum" units: count_i (/ total at the end = the count share), or 1/k if the total is 0
        weight = jnp.where(total_count > 0, count, 1.0 / k)
        aux = {name: weight * value for name, value in _aux_losses(out).items()}
        total = loss_sum + sum(aux.values()) if aux else loss_sum
        return total, (loss_sum, tokens, new_rest, aux, stats)

    grad_fn = jax.value_and_grad(objective, has_aux=True)
    mb_spec = jax.eval_shape(lambda b: jax.tree.map(lambda x: x[0], b), micro)
    aux_names, stat_names = jax.eval_shape(
        lambda p, r, b: (lambda out: (_aux_losses(out), terms(out, b)[3]))(_apply(graphdef, p, r, b, frozen)[0]),
        params,
        rest,
        mb_spec,
    )

    def body(carry, mb):
        acc, loss_sum, tokens, aux_sum, stat_sum, rest = carry
        mb = {key: constrain(v, ("activation_batch", "activation_length")[: v.ndim]) for key, v in mb.items()}
        (_, (mb_loss, mb_tokens, rest, mb_aux, mb_stats)), grads = grad_fn(params, rest, mb)
        if grad_shardings is not None:  # per-stage offload: host gradients join the accumulator
            grads = host_to_device(grads, grad_shardings)
        acc = _constrain_tree(jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads), grad_shardings)
        aux_sum = {name: aux_sum[name] + mb_aux[name] for name in aux_sum}
        stat_sum = {name: stat_sum[name] + mb_stats[name] for name in stat_sum}
        return (acc, loss_sum + mb_loss, tokens + mb_tokens, aux_sum, stat_sum, rest), None

    zeros = _constrain_tree(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), grad_shardings)
    scalar = jnp.zeros((), jnp.float32)
    init = (zeros, scalar, scalar, {name: scalar for name in aux_names}, {name: scalar for name in stat_names}, rest)
    (acc, loss_sum, tokens, aux_sum, stat_sum, new_rest), _ = jax.lax.scan(body, init, micro)
    # the barrier makes XLA write the divided gradients once (into the accumulator) rather than
    # fuse the division into each reader (the norms, the clip), which on CPU materialises the
    # broadcast divisor as a parameter-sized tree (docs/plan.md, "Train-step memory")
    grads = jax.lax.optimization_barrier(jax.tree.map(lambda a, p: (a / norm).astype(p.dtype), acc, params))
    aux = {name: value / norm for name, value in aux_sum.items()}
    stats = {name: value / norm for name, value in stat_sum.items()}
    return Gradients(loss_sum / norm, tokens, grads, new_rest, aux, stats)


def make_train_step(
    cfg: Config, model_setup: ModelSetup, tx: optax.GradientTransformation, schedule: optax.Schedule
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """``step(state, batch) -> (state, metrics)``; the input state is donated.

    With ``gradient_accumulation_steps`` = k > 1 the batch is processed as k microbatches
    (``compute_gradients``); the update is the same as for the whole batch at once.
    Metrics: ``loss`` (token-mean cross-entropy), ``tokens``, ``grad_norm``,
    ``learning_rate``, ``aux/<name>`` for each auxiliary loss the model returns, and the
    non-finite guard: ``skipped`` (1 when the loss, a gradient or the updated state — the
    parameters, optimizer and model state after the update — holds a NaN/Inf),
    ``non_finite_leaf`` (the flatten-order index of the first parameter whose gradient is
    not finite, else -1) and ``non_finite_state`` (1 when the gradients were finite but the
    update made the state non-finite, e.g. an overflowing learning rate). With
    ``non_finite_policy=skip`` such a step keeps the previous parameters, optimizer and
    model state (only ``step`` advances).

    With ``routed_bias_update_rate`` > 0 the MoE routers' correction biases are updated
    after the gradient (loss-free balancing) from the expert load the step counted.

    With dropout (``enable_dropout`` and ``dropout_rate`` > 0) each row of the global batch
    gets its PRNG key from (``init_weights_seed``, step, row) (``parallel.row_keys``),
    carried in the batch as ``dropout_keys`` with its row through the microbatches.
    """
    graphdef = model_setup.graphdef
    rules = cfg.logical_axis_rules
    accumulation = cfg.gradient_accumulation_steps
    # the accumulator lives in device memory (also under host offload)
    param_shardings = model_setup.device_param_shardings() if accumulation > 1 else None

    drop = dropout_active(cfg.dropout_rate, cfg.enable_dropout) or dropout_active(cfg.lora_dropout, cfg.enable_dropout)
    dpo = dpo_settings(cfg)

    def train_step(state: TrainState, batch: Batch, extras: Extras = NO_EXTRAS):
        state = model_setup.to_compute(state)
        if drop:
            batch = {**batch, "dropout_keys": row_keys(cfg.init_weights_seed, state["step"], batch["inputs"].shape[0])}
        with activate(model_setup.mesh, rules):
            g = compute_gradients(
                graphdef, state["params"], state["rest"], batch, accumulation, grad_shardings=param_shardings,
                reference=extras.reference, dpo=dpo, frozen=extras.frozen,
            )  # fmt: skip
            # per-stage offload leaves the pipelined stack (and its gradient) in host memory until here
            g = g._replace(grads=model_setup.params_on_device(g.grads))
            state = {**state, "params": model_setup.params_on_device(state["params"])}
            updates, opt_state = tx.update(g.grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            rest = update_router_bias(g.rest, cfg.routed_bias_update_rate) if cfg.routed_bias_update_rate > 0 else g.rest
        squares = jnp.stack([jnp.sum(jnp.square(v.astype(jnp.float32))) for v in flatten_with_treedef(g.grads)[0].values()])
        gradients_finite = jnp.isfinite(g.loss) & jnp.all(jnp.isfinite(squares))
        state_finite = _all_finite({"params": params, "rest": rest, "opt_state": opt_state})
        finite = gradients_finite & state_finite
        metrics = {
            "loss": g.loss,
            "tokens": g.tokens,
            "grad_norm": jnp.sqrt(jnp.sum(squares)),
            "learning_rate": jnp.asarray(schedule(state["step"]), jnp.float32),
            **{f"aux/{name}": value for name, value in g.aux.items()},
            **g.stats,
            # the first parameter (in flatten order) whose gradient is not finite, or -1
            "non_finite_leaf": jnp.where(gradients_finite, -1, jnp.argmax(~jnp.isfinite(squares))).astype(jnp.int32),
            "non_finite_state": (gradients_finite & ~state_finite).astype(jnp.float32),
        }
        new_state = {"params": params, "rest": rest, "opt_state": opt_state, "step": state["step"] + 1}
        if cfg.non_finite_policy == "skip":  # keep the old weights, optimizer and model state; the data moves on
            old = {k: state[k] for k in ("params", "rest", "opt_state")}
            kept = jax.tree.map(lambda new, prev: jnp.where(finite, new, prev), {k: new_state[k] for k in old}, old)
            new_state = {**kept, "step": new_state["step"]}
        metrics["skipped"] = (~finite).astype(jnp.float32)
        return model_setup.to_storage(new_state), metrics

    shardings = model_setup.state_shardings
    replicated = NamedSharding(model_setup.mesh, PartitionSpec())
    inputs = (shardings, batch_sharding(cfg, model_setup)) + extras_shardings(cfg, model_setup)
    return jax.jit(train_step, in_shardings=inputs, out_shardings=(shardings, replicated), donate_argnums=(0,))


def extras_shardings(cfg: Config, model_setup: ModelSetup) -> tuple[Extras, ...]:
    """The shardings of the steps' extra argument: ``(Extras(...),)``, or ``()`` when the run
    has no frozen base (``lora_rank`` = 0) and no reference (``use_dpo=false``)."""
    if not (cfg.lora_rank or cfg.use_dpo):
        return ()
    return (Extras(model_setup.frozen_shardings, reference_shardings(model_setup) if cfg.use_dpo else None),)


def dpo_settings(cfg: Config) -> DPOSettings | None:
    """The DPO loss of a ``use_dpo`` config (None: cross-entropy). With it the train and eval
    steps' third argument (``Extras``) holds the frozen :class:`Reference`."""
    if not cfg.use_dpo:
        return None
    return DPOSettings(cfg.dpo_beta, cfg.dpo_label_smoothing, jax.process_count())


def reference_shardings(model_setup: ModelSetup) -> Reference:
    """Where DPO's reference model lives: like the parameters (in device memory) and model state."""
    return Reference(model_setup.device_param_shardings(), model_setup.state_shardings["rest"])


def reference_from(state: TrainState, model_setup: ModelSetup) -> Reference:
    """A copy of ``state``'s parameters and model state, as DPO's reference (the step donates the state)."""
    copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=reference_shardings(model_setup))
    return copy(Reference(state["params"], state["rest"]))


def abstract_extras(cfg: Config, model_setup: ModelSetup) -> tuple[Extras, ...]:
    """The steps' extra argument as shapes, dtypes and shardings (``extras_shardings``), for
    tracing the steps ahead of time."""
    abstract = model_setup.abstract_state
    values = Extras(model_setup.abstract_frozen, Reference(abstract["params"], abstract["rest"]) if cfg.use_dpo else None)
    return tuple(
        jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), values, shardings)
        for shardings in extras_shardings(cfg, model_setup)
    )


def _all_finite(tree: Any) -> jax.Array:
    """Whether every floating-point leaf of ``tree`` is free of NaN/Inf.

    Each leaf is summed in float32 (a NaN or an Inf anywhere makes the sum non-finite): one
    vectorised read of the leaf, where ``all(isfinite(leaf))`` writes a boolean copy and reduces
    it (4-5x the time on CPU). A leaf whose sum overflows float32 counts as non-finite, as the
    gradient check's sum of squares already does.
    """
    leaves = [leaf for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    sums = [jnp.sum(leaf, dtype=jnp.float32) for leaf in leaves]
    return jnp.all(jnp.isfinite(jnp.stack(sums))) if sums else jnp.bool_(True)


def make_eval_step(cfg: Config, model_setup: ModelSetup) -> Callable[[TrainState, Batch], dict[str, jax.Array]]:
    """``eval(state, batch) -> {"loss_sum", "tokens"}`` (sums so that batches can be pooled; with
    ``use_dpo`` ``eval(state, batch, Extras(..., reference))``, the DPO loss and statistics summed over pairs,
    ``tokens`` = pairs);
    with ``mtp_eval_target_module`` > 0 also ``mtp_accepted`` and ``mtp_predictions``: how
    many of that MTP depth's predictions equal the main head's (the acceptance rate)."""
    graphdef = model_setup.graphdef
    dpo = dpo_settings(cfg)

    def eval_step(state: TrainState, batch: Batch, extras: Extras = NO_EXTRAS):
        state = model_setup.to_compute(state)
        with activate(model_setup.mesh, cfg.logical_axis_rules):
            out, _ = _apply(graphdef, state["params"], state["rest"], batch, extras.frozen)
            loss_sum, count, _, stats = _Objective(graphdef, extras.reference, dpo, extras.frozen)(out, batch)
        result = {"loss_sum": loss_sum, "tokens": count, **stats}
        if cfg.mtp_eval_target_module:
            result["mtp_accepted"], result["mtp_predictions"] = out.aux["mtp_acceptance"]
        return result

    replicated = NamedSharding(model_setup.mesh, PartitionSpec())
    inputs = (model_setup.state_shardings, batch_sharding(cfg, model_setup))
    return jax.jit(eval_step, in_shardings=inputs + extras_shardings(cfg, model_setup), out_shardings=replicated)


def device_batch(host_batch: dict[str, Any], shardings: dict[str, NamedSharding]) -> Batch:
    """Place this process's rows of the global batch onto the mesh."""
    if jax.process_count() == 1:
        return {k: jax.device_put(host_batch[k], shardings[k]) for k in BATCH_KEYS}
    return {k: jax.make_array_from_process_local_data(shardings[k], host_batch[k]) for k in BATCH_KEYS}
