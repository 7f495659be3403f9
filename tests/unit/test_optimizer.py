"""Optimizer: warmup + cosine schedule values, decay mask, clipping."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxtron.config import derive
from nnxtron.models.build import build_model
from nnxtron.params import flatten
from nnxtron.train.optimizer import decay_mask, learning_rate_schedule, make_optimizer
from tests.conftest import tiny_config


def test_schedule_warmup_then_cosine_to_final_fraction():
    cfg = tiny_config(
        "llama2-tiny", steps=100, learning_rate=1e-3, warmup_steps_fraction=0.1, cosine_learning_rate_final_fraction=0.1
    )
    schedule = learning_rate_schedule(cfg, derive(cfg, 8))
    np.testing.assert_allclose([schedule(0), schedule(5), schedule(10)], [0.0, 5e-4, 1e-3], rtol=1e-6)
    np.testing.assert_allclose(schedule(55), 1e-4 + 0.5 * (1e-3 - 1e-4), rtol=1e-5)  # cosine midpoint
    np.testing.assert_allclose(schedule(100), 1e-4, rtol=1e-5)


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
    params = nnx.to_pure_dict(nnx.state(build_model(cfg), nnx.Param))
    zeros = jax_zeros_like(params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    flat = flatten(updates)
    assert float(jnp.abs(flat["layers/layers/mlp/wo/kernel"]).max()) > 0
    assert float(jnp.abs(flat["final_norm/scale"]).max()) == 0.0


def test_gradient_clipping_rescales_to_the_threshold():
    """With a large adam_eps Adam is not scale-invariant, so clipping shows in the update:
    clipped big gradients give exactly the update of the same gradients pre-scaled to norm 1."""
    import jax
    import optax

    common = dict(adam_weight_decay=0.0, adam_eps=10.0, warmup_steps_fraction=0.0)
    clipped_cfg = tiny_config("llama2-tiny", gradient_clipping_threshold=1.0, **common)
    plain_cfg = tiny_config("llama2-tiny", gradient_clipping_threshold=0.0, **common)
    params = nnx.to_pure_dict(nnx.state(build_model(clipped_cfg), nnx.Param))
    grads = jax.tree.map(lambda p: 100.0 * p, params)
    unit = jax.tree.map(lambda g: g / optax.tree.norm(grads), grads)

    def update(cfg, g):
        tx, _ = make_optimizer(cfg, derive(cfg, 8))
        return flatten(tx.update(g, tx.init(params), params)[0])

    clipped, unclipped, reference = update(clipped_cfg, grads), update(plain_cfg, grads), update(plain_cfg, unit)
    key = "layers/layers/mlp/wo/kernel"
    np.testing.assert_allclose(clipped[key], reference[key], rtol=1e-5, atol=1e-12)
    assert float(jnp.abs(unclipped[key] - clipped[key]).max()) > 1e-6


def jax_zeros_like(tree):
    import jax

    return jax.tree.map(jnp.zeros_like, tree)
