"""The DeepSeek-V4 layer and the decoder's stream head.

The residual is ``mhc_expansion_rate`` streams ``[B, S, k, D]``; each layer::

    post, comb, u = attention_hc(X);  X = post * attention(pre_attention_norm(u)) + comb^T X
    post, comb, u = mlp_hc(X);        X = post * moe(post_attention_norm(u), tokens) + comb^T X

Attention kind per layer from ``compress_ratios`` (``compressed.py``); the MoE is
``sqrtsoftplus`` scoring with the correction bias on top-k layers and the token -> expert
table (``HashTable``) on the first ``first_num_hash_layers`` layers, SwiGLU clamped at
``mlp_activations_limit`` on routed and shared experts, one shared expert. The decoder
repeats the embedding into the streams and collapses them with a ``HyperHead`` before the
final norm (``stream_head``, the family's ``make_stream_head``).
"""

from __future__ import annotations

import jax
from flax import nnx

from nnxtron.config.layout import PLAIN, LayerKind
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.layers import dropout
from nnxtron.layers.moe import MoE
from nnxtron.layers.norms import rms_norm
from nnxtron.models.deepseek4.compressed import CompressedAttention
from nnxtron.models.deepseek4.mhc import HyperConnection, HyperHead, expand


def hyper_connection(cfg: Config, rngs: nnx.Rngs) -> HyperConnection:
    return HyperConnection(
        cfg.base_emb_dim,
        cfg.mhc_expansion_rate,
        iterations=cfg.sinkhorn_iterations,
        eps=cfg.mhc_eps,
        norm_eps=cfg.normalization_layer_epsilon,
        rngs=rngs,
    )


class DeepSeek4Block(nnx.Module):
    """One DeepSeek-V4 layer of ``kind`` (attention ``sliding``/``csa``/``hca``; ``hash`` routing)."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs, kind: LayerKind = PLAIN):
        if not kind.moe:
            raise ConfigError("decoder_block deepseek4 has MoE layers only; set num_experts > 1")
        self.attention_hc = hyper_connection(cfg, rngs)
        self.pre_attention_norm = rms_norm(cfg)
        self.attention = CompressedAttention(cfg, kind.attention, rngs)
        self.mlp_hc = hyper_connection(cfg, rngs)
        self.post_attention_norm = rms_norm(cfg)
        self.mlp = MoE(cfg, rngs, hash_routed=kind.hash)
        self.dropout_rate = cfg.dropout_rate

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        tokens: jax.Array,
        dropout_keys: dropout.Keys | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """With ``dropout_keys`` (training) the layer output ``[B, S, k, D]`` is dropped, its
        mask shared along axis -2 (the streams), as in MaxText (``layers.dropout``)."""
        post, comb, collapsed = self.attention_hc(x)
        x = expand(post, comb, self.attention(self.pre_attention_norm(collapsed), positions, segment_ids), x)
        post, comb, collapsed = self.mlp_hc(x)
        intermediate = dropout.site_dropout(dropout_keys, self.dropout_rate, dropout.MLP)  # the shared expert's
        y, aux = self.mlp(self.post_attention_norm(collapsed), tokens, intermediate)
        return dropout.dropout(expand(post, comb, y, x), dropout_keys, self.dropout_rate, dropout.LAYER_OUTPUT), aux


def stream_head(cfg: Config, rngs: nnx.Rngs) -> HyperHead:
    """The decoder's ``HyperHead`` over ``mhc_expansion_rate`` streams."""
    return HyperHead(
        cfg.base_emb_dim, cfg.mhc_expansion_rate, eps=cfg.mhc_eps, norm_eps=cfg.normalization_layer_epsilon, rngs=rngs
    )
