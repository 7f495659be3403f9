"""Quantized training with qwix: which matmuls, in which types, and the one quantized model.

``use_qwix_quantization=true quantization=<mode>`` quantizes the *weight matmuls* of the
modules whose path matches ``qwix_module_path`` and not ``qwix_exclude_module_path``
(defaults: every decoder layer and the MTP depths; never the embedding, the output head
or the MoE router). A weight matmul is a ``dot_general`` / ``einsum`` with one operand a
parameter of the calling module, or an MoE grouped matmul (``ragged_dot``); products of
two activations (attention scores, attention-weighted values, the DeepSeek-V4 indexer)
stay in the compute dtype.

======== =================== ===================
mode     forward (w, x)      backward (gradients)
======== =================== ===================
int8     int8                int8
fp8      float8_e4m3fn       float8_e4m3fn       (MaxText's name for fp8_e4m3)
fp8_e4m3 float8_e4m3fn       float8_e4m3fn
fp8_e5m2 float8_e5m2         float8_e5m2
fp8_full float8_e4m3fn       float8_e5m2
======== =================== ===================

Scales are dynamic (computed from each tensor on every call, per channel, or per tile of
``quantization_tile_size`` along the contraction axis); the calibration methods are
qwix's (``absmax``, ``absmax,<clip>``, ``minmax``, ``rms,<scale>``, ``fixed,<lo>,<hi>``).

Quantization is structural: ``quantize`` returns the same model (same parameters, same
non-parameter state, same sharding annotations) whose class runs ``__call__`` under
qwix's interception. The interception is set up once per config by a quantization
pass that traces the real forward (with targets, so multi-token prediction runs) and
backward abstractly; the pass never touches the values of the model it is given.
"""

from __future__ import annotations

import collections
import functools
import itertools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from nnxtron.config.options import QUANTIZATION_MODES
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.layers.lora import ADAPTERS
from nnxtron.models.decoder import Decoder
from nnxtron.runtime.private_api import qwix_find_param, qwix_module_path

MODES: dict[str, tuple[Any, Any]] = {  # mode -> (forward qtype, backward qtype)
    mode: (getattr(jnp, forward), getattr(jnp, backward)) for mode, (forward, backward) in QUANTIZATION_MODES.items()
}
_PASSES = itertools.count()
QUANTIZED_METHOD = "__call__"


class WeightMatmulProvider(qwix.QtProvider):
    """qwix's quantized-training provider, restricted to weight matmuls.

    ``quantized`` records, per module path, the ops it quantized while tracing (the
    quantization pass fills it; ``nnxtron plan`` and the tests read it).
    """

    def __init__(self, rules):
        super().__init__(rules)
        self.quantized: dict[str, collections.Counter] | None = collections.defaultdict(collections.Counter)

    def _record(self, op: str) -> None:
        if self.quantized is None:  # recording is over (the quantization pass is done)
            return
        rule, _ = self._get_current_rule_and_op_id(op, only_rule=True)
        if rule is not None and rule.weight_qtype is not None:
            self.quantized["/".join(map(str, qwix_module_path()))][op] += 1

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, out_sharding=None):
        if not _one_weight(lhs, rhs):  # activation x activation: not quantized
            return jax.lax.dot_general(
                lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding=out_sharding
            )  # fmt: skip
        self._record("dot_general")
        return super().dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding=out_sharding)

    def einsum(self, einsum_str, *operands, **kwargs):
        if len(operands) != 2 or not _one_weight(*operands):
            return jnp.einsum(einsum_str, *operands, **kwargs)
        self._record("einsum")
        return super().einsum(einsum_str, *operands, **kwargs)

    def ragged_dot(self, lhs, rhs, group_sizes, *args, **kwargs):
        self._record("ragged_dot")  # MoE grouped matmul: rhs is always the expert weights
        return super().ragged_dot(lhs, rhs, group_sizes, *args, **kwargs)


def _one_weight(lhs, rhs) -> bool:
    """One operand is a weight of the calling module and the other is not. LoRA's adapter
    products (``layers/lora.py``) stay in the compute dtype: a quantized base is frozen, its
    float adapters are what trains (QLoRA)."""
    names = (qwix_find_param(lhs), qwix_find_param(rhs))
    return (names[0] is not None) != (names[1] is not None) and not set(names) & set(ADAPTERS)


def _tile(size: int) -> int | None:
    return size or None


def rules(cfg: Config) -> list[qwix.QtRule]:
    """The qwix rules of ``cfg``: first the exclusions (no qtype: left alone), then the quantized modules."""
    forward, backward = MODES[cfg.quantization]
    quantized = qwix.QtRule(
        module_path=cfg.qwix_module_path,
        op_names=("dot_general", "einsum", "ragged_dot"),
        weight_qtype=forward,
        act_qtype=forward,
        bwd_qtype=backward,
        tile_size=_tile(cfg.quantization_tile_size),
        bwd_weight_grad_tile_size=_tile(cfg.quantization_bwd_tile_size),
        weight_calibration_method=cfg.weight_quantization_calibration_method,
        act_calibration_method=cfg.act_quantization_calibration_method,
        bwd_calibration_method=cfg.bwd_quantization_calibration_method,
    )
    return [qwix.QtRule(module_path=cfg.qwix_exclude_module_path), quantized]


@dataclass(frozen=True)
class Quantized:
    """The quantized model structure of one config and what the quantization pass found."""

    graphdef: nnx.GraphDef
    ops: dict[str, dict[str, int]]  # module path -> {op name: calls traced in the forward}

    def report(self) -> list[str]:
        """``<module path>: <op> xN`` per quantized module, in path order."""
        return [f"{path}: " + ", ".join(f"{op} x{n}" for op, n in sorted(ops.items())) for path, ops in sorted(self.ops.items())]


def _example_call(cfg: Config) -> tuple[tuple, dict]:
    """Inputs of a real forward: one row of ``max_target_length`` tokens, with targets (MTP needs them)."""
    tokens = jnp.zeros((1, cfg.max_target_length), jnp.int32)
    return (tokens,), dict(targets=tokens, loss_mask=jnp.ones(tokens.shape, jnp.float32))


def _describe(cfg: Config) -> str:
    return f"use_qwix_quantization=true quantization={cfg.quantization} qwix_module_path={cfg.qwix_module_path!r}"


@functools.cache
def quantized_structure(cfg: Config) -> Quantized:
    """Run the quantization pass once per config (abstractly): qwix returns a new model
    whose class intercepts ``__call__``; its backward is traced too, so a rule the
    backward cannot apply fails here, at setup, not in the first step."""
    provider = WeightMatmulProvider(rules(cfg))
    pass_id = f"{cfg.quantization}#{next(_PASSES)}"
    found: dict[str, dict[str, int]] = {}

    def quantization_pass():
        model = Decoder(cfg, nnx.Rngs(0))
        args, kwargs = _example_call(cfg)
        # a mark unique to this pass on every module: JAX caches the traces of scan and
        # remat bodies by the layers' graphdef, and a trace made under another config's
        # interception (or none) must never be reused for this one
        for _, module in nnx.iter_modules(model):
            module.quantization_pass = pass_id
        quantized = qwix.quantize_model(model, provider, *args, methods=(QUANTIZED_METHOD,), **kwargs)
        found.update({path: dict(counts) for path, counts in provider.quantized.items()})
        provider.quantized = None  # one forward recorded; the backward below only checks the rules apply
        graphdef, params, rest = nnx.split(quantized, nnx.Param, ...)
        params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

        def objective(params, rest):
            out = nnx.merge(graphdef, params, rest)(*args, **kwargs)
            return jnp.sum(out.logits) + sum(jnp.sum(v) for v in out.aux.get("losses", {}).values())

        jax.grad(objective)(params, rest)
        return quantized

    try:
        with nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(quantization_pass)
    except (ValueError, NotImplementedError, AssertionError, TypeError) as err:
        raise ConfigError(f"{_describe(cfg)}: qwix cannot quantize this model ({err}); check the quantization options") from None
    if not found:
        raise ConfigError(
            f"{_describe(cfg)} quantizes no matmul of {cfg.model_name}: the module path matches no decoder "
            "layer (or qwix_exclude_module_path excludes them all); fix the regex"
        )
    return Quantized(nnx.graphdef(abstract), found)


def quantize(model: nnx.Module) -> nnx.Module:
    """``model`` (a Decoder whose config quantizes) with quantized matmuls: the same state
    (parameters, non-parameter state, sharding annotations), the quantized structure."""
    return nnx.merge(quantized_structure(model.config).graphdef, nnx.state(model))


def summary(cfg: Config) -> str:
    """One line for logs and ``nnxtron plan``: the mode, its types and what it quantizes."""
    forward, backward = (jnp.dtype(t).name for t in MODES[cfg.quantization])
    ops = quantized_structure(cfg).ops
    calls = sum(sum(counts.values()) for counts in ops.values())
    return (
        f"quantization {cfg.quantization}: {forward} forward, {backward} backward; {calls} weight matmuls per "
        f"forward in {len(ops)} modules matching {cfg.qwix_module_path!r} (excluded: {cfg.qwix_exclude_module_path!r}, "
        "embedding, output head, activation x activation products)"
    )


def check_backend(cfg: Config) -> None:
    """One quantized matmul, forward and backward, on the default backend: a mode this
    backend cannot compile or run fails here with one line, not inside the first step."""
    if not cfg.use_qwix_quantization:
        return
    _probe(cfg.quantization, jax.default_backend())


@functools.cache
def _probe(mode: str, backend: str) -> None:
    forward, backward = MODES[mode]

    class Probe(nnx.Module):
        def __init__(self):
            self.kernel = nnx.Param(jnp.linspace(-1.0, 1.0, 32 * 16, dtype=jnp.float32).reshape(32, 16))

        def __call__(self, x):
            return jax.lax.dot_general(x, self.kernel[...], (((1,), (0,)), ((), ())))

    rule = qwix.QtRule(module_path=".*", weight_qtype=forward, act_qtype=forward, bwd_qtype=backward)
    x = jnp.linspace(-2.0, 2.0, 8 * 32, dtype=jnp.float32).reshape(8, 32)
    try:
        model = qwix.quantize_model(Probe(), qwix.QtProvider([rule]), x)
        graphdef, params = nnx.split(model)
        grads = jax.jit(jax.grad(lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x) ** 2), argnums=(0, 1)))(params, x)
        jax.block_until_ready(grads)
    except Exception as err:  # noqa: BLE001 - any backend failure becomes one clear line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"quantization={mode}: the {backend} backend cannot run {jnp.dtype(forward).name}/{jnp.dtype(backward).name} "
            f"matmuls ({first}); choose another quantization mode or set use_qwix_quantization=false"
        ) from None
