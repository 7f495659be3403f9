"""Jitted train and eval steps over split state, with explicit shardings and donation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnxtron.config.schema import Config
from nnxtron.data.packing import BATCH_KEYS
from nnxtron.parallel.sharding import activate, logical_to_spec
from nnxtron.train.loss import cross_entropy
from nnxtron.train.state import ModelSetup, TrainState

Batch = dict[str, jax.Array]


def batch_sharding(cfg: Config, model_setup: ModelSetup) -> dict[str, NamedSharding]:
    spec = logical_to_spec(("activation_batch", "activation_length"), cfg.logical_axis_rules, model_setup.mesh)
    sharding = NamedSharding(model_setup.mesh, spec)
    return {key: sharding for key in BATCH_KEYS}


def _forward_loss(graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State, batch: Batch):
    model = nnx.merge(graphdef, params, rest)
    out = model(batch["inputs"], batch["positions"], batch["segment_ids"])
    loss, tokens = cross_entropy(out.logits, batch["targets"], batch["loss_mask"])
    return loss, (tokens, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))))


def make_train_step(
    cfg: Config, model_setup: ModelSetup, tx: optax.GradientTransformation, schedule: optax.Schedule
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """``step(state, batch) -> (state, metrics)``; the input state is donated."""
    graphdef = model_setup.graphdef
    rules = cfg.logical_axis_rules

    def train_step(state: TrainState, batch: Batch):
        with activate(model_setup.mesh, rules):
            grad_fn = jax.value_and_grad(_forward_loss, argnums=1, has_aux=True)
            (loss, (tokens, rest)), grads = grad_fn(graphdef, state["params"], state["rest"], batch)
            updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
        metrics = {
            "loss": loss,
            "tokens": tokens,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": jnp.asarray(schedule(state["step"]), jnp.float32),
        }
        new_state = {"params": params, "rest": rest, "opt_state": opt_state, "step": state["step"] + 1}
        return new_state, metrics

    shardings = model_setup.state_shardings
    replicated = NamedSharding(model_setup.mesh, PartitionSpec())
    return jax.jit(
        train_step,
        in_shardings=(shardings, batch_sharding(cfg, model_setup)),
        out_shardings=(shardings, replicated),
        donate_argnums=(0,),
    )


def make_eval_step(cfg: Config, model_setup: ModelSetup) -> Callable[[TrainState, Batch], dict[str, jax.Array]]:
    """``eval(state, batch) -> {"loss_sum", "tokens"}`` (sum so that batches can be pooled)."""
    graphdef = model_setup.graphdef

    def eval_step(state: TrainState, batch: Batch):
        with activate(model_setup.mesh, cfg.logical_axis_rules):
            loss, (tokens, _) = _forward_loss(graphdef, state["params"], state["rest"], batch)
        return {"loss_sum": loss * tokens, "tokens": tokens}

    replicated = NamedSharding(model_setup.mesh, PartitionSpec())
    return jax.jit(
        eval_step,
        in_shardings=(model_setup.state_shardings, batch_sharding(cfg, model_setup)),
        out_shardings=replicated,
    )


def device_batch(host_batch: dict[str, Any], shardings: dict[str, NamedSharding]) -> Batch:
    """Place this process's rows of the global batch onto the mesh."""
    if jax.process_count() == 1:
        return {k: jax.device_put(host_batch[k], shardings[k]) for k in BATCH_KEYS}
    return {k: jax.make_array_from_process_local_data(shardings[k], host_batch[k]) for k in BATCH_KEYS}
