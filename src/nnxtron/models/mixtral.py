"""Mixtral: the pre-norm block (``models/prenorm.py``) with a routed MoE feed-forward (softmax top-k, renormalised).

HF ``MixtralForCausalLM``. The hub checkpoint (what ``save_pretrained`` writes) keeps
one tensor per expert (``block_sparse_moe.experts.{e}.w1/w3/w2``); transformers >= 5
fuses them in memory (``mlp.experts.gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``,
router ``mlp.gate``). Both load; export writes the hub layout.
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
    routed_expert_weights,
)
from nnxtron.models.maxtext_map import expert_rules, pre_norm_map
from nnxtron.models.prenorm import pre_norm_family

MOE_WEIGHTS = routed_expert_weights("block_sparse_moe.gate", "block_sparse_moe.experts", ("w1", "w3", "w2"), "mlp.gate")


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    if not kind.moe:
        raise ConfigError("decoder_block mixtral has only MoE layers; set num_experts > 1 and first_num_dense_layers=0")
    return NORM_WEIGHTS + GQA_WEIGHTS + MOE_WEIGHTS


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    values = common_config_from_hf(hf, "mixtral", head_dim_zero_is_default=True)  # MixtralAttention: head_dim or width // heads
    values.update(
        num_experts=int(hf["num_local_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        base_moe_mlp_dim=int(hf["intermediate_size"]),
        routed_score_func="softmax",
        norm_topk_prob=True,
    )
    return values


def config_to_hf(cfg: Config) -> dict[str, Any]:
    check_exportable(cfg, "mixtral", moe=True)
    if cfg.routed_score_func != "softmax" or not cfg.norm_topk_prob or cfg.shared_experts or cfg.first_num_dense_layers:
        raise ConfigError("HF Mixtral routes by softmax top-k with renormalisation, without shared experts or dense layers")
    if cfg.rope_interleave:
        raise ConfigError("rope_interleave=true has no HF Mixtral equivalent; export needs rope_interleave=false")
    hf = common_config_to_hf(cfg, "mixtral", "MixtralForCausalLM")
    del hf["attention_bias"]
    hf.update(
        intermediate_size=cfg.base_moe_mlp_dim,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        sliding_window=cfg.sliding_window_size or None,
        router_aux_loss_coef=cfg.load_balance_loss_weight,
    )
    return hf


MAXTEXT = pre_norm_map(lambda cfg: expert_rules("MoeBlock_0/"))
FAMILIES = (
    pre_norm_family(
        "mixtral",
        "mixtral",
        "MixtralForCausalLM",
        layer_weights,
        config_from_hf,
        config_to_hf,
        maxtext=MAXTEXT,
        goldens=(Golden("mixtral", "mixtral_qwen3", fused_checked=True),),
        strategy_rows=(StrategyRow("mixtral-tiny", True, "full", "data2_fsdp4", 2),),
    ),
)
