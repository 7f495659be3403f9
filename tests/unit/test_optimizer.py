"""Optimizer and schedules: schedule values against their formulas, each optimizer's update
against optax or a hand formula, every optimizer key read, the decay mask, clipping, Muon on
stacked and >2-D kernels, and a short training run per optimizer."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from nnxtron.config import derive, options
from nnxtron.errors import ConfigError
from nnxtron.models.build import abstract_model
from nnxtron.parallel.mesh import make_mesh
from nnxtron.params import flatten
from nnxtron.train.optimizer import decay_mask, make_optimizer, muon_dimension_tree
from nnxtron.train.schedules import learning_rate_schedule
from nnxtron.train.state import init_state, setup
from nnxtron.train.step import batch_sharding, device_batch, make_train_step
from tests.conftest import random_batch, tiny_config

SMALL = dict(base_num_decoder_layers=2, vocab_size=64)  # optimizer tests: a small parameter tree


def _schedule(**values):
    cfg = tiny_config("llama2-tiny", **values)
    return learning_rate_schedule(cfg, derive(cfg, 8))


def test_schedule_warmup_then_cosine_to_final_fraction():
    schedule = _schedule(steps=100, learning_rate=1e-3, warmup_steps_fraction=0.1, cosine_learning_rate_final_fraction=0.1)
    np.testing.assert_allclose([schedule(0), schedule(5), schedule(10)], [0.0, 5e-4, 1e-3], rtol=1e-6)
    np.testing.assert_allclose(schedule(55), 1e-4 + 0.5 * (1e-3 - 1e-4), rtol=1e-5)  # cosine midpoint
    np.testing.assert_allclose(schedule(100), 1e-4, rtol=1e-5)


@pytest.mark.parametrize("warmup", [0.0, 0.05, 0.3])
def test_default_cosine_is_bit_identical_to_the_schedule_before_lr_schedule_type(warmup):
    """The schedule every run had before ``lr_schedule_type`` existed, written out again."""
    cfg = tiny_config("llama2-tiny", steps=60, learning_rate=3e-3, warmup_steps_fraction=warmup)
    derived = derive(cfg, 8)
    decay = max(derived.schedule_steps - derived.warmup_steps, 1)
    before = optax.cosine_decay_schedule(cfg.learning_rate, decay, alpha=cfg.cosine_learning_rate_final_fraction)
    if derived.warmup_steps:
        ramp = optax.linear_schedule(0.0, cfg.learning_rate, derived.warmup_steps)
        before = optax.join_schedules([ramp, before], [derived.warmup_steps])
    steps = jnp.arange(70)
    np.testing.assert_array_equal(jax.vmap(learning_rate_schedule(cfg, derived))(steps), jax.vmap(before)(steps))


def _closed_form(kind: str, t: int, lr=2e-3, total=100, warmup=10, final=0.2, decay=20, style="linear") -> float:
    """The docs/optimizers.md formulas; t = updates done so far."""
    if t < warmup:
        return lr * t / warmup
    if kind == "constant":
        return lr
    if kind == "wsd":
        if t < total - decay:
            return lr
        p = min((t - (total - decay)) / decay, 1.0)
    else:
        p = min((t - warmup) / (total - warmup), 1.0)
    shape = 1 - p if (kind == "linear" or style == "linear") else 0.5 * (1 + math.cos(math.pi * p))
    return lr * (final + (1 - final) * shape)


@pytest.mark.parametrize(
    "kind, style",
    [("wsd", "linear"), ("wsd", "cosine"), ("linear", "linear"), ("constant", "linear"), ("cosine", "cosine")],
)
def test_schedules_follow_their_formulas(kind, style):
    values = dict(steps=100, learning_rate=2e-3, warmup_steps_fraction=0.1, lr_schedule_type=kind)
    if kind == "cosine":
        values.update(cosine_learning_rate_final_fraction=0.2)
    if kind in ("wsd", "linear"):
        values.update(learning_rate_final_fraction=0.2)
    if kind == "wsd":
        values.update(wsd_decay_steps_fraction=0.2, wsd_decay_style=style)
    schedule = _schedule(**values)
    for t in (0, 4, 10, 11, 30, 55, 79, 80, 81, 85, 90, 97, 100, 130):
        np.testing.assert_allclose(float(schedule(t)), _closed_form(kind, t, style=style), rtol=2e-6, err_msg=f"step {t}")


@pytest.mark.parametrize(
    "values, fragment",
    [
        (dict(opt_type="sgd", adam_b1=0.8), "adam_b1=0.8 is not read by opt_type=sgd (only by opt_type=adamw/muon)"),
        (dict(opt_type="lion", sgd_momentum=0.9), "sgd_momentum=0.9 is not read by opt_type=lion"),
        (dict(muon_beta=0.9), "muon_beta=0.9 is not read by opt_type=adamw"),
        (dict(opt_type="muon", lion_b1=0.5), "lion_b1=0.5 is not read by opt_type=muon"),
        (dict(adafactor_decay_rate=0.5), "adafactor_decay_rate=0.5 is not read by opt_type=adamw"),
        (dict(learning_rate_final_fraction=0.0), "cosine's is cosine_learning_rate_final_fraction"),
        (dict(lr_schedule_type="wsd", cosine_learning_rate_final_fraction=0.0), "wsd's is learning_rate_final_fraction"),
        (
            dict(lr_schedule_type="linear", wsd_decay_style="cosine"),
            "wsd_decay_style='cosine' is not read by lr_schedule_type=linear",
        ),
        (dict(lr_schedule_type="constant", learning_rate_final_fraction=0.5), "not read by lr_schedule_type=constant"),
        (dict(lr_schedule_type="wsd", warmup_steps_fraction=0.5, wsd_decay_steps_fraction=0.6), "exceed 1"),
        (dict(opt_type="adam_pax"), "config key 'opt_type': Input should be 'adamw', 'adafactor', 'lion', 'sgd' or 'muon'"),
        (dict(lr_schedule_type="warmup_cosine"), "config key 'lr_schedule_type'"),
    ],
)
def test_a_key_the_chosen_schedule_or_optimizer_does_not_read_is_an_error(values, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        tiny_config("llama2-tiny", **values)


# a changed value for each schedule key, to see that its schedule reads it
OTHER_VALUE = {"learning_rate_final_fraction": 0.5, "cosine_learning_rate_final_fraction": 0.5,
               "wsd_decay_steps_fraction": 0.5, "wsd_decay_style": "cosine"}  # fmt: skip


@pytest.mark.parametrize("kind, key", [(s, k) for s, keys in options.SCHEDULE_KEYS.items() for k in keys])
def test_every_schedule_key_changes_the_schedule(kind, key):
    steps = jnp.arange(41)
    before = jax.vmap(_schedule(steps=40, lr_schedule_type=kind))(steps)
    after = jax.vmap(_schedule(steps=40, lr_schedule_type=kind, **{key: OTHER_VALUE[key]}))(steps)
    assert float(jnp.abs(before - after).max()) > 0, f"{key} is not read by {kind}"


# The optimizer tests below set every key of the optimizer to a non-default value (so a key
# that is not passed on shows as a difference) and compare two updates: at the first, Adam,
# Lion and Muon are blind to their betas (the bias-corrected moment is the gradient).
def _optimizer_config(opt, **values):
    return tiny_config("llama2-tiny", **SMALL, opt_type=opt, lr_schedule_type="constant", warmup_steps_fraction=0.0,
                       gradient_clipping_threshold=0.0, **values)  # fmt: skip


def _params(cfg):
    """Random values (scale 0.1) of the model's parameters, as a pure dict (no model is built)."""
    shapes = nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param))
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    return jax.tree.unflatten(treedef, [0.1 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def _two_updates(tx, params):
    """Two updates of ``tx`` for two fixed gradients: (g1, g2, u1, u2), flat."""
    g1 = jax.tree.map(lambda p: jax.random.normal(jax.random.key(1), p.shape, p.dtype), params)
    g2 = jax.tree.map(lambda p: jax.random.normal(jax.random.key(2), p.shape, p.dtype), params)

    @jax.jit
    def both(params, g1, g2):
        u1, state = tx.update(g1, tx.init(params), params)
        return u1, tx.update(g2, state, params)[0]

    u1, u2 = both(params, g1, g2)
    return flatten(g1), flatten(g2), flatten(u1), flatten(u2)


def _ours(cfg, params):
    return _two_updates(make_optimizer(cfg, derive(cfg, 8))[0], params)


def _assert_same(ours, reference, keys=None, rtol=1e-5, atol=1e-7):
    for key in keys or reference:
        np.testing.assert_allclose(ours[key], reference[key], rtol=rtol, atol=atol, err_msg=key)


def test_adamw_equals_optax_adamw_with_clipping_and_the_decay_mask():
    values = dict(adam_b1=0.8, adam_b2=0.9, adam_eps=1e-4, adam_weight_decay=0.05)
    cfg = tiny_config("llama2-tiny", **SMALL, **values)  # the default cosine schedule, with clipping
    params, derived = _params(cfg), derive(cfg, 8)
    reference = optax.chain(
        optax.clip_by_global_norm(cfg.gradient_clipping_threshold),
        optax.adamw(learning_rate_schedule(cfg, derived), b1=0.8, b2=0.9, eps=1e-4, weight_decay=0.05, mask=decay_mask(cfg)),
    )
    *_, u1, u2 = _ours(cfg, params)
    *_, r1, r2 = _two_updates(reference, params)
    _assert_same(u1, r1, rtol=0, atol=0)  # the same transformation: bitwise
    _assert_same(u2, r2, rtol=0, atol=0)


def test_adafactor_equals_optax_adafactor():
    cfg = _optimizer_config("adafactor", adafactor_decay_rate=0.6, adafactor_weight_decay=0.05)
    params = _params(cfg)
    reference = optax.adafactor(cfg.learning_rate, decay_rate=0.6, weight_decay_rate=0.05, weight_decay_mask=decay_mask(cfg))
    *_, u1, u2 = _ours(cfg, params)
    *_, r1, r2 = _two_updates(reference, params)
    _assert_same(u1, r1, atol=1e-6)
    _assert_same(u2, r2, atol=1e-6)


def test_lion_follows_its_formula_with_masked_decoupled_decay():
    """u_t = -lr (sign(b1 m_{t-1} + (1 - b1) g_t) + wd p [matrices]); m_t = b2 m_{t-1} + (1 - b2) g_t."""
    lr, b1, b2, wd = 0.01, 0.6, 0.7, 0.3
    cfg = _optimizer_config("lion", learning_rate=lr, lion_b1=b1, lion_b2=b2, lion_weight_decay=wd)
    params = _params(cfg)
    g1, g2, u1, u2 = _ours(cfg, params)
    mask, p = flatten(decay_mask(cfg)), flatten(params)
    for key in p:
        decay = wd * np.asarray(p[key]) if mask[key] else 0.0
        m1 = (1 - b2) * np.asarray(g1[key])
        np.testing.assert_allclose(u1[key], -lr * (np.sign(g1[key]) + decay), rtol=1e-6, atol=1e-9, err_msg=key)
        expected = -lr * (np.sign(b1 * m1 + (1 - b1) * np.asarray(g2[key])) + decay)
        np.testing.assert_allclose(u2[key], expected, rtol=1e-6, atol=1e-9, err_msg=key)


def test_sgd_with_momentum_follows_the_heavy_ball_formula():
    lr, momentum = 0.05, 0.7
    cfg = _optimizer_config("sgd", learning_rate=lr, sgd_momentum=momentum)
    g1, g2, u1, u2 = _ours(cfg, _params(cfg))
    for key in g1:
        np.testing.assert_allclose(u1[key], -lr * g1[key], rtol=1e-6, err_msg=key)
        expected = -lr * (g2[key] + momentum * g1[key])
        # where g2 and momentum * g1 nearly cancel, float32 rounding is relative to their size: atol 1e-6 of the leaf's largest
        np.testing.assert_allclose(u2[key], expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max(), err_msg=key)


def test_muon_orthogonalizes_each_layer_matrix_and_uses_adam_for_the_rest():
    """A stacked kernel's updates, layer by layer, equal optax's Muon on that layer's 2-D
    matrix: query [layers, embed, heads, head_dim] as embed x heads*head_dim, out
    [layers, heads, head_dim, embed] as heads*head_dim x embed. Embeddings, the output
    projection and norms get optax's AdamW with the adam_* keys (norms: no decay)."""
    lr = 0.02
    adam_values = dict(adam_b1=0.8, adam_b2=0.9, adam_eps=1e-4, adam_weight_decay=0.05)
    cfg = _optimizer_config("muon", learning_rate=lr, muon_beta=0.9, muon_weight_decay=0.1, muon_consistent_rms=0.2,
                            **adam_values)  # fmt: skip
    params = _params(cfg)
    g1, g2, u1, u2 = _ours(cfg, params)
    p = flatten(params)
    muon = optax.contrib.muon(lr, beta=0.9, eps=1e-4, weight_decay=0.1, consistent_rms=0.2)
    for key, matrix in (
        ("layers/layers/attention/query/kernel", lambda x: x.reshape(x.shape[0], -1)),
        ("layers/layers/attention/out/kernel", lambda x: x.reshape(-1, x.shape[-1])),
        ("layers/layers/mlp/wo/kernel", lambda x: x),
    ):
        for layer in range(p[key].shape[0]):
            one = {"w": matrix(p[key][layer])}
            r1, r2 = _two_updates_of(muon, one, g1[key][layer], g2[key][layer], matrix)
            np.testing.assert_allclose(matrix(u1[key][layer]), r1, rtol=1e-5, atol=1e-6, err_msg=f"{key}[{layer}]")
            np.testing.assert_allclose(matrix(u2[key][layer]), r2, rtol=1e-5, atol=1e-6, err_msg=f"{key}[{layer}]")
    for key in ("embed/embedding", "logits/kernel", "final_norm/scale", "layers/layers/pre_attention_norm/scale"):
        decay = 0.05 if flatten(decay_mask(cfg))[key] else 0.0
        adam = optax.adamw(lr, b1=0.8, b2=0.9, eps=1e-4, weight_decay=decay)
        r1, r2 = _two_updates_of(adam, {"w": p[key]}, g1[key], g2[key], lambda x: x)
        np.testing.assert_allclose(u1[key], r1, rtol=1e-5, atol=1e-7, err_msg=key)
        np.testing.assert_allclose(u2[key], r2, rtol=1e-5, atol=1e-7, err_msg=key)


def _two_updates_of(tx, one, g1, g2, matrix):
    """Two updates of ``tx`` on the one-parameter tree ``one`` for the gradients ``matrix(g)``."""
    state = tx.init(one)
    r1, state = tx.update({"w": matrix(g1)}, state, one)
    r2, _ = tx.update({"w": matrix(g2)}, state, one)
    return r1["w"], r2["w"]


def test_muon_dimensions_follow_the_logical_axes():
    leaves = jax.tree_util.tree_flatten_with_path(
        muon_dimension_tree(tiny_config("mixtral-tiny")), is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers)
    )[0]
    as_tuple = {"/".join(k.key for k in path): d and (d.reduction_axis, d.output_axis) for path, d in leaves}
    assert as_tuple["layers/layers/attention/query/kernel"] == ((1,), (2, 3))  # [layers, embed, heads, head_dim]
    assert as_tuple["layers/layers/attention/out/kernel"] == ((1, 2), (3,))  # [layers, heads, head_dim, embed]
    assert as_tuple["layers/layers/mlp/wi_0"] == ((2,), (3,))  # [layers, exp, embed, mlp]: experts are a batch axis
    assert as_tuple["layers/layers/mlp/wo"] == ((2,), (3,))  # [layers, exp, mlp, embed]
    for adam in ("embed/embedding", "logits/kernel", "final_norm/scale", "layers/layers/mlp/router/kernel"):
        assert as_tuple[adam] is None, adam  # vocab axis, vector, unnamed router axis


@pytest.mark.parametrize("opt", ["adafactor", "lion", "sgd", "muon"])
def test_a_short_training_run_lowers_the_loss(opt):
    """Eight steps of the real train step on one fixed batch, 4 devices (fsdp): the state
    initialises into its shardings (Adafactor's factored statistics are not parameter-shaped;
    Muon's momenta sit in optax.partition's masked states and are sharded like their kernels)
    and the loss drops."""
    lr = {"adafactor": 0.01, "lion": 0.003, "sgd": 0.3, "muon": 0.02}[opt]
    # lion and sgd keep parameter-shaped momenta: unrolled layers (faster to compile) do for them
    extra = {"sgd": dict(sgd_momentum=0.9, scan_layers=False), "lion": dict(scan_layers=False)}.get(opt, {})
    cfg = tiny_config("llama2-tiny", opt_type=opt, base_num_decoder_layers=1, vocab_size=64, max_target_length=16,
                      per_device_batch_size=1, steps=8, warmup_steps_fraction=0.0, learning_rate=lr, **extra)  # fmt: skip
    mesh = make_mesh(cfg, devices=jax.devices()[:4])
    derived = derive(cfg, 4)
    tx, schedule = make_optimizer(cfg, derived)
    model_setup = setup(cfg, mesh, tx)
    state, step = init_state(cfg, model_setup, tx), make_train_step(cfg, model_setup, tx, schedule)
    if opt == "muon":
        kernel = flatten(model_setup.state_shardings["params"])["layers/layers/mlp/wo/kernel"]
        paths = jax.tree_util.tree_flatten_with_path(state["opt_state"])[0]
        momenta = [leaf for path, leaf in paths if jax.tree_util.keystr(path).endswith("['mlp']['wo']['kernel']")]
        assert momenta and not kernel.is_fully_replicated and all(leaf.sharding == kernel for leaf in momenta)
    batch = device_batch(random_batch(cfg, batch=4, seq=16), batch_sharding(cfg, model_setup))
    losses = []
    for _ in range(8):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.8 * losses[0], losses


def test_weight_decay_only_on_matrices():
    mask = flatten(decay_mask(tiny_config("llama2-tiny")))
    assert mask["layers/layers/attention/query/kernel"] is True  # stacked 4-d kernel
    assert mask["layers/layers/mlp/wo/kernel"] is True
    assert mask["embed/embedding"] is True and mask["logits/kernel"] is True
    assert mask["layers/layers/pre_attention_norm/scale"] is False  # stacked vector: [layers, embed]
    assert mask["final_norm/scale"] is False


def test_decay_changes_matrices_not_norms_when_gradients_are_zero():
    cfg = tiny_config("llama2-tiny", learning_rate=0.1, warmup_steps_fraction=0.0, adam_weight_decay=0.5)
    tx, _ = make_optimizer(cfg, derive(cfg, 8))
    params = _params(cfg)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    flat = flatten(updates)
    assert float(jnp.abs(flat["layers/layers/mlp/wo/kernel"]).max()) > 0
    assert float(jnp.abs(flat["final_norm/scale"]).max()) == 0.0


def test_gradient_clipping_rescales_to_the_threshold():
    """With a large adam_eps Adam is not scale-invariant, so clipping shows in the update:
    clipped big gradients give exactly the update of the same gradients pre-scaled to norm 1."""
    common = dict(adam_weight_decay=0.0, adam_eps=10.0, warmup_steps_fraction=0.0)
    clipped_cfg = tiny_config("llama2-tiny", gradient_clipping_threshold=1.0, **common)
    plain_cfg = tiny_config("llama2-tiny", gradient_clipping_threshold=0.0, **common)
    params = _params(clipped_cfg)
    grads = jax.tree.map(lambda p: 100.0 * p, params)
    unit = jax.tree.map(lambda g: g / optax.tree.norm(grads), grads)

    def update(cfg, g):
        tx, _ = make_optimizer(cfg, derive(cfg, 8))
        return flatten(tx.update(g, tx.init(params), params)[0])

    clipped, unclipped, reference = update(clipped_cfg, grads), update(plain_cfg, grads), update(plain_cfg, unit)
    key = "layers/layers/mlp/wo/kernel"
    np.testing.assert_allclose(clipped[key], reference[key], rtol=1e-5, atol=1e-12)
    assert float(jnp.abs(unclipped[key] - clipped[key]).max()) > 1e-6
