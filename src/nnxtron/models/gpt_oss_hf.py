"""GPT-OSS's HF ``config.json`` maps (``models/gpt_oss.py`` is the family: block, weights, MaxText names).

Kept apart from the block so that the flag matrix's family cases run the block's reads; the conversions'
reads are proven by the HF round trip and goldens (``tests/flags/read_sites_not_proven.py``: CONVERSION).
"""

from __future__ import annotations

from typing import Any

from nnxtron.config.gpt_oss import ACTIVATIONS, PATTERN
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.layers.mlp import GPT_OSS_ALPHA
from nnxtron.models.hf_common import PATTERN_FIELDS, common_config_from_hf, common_config_to_hf, hf_layer_types


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """nnxtron config values for an HF ``gpt_oss`` ``config.json``: the pre-norm families' shared entries
    (``common_config_from_hf``; YaRN with HF's ``truncate``), the sinks and biases HF always has, the
    alternating layers (HF's default ``layer_types``) and the experts (``swiglu_limit``; ``swiglu_alpha``
    must be 1.702, the constant MaxText and nnxtron use)."""
    layers = int(hf["num_hidden_layers"])
    expected = hf_layer_types(layers, PATTERN)
    if list(hf.get("layer_types") or expected) != expected:
        raise ConfigError(
            f"HF layer_types {hf['layer_types']} is not GPT-OSS's alternating sliding / full layers; "
            "decoder_block gpt_oss supports only that pattern"
        )
    if float(hf.get("swiglu_alpha", GPT_OSS_ALPHA)) != GPT_OSS_ALPHA:
        raise ConfigError(f"HF swiglu_alpha={hf['swiglu_alpha']} is not supported; decoder_block gpt_oss uses {GPT_OSS_ALPHA}")
    if not hf.get("sliding_window"):
        raise ConfigError("HF gpt_oss sliding_window must be set (its sliding layers need a window)")
    values = common_config_from_hf({**hf, "hidden_act": "silu"}, "gpt_oss", qkv_bias=True)  # its hidden_act is unread
    values.update(
        attention_bias=bool(hf.get("attention_bias", True)),
        attention_sink=True,
        sliding_window_pattern=PATTERN,
        mlp_activations=list(ACTIVATIONS),
        mlp_activations_limit=float(hf.get("swiglu_limit", 7.0)),
        mlp_bias=True,
        num_experts=int(hf["num_local_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        base_moe_mlp_dim=int(hf["intermediate_size"]),
        routed_score_func="softmax",
        norm_topk_prob=True,  # the softmax over the top-k logits
        routed_bias=True,  # router.bias: trained, selection and weights (models/gpt_oss.GptOssBlock)
    )
    return values


def config_to_hf(cfg: Config) -> dict[str, Any]:
    """The HF ``config.json`` of a gpt_oss config (``config/gpt_oss.py`` has already checked its own rules)."""
    for name in PATTERN_FIELDS:
        if name != "sliding_window_pattern" and getattr(cfg, name):
            raise ConfigError(f"{name} has no HF GPT-OSS equivalent; export needs {name}=0/false")
    if cfg.mlp_activations_limit <= 0:
        raise ConfigError("HF GPT-OSS always clamps its experts (swiglu_limit); export needs mlp_activations_limit > 0")
    if not (cfg.attention_sink and cfg.mlp_bias and cfg.routed_bias and cfg.sliding_window_size):
        raise ConfigError(
            "HF GPT-OSS always has attention sinks, expert biases, a router bias and a sliding window; export needs "
            "attention_sink=true, mlp_bias=true, routed_bias=true and sliding_window_size > 0"
        )
    if cfg.rope_interleave or cfg.use_qk_norm or cfg.final_logits_soft_cap or cfg.rope_type not in ("default", "yarn"):
        raise ConfigError(
            "HF GPT-OSS needs rope_interleave=false, use_qk_norm=false, final_logits_soft_cap=0 and rope_type default or yarn"
        )
    if cfg.logits_via_embedding and cfg.normalize_embedding_logits:
        raise ConfigError("HF GPT-OSS's tied head is x @ E^T; export needs normalize_embedding_logits=false")
    if cfg.routed_scaling_factor != 1.0 or cfg.capacity_factor > 0:
        raise ConfigError("HF GPT-OSS has no routed_scaling_factor or expert capacity; export needs 1.0 and -1")
    hf = common_config_to_hf(cfg, "gpt_oss", "GptOssForCausalLM", qkv_bias=cfg.attention_bias)
    hf.update(
        attention_bias=cfg.attention_bias,
        intermediate_size=cfg.base_moe_mlp_dim,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        sliding_window=cfg.sliding_window_size,
        layer_types=hf_layer_types(cfg.base_num_decoder_layers, PATTERN),
        swiglu_limit=cfg.mlp_activations_limit,
        swiglu_alpha=GPT_OSS_ALPHA,
        router_aux_loss_coef=cfg.load_balance_loss_weight,
    )
    return hf
