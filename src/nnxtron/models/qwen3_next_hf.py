"""Qwen3-Next's HF ``config.json`` maps (``models/qwen3_next.py`` is the family: block and weights).

Kept apart from the block so that the flag matrix's family cases run the block's reads; the conversions'
reads are proven by the HF round trip and goldens (``tests/flags/read_sites_not_proven.py``: CONVERSION).
"""

from __future__ import annotations

from typing import Any

from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.models.hf_common import check_exportable, common_config_from_hf, common_config_to_hf

HF_PARTIAL_ROTARY = 0.25  # transformers' Qwen3NextConfig default when the config names none
GDN_KEYS = (  # nnxtron key, HF key
    ("gdn_conv_kernel_dim", "linear_conv_kernel_dim"),
    ("gdn_key_head_dim", "linear_key_head_dim"),
    ("gdn_value_head_dim", "linear_value_head_dim"),
    ("gdn_num_key_heads", "linear_num_key_heads"),
    ("gdn_num_value_heads", "linear_num_value_heads"),
)


def hf_layer_types(layers: int, interval: int) -> list[str]:
    """HF's ``layer_types``: every ``interval``-th layer ``full_attention``, the others ``linear_attention``."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def _interval(hf: dict[str, Any], decoder_block: str) -> int:
    """The full-attention interval of HF ``layer_types`` (or ``full_attention_interval``); other patterns raise."""
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if not types:
        return int(hf.get("full_attention_interval") or 4)
    fulls = [i for i, t in enumerate(types) if t == "full_attention"]
    interval = fulls[0] + 1 if fulls else layers + 1
    if list(types) != hf_layer_types(layers, interval):
        raise ConfigError(
            f"HF layer_types {types} is not one full-attention layer every N layers (the last of each N); "
            f"decoder_block {decoder_block} supports only that pattern"
        )
    return interval


def config_from_hf(hf: dict[str, Any], decoder_block: str = "qwen3_next") -> dict[str, Any]:
    """nnxtron config values for an HF ``qwen3_next`` ``config.json`` (or, as ``decoder_block``, a config of the same
    keys: ``models/qwen3_5_hf.py``)."""
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step") or 1) != 1:
        raise ConfigError("HF qwen3_next with dense layers (mlp_only_layers, decoder_sparse_step > 1) is not supported")
    moe, shared = int(hf["moe_intermediate_size"]), int(hf["shared_expert_intermediate_size"])
    if shared % moe:
        raise ConfigError(
            f"HF shared_expert_intermediate_size={shared} is not a multiple of moe_intermediate_size={moe}; nnxtron's "
            "shared expert is shared_experts x base_moe_mlp_dim wide"
        )
    values = common_config_from_hf(hf, decoder_block)
    rope = hf.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", HF_PARTIAL_ROTARY))
    values.update(
        use_qk_norm=True,
        sliding_window_size=0,
        inhomogeneous_layer_cycle_interval=_interval(hf, decoder_block),
        partial_rotary_factor=float(partial),
        num_experts=int(hf["num_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        base_moe_mlp_dim=moe,
        shared_experts=shared // moe,
        routed_score_func="softmax",
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        **{key: int(hf[hf_key]) for key, hf_key in GDN_KEYS if hf.get(hf_key) is not None},
    )
    return values


def config_to_hf(cfg: Config, model_type: str = "qwen3_next", architecture: str = "Qwen3NextForCausalLM") -> dict[str, Any]:
    """The HF ``config.json`` of a qwen3_next config (``config/qwen3_next.py`` has already checked its rules), or
    of Qwen3.5's with its ``model_type`` and ``architecture`` (``models/qwen3_5_hf.py`` drops the keys it lacks)."""
    check_exportable(cfg, model_type, moe=True, qk_norm=True)
    if cfg.rope_interleave or cfg.capacity_factor > 0 or cfg.routed_scaling_factor != 1.0:
        raise ConfigError(f"HF {architecture} needs rope_interleave=false, capacity_factor=-1 and routed_scaling_factor=1")
    if cfg.logits_via_embedding and cfg.normalize_embedding_logits:
        raise ConfigError(f"HF {architecture}'s tied head is x @ E^T; export needs normalize_embedding_logits=false")
    hf = common_config_to_hf(cfg, model_type, architecture)
    hf["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
    hf.update(
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.base_moe_mlp_dim,
        shared_expert_intermediate_size=cfg.shared_experts * cfg.base_moe_mlp_dim,
        norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        layer_types=hf_layer_types(cfg.base_num_decoder_layers, cfg.inhomogeneous_layer_cycle_interval),
        router_aux_loss_coef=cfg.load_balance_loss_weight,
        **{hf_key: getattr(cfg, key) for key, hf_key in GDN_KEYS},
    )
    return hf
