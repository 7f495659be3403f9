"""Qwen2 / Qwen2.5: the pre-norm block (``models/prenorm.py``) with biased query, key and value projections.

HF ``Qwen2ForCausalLM`` (``decoder_block=qwen2``) is Llama's layer whose ``q_proj``, ``k_proj`` and
``v_proj`` always carry biases (its config has no ``attention_bias`` entry) and whose ``o_proj`` has
none. In nnxtron that is ``attention_bias=true`` (MaxText's key), and the family's rule
(``config/families.py``: ``attention_out_bias=False``) leaves the output projection unbiased, as
MaxText's ``Attention`` does for ``decoder_block=qwen2``. HF's sliding layers (``use_sliding_window``)
are refused. The biases load as ``[heads, head_dim]`` from HF's flat ``[heads * head_dim]``.

MaxText (``decoder_block=qwen2``, ``Qwen2DecoderLayer``) names a layer as Llama's plus
``self_attention/{query,key,value}/bias`` (``maxtext_map.attention_rules``); it scales the query by
``head_dim ** -0.5`` at run time (``query_pre_attn_scalar``), as nnxtron does, so nothing is folded.
"""

from __future__ import annotations

from typing import Any

from nnxtron.config.layout import LayerKind
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.models.family import Golden, StrategyRow, WeightMap
from nnxtron.models.hf_common import (
    GQA_BIAS_WEIGHTS,
    check_exportable,
    common_config_from_hf,
    common_config_to_hf,
    window_off_from_hf,
)
from nnxtron.models.llama import LAYER_WEIGHTS
from nnxtron.models.maxtext_map import pre_norm_map
from nnxtron.models.prenorm import pre_norm_family


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    return LAYER_WEIGHTS + GQA_BIAS_WEIGHTS if cfg.attention_bias else LAYER_WEIGHTS


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """nnxtron config values for an HF Qwen2 ``config.json`` (``attention_bias=true``: HF's q/k/v biases)."""
    values = common_config_from_hf(hf, "qwen2", qkv_bias=True)
    values.update(window_off_from_hf(hf, "Qwen2"))
    return values


def config_to_hf(cfg: Config) -> dict[str, Any]:
    check_exportable(cfg, "Qwen2")
    if cfg.rope_interleave or cfg.sliding_window_size:
        raise ConfigError("HF Qwen2 needs rope_interleave=false and sliding_window_size=0")
    hf = common_config_to_hf(cfg, "qwen2", "Qwen2ForCausalLM", qkv_bias=True)
    hf.update(use_sliding_window=False, sliding_window=None)
    return hf


FAMILIES = (
    pre_norm_family(
        "qwen2",
        "qwen2",
        "Qwen2ForCausalLM",
        layer_weights,
        config_from_hf,
        config_to_hf,
        maxtext=pre_norm_map(),  # dense layers only; the biases: attention_rules
        goldens=(Golden("qwen2", "qwen2"),),
        # the biases sharded over the tensor axis with the heads; the projections (bias included) saved
        strategy_rows=(StrategyRow("qwen2-tiny", True, "save_qkv_proj", "fsdp4_tensor2", 2),),
    ),
)
