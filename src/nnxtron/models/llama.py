"""Llama 2 / 3 / 3.1 and Mistral: the pre-norm block (``models/prenorm.py``) with GQA and
the gated MLP; their HF weight and config maps.

Mistral is the same block; its sliding window comes from ``sliding_window_size``.
"""

from __future__ import annotations

from typing import Any

from nnxtron.config.layout import LayerKind
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.models.family import Golden, StrategyRow, WeightMap
from nnxtron.models.hf_common import (
    GQA_WEIGHTS,
    NORM_WEIGHTS,
    check_exportable,
    common_config_from_hf,
    common_config_to_hf,
    gated_mlp_weights,
)
from nnxtron.models.maxtext_map import pre_norm_map
from nnxtron.models.prenorm import pre_norm_family

LAYER_WEIGHTS = NORM_WEIGHTS + GQA_WEIGHTS + gated_mlp_weights("mlp", "mlp")


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    return LAYER_WEIGHTS


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """nnxtron config values for an HF Llama/Mistral ``config.json`` (MistralAttention reads head_dim 0 as the default)."""
    mistral = hf["model_type"] == "mistral"
    return common_config_from_hf(hf, "mistral" if mistral else "llama2", head_dim_zero_is_default=mistral)


def config_to_hf(cfg: Config) -> dict[str, Any]:
    check_exportable(cfg, "Llama/Mistral")
    if cfg.rope_interleave:
        raise ConfigError("rope_interleave=true has no HF Llama/Mistral equivalent; export needs rope_interleave=false")
    mistral = cfg.decoder_block == "mistral"
    hf = common_config_to_hf(cfg, "mistral" if mistral else "llama", "MistralForCausalLM" if mistral else "LlamaForCausalLM")
    if mistral:
        hf["sliding_window"] = cfg.sliding_window_size or None
        del hf["attention_bias"]
    elif cfg.sliding_window_size:
        raise ConfigError("sliding_window_size > 0 has no HF Llama equivalent; use decoder_block=mistral")
    else:
        hf["mlp_bias"] = False
    return hf


MAXTEXT = pre_norm_map()  # dense layers only

FAMILIES = (
    pre_norm_family(
        "llama2",
        "llama",
        "LlamaForCausalLM",
        layer_weights,
        config_from_hf,
        config_to_hf,
        maxtext=MAXTEXT,
        # no strategy rows of its own: the matrix's rows run llama3.1-tiny
        goldens=(Golden("llama2", "llama"), Golden("llama31", "llama")),
    ),
    pre_norm_family(
        "mistral",
        "mistral",
        "MistralForCausalLM",
        layer_weights,
        config_from_hf,
        config_to_hf,
        maxtext=MAXTEXT,
        goldens=(Golden("mistral", "llama"),),
        strategy_rows=(StrategyRow("mistral-tiny", True, "minimal", "fsdp4_tensor2", 2),),  # sliding window 8 < 16 tokens
    ),
)
