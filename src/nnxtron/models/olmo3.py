"""OLMo 3: post-norm sublayers inside the residual, whole-projection qk-norm, 3 sliding : 1 global layers.

HF ``Olmo3ForCausalLM`` (``decoder_block=olmo3``). Per layer::

    h = x + norm_attn(o(attn(rope(qnorm(q(x))), rope(knorm(k(x))), v(x))))   # logits x head_dim^-0.5
    y = h + norm_mlp(down(silu(gate(h)) * up(h)))

The norms take the sublayer OUTPUTS (no norm on a sublayer's input); ``qnorm`` / ``knorm`` are one
RMSNorm over the whole query / key projection (``heads * head_dim`` weights and one statistic across
the heads: qk-norm mode ``rms_projection``), before RoPE. Layer ``i`` is global iff ``(i + 1) % 4 == 0``
(``sliding_window_pattern=4``), else sliding-window. RoPE: HF (transformers 5) gives each layer type
its own ``rope_parameters``; the releases scale (YaRN) the global layers only, the sliding layers
rotate with the plain frequencies of the same theta (``local_rope_max_timescale``). Untied head, SwiGLU.

MaxText (``decoder_block=olmo3``, ``models/olmo3.py: Olmo3DecoderLayer``) names a layer
``attention/{query,key,value,out}``, ``attention/{query,key}_norm`` (its ``GlobalRMSNorm``,
flat ``[heads * head_dim]`` as nnxtron's and HF's; MaxText uses it only when ``model_name`` starts
with ``olmo3``), ``post_self_attention_layer_norm`` / ``post_mlp_layer_norm`` and ``mlp/{wi_0,wi_1,wo}``;
it scans blocks of 4 layers. MaxText 0.2.5 applies ``rope_type`` (YaRN in olmo3-7b / 32b) to every
layer, sliding ones included; nnxtron's presets follow HF (docs/families.md). The HF ``config.json``
maps are ``models/olmo3_hf.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nnxtron.config.layout import PLAIN, LayerKind
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.layers import dropout
from nnxtron.layers.attention import gqa_attention
from nnxtron.layers.mlp import GatedMLP
from nnxtron.layers.norms import rms_norm
from nnxtron.models.family import Family, Golden, StrategyRow, WeightMap
from nnxtron.models.hf_common import GQA_WEIGHTS, QK_NORM_WEIGHTS, gated_mlp_weights, top_weights
from nnxtron.models.maxtext_map import MaxTextMap, Rule, mlp_rules
from nnxtron.models.olmo3_hf import PATTERN, config_from_hf, config_to_hf
from nnxtron.parallel.sharding import RESIDUAL, constrain


class Olmo3Block(nnx.Module):
    """One OLMo 3 layer of ``kind`` (sliding or global attention): norms on the sublayer outputs."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs, kind: LayerKind = PLAIN):
        if kind.moe:
            raise ConfigError("decoder_block olmo3 has no MoE layers; set num_experts=1")
        if cfg.attention_type != "global":
            raise ConfigError(
                f"decoder_block olmo3 has grouped-query attention; set attention_type=global, not {cfg.attention_type}"
            )
        self.attention = gqa_attention(cfg, rngs, kind, qk_norm="rms_projection")
        self.post_attention_norm = rms_norm(cfg)
        self.mlp = GatedMLP(
            cfg.base_emb_dim,
            cfg.base_mlp_dim,
            cfg.mlp_activations[0],
            dtype=jnp.dtype(cfg.dtype),
            weight_dtype=jnp.dtype(cfg.weight_dtype),
            rngs=rngs,
        )
        self.post_mlp_norm = rms_norm(cfg)
        self.dropout_rate = cfg.dropout_rate

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, dropout_keys: dropout.Keys | None = None
    ) -> jax.Array:
        """With ``dropout_keys`` (training) the MLP's intermediate activations and the layer output are
        dropped, as in MaxText (``layers.dropout``)."""
        x = checkpoint_name(constrain(x, RESIDUAL), "decoder_layer_input")
        h = x + self.post_attention_norm(self.attention(x, positions, segment_ids))
        hidden = self.mlp(h, dropout.site_dropout(dropout_keys, self.dropout_rate, dropout.MLP))
        return dropout.dropout(h + self.post_mlp_norm(hidden), dropout_keys, self.dropout_rate, dropout.LAYER_OUTPUT)


LAYER_WEIGHTS = (
    *GQA_WEIGHTS,
    *QK_NORM_WEIGHTS,  # flat [heads * head_dim] in HF and nnxtron
    WeightMap("post_attention_norm/scale", "post_attention_layernorm.weight"),
    *gated_mlp_weights("mlp", "mlp"),
    WeightMap("post_mlp_norm/scale", "post_feedforward_layernorm.weight"),
)


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    return LAYER_WEIGHTS


_MAXTEXT_LAYER = tuple(
    Rule(f"attention/{n}", f"attention/{n}")
    for n in ("query/kernel", "key/kernel", "value/kernel", "out/kernel", "query_norm/scale", "key_norm/scale")
) + (
    Rule("post_self_attention_layer_norm/scale", "post_attention_norm/scale"),
    Rule("post_mlp_layer_norm/scale", "post_mlp_norm/scale"),
)


def maxtext_layer_rules(cfg: Config, kind: LayerKind) -> tuple[Rule, ...]:
    """MaxText's OLMo 3 layer: its attention is ``attention/`` (not ``self_attention/``); no conventions to
    convert (its query is scaled at run time); no biases (``config/olmo3.py`` refuses ``attention_bias``)."""
    return (*_MAXTEXT_LAYER, *mlp_rules("mlp/", "mlp/"))


FAMILIES = (
    Family(
        name="olmo3",
        hf_model_type="olmo3",
        hf_architecture="Olmo3ForCausalLM",
        make_block=Olmo3Block,
        layer_weights=layer_weights,
        top_weights=top_weights,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        maxtext=MaxTextMap(maxtext_layer_rules, scan_cycle=PATTERN),
        goldens=(Golden("olmo3", "olmo3"),),
        # the whole-projection qk-norm's statistic across heads split over the tensor axis
        strategy_rows=(StrategyRow("olmo3-tiny", True, "full", "fsdp4_tensor2", 2),),
    ),
)
