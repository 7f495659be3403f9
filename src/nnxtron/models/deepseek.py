"""DeepSeek-V3: multi-head latent attention, a dense prefix, then DeepSeekMoE layers.

HF ``DeepseekV3ForCausalLM``. Layers ``0 .. first_num_dense_layers-1`` use the dense
gated MLP (``base_mlp_dim``) and form the ``dense_layers`` stack; the rest form
``moe_layers``: sigmoid scores + correction bias (``mlp.gate.e_score_correction_bias``,
a non-trainable ``RouterBias``), group-limited top-k, weights renormalised and scaled by
``routed_scaling_factor``, plus the shared experts. Attention is MLA with YaRN RoPE on
the interleaved rope dims.

Multi-token prediction: the hub checkpoint stores ``num_nextn_predict_layers`` MTP layers after
the decoder's (``model.layers.61`` for the 61-layer model): ``enorm`` / ``hnorm`` (the
embedding's and the hidden state's norms), ``eh_proj`` (``[D, 2D]``: the embedding half
first), a decoder layer of the last layer's kind, ``shared_head.norm`` and copies of the
embedding and output head. They map to ``mtp_num_layers`` depths (``models/mtp.py``);
transformers' ``DeepseekV3ForCausalLM`` has no MTP and its ``save_pretrained`` drops them, so
a directory without them imports with ``mtp_num_layers=0`` (``convert/hf.py``).
"""

from __future__ import annotations

from typing import Any

from nnxtron.config.layout import LayerKind
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.models.family import Golden, WeightMap
from nnxtron.models.hf_common import (
    NORM_WEIGHTS,
    check_exportable,
    common_config_from_hf,
    common_config_to_hf,
    gated_mlp_weights,
    routed_expert_weights,
)
from nnxtron.models.maxtext_map import Rule, expert_rules, mlp_rules, pre_norm_map
from nnxtron.models.prenorm import pre_norm_family


def mla_weights(cfg: Config) -> tuple[WeightMap, ...]:
    if cfg.q_lora_rank:
        query = (
            WeightMap("attention/wq_a/kernel", "self_attn.q_a_proj.weight", 1),
            WeightMap("attention/q_norm/scale", "self_attn.q_a_layernorm.weight"),
            WeightMap("attention/wq_b/kernel", "self_attn.q_b_proj.weight", 1),
        )
    else:
        query = (WeightMap("attention/wq/kernel", "self_attn.q_proj.weight", 1),)
    return query + (
        WeightMap("attention/wkv_a/kernel", "self_attn.kv_a_proj_with_mqa.weight", 1),
        WeightMap("attention/kv_norm/scale", "self_attn.kv_a_layernorm.weight"),
        WeightMap("attention/wkv_b/kernel", "self_attn.kv_b_proj.weight", 1),
        WeightMap("attention/out/kernel", "self_attn.o_proj.weight", 2),
    )


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    common = NORM_WEIGHTS + mla_weights(cfg)
    if not kind.moe:
        return common + gated_mlp_weights("mlp", "mlp")
    maps = common + routed_expert_weights("mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj"))
    if cfg.routed_bias:
        maps += (WeightMap("mlp/router_bias", "mlp.gate.e_score_correction_bias"),)
    if cfg.shared_experts:
        maps += gated_mlp_weights("mlp/shared", "mlp.shared_experts")
    return maps


MTP_WEIGHTS = (
    WeightMap("embedding_norm/scale", "enorm.weight"),
    WeightMap("hidden_norm/scale", "hnorm.weight"),
    WeightMap("projection/kernel", "eh_proj.weight", 1),
    WeightMap("final_norm/scale", "shared_head.norm.weight"),
)
MTP_COPIES = (("embed_tokens.weight", "model.embed_tokens.weight"), ("shared_head.head.weight", "lm_head.weight"))


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    values = common_config_from_hf(hf, "deepseek")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError("only DeepSeek-V3 routing (topk_method noaux_tc, scoring_func sigmoid) is supported")
    groups, keep = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    experts = int(hf["n_routed_experts"])
    values.update(
        attention_type="mla",
        q_lora_rank=int(hf.get("q_lora_rank") or 0),
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
        head_dim=int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"]),
        rope_interleave=bool(hf.get("rope_interleave", True)),
        num_experts=experts,
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        base_moe_mlp_dim=int(hf["moe_intermediate_size"]),
        shared_experts=int(hf.get("n_shared_experts") or 0),
        first_num_dense_layers=int(hf.get("first_k_dense_replace") or 0),
        routed_score_func="sigmoid",
        routed_bias=True,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        # one group kept of one is plain top-k
        n_routing_groups=groups if groups > 1 else -1,
        topk_routing_group=keep if groups > 1 else -1,
        mtp_num_layers=int(hf.get("num_nextn_predict_layers") or 0),
    )
    return values


def config_to_hf(cfg: Config) -> dict[str, Any]:
    check_exportable(cfg, "DeepSeek-V3", moe=True, mla=True)
    if cfg.routed_score_func != "sigmoid" or not cfg.routed_bias:
        raise ConfigError("HF DeepSeek-V3 routes by sigmoid scores with a correction bias (routed_bias=true)")
    hf = common_config_to_hf(cfg, "deepseek_v3", "DeepseekV3ForCausalLM")
    hf.update(
        head_dim=cfg.qk_rope_head_dim,  # HF names the rope part head_dim
        q_lora_rank=cfg.q_lora_rank or None,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_interleave=cfg.rope_interleave,
        n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.base_moe_mlp_dim,
        n_shared_experts=cfg.shared_experts,
        first_k_dense_replace=cfg.first_num_dense_layers,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
        n_group=max(cfg.n_routing_groups, 1),
        topk_group=max(cfg.topk_routing_group, 1),
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        num_nextn_predict_layers=cfg.mtp_num_layers,
    )
    return hf


def maxtext_moe_rules(cfg: Config) -> tuple[Rule, ...]:
    """MaxText's DeepSeek MoE layer: routed experts, the shared experts and the router bias (model state)."""
    moe = "DeepSeekMoeBlock_0/"
    rules = [*expert_rules(f"{moe}MoeBlock_0/"), *mlp_rules(f"{moe}shared_experts/", "mlp/shared/")]
    if cfg.routed_bias:
        rules.append(Rule(f"{moe}MoeBlock_0/gate/bias", "mlp/router_bias", state=True))
    return tuple(rules)


def maxtext_layer_prefix(cfg: Config, layer: int) -> str:
    """MaxText names the dense prefix and the MoE layers apart: ``dense_layers_{i}``, ``moe_layers_{i - dense}``."""
    dense = cfg.first_num_dense_layers
    return f"decoder/dense_layers_{layer}" if layer < dense else f"decoder/moe_layers_{layer - dense}"


FAMILIES = (
    pre_norm_family(
        "deepseek",
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        layer_weights,
        config_from_hf,
        config_to_hf,
        mtp_weights=MTP_WEIGHTS,
        mtp_copies=MTP_COPIES,
        maxtext=pre_norm_map(maxtext_moe_rules, maxtext_layer_prefix),
        # no strategy rows of its own: the matrix's MoE rows run deepseek3-test
        goldens=(Golden("deepseek3", "deepseek3", fused_checked=True), Golden("deepseek3_mtp", "deepseek3_mtp")),
    ),
)
