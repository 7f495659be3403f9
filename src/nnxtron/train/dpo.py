"""Direct preference optimisation (DPO, Rafailov et al. 2023), with conservative label
smoothing (cDPO, Mitchell 2023): the loss of a batch of preference pairs.

For a pair with prompt x, chosen answer y_w and rejected answer y_l, let
``log pi(y | x)`` be the summed log-probability of an answer's tokens under the policy
(the weights being trained) and ``log ref(y | x)`` under the reference (the weights the
run started from, frozen). With

    r_w = beta * (log pi(y_w | x) - log ref(y_w | x))      (the chosen answer's implicit reward)
    r_l = beta * (log pi(y_l | x) - log ref(y_l | x))      (the rejected answer's)
    m   = r_w - r_l

the loss of the pair is ``-(1 - eps) * log sigmoid(m) - eps * log sigmoid(-m)`` (eps =
``dpo_label_smoothing``, 0 = plain DPO), and the batch loss is its mean over the pairs.

Rows: a batch of ``2P`` rows holds, per block of rows (one block per process, the rows a
process reads), the chosen sides of its pairs followed by their rejected sides in the same
order (``data.stream.BatchIterator``). Microbatches (``parallel.microbatch``, rows ``i, i +
k, ...``) keep that layout when each block's ``P / blocks`` pairs divide by ``k``
(``config.derived`` checks it), so :func:`pair_halves` pairs any of them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from nnxtron.models.loss import token_nll

__all__ = ["DPOSettings", "dpo_sums", "pair_halves", "sequence_logprobs"]


class DPOSettings(NamedTuple):
    beta: float
    label_smoothing: float
    blocks: int  # row blocks of [chosen sides; rejected sides]: the processes (see the module docstring)


def sequence_logprobs(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """``sum_s mask[b, s] * log p(targets[b, s])`` per row: float32 ``[B]``."""
    return -jnp.sum(token_nll(logits, targets) * mask.astype(jnp.float32), axis=-1)


def pair_halves(values: jax.Array, blocks: int) -> tuple[jax.Array, jax.Array]:
    """``[2P]`` per-row values -> (chosen ``[P]``, rejected ``[P]``), pair ``j`` at index ``j`` of both."""
    halves = values.reshape(blocks, 2, -1)
    return halves[:, 0].reshape(-1), halves[:, 1].reshape(-1)


def dpo_sums(policy: jax.Array, reference: jax.Array, settings: DPOSettings) -> tuple[jax.Array, jax.Array, dict]:
    """(loss summed over the pairs, number of pairs, statistics summed over the pairs) of the
    per-row answer log-probabilities ``policy`` and ``reference`` ``[2P]``.

    Statistics: ``dpo/reward_accuracy`` (the pairs whose chosen reward is the larger),
    ``dpo/chosen_reward``, ``dpo/rejected_reward`` and ``dpo/margin`` (r_w, r_l, m above);
    each becomes a mean when divided by the number of pairs."""
    policy_w, policy_l = pair_halves(policy, settings.blocks)
    reference_w, reference_l = pair_halves(jax.lax.stop_gradient(reference), settings.blocks)
    chosen = settings.beta * (policy_w - reference_w)
    rejected = settings.beta * (policy_l - reference_l)
    margin = chosen - rejected
    eps = settings.label_smoothing
    losses = -(1.0 - eps) * jax.nn.log_sigmoid(margin) - eps * jax.nn.log_sigmoid(-margin)
    stats = {
        "dpo/reward_accuracy": jnp.sum((margin > 0).astype(jnp.float32)),
        "dpo/chosen_reward": jnp.sum(chosen),
        "dpo/rejected_reward": jnp.sum(rejected),
        "dpo/margin": jnp.sum(margin),
    }
    return jnp.sum(losses), jnp.float32(margin.shape[0]), stats
