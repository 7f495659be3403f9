"""Qwen3 dense and MoE: the pre-norm block (``models/prenorm.py``) with per-head q/k RMSNorm before RoPE.

HF ``Qwen3ForCausalLM`` (``decoder_block=qwen3``) and ``Qwen3MoeForCausalLM``
(``decoder_block=qwen3_moe``: softmax top-k routing, renormalised when
``norm_topk_prob``). Qwen3-MoE's dense layers (HF: layer ``i`` is MoE iff ``i`` is not in
``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; the others are dense MLPs of
``intermediate_size``) map to ``interleave_moe_layer_step`` = ``decoder_sparse_step`` and
``dense_layers`` = ``mlp_only_layers``, or ``first_num_dense_layers`` when they are a prefix and
the step is 1 (a scanned stack of their own). Experts load from the hub layout
(``mlp.experts.{e}.*_proj``) or the transformers >= 5 fused one; export writes the hub layout.

MaxText (``decoder_block=qwen3`` / ``qwen3_moe``, ``MAXTEXT``) names a layer as Llama's plus
``self_attention/{query,key}_norm/scale``; its MoE layers hold ``moe_block/{gate/kernel,wi_0,wi_1,wo}``.
Values are the same: MaxText scales the normed, rotated query by ``head_dim ** -0.5`` at run time
(``query_pre_attn_scalar``), as nnxtron does, and its RMSNorms multiply by ``scale`` as nnxtron's.
"""

from __future__ import annotations

from typing import Any

from nnxtron.config.layout import LayerKind
from nnxtron.config.schema import Config
from nnxtron.errors import CheckpointError, ConfigError
from nnxtron.models.family import Golden, StrategyRow, WeightMap
from nnxtron.models.hf_common import (
    GQA_WEIGHTS,
    NORM_WEIGHTS,
    QK_NORM_WEIGHTS,
    check_exportable,
    common_config_from_hf,
    common_config_to_hf,
    routed_expert_weights,
    window_off_from_hf,
)
from nnxtron.models.llama import LAYER_WEIGHTS
from nnxtron.models.maxtext_map import PRE_NORMS, MaxTextMap, Rule, attention_rules, expert_rules, mlp_rules
from nnxtron.models.prenorm import pre_norm_family

MOE_WEIGHTS = routed_expert_weights("mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj"))


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    if kind.moe:
        return NORM_WEIGHTS + GQA_WEIGHTS + QK_NORM_WEIGHTS + MOE_WEIGHTS
    return LAYER_WEIGHTS + QK_NORM_WEIGHTS


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    moe = hf["model_type"] == "qwen3_moe"
    values = common_config_from_hf(hf, "qwen3_moe" if moe else "qwen3")
    values.update(window_off_from_hf(hf, "Qwen3"), use_qk_norm=True)
    if moe:
        values.update(_dense_layers_from_hf(hf))
        values.update(
            num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),  # 5.24 saves num_local_experts
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            base_moe_mlp_dim=int(hf["moe_intermediate_size"]),
            routed_score_func="softmax",
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        )
    return values


def _dense_layers_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """``decoder_sparse_step`` and ``mlp_only_layers`` as nnxtron's layer-pattern keys."""
    step = int(hf.get("decoder_sparse_step") or 1)
    layers = int(hf["num_hidden_layers"])
    dense = sorted({int(i) for i in hf.get("mlp_only_layers") or ()} & set(range(layers)))  # HF ignores other indices
    if step == 1 and dense == list(range(len(dense))):
        return {"interleave_moe_layer_step": 1, "first_num_dense_layers": len(dense), "dense_layers": ()}
    return {"interleave_moe_layer_step": step, "first_num_dense_layers": 0, "dense_layers": tuple(dense)}


def config_to_hf(cfg: Config) -> dict[str, Any]:
    moe = cfg.decoder_block == "qwen3_moe"
    check_exportable(cfg, "qwen3", moe=moe, qk_norm=True, dense_layers=moe)
    if not cfg.use_qk_norm or cfg.rope_interleave or cfg.sliding_window_size:
        raise ConfigError("HF Qwen3 needs use_qk_norm=true, rope_interleave=false and sliding_window_size=0")
    hf = common_config_to_hf(cfg, "qwen3_moe" if moe else "qwen3", "Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM")
    hf.update(use_sliding_window=False, sliding_window=None)
    if moe:
        if cfg.routed_score_func != "softmax" or cfg.shared_experts:
            raise ConfigError("HF Qwen3-MoE routes by softmax top-k, without shared experts")
        hf.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.base_moe_mlp_dim,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=cfg.interleave_moe_layer_step,
            mlp_only_layers=sorted(set(range(cfg.first_num_dense_layers)) | set(cfg.dense_layers)),
            router_aux_loss_coef=cfg.load_balance_loss_weight,
        )
    return hf


MAXTEXT_QK_NORMS = tuple(Rule(f"self_attention/{n}_norm/scale", f"attention/{n}_norm/scale") for n in ("query", "key"))


def maxtext_layer_rules(cfg: Config, kind: LayerKind) -> tuple[Rule, ...]:
    """MaxText's Qwen3 layer (``Qwen3DecoderLayer``) or Qwen3-MoE layer (``Qwen3MoeDecoderLayer``):
    MaxText's ``qwen3`` has dense layers only, its ``qwen3_moe`` MoE layers only."""
    moe = cfg.decoder_block == "qwen3_moe"
    if kind.moe != moe:
        raise CheckpointError(
            f"MaxText's decoder_block={cfg.decoder_block} has {'MoE' if moe else 'dense'} layers only, this model has a "
            f"{'MoE' if kind.moe else 'dense'} layer (num_experts, first_num_dense_layers, dense_layers, "
            "interleave_moe_layer_step); it has no MaxText checkpoint"
        )
    mlp = expert_rules("moe_block/") if kind.moe else mlp_rules("mlp/", "mlp/")
    return (*attention_rules(cfg), *MAXTEXT_QK_NORMS, *PRE_NORMS, *mlp)


MAXTEXT = MaxTextMap(maxtext_layer_rules)

FAMILIES = (
    pre_norm_family(
        "qwen3",
        "qwen3",
        "Qwen3ForCausalLM",
        layer_weights,
        config_from_hf,
        config_to_hf,
        maxtext=MAXTEXT,
        goldens=(Golden("qwen3", "mixtral_qwen3"),),
        strategy_rows=(StrategyRow("qwen3-tiny", True, "save_dot_except_mlp", "fsdp2_context4", 2),),  # qk-norm, context parallel
    ),
    pre_norm_family(
        "qwen3_moe",
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        layer_weights,
        config_from_hf,
        config_to_hf,
        maxtext=MAXTEXT,
        goldens=(
            Golden("qwen3_moe", "mixtral_qwen3", fused_checked=True),
            Golden("qwen3_moe_norenorm", "mixtral_qwen3"),
            Golden("qwen3_moe_dense", "mixtral_qwen3", fused_checked=True),
            Golden("qwen3_moe_prefix", "mixtral_qwen3", fused_checked=True),
        ),
        # the load-balance loss is not additive over microbatches: no accumulation in its row
        strategy_rows=(StrategyRow("qwen3-moe-tiny", True, "none", "fsdp4_tensor2", 1, (("load_balance_loss_weight", 0.01),)),),
    ),
)
