"""Qwen3 dense and MoE: the pre-norm block (``models/prenorm.py``) with per-head q/k RMSNorm before RoPE.

HF ``Qwen3ForCausalLM`` (``decoder_block=qwen3``) and ``Qwen3MoeForCausalLM``
(``decoder_block=qwen3_moe``: softmax top-k routing, renormalised when
``norm_topk_prob``; every layer is MoE — ``decoder_sparse_step`` 1, no
``mlp_only_layers``). Experts load from the hub layout (``mlp.experts.{e}.*_proj``) or
the transformers >= 5 fused one; export writes the hub layout.
"""

from __future__ import annotations

from typing import Any

from nnxtron.config.layout import LayerKind
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.models.family import WeightMap
from nnxtron.models.hf_common import (
    GQA_WEIGHTS,
    NORM_WEIGHTS,
    QK_NORM_WEIGHTS,
    check_exportable,
    common_config_from_hf,
    common_config_to_hf,
    routed_expert_weights,
)
from nnxtron.models.llama import LAYER_WEIGHTS
from nnxtron.models.prenorm import pre_norm_family

MOE_WEIGHTS = routed_expert_weights("mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj"))


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    if kind.moe:
        return NORM_WEIGHTS + GQA_WEIGHTS + QK_NORM_WEIGHTS + MOE_WEIGHTS
    return LAYER_WEIGHTS + QK_NORM_WEIGHTS


def _check_no_window(hf: dict[str, Any]) -> None:
    if hf.get("use_sliding_window"):
        raise ConfigError("HF use_sliding_window=true (Qwen3 sliding layers) is not supported; use a checkpoint without it")


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    _check_no_window(hf)
    moe = hf["model_type"] == "qwen3_moe"
    values = common_config_from_hf(hf, "qwen3_moe" if moe else "qwen3")
    values.update(use_qk_norm=True, sliding_window_size=0)
    if moe:
        if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
            raise ConfigError("HF Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not supported")
        values.update(
            num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),  # 5.24 saves num_local_experts
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            base_moe_mlp_dim=int(hf["moe_intermediate_size"]),
            routed_score_func="softmax",
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        )
    return values


def config_to_hf(cfg: Config) -> dict[str, Any]:
    check_exportable(cfg, "qwen3", moe=cfg.decoder_block == "qwen3_moe", qk_norm=True)
    if not cfg.use_qk_norm or cfg.rope_interleave or cfg.sliding_window_size:
        raise ConfigError("HF Qwen3 needs use_qk_norm=true, rope_interleave=false and sliding_window_size=0")
    moe = cfg.decoder_block == "qwen3_moe"
    hf = common_config_to_hf(cfg, "qwen3_moe" if moe else "qwen3", "Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM")
    hf.update(use_sliding_window=False, sliding_window=None)
    if moe:
        if cfg.routed_score_func != "softmax" or cfg.shared_experts or cfg.first_num_dense_layers:
            raise ConfigError("HF Qwen3-MoE routes by softmax top-k, without shared experts or dense layers")
        hf.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.base_moe_mlp_dim,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=cfg.load_balance_loss_weight,
        )
    return hf


FAMILIES = (
    pre_norm_family("qwen3", "qwen3", "Qwen3ForCausalLM", layer_weights, config_from_hf, config_to_hf),
    pre_norm_family("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", layer_weights, config_from_hf, config_to_hf),
)
