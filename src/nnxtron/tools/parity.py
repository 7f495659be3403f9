"""Parity helpers used by the test suite (and usable for your own strategy checks).

Gradient parity (DESIGN.md): compare the loss, the input cotangent and every parameter
gradient with two bounds — an aggregate relative L2 bound over all leaves, and per leaf
``||g_a - g_b|| <= rel * ||g_b_leaf|| + abs_frac * ||g_b_total||`` (a relative-only bound
false-alarms on tiny leaves; an aggregate-only bound hides a wrong small leaf).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from nnxtron.config.pipeline import UNPIPELINED
from nnxtron.config.schema import Config
from nnxtron.config.stacks import layer_counts, layer_stacks
from nnxtron.parallel.microbatch import merge_microbatches
from nnxtron.parallel.row_keys import row_keys
from nnxtron.parallel.sharding import activate, logical_to_spec, state_shardings
from nnxtron.params import (
    convert_layers,
    flatten,
    flatten_with_treedef,
    layer_list_layout,
    rename_stacks,
    restack,
    unstack_layers,
)
from nnxtron.train.step import compute_gradients


@dataclass
class GradResult:
    loss: float  # token-mean cross-entropy (aux losses excluded)
    input_grad: np.ndarray  # d objective / d embedding output [B, S, D]
    param_grads: dict[str, np.ndarray]  # layer-list layout, independent of scan_layers
    aux: dict[str, float] = field(default_factory=dict)  # the model's aux losses (batch values)
    rest: dict[str, np.ndarray] = field(default_factory=dict)  # non-parameter state after the batch (layer-list layout)


class _ProbedEmbed(nnx.Module):
    """The model's token embedding plus ``probe``: a zero parameter added to the embedding
    output, so that its gradient is the input cotangent, taken from outside the train step.

    ``probe`` is ``[k, B / k, S, D]``: microbatch ``i`` of ``k`` (rows ``i, i + k, ...``, as
    ``split_microbatches`` forms them) adds ``probe[i]``; ``calls``, carried from one
    microbatch to the next like any non-parameter state, says which one runs.
    """

    def __init__(self, embed: nnx.Module, shape: tuple[int, ...], dtype: jnp.dtype, microbatches: int):
        batch, *rest = shape
        self.inner = embed
        self.probe = nnx.Param(jnp.zeros((microbatches, batch // microbatches, *rest), dtype))
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

    @property
    def embedding(self) -> nnx.Param:
        return self.inner.embedding

    def attend(self, x: jax.Array, *args: float) -> jax.Array:
        return self.inner.attend(x, *args)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.inner(tokens)
        delta = self.probe[...][self.calls[...] % self.probe.shape[0]]
        self.calls[...] = self.calls[...] + 1
        return x + delta.astype(x.dtype)


def _probed(model: nnx.Module, inputs: jax.Array, microbatches: int) -> nnx.Module:
    """A copy of ``model`` whose embedding carries a ``_ProbedEmbed`` probe (``model`` is untouched)."""
    copy = nnx.merge(*nnx.split(model))
    out = jax.eval_shape(copy.embed, inputs)
    copy.embed = _ProbedEmbed(copy.embed, out.shape, out.dtype, microbatches)
    return copy


def _unprobed(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The probed model's leaves under the plain model's names, without the probe's own."""
    return {
        key.replace("embed/inner/", "embed/"): value for key, value in flat.items() if key not in ("embed/probe", "embed/calls")
    }


def loss_and_grads(
    model: nnx.Module,
    batch: dict[str, jax.Array],
    mesh: Mesh | None = None,
    accumulation_steps: int = 1,
    dropout_step: int | None = None,
) -> GradResult:
    """Loss, input cotangent and parameter gradients of the training objective (jitted).

    Computed by the train step's own ``compute_gradients``: the objective is token-mean
    cross-entropy plus the model's aux losses, the parameter gradients are exactly those
    the optimizer receives (including the embedding lookup), and the input cotangent is
    d objective / d (embedding output), the gradient of a zero probe added to it
    (``_ProbedEmbed``). ``accumulation_steps`` = k > 1 runs the batch as k microbatches
    (rows i, i+k, ... form microbatch i); the input cotangent is then the per-microbatch
    cotangents put back in row order, scaled like the k = 1 one.

    With ``mesh``, parameters are placed by the config's logical rules and activations
    are constrained as in training, so the result checks the sharded computation.

    ``dropout_step``: train with the config's dropout, drawing the masks of that step
    (the per-row keys the train step makes, ``parallel.row_keys``).
    """
    cfg = model.config
    graphdef, params, rest = nnx.split(_probed(model, batch["inputs"], accumulation_steps), nnx.Param, ...)
    num_layers = layer_counts(cfg)
    rules = cfg.logical_axis_rules
    grad_shardings = None
    if mesh is not None:
        param_shardings = state_shardings(params, mesh, rules)
        params = jax.device_put(params, param_shardings)
        rest = jax.device_put(rest, state_shardings(rest, mesh, rules))
        grad_shardings = nnx.to_pure_dict(param_shardings)
        batch_spec = NamedSharding(mesh, logical_to_spec(("activation_batch", "activation_length"), rules, mesh))
        batch = {k: jax.device_put(v, batch_spec) for k, v in batch.items()}
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

    @jax.jit
    def run(params, rest, batch):
        if dropout_step is not None:
            batch = {**batch, "dropout_keys": row_keys(cfg.init_weights_seed, jnp.int32(dropout_step), batch["inputs"].shape[0])}
        with activate(mesh, rules) if mesh is not None else contextlib.nullcontext():
            g = compute_gradients(graphdef, params, rest, batch, accumulation_steps, grad_shardings=grad_shardings)
        return g.loss, g.grads, g.aux, g.rest

    loss, g_params, aux, new_rest = run(params, rest, batch)
    g_input = merge_microbatches(g_params["embed"]["probe"])
    grads = _unprobed({k: np.asarray(v) for k, v in layer_list_layout(g_params, num_layers).items()})
    new_rest = _unprobed({k: np.asarray(v) for k, v in layer_list_layout(new_rest, num_layers).items()})
    return GradResult(float(loss), np.asarray(g_input), grads, {k: float(v) for k, v in aux.items()}, new_rest)


def with_tail_stack_merged(result: GradResult, first_block: int) -> GradResult:
    """``result`` with a partial pipeline's tail stack (``unpipelined_layers/layers/i``) named as
    the blocks ``first_block + i`` of the unsplit stack (``layers/layers/...``), to compare with
    the sequential model."""
    moves = {UNPIPELINED: ("layers", first_block)}
    return GradResult(
        result.loss, result.input_grad, rename_stacks(result.param_grads, moves), result.aux, rename_stacks(result.rest, moves)
    )


def with_layers_of(result: GradResult, source: Config, target: Config) -> GradResult:
    """``result`` (of a model of ``source``) with its layers named as a model of ``target`` names
    them (``params.restack``): a pipeline's one-layer blocks whose kind is data compared with
    the sequential model's cycles."""
    stacks = layer_stacks(source), layer_stacks(target)
    return GradResult(
        result.loss, result.input_grad, restack(result.param_grads, *stacks), result.aux, restack(result.rest, *stacks)
    )


def copy_weights(source: nnx.Module, target: nnx.Module) -> None:
    """Set every variable of the decoder ``target`` to ``source``'s value for the same model
    layer (their configs may lay the layers out differently: ``params.restack``)."""
    src, dst = source.config, target.config
    flat = restack(unstack_layers(flatten(nnx.state(source)), layer_counts(src)), layer_stacks(src), layer_stacks(dst))
    if dst.stacked_layers:
        flat = convert_layers(flat, layer_counts(dst), scanned=True, stack=jnp.stack)
    pure, treedef = flatten_with_treedef(nnx.to_pure_dict(nnx.state(target)))
    if flat.keys() != pure.keys():
        raise ValueError(
            f"copy_weights: missing {sorted(pure.keys() - flat.keys())[:3]}, extra {sorted(flat.keys() - pure.keys())[:3]}"
        )
    for key, value in pure.items():
        if flat[key].shape != value.shape:
            raise ValueError(f"copy_weights: {key} has shape {flat[key].shape}, the target {value.shape}")
    nnx.update(target, nnx.State(jax.tree_util.tree_unflatten(treedef, [jnp.asarray(flat[key]) for key in pure])))


def _norm(x: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(x, np.float64).ravel()))


LARGE_LEAF = 0.01  # grad_differences: a leaf holding this share of the total gradient norm is "large"


def _leaf_errors(a: GradResult, b: GradResult) -> tuple[float, dict[str, float]]:
    """The reference ``b``'s total gradient norm and each leaf's ``||g_a - g_b||``."""
    total = float(np.sqrt(sum(_norm(g) ** 2 for g in b.param_grads.values())))
    return total, {key: _norm(a.param_grads[key] - g) for key, g in b.param_grads.items()}


def _loss_error(a: GradResult, b: GradResult) -> float:
    """The worst relative error of the loss and the aux losses."""
    pairs = [(a.loss, b.loss), *((a.aux[k], v) for k, v in b.aux.items())]
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in pairs)


def _input_error(a: GradResult, b: GradResult) -> float:
    return _norm(a.input_grad - b.input_grad) / max(_norm(b.input_grad), 1e-30)


def _aggregate_error(total: float, errors: dict[str, float]) -> float:
    return float(np.sqrt(sum(e**2 for e in errors.values()))) / max(total, 1e-30)


def grad_differences(a: GradResult, b: GradResult) -> dict[str, float]:
    """How far ``a`` is from the reference ``b``, without bounds (to measure bounds from): relative
    loss and aux-loss error, input-cotangent and aggregate gradient relative L2 errors, the worst
    ``||g_a - g_b|| / ||g_b||`` among the leaves holding at least ``LARGE_LEAF`` of the total
    gradient norm (``leaf_rel``: what the per-leaf bound's ``rel`` must cover) and the worst
    leaf's error as a fraction of the total norm (``leaf_of_total``: ``abs_frac``, which covers
    the small leaves)."""
    total, errors = _leaf_errors(a, b)
    return {
        "loss": _loss_error(a, b),
        "input": _input_error(a, b),
        "aggregate": _aggregate_error(total, errors),
        "leaf_rel": max(
            (errors[key] / _norm(g) for key, g in b.param_grads.items() if _norm(g) >= LARGE_LEAF * total), default=0.0
        ),
        "leaf_of_total": max(errors.values()) / max(total, 1e-30),
    }


def assert_grad_parity(
    a: GradResult,
    b: GradResult,
    *,
    loss_rtol: float,
    rel: float,
    abs_frac: float,
    aggregate_rel: float,
) -> dict[str, float]:
    """Assert a ~= b (b is the reference); returns the measured worst ratios."""
    assert set(a.param_grads) == set(b.param_grads), (
        f"gradient trees differ: only in a {sorted(set(a.param_grads) - set(b.param_grads))}, "
        f"only in b {sorted(set(b.param_grads) - set(a.param_grads))}"
    )
    loss_err = abs(a.loss - b.loss) / max(abs(b.loss), 1e-12)
    assert loss_err <= loss_rtol, f"loss {a.loss} vs {b.loss}: rel err {loss_err:.3e} > {loss_rtol}"
    assert set(a.aux) == set(b.aux), f"aux losses differ: {sorted(a.aux)} vs {sorted(b.aux)}"
    assert set(a.rest) == set(b.rest), f"non-parameter state differs: {sorted(a.rest)} vs {sorted(b.rest)}"
    for key, value in b.rest.items():  # e.g. MoE expert-load counts: carried, never dropped
        np.testing.assert_allclose(a.rest[key], value, rtol=loss_rtol, atol=0, err_msg=f"non-parameter state {key}")
    for name, value in b.aux.items():
        aux_err = abs(a.aux[name] - value) / max(abs(value), 1e-12)
        assert aux_err <= loss_rtol, f"aux loss {name} {a.aux[name]} vs {value}: rel err {aux_err:.3e} > {loss_rtol}"
    for key, gb in b.param_grads.items():
        assert a.param_grads[key].shape == gb.shape, f"{key}: shape {a.param_grads[key].shape} vs {gb.shape}"

    in_err = _input_error(a, b)
    assert in_err <= aggregate_rel, f"input cotangent rel err {in_err:.3e} > {aggregate_rel}"
    total, errors = _leaf_errors(a, b)
    agg_err = _aggregate_error(total, errors)
    assert agg_err <= aggregate_rel, f"aggregate gradient rel err {agg_err:.3e} > {aggregate_rel}"

    worst = 0.0
    for key, gb in b.param_grads.items():
        bound = rel * _norm(gb) + abs_frac * total
        err = errors[key]
        assert err <= bound, f"{key}: ||ga-gb||={err:.3e} > bound {bound:.3e} (||gb||={_norm(gb):.3e})"
        worst = max(worst, err / max(bound, 1e-30))
    return {"loss": _loss_error(a, b), "input": in_err, "aggregate": agg_err, "worst_leaf_fraction_of_bound": worst}


def max_abs_diff(a, b) -> float:
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))
