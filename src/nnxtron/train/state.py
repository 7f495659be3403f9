"""The sharded train state: created already sharded, never materialised on one device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnxtron.config.schema import Config
from nnxtron.decoder import Decoder
from nnxtron.parallel.sharding import state_shardings

TrainState = dict[str, Any]  # {"params": nnx.State, "rest": nnx.State, "opt_state": ..., "step": int32}


@dataclass
class ModelSetup:
    """What the step functions need: the static graph and the shardings of each piece."""

    graphdef: nnx.GraphDef
    mesh: Mesh
    state_shardings: TrainState
    abstract_state: TrainState


def abstract_model(cfg: Config) -> Decoder:
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(cfg.init_weights_seed)))


def _opt_shardings(opt_abstract: Any, param_shardings: nnx.State, replicated: NamedSharding) -> Any:
    """Param-shaped optimizer subtrees (Adam moments) take the parameter shardings."""

    def one(node):
        if isinstance(node, nnx.State):
            return param_shardings
        return replicated

    return jax.tree.map(one, opt_abstract, is_leaf=lambda x: isinstance(x, nnx.State))


def model_shardings(cfg: Config, mesh: Mesh) -> tuple[nnx.GraphDef, nnx.State, nnx.State, nnx.State, nnx.State]:
    """(graphdef, abstract params, abstract other state, their shardings) of the model."""
    graphdef, params, rest = nnx.split(abstract_model(cfg), nnx.Param, ...)
    rules = cfg.logical_axis_rules
    return graphdef, params, rest, state_shardings(params, mesh, rules), state_shardings(rest, mesh, rules)


def init_non_params(cfg: Config, rest_shardings: nnx.State) -> nnx.State:
    """Fresh values of the model's non-parameter state (parameters are not materialised)."""

    def init():
        with nnx.use_eager_sharding(False):
            return nnx.split(Decoder(cfg, nnx.Rngs(cfg.init_weights_seed)), nnx.Param, ...)[2]

    return jax.jit(init, out_shardings=rest_shardings)()


def setup(cfg: Config, mesh: Mesh, tx: optax.GradientTransformation) -> ModelSetup:
    """Trace the model abstractly and compute the shardings of the whole train state."""
    graphdef, params, rest, param_sh, rest_sh = model_shardings(cfg, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_abstract = jax.eval_shape(tx.init, params)
    shardings = {
        "params": param_sh,
        "rest": rest_sh,
        "opt_state": _opt_shardings(opt_abstract, param_sh, replicated),
        "step": replicated,
    }
    abstract_state = {"params": params, "rest": rest, "opt_state": opt_abstract, "step": jax.ShapeDtypeStruct((), jnp.int32)}
    return ModelSetup(graphdef, mesh, shardings, abstract_state)


def init_state(cfg: Config, model_setup: ModelSetup, tx: optax.GradientTransformation, params: nnx.State | None = None) -> TrainState:
    """Initialise the train state directly into its shardings (jit with out_shardings).

    ``params``: start from these parameter values (e.g. a converted HF checkpoint)
    instead of the seeded random init.
    """

    def init(loaded):
        with nnx.use_eager_sharding(False):
            model = Decoder(cfg, nnx.Rngs(cfg.init_weights_seed))
        _, fresh, rest = nnx.split(model, nnx.Param, ...)
        p = fresh if loaded is None else loaded
        return {"params": p, "rest": rest, "opt_state": tx.init(p), "step": jnp.zeros((), jnp.int32)}

    shardings = model_setup.state_shardings
    if params is None:
        return jax.jit(lambda: init(None), out_shardings=shardings)()
    return jax.jit(init, in_shardings=(shardings["params"],), out_shardings=shardings)(params)
