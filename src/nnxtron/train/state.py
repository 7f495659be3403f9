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

from nnxtron.config.pipeline import pipeline_spec
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

    def params_on_device(self, tree: Any) -> Any:
        """Inside the step: a parameter-shaped tree (parameters, gradients) in device memory.

        Only the pipelined stack under per-stage offload stays in host memory through the
        forward and backward pass (``parallel.pipeline`` moves a repeat's weights at a time);
        the optimizer update runs on device memory like every other offload."""
        if self.compute_shardings is None:
            return tree
        return host_to_device(tree, self.device_param_shardings())

    def device_param_shardings(self) -> Any:
        """Where the parameters (and their gradients) are in device memory."""
        if self.compute_shardings is None:
            return self.state_shardings["params"]
        return _with_memory_kind(self.compute_shardings["params"], "device")

    def to_storage(self, state: TrainState) -> TrainState:
        """Inside the step: send the offloaded parts of the new state back to host memory."""
        if self.compute_shardings is None:
            return state
        return {key: jax.device_put(value, self.state_shardings[key]) for key, value in state.items()}


def host_to_device(tree: Any, shardings: Any) -> Any:
    """Inside a step: the leaves of ``tree`` held in host memory moved to ``shardings`` (device
    memory); the others are returned as they are, so the program without host leaves is unchanged."""

    def one(value: jax.Array, sharding: NamedSharding) -> jax.Array:
        on_host = jax.typeof(value).memory_space == jax.memory.Space.Host
        return jax.device_put(value, sharding) if on_host else value

    return jax.tree.map(one, tree, shardings)


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
    pipeline = pipeline_spec(cfg)
    if pipeline is not None and pipeline.host_weights:  # per-stage offload: the pipeline moves them
        stack = pipeline.stack
        compute["params"] = {**compute["params"], stack: storage["params"][stack]}
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
    """An optimizer leaf that mirrors a parameter (Adam moments, Lion/SGD/Muon momenta, also
    inside ``optax.partition``'s masked states) — its key path ends with the parameter's path
    and it has its shape — takes the parameter's sharding; the rest (step counts, Adafactor's
    factored row/column statistics) are replicated."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params_abstract)
    params = {tuple(path): (leaf.shape, sh) for (path, leaf), sh in zip(flat, jax.tree.leaves(param_shardings), strict=True)}
    depths = sorted({len(path) for path in params})

    def one(path: tuple, leaf: Any) -> NamedSharding:
        for depth in depths:
            shape, sharding = params.get(tuple(path[-depth:]), (None, None))
            if shape == leaf.shape:
                return sharding
        return replicated

    return jax.tree_util.tree_map_with_path(one, opt_abstract)


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


def init_state(
    cfg: Config,
    model_setup: ModelSetup,
    tx: optax.GradientTransformation | None,
    params: dict | None = None,
    rest: dict | None = None,
) -> TrainState:
    """Initialise the train state directly into its shardings (jit with out_shardings).

    ``params`` / ``rest``: start from these parameter values / this model state (router
    biases, hash tables: ``train/weights.py``) instead of the seeded random init.
    ``tx=None``: only ``{"params", "rest"}`` (no optimizer state is made).
    """
    shardings = model_setup.state_shardings
    outputs = ("params", "rest") if tx is None else tuple(shardings)

    def init(loaded, loaded_rest):
        fresh, fresh_rest = _fresh_state(cfg)
        p = fresh if loaded is None else loaded
        r = fresh_rest if loaded_rest is None else loaded_rest
        if tx is None:
            return {"params": p, "rest": r}
        return {"params": p, "rest": r, "opt_state": tx.init(p), "step": jnp.zeros((), jnp.int32)}

    given = {"params": params, "rest": rest}
    inputs = {key: value for key, value in given.items() if value is not None}
    jitted = jax.jit(
        lambda loaded: init(loaded.get("params"), loaded.get("rest")),
        in_shardings=({key: shardings[key] for key in inputs},),
        out_shardings={key: shardings[key] for key in outputs},
    )
    return jitted(inputs)
