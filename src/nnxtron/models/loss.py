"""Token-mean cross-entropy in float32 with a loss mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Sum of the next-token loss over unmasked tokens, and the number of those tokens.

    logits [B, S, V] (any float dtype, computed in float32), targets [B, S] int, mask [B, S]
    (1 = count this target; padding and cross-document targets are 0). Sums (not means)
    let gradient accumulation normalise by the tokens of the whole batch.

    The target logit is picked by comparing a vocabulary iota with the target (a one-hot
    select, exact: one value summed with zeros), not by ``take_along_axis``: its gradient
    is then one fused select next to the softmax's, where a gather's gradient is a scatter
    into a zeroed logits-sized buffer.
    """
    per_token = token_nll(logits, targets)
    weights = jnp.ones_like(per_token) if mask is None else mask.astype(jnp.float32)
    return jnp.sum(per_token * weights), jnp.sum(weights)


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``-log softmax(logits)[target]`` of every position, float32 ``[B, S]`` (see ``cross_entropy_sum``)."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    target_logit = jnp.sum(jnp.where(vocab == targets[..., None].astype(jnp.int32), logits, 0.0), axis=-1)
    return log_z - target_logit


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Token-mean next-token loss over unmasked tokens, and the number of those tokens."""
    total, count = cross_entropy_sum(logits, targets, mask)
    return total / jnp.maximum(count, 1.0), count
