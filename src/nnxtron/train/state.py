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
from nnxtron.layers.lora import FROZEN
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
    frozen_shardings: dict | None = None  # LoRA: the frozen base parameters (not in the train state)
    abstract_frozen: dict | None = None

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


def split_model(model: nnx.Module, cfg: Config) -> tuple[nnx.GraphDef, nnx.State, nnx.State, nnx.State | None]:
    """(graphdef, trained parameters, other state, frozen base parameters or None): with
    ``lora_rank`` > 0 the trained parameters are the LoRA adapters and the base is frozen."""
    if not cfg.lora_rank:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return graphdef, params, rest, None
    graphdef, params, frozen, rest = nnx.split(model, nnx.LoRAParam, FROZEN, ...)
    return graphdef, params, rest, frozen


def model_shardings(cfg: Config, mesh: Mesh) -> tuple[nnx.GraphDef, dict, dict, dict, dict]:
    """(graphdef, abstract params, abstract other state, their shardings), as pure dicts.
    With LoRA the params are the adapters (``frozen_shardings``: the base)."""
    graphdef, params, rest, _ = split_model(abstract_model(cfg), cfg)
    rules = cfg.logical_axis_rules
    pure = nnx.to_pure_dict
    return (
        graphdef,
        pure(params),
        pure(rest),
        pure(state_shardings(params, mesh, rules)),
        pure(state_shardings(rest, mesh, rules)),
    )


def frozen_shardings(cfg: Config, mesh: Mesh) -> tuple[dict, dict]:
    """LoRA's frozen base: (abstract parameters, their shardings), as pure dicts."""
    frozen = split_model(abstract_model(cfg), cfg)[3]
    return nnx.to_pure_dict(frozen), nnx.to_pure_dict(state_shardings(frozen, mesh, cfg.logical_axis_rules))


def _fresh_state(cfg: Config) -> tuple[dict, dict, dict | None]:
    """(trained parameters, other state, LoRA's frozen base or None) of the seeded init."""
    with nnx.use_eager_sharding(False):
        _, params, rest, frozen = split_model(Decoder(cfg, nnx.Rngs(cfg.init_weights_seed)), cfg)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(rest), None if frozen is None else nnx.to_pure_dict(frozen)


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
    frozen, frozen_sh = frozen_shardings(cfg, mesh) if cfg.lora_rank else (None, None)
    # with LoRA the frozen base is the memory that matters: the adapters (rank x (in + out) per
    # layer against in x out) may stay replicated where their rank axis would have been split
    checked, checked_sh = (frozen, frozen_sh) if cfg.lora_rank else (params, param_sh)
    unsharded = check_unsharded(checked, checked_sh, mesh, cfg.sharding_tolerance)
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
    return ModelSetup(graphdef, mesh, storage, abstract_state, compute, unsharded, frozen_sh, frozen)


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
        fresh, fresh_rest, _ = _fresh_state(cfg)
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


def init_frozen(cfg: Config, shardings: dict, base: dict | None = None) -> dict:
    """LoRA's frozen base placed in its shardings: ``base`` (the parameters of the model
    without adapters, as loaded from init_from / load_parameters_path), else the seeded init."""
    if base is not None:
        return jax.device_put(base, shardings)
    return jax.jit(lambda: _fresh_state(cfg)[2], out_shardings=shardings)()
