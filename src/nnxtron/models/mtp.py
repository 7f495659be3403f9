"""Multi-token prediction (DeepSeek-V3): extra depths that predict tokens further ahead.

Depth ``k`` (1..N) at position ``t`` combines the previous depth's hidden state
``h_{k-1}[t]`` (``h_0`` = the main stack's output, before the final norm) with the
embedding of the input token ``k`` ahead, ``emb(tok[t+k])``::

    h_k = Block_k( W_k · [ RMSNorm_e(emb(tok[t+k])) ‖ RMSNorm_h(h_{k-1}[t]) ] )
    logits_k = shared LM head( RMSNorm_k(h_k) )   -> predicts tok[t+k+1] = target[t+k]

``RMSNorm_k`` is the depth's own output norm (DeepSeek-V3's ``shared_head.norm``, MaxText's
``mtp_k_final_norm``): the depths share the LM head with the model, not its final norm.

The loss is the token-weighted cross-entropy over all depths (sum of the per-depth
token losses / number of counted tokens), times ``mtp_loss_scaling_factor``. A position
counts at depth k when ``t+k`` lies in the sequence, in the same packed segment as
``t``, and ``loss_mask[t+k]`` is set. The block is the model's last layer kind (the MoE
layer for MoE models); its own aux losses (e.g. MoE load balancing) are returned too.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from nnxtron.config.schema import Config
from nnxtron.layers import dropout
from nnxtron.layers.linear import Linear
from nnxtron.layers.norms import RMSNorm
from nnxtron.models.loss import cross_entropy_sum
from nnxtron.parallel.row_keys import Keys, fold, layer_keys
from nnxtron.parallel.scan import sum_aux

Aux = dict[str, jax.Array]


def shift_left(x: jax.Array, k: int, fill: int | float = 0) -> jax.Array:
    """``x[:, t + k]`` at position t (axis 1), ``fill`` past the end."""
    pad = jnp.full((x.shape[0], k, *x.shape[2:]), fill, x.dtype)
    return jnp.concatenate([x[:, k:], pad], axis=1)


def valid_ahead(segment_ids: jax.Array, loss_mask: jax.Array | None, k: int) -> jax.Array:
    """[B, S] float mask: position t+k exists, is in t's segment and is a loss token."""
    ahead = shift_left(segment_ids, k, fill=-1)
    valid = (ahead == segment_ids).astype(jnp.float32)
    if loss_mask is not None:
        valid = valid * shift_left(loss_mask.astype(jnp.float32), k)
    return valid


class MTPDepth(nnx.Module):
    """One prediction depth: two norms, the [2D -> D] projection and a transformer block."""

    def __init__(self, cfg: Config, block: nnx.Module, rngs: nnx.Rngs):
        dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
        norm = dict(eps=cfg.normalization_layer_epsilon, dtype=dtype, weight_dtype=weight_dtype)
        d = cfg.base_emb_dim
        self.embedding_norm = RMSNorm(d, **norm)
        self.hidden_norm = RMSNorm(d, **norm)
        self.projection = Linear([2 * d], [d], ("mlp", "embed"), dtype=dtype, weight_dtype=weight_dtype, rngs=rngs)
        self.block = block
        self.final_norm = RMSNorm(d, **norm)

    def __call__(
        self, hidden: jax.Array, embedded_ahead: jax.Array, positions, segment_ids, dropout_keys: Keys | None = None
    ) -> tuple[jax.Array, Aux]:
        combined = jnp.concatenate([self.embedding_norm(embedded_ahead), self.hidden_norm(hidden)], axis=-1)
        with layer_keys(dropout_keys):  # LoRA's adapter dropout reads them (layers/lora.py)
            if dropout_keys is None:
                out = self.block(self.projection(combined), positions, segment_ids)
            else:
                out = self.block(self.projection(combined), positions, segment_ids, dropout_keys=dropout_keys)
        return out if isinstance(out, tuple) else (out, {})


class MultiTokenPrediction(nnx.Module):
    """``mtp_num_layers`` depths; ``make_block(rngs)`` builds each depth's transformer block."""

    def __init__(self, cfg: Config, make_block: Callable[[nnx.Rngs], nnx.Module], key: jax.Array):
        keys = jax.random.split(key, cfg.mtp_num_layers)
        self.depths = nnx.List(
            [MTPDepth(cfg, make_block(nnx.Rngs(jax.random.fold_in(k, 0))), nnx.Rngs(jax.random.fold_in(k, 1))) for k in keys]
        )
        self.scale = cfg.mtp_loss_scaling_factor
        self.eval_depth = cfg.mtp_eval_target_module
        self.dropout_rate = cfg.dropout_rate

    def __call__(
        self,
        hidden: jax.Array,
        embedded: jax.Array,
        head: Callable[[jax.Array], jax.Array],
        main_logits: jax.Array,
        targets: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        loss_mask: jax.Array | None,
        dropout_keys: Keys | None = None,
    ) -> Aux:
        """The MTP aux outputs for one batch.

        ``hidden`` [B,S,D]: main stack output before the final norm; ``embedded``: the
        input embeddings; ``head``: the LM head on normed states (float32 logits). Returns
        ``{"losses": {"mtp": scaled loss, **block aux losses}, "mtp_loss": unscaled,
        "mtp_acceptance": [accepted, predictions]}`` (acceptance only with
        ``mtp_eval_target_module`` > 0).

        ``dropout_keys`` (training with dropout; ``embedded`` then without dropout): depth ``k``
        folds ``k`` in and drops, as MaxText's MTP does, its embeddings ahead (site ``EMBED``),
        inside its block (keys folded with ``STACKS``) and its normed output (``HEAD``).
        """
        loss_sum = jnp.zeros((), jnp.float32)
        tokens = jnp.zeros((), jnp.float32)
        block_aux: list[Aux] = []
        acceptance = None
        h = hidden
        for k, depth in enumerate(self.depths, start=1):
            keys = fold(dropout_keys, k)
            ahead = dropout.dropout(shift_left(embedded, k), keys, self.dropout_rate, dropout.EMBED)
            h, aux = depth(h, ahead, positions, segment_ids, fold(keys, dropout.STACKS))
            block_aux.append(aux)
            logits = head(dropout.dropout(depth.final_norm(h), keys, self.dropout_rate, dropout.HEAD))
            valid = valid_ahead(segment_ids, loss_mask, k)
            depth_sum, depth_tokens = cross_entropy_sum(logits, shift_left(targets, k), valid)
            loss_sum, tokens = loss_sum + depth_sum, tokens + depth_tokens
            if k == self.eval_depth:
                # main head at t+k predicts the same token as depth k at t (target[t+k])
                same = jnp.argmax(logits, -1) == jnp.argmax(shift_left(main_logits, k), -1)
                acceptance = jnp.stack([jnp.sum(same * valid), jnp.sum(valid)]).astype(jnp.float32)
        mtp_loss = loss_sum / jnp.maximum(tokens, 1.0)
        out: Aux = {"losses": {"mtp": self.scale * mtp_loss, **sum_aux(*block_aux)}, "mtp_loss": mtp_loss}
        if acceptance is not None:
            out["mtp_acceptance"] = acceptance
        return out
