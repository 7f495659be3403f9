"""The sharded train state: created already sharded, never materialised on one device.

The state crossing the ``jax.jit`` boundary is made of plain dicts of arrays
(``nnx.to_pure_dict``): flattening them costs a few microseconds per call, against
hundreds for ``nnx.State`` trees of Variables. The static model structure (and each
parameter's sharding annotation) lives in the graphdef and in ``ModelSetup``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.models.build import abstract_model
from nnxtron.models.decoder import Decoder
from nnxtron.models.quant import check_backend
from nnxtron.parallel.remat import RematSpec, check_offload_supported, host_memory_available
from nnxtron.parallel.sharding import check_unsharded, state_shardings

TrainState = dict[str, Any]  # {"params": dict, "rest": dict, "opt_state": optax state over dicts, "step": int32}


HOST_MEMORY = "pinned_host"


@dataclass
class ModelSetup:
    """What the step functions need: the static graph and the shardings of each piece.

    ``state_shardings`` say where the state lives between steps (host memory for the
    parts named by parameter/optimizer_memory_host_offload); ``compute_shardings`` say
    where the step computes on them (device memory).
    """

    graphdef: nnx.GraphDef
    mesh: Mesh
    state_shardings: TrainState
    abstract_state: TrainState
    compute_shardings: TrainState | None = None
    unsharded_fraction: float = 0.0  # parameter elements split over no model axis (checked against sharding_tolerance)

    def to_compute(self, state: TrainState) -> TrainState:
        """Inside the step: bring host-offloaded parts of the state into device memory."""
        if self.compute_shardings is None:
            return state
        return {key: jax.device_put(value, self.compute_shardings[key]) for key, value in state.items()}

    def to_storage(self, state: TrainState) -> TrainState:
        """Inside the step: send the offloaded parts of the new state back to host memory."""
        if self.compute_shardings is None:
            return state
        return {key: jax.device_put(value, self.state_shardings[key]) for key, value in state.items()}


def _with_memory_kind(shardings: Any, kind: str) -> Any:
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


def _host_offload(cfg: Config, shardings: TrainState) -> tuple[TrainState, TrainState | None]:
    """(storage shardings, compute shardings) for parameter/optimizer host offload."""
    parts = [
        k for k, flag in (("params", cfg.parameter_memory_host_offload), ("opt_state", cfg.optimizer_memory_host_offload)) if flag
    ]
    if not parts:
        return shardings, None
    if not host_memory_available():
        device = jax.devices()[0]
        flag = "parameter_memory_host_offload" if "params" in parts else "optimizer_memory_host_offload"
        raise ConfigError(f"{flag}=true needs '{HOST_MEMORY}' memory, which the {device.platform} backend lacks; set it to false")
    compute = {k: _with_memory_kind(v, "device") for k, v in shardings.items()}
    storage = {k: _with_memory_kind(v, HOST_MEMORY) if k in parts else compute[k] for k, v in shardings.items()}
    return storage, compute


def model_shardings(cfg: Config, mesh: Mesh) -> tuple[nnx.GraphDef, dict, dict, dict, dict]:
    """(graphdef, abstract params, abstract other state, their shardings), as pure dicts."""
    graphdef, params, rest = nnx.split(abstract_model(cfg), nnx.Param, ...)
    rules = cfg.logical_axis_rules
    pure = nnx.to_pure_dict
    return (
        graphdef,
        pure(params),
        pure(rest),
        pure(state_shardings(params, mesh, rules)),
        pure(state_shardings(rest, mesh, rules)),
    )


def _fresh_state(cfg: Config) -> tuple[dict, dict]:
    with nnx.use_eager_sharding(False):
        _, params, rest = nnx.split(Decoder(cfg, nnx.Rngs(cfg.init_weights_seed)), nnx.Param, ...)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def init_non_params(cfg: Config, rest_shardings: dict) -> dict:
    """Fresh values of the model's non-parameter state (parameters are not materialised)."""
    return jax.jit(lambda: _fresh_state(cfg)[1], out_shardings=rest_shardings)()


def _opt_shardings(opt_abstract: Any, params_abstract: dict, param_shardings: dict, replicated: NamedSharding) -> Any:
    """Param-shaped optimizer subtrees (Adam moments) take the parameter shardings."""
    param_structure = jax.tree.structure(params_abstract)

    def is_param_shaped(node: Any) -> bool:
        return isinstance(node, dict) and jax.tree.structure(node) == param_structure

    return jax.tree.map(
        lambda node: param_shardings if is_param_shaped(node) else replicated, opt_abstract, is_leaf=is_param_shaped
    )


def setup(cfg: Config, mesh: Mesh, tx: optax.GradientTransformation) -> ModelSetup:
    """Trace the model abstractly and compute the shardings of the whole train state."""
    check_offload_supported(RematSpec.from_config(cfg))
    if cfg.use_qwix_quantization:
        check_backend(cfg)
    graphdef, params, rest, param_sh, rest_sh = model_shardings(cfg, mesh)
    unsharded = check_unsharded(params, param_sh, mesh, cfg.sharding_tolerance)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_abstract = jax.eval_shape(tx.init, params)
    shardings = {
        "params": param_sh,
        "rest": rest_sh,
        "opt_state": _opt_shardings(opt_abstract, params, param_sh, replicated),
        "step": replicated,
    }
    abstract_state = {"params": params, "rest": rest, "opt_state": opt_abstract, "step": jax.ShapeDtypeStruct((), jnp.int32)}
    storage, compute = _host_offload(cfg, shardings)
    return ModelSetup(graphdef, mesh, storage, abstract_state, compute, unsharded)


def init_state(cfg: Config, model_setup: ModelSetup, tx: optax.GradientTransformation, params: dict | None = None) -> TrainState:
    """Initialise the train state directly into its shardings (jit with out_shardings).

    ``params``: start from these parameter values (e.g. a converted HF checkpoint)
    instead of the seeded random init.
    """

    def init(loaded):
        fresh, rest = _fresh_state(cfg)
        p = fresh if loaded is None else loaded
        return {"params": p, "rest": rest, "opt_state": tx.init(p), "step": jnp.zeros((), jnp.int32)}

    shardings = model_setup.state_shardings
    if params is None:
        return jax.jit(lambda: init(None), out_shardings=shardings)()
    return jax.jit(init, in_shardings=(shardings["params"],), out_shardings=shardings)(params)
