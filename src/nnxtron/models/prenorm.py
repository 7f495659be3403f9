"""The pre-norm decoder block shared by Llama, Mistral, Mixtral, Qwen2, Qwen3, DeepSeek-V3, Llama 4 and Gemma.

Block (HF ``LlamaDecoderLayer``)::

    h = x + o(attn(rope(q(norm_in(x))), rope(k(.)), v(.)))
    y = h + down(silu(gate(norm_post(h))) * up(norm_post(h)))

Its attention is GQA (``layers.attention.gqa_attention``: sliding windows, chunks, qk-norms, NoPE layers)
or MLA (``attention_type=mla``, DeepSeek), and its feed-forward is the gated MLP or, for
MoE layers, the routed ``MoE`` (Mixtral, Qwen3-MoE, DeepSeek, Llama 4). MoE blocks return
``(y, aux)`` with the MoE's auxiliary losses. ``pre_norm_family`` makes the ``Family`` of
a family built from this block. With dropout keys (training, ``layers.dropout``) the dense
MLP's intermediate activations and the layer output ``y`` are dropped, as MaxText does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nnxtron.config.layout import PLAIN, LayerKind
from nnxtron.config.schema import Config
from nnxtron.layers import dropout
from nnxtron.layers.attention import gqa_attention
from nnxtron.layers.mla import MLA
from nnxtron.layers.mlp import GatedMLP
from nnxtron.layers.moe import MoE
from nnxtron.layers.norms import rms_norm
from nnxtron.models.family import Family, WeightMap
from nnxtron.models.hf_common import top_weights
from nnxtron.parallel.sharding import RESIDUAL, constrain


class PreNormBlock(nnx.Module):
    """Pre-norm attention + pre-norm feed-forward; ``kind.moe`` selects the routed MoE feed-forward.

    ``qk_norm``: what ``use_qk_norm`` means for the family (see ``gqa_attention``); ``zero_centered``:
    both norms are Gemma's ``x_hat * (1 + w)`` in float32 (Gemma v1); ``trained_router_bias``: the MoE's
    ``routed_bias`` is a trained bias of the router logits (GPT-OSS; ``layers/moe.MoE``); ``make_attention``: the
    layer's token mixer instead of GQA / MLA (Qwen3-Next); ``gated_shared_expert``: ``layers/moe.MoE``'s.
    """

    def __init__(
        self,
        cfg: Config,
        rngs: nnx.Rngs,
        kind: LayerKind = PLAIN,
        qk_norm: str = "rms",
        zero_centered: bool = False,
        trained_router_bias: bool = False,
        make_attention: Callable[[Config, nnx.Rngs, LayerKind], nnx.Module] | None = None,
        gated_shared_expert: bool = False,
    ):
        dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
        self.pre_attention_norm = rms_norm(cfg, zero_centered=zero_centered)
        if make_attention is not None:
            self.attention = make_attention(cfg, rngs, kind)
        elif cfg.attention_type == "mla":
            self.attention = MLA(cfg, rngs)
        else:
            self.attention = gqa_attention(cfg, rngs, kind, qk_norm)
        self.post_attention_norm = rms_norm(cfg, zero_centered=zero_centered)
        if kind.moe:
            self.mlp = MoE(cfg, rngs, trained_router_bias=trained_router_bias, gated_shared_expert=gated_shared_expert)
        else:
            self.mlp = GatedMLP(
                cfg.base_emb_dim, cfg.base_mlp_dim, cfg.mlp_activations[0], dtype=dtype, weight_dtype=weight_dtype, rngs=rngs
            )
        self.moe = kind.moe
        self.dropout_rate = cfg.dropout_rate

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, dropout_keys: dropout.Keys | None = None
    ) -> jax.Array | tuple[jax.Array, dict]:
        x = checkpoint_name(constrain(x, RESIDUAL), "decoder_layer_input")
        h = x + self.attention(self.pre_attention_norm(x), positions, segment_ids)
        intermediate = dropout.site_dropout(dropout_keys, self.dropout_rate, dropout.MLP)
        if not self.moe:
            y = h + self.mlp(self.post_attention_norm(h), intermediate)
            return dropout.dropout(y, dropout_keys, self.dropout_rate, dropout.LAYER_OUTPUT)
        y, aux = self.mlp(self.post_attention_norm(h), intermediate=intermediate)
        return dropout.dropout(h + y, dropout_keys, self.dropout_rate, dropout.LAYER_OUTPUT), aux


def pre_norm_family(
    name: str,
    hf_model_type: str,
    hf_architecture: str,
    layer_weights: Callable[[Config, LayerKind], tuple[WeightMap, ...]],
    config_from_hf: Callable[[dict[str, Any]], dict[str, Any]],
    config_to_hf: Callable[[Config], dict[str, Any]],
    make_block: Callable[[Config, nnx.Rngs, LayerKind], nnx.Module] = PreNormBlock,
    **extra: Any,
) -> Family:
    """The ``Family`` of a family built from ``PreNormBlock`` with the Llama top-level weights
    (``extra``: further ``Family`` fields)."""
    return Family(
        name=name,
        hf_model_type=hf_model_type,
        hf_architecture=hf_architecture,
        make_block=make_block,
        layer_weights=layer_weights,
        top_weights=top_weights,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        **extra,
    )
