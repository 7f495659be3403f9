"""Gemma (v1): the pre-norm block (``models/prenorm.py``) with Gemma's norms, GeGLU and scaled embeddings.

HF ``GemmaForCausalLM`` (``decoder_block=gemma``). Per layer::

    h = x + o(attn(rope(q(norm_in(x))), rope(k(.)), v(.)))        # logits x head_dim^-0.5
    y = h + down(gelu_tanh(gate(norm_post(h))) * up(norm_post(h)))

Every RMSNorm (the two of a layer and the final one) is Gemma's zero-centred ``x_hat * (1 + w)``
in float32; token embeddings are multiplied by ``sqrt(emb_dim)`` rounded to the table's dtype (as
HF); the head is tied (``normalize_embedding_logits=true`` makes nnxtron's tied head HF's
``x @ E^T``, see ``layers/embed.py``). Gemma 2b is multi-query (1 key/value head), 7b multi-head;
both have ``head_dim`` 256. No soft caps, no sliding window, no qk-norm.

MaxText (``decoder_block=gemma``, ``models/gemma.py: GemmaDecoderLayer``) names a layer
``pre_self_attention_norm`` / ``self_attention/{query,key,value,out}`` / ``pre_ffw_norm`` /
``mlp/{wi_0,wi_1,wo}``; its norms store ``1 + w`` (``NORM_OFFSET``), its table holds the
``sqrt(emb_dim)`` input scale (``EMBED_SCALE``) and its query kernel folds ``1/sqrt(head_dim)``
(``config/families.py``: ``maxtext_query_folded``; a MaxText config runs ``query_pre_attn_scalar=1``).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from nnxtron.config.layout import PLAIN, LayerKind
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.models.family import Golden, StrategyRow, WeightMap
from nnxtron.models.gemma3 import gemma_norm, maxtext_top_level  # the final norm and top-level MaxText rules: Gemma 3's
from nnxtron.models.hf_common import (
    GELU_TANH,
    GQA_WEIGHTS,
    NORM_WEIGHTS,
    check_exportable,
    common_config_from_hf,
    common_config_to_hf,
    gated_mlp_weights,
    hf_ties_head,
)
from nnxtron.models.maxtext_map import NORM_OFFSET, MaxTextMap, Rule, attention_rules, mlp_rules
from nnxtron.models.prenorm import PreNormBlock, pre_norm_family

LAYER_WEIGHTS = NORM_WEIGHTS + GQA_WEIGHTS + gated_mlp_weights("mlp", "mlp")


def make_block(cfg: Config, rngs: nnx.Rngs, kind: LayerKind = PLAIN) -> PreNormBlock:
    """One Gemma layer: the pre-norm block with zero-centred norms (a qk-norm, if set, is Gemma's too)."""
    if kind.moe:
        raise ConfigError("decoder_block gemma has no MoE layers; set num_experts=1")
    return PreNormBlock(cfg, rngs, kind, qk_norm="rms_zero_centered", zero_centered=True)


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    return LAYER_WEIGHTS


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """nnxtron config values for an HF Gemma ``config.json`` (HF's defaults: head_dim 256, tied head)."""
    for key in ("use_bidirectional_attention", "hidden_activation"):
        if hf.get(key) and not (key == "hidden_activation" and hf[key] in GELU_TANH):
            raise ConfigError(f"HF Gemma {key}={hf[key]!r} is not supported by decoder_block gemma")
    values = common_config_from_hf({"head_dim": 256, "tie_word_embeddings": True, **hf}, "gemma", gelu_acts=(*GELU_TANH, "gelu"))
    if values["sliding_window_size"]:
        raise ConfigError("HF Gemma has no sliding window; a config with sliding_window is not Gemma v1's")
    values["normalize_embedding_logits"] = True  # with the sqrt(emb_dim) input scale: HF's tied head x @ E^T
    return values


def config_to_hf(cfg: Config) -> dict[str, Any]:
    check_exportable(cfg, "Gemma")
    if cfg.rope_interleave or cfg.sliding_window_size or cfg.final_logits_soft_cap:
        raise ConfigError("HF Gemma needs rope_interleave=false, sliding_window_size=0 and final_logits_soft_cap=0")
    if list(cfg.mlp_activations) != ["gelu", "linear"]:
        raise ConfigError(f"HF Gemma's MLP is GeGLU; export needs mlp_activations=[gelu, linear], not {cfg.mlp_activations}")
    hf = common_config_to_hf(cfg, "gemma", "GemmaForCausalLM")
    hf.update(hidden_act="gelu_pytorch_tanh", tie_word_embeddings=hf_ties_head(cfg, input_scale=True))
    return hf


_MAXTEXT_NORMS = (
    Rule("pre_self_attention_norm/scale", "pre_attention_norm/scale", NORM_OFFSET),
    Rule("pre_ffw_norm/scale", "post_attention_norm/scale", NORM_OFFSET),
)


def maxtext_layer_rules(cfg: Config, kind: LayerKind) -> tuple[Rule, ...]:
    """MaxText's Gemma layer: its norms store ``w`` where nnxtron stores ``w - 1`` (``NORM_OFFSET``)."""
    return (*attention_rules(cfg), *_MAXTEXT_NORMS, *mlp_rules("mlp/", "mlp/"))


FAMILIES = (
    pre_norm_family(
        "gemma",
        "gemma",
        "GemmaForCausalLM",
        layer_weights,
        config_from_hf,
        config_to_hf,
        make_block=make_block,
        make_final_norm=gemma_norm,
        scale_embeddings=True,
        maxtext=MaxTextMap(maxtext_layer_rules, maxtext_top_level),
        goldens=(Golden("gemma", "gemma"),),
        # multi-query: its one key/value head cannot split over a tensor axis (refused), so the sequence
        # is split over context (the one key/value head gathered), the tied, scaled table over fsdp
        strategy_rows=(StrategyRow("gemma-tiny", True, "full", "fsdp2_context4", 2),),
    ),
)
