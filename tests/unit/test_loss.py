"""Cross-entropy: token mean over unmasked targets, in float32."""

import jax
import jax.numpy as jnp
import numpy as np

from nnxtron.models.loss import cross_entropy


def test_masked_token_mean_matches_a_direct_computation():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32) * 3
    targets = rng.integers(0, 7, size=(2, 5))
    mask = np.array([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], np.float32)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    per_token = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    expected = (per_token * mask).sum() / mask.sum()
    loss, count = cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    assert float(count) == 7.0
    # masked positions have no gradient
    grads = jax.grad(lambda lg: cross_entropy(lg, jnp.asarray(targets), jnp.asarray(mask))[0])(jnp.asarray(logits))
    assert float(jnp.abs(grads[0, 2]).max()) == 0.0 and float(jnp.abs(grads[0, 1]).max()) > 0


def test_bfloat16_logits_are_upcast():
    logits = jnp.asarray([[[10.0, 0.0, -10.0]]], jnp.bfloat16)
    loss, _ = cross_entropy(logits, jnp.asarray([[0]]))
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, np.log1p(np.exp(-10.0) + np.exp(-20.0)), atol=1e-6)  # f32 ulp at 10
