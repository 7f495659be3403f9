"""Gemma 2: sliding-window and global layers alternating (local first), sandwich norms, soft caps.

HF ``Gemma2ForCausalLM`` (``decoder_block=gemma2``). Gemma 3's block (``models/gemma3.py``)
without the qk-norm; per layer::

    a = attn(norm_in(x))            # logits x query_pre_attn_scalar^-0.5, then 50 * tanh(logits / 50)
    h = x + norm_post_attn(a)
    y = h + norm_post_ffw(down(gelu_tanh(gate(norm_pre_ffw(h))) * up(.)))

Every RMSNorm is Gemma's zero-centred ``x_hat * (1 + w)`` in float32. Layer ``i`` is global iff
``(i + 1) % 2 == 0`` (``sliding_window_pattern=2``: layer 0 slides, window 4096); both kinds share
one RoPE base (``rope_max_timescale``, 1e4). The attention logits are soft-capped
(``attn_logits_soft_cap``, 50) before the mask, the output logits too (``final_logits_soft_cap``,
30); token embeddings are multiplied by ``sqrt(emb_dim)`` and the head is tied (as Gemma 3).

MaxText (``decoder_block=gemma2``, ``models/gemma2.py: Gemma2DecoderLayer``) holds a local and a
global layer in one of its layers: ``base_num_decoder_layers`` there counts the pairs
(``config/maxtext_keys.py`` doubles it) and its checkpoint names layer ``2p`` / ``2p + 1``
``decoder/layers_{p}/..._local`` / ``..._global`` (scanned over the pairs: ``decoder/layers/..._local``).
Its query kernel folds ``1/sqrt(head_dim)`` (``config/families.py``: ``maxtext_query_folded``;
MaxText's converter does so even for gemma2-27b, whose HF ``query_pre_attn_scalar`` is 144, not
``head_dim`` 128): a MaxText config runs ``query_pre_attn_scalar=1`` on the kernels as stored, and an
nnxtron model with HF's ``query_pre_attn_scalar`` writes MaxText kernels times
``query_pre_attn_scalar ** -0.5``, so MaxText computes HF's function.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from nnxtron.config.layout import PLAIN, LayerKind
from nnxtron.config.schema import Config
from nnxtron.errors import CheckpointError, ConfigError
from nnxtron.models.family import Family, Golden, StrategyRow, WeightMap
from nnxtron.models.gemma3 import LAYER_WEIGHTS as GEMMA3_LAYER_WEIGHTS
from nnxtron.models.gemma3 import Gemma3Block, gemma_norm, maxtext_top_level
from nnxtron.models.hf_common import (
    GELU_TANH,
    common_config_from_hf,
    common_config_to_hf,
    hf_layer_types,
    hf_ties_head,
    top_weights,
)
from nnxtron.models.maxtext_map import NORM_OFFSET, MaxTextMap, Rule, attention_rules, mlp_rules

PATTERN = 2  # HF's layer_types: sliding_attention, full_attention, sliding_attention, ...


class Gemma2Block(Gemma3Block):
    """One Gemma 2 layer of ``kind`` (sliding or global): Gemma 3's layer without a qk-norm."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs, kind: LayerKind = PLAIN):
        if kind.moe:
            raise ConfigError("decoder_block gemma2 has no MoE layers; set num_experts=1")
        if cfg.use_qk_norm:
            raise ConfigError(
                "decoder_block gemma2 has no qk-norm; set use_qk_norm=false (Gemma 3 has one: decoder_block=gemma3)"
            )
        super().__init__(cfg, rngs, kind)


LAYER_WEIGHTS = tuple(w for w in GEMMA3_LAYER_WEIGHTS if "query_norm" not in w.path and "key_norm" not in w.path)


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    return LAYER_WEIGHTS


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """nnxtron config values for an HF ``gemma2`` ``config.json`` (HF's defaults where it leaves one out)."""
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("HF Gemma 2 use_bidirectional_attention=true is not supported by decoder_block gemma2")
    act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    if act not in GELU_TANH:
        raise ConfigError(f"HF Gemma 2 hidden_activation '{act}' is not supported; only gelu_pytorch_tanh")
    full = {"head_dim": 256, "tie_word_embeddings": True, "sliding_window": 4096, **hf, "hidden_act": act}
    layers = int(full["num_hidden_layers"])
    expected = hf_layer_types(layers, PATTERN)
    if list(hf.get("layer_types") or expected) != expected:
        raise ConfigError(
            f"HF layer_types {hf['layer_types']} is not Gemma 2's alternation (sliding_attention first); "
            "decoder_block gemma2 supports only that pattern"
        )
    values = common_config_from_hf(full, "gemma2", gelu_acts=GELU_TANH)
    if values["rope_type"] != "default":
        raise ConfigError(f"HF Gemma 2 rope_type '{values['rope_type']}' is not supported; only default")
    values.update(
        normalize_embedding_logits=True,  # with the sqrt(emb_dim) input scale: HF's tied head x @ E^T
        sliding_window_pattern=PATTERN,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 256),
        attn_logits_soft_cap=float(hf.get("attn_logit_softcapping") or 0.0),
        final_logits_soft_cap=float(hf.get("final_logit_softcapping") or 0.0),
    )
    return values


def config_to_hf(cfg: Config) -> dict[str, Any]:
    if cfg.num_experts > 1 or cfg.attention_type != "global" or cfg.rope_interleave or cfg.nope_layer_interval:
        raise ConfigError("HF Gemma 2 has no MoE, MLA, interleaved RoPE or NoPE layers; export a plain gemma2 config")
    if cfg.sliding_window_pattern != PATTERN or cfg.use_qk_norm or cfg.rope_type != "default":
        raise ConfigError("HF Gemma 2 needs sliding_window_pattern=2, use_qk_norm=false and rope_type=default")
    if cfg.local_rope_max_timescale not in (0.0, cfg.rope_max_timescale) or cfg.chunk_attn_window_size:
        raise ConfigError(
            "HF Gemma 2 has one RoPE base and no chunks; export needs local_rope_max_timescale=0 and chunk_attn_window_size=0"
        )
    if list(cfg.mlp_activations) != ["gelu", "linear"]:
        raise ConfigError(f"HF Gemma 2's MLP is GeGLU; export needs mlp_activations=[gelu, linear], not {cfg.mlp_activations}")
    hf = common_config_to_hf(cfg, "gemma2", "Gemma2ForCausalLM")
    del hf["hidden_act"]
    hf.update(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.resolved_head_dim,
        sliding_window=cfg.sliding_window_size,
        layer_types=hf_layer_types(cfg.base_num_decoder_layers, PATTERN),
        attn_logit_softcapping=cfg.attn_logits_soft_cap or None,
        final_logit_softcapping=cfg.final_logits_soft_cap or None,
        tie_word_embeddings=hf_ties_head(cfg, input_scale=True),  # the input scale sqrt(emb_dim): normalize is HF's
    )
    return hf


_MAXTEXT_NORMS = (
    ("pre_self_attention_norm", "pre_attention_norm"),
    ("post_self_attention_norm", "post_attention_norm"),
    ("pre_ffw_norm", "pre_ffw_norm"),
    ("post_ffw_norm", "post_ffw_norm"),
)


def _check_pairs(cfg: Config) -> None:
    if cfg.sliding_window_pattern != PATTERN or cfg.base_num_decoder_layers % PATTERN:
        raise CheckpointError(
            "MaxText's Gemma 2 layer holds a (sliding, global) pair of layers: a MaxText checkpoint needs "
            f"sliding_window_pattern=2 and an even base_num_decoder_layers (got {cfg.sliding_window_pattern}, "
            f"{cfg.base_num_decoder_layers})"
        )


def maxtext_layer_rules(cfg: Config, kind: LayerKind) -> tuple[Rule, ...]:
    """One nnxtron layer inside MaxText's pair: the ``_local`` (sliding) or ``_global`` sub-modules;
    its norms store ``w`` where nnxtron stores ``w - 1`` (``NORM_OFFSET``)."""
    _check_pairs(cfg)
    side = "local" if kind.attention == "sliding" else "global"
    rules = [Rule(f"{a}_{side}/scale", f"{b}/scale", NORM_OFFSET) for a, b in _MAXTEXT_NORMS]
    for rule in attention_rules(cfg):
        rules.append(Rule(rule.maxtext.replace("self_attention/", f"self_attention_{side}/", 1), rule.nnxtron, rule.convention))
    return (*rules, *mlp_rules(f"mlp_{side}/", "mlp/"))


def maxtext_layer_prefix(cfg: Config, layer: int) -> str:
    """Layer ``layer`` lies in MaxText's pair ``layer // 2``."""
    return f"decoder/layers_{layer // PATTERN}"


FAMILIES = (
    Family(
        name="gemma2",
        hf_model_type="gemma2",
        hf_architecture="Gemma2ForCausalLM",
        make_block=Gemma2Block,
        layer_weights=layer_weights,
        top_weights=top_weights,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        make_final_norm=gemma_norm,
        scale_embeddings=True,
        maxtext=MaxTextMap(maxtext_layer_rules, maxtext_top_level, layer_prefix=maxtext_layer_prefix),
        goldens=(Golden("gemma2", "gemma2"),),
        # 4 layers = 2 (sliding, global) pairs; the soft cap through the sharded attention (heads over tensor)
        strategy_rows=(StrategyRow("gemma2-tiny", True, "full", "fsdp4_tensor2", 2),),
    ),
)
