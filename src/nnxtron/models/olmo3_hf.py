"""OLMo 3's HF ``config.json`` maps (``models/olmo3.py`` is the family: block, weights, MaxText names).

Kept apart from the block so that the flag matrix's family cases (``tests/unit/test_flag_sensitivity.py``:
``FAMILY_MODULES``) run the block's reads; the conversions' reads are proven by the HF round trip and
goldens (``tests/flags/read_sites_not_proven.py``: CONVERSION).
"""

from __future__ import annotations

from typing import Any

from nnxtron.config.olmo3 import PATTERN  # HF's default layer_types: every 4th layer global
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.models.hf_common import common_config_from_hf, common_config_to_hf, hf_layer_types, rope_to_hf


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """nnxtron config values for an HF ``olmo3`` ``config.json`` (transformers 5 per-type
    ``rope_parameters``, or 4.x ``rope_theta`` / ``rope_scaling``, which scale the global layers only):
    the pre-norm families' shared entries (``common_config_from_hf``) on the global layers' RoPE."""
    layers = int(hf["num_hidden_layers"])
    expected = hf_layer_types(layers, PATTERN)
    if list(hf.get("layer_types") or expected) != expected:
        raise ConfigError(
            f"HF layer_types {hf['layer_types']} is not OLMo 3's 'global every {PATTERN}th layer'; "
            "decoder_block olmo3 supports only that pattern"
        )
    params = hf.get("rope_parameters") or {}
    if params and "full_attention" not in params:
        raise ConfigError("HF olmo3 rope_parameters must hold one entry per layer type (full_attention, sliding_attention)")
    theta = hf.get("rope_theta", 500000.0)
    full = params.get("full_attention") or {"rope_theta": theta, **(hf.get("rope_scaling") or {"rope_type": "default"})}
    local = params.get("sliding_attention") or {"rope_type": "default", "rope_theta": theta}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"HF OLMo 3 sliding-layer rope_type '{local['rope_type']}' is not supported; only default")
    global_layers = {key: v for key, v in hf.items() if key not in ("rope_theta", "rope_scaling")}
    global_layers.update(rope_parameters=full, rms_norm_eps=hf.get("rms_norm_eps", 1e-5))
    values = common_config_from_hf(global_layers, "olmo3")
    if values["rope_type"] not in ("default", "yarn"):
        raise ConfigError(f"HF OLMo 3 global-layer rope_type '{values['rope_type']}' is not supported; use default or yarn")
    values.update(
        use_qk_norm=True,
        sliding_window_size=int(hf.get("sliding_window") or 4096),
        sliding_window_pattern=PATTERN,
        local_rope_max_timescale=float(local.get("rope_theta", theta)),
    )
    return values


def config_to_hf(cfg: Config) -> dict[str, Any]:
    if cfg.num_experts > 1 or cfg.attention_type != "global" or cfg.rope_interleave or cfg.nope_layer_interval:
        raise ConfigError("HF OLMo 3 has no MoE, MLA, interleaved RoPE or NoPE layers; export a plain olmo3 config")
    if cfg.sliding_window_pattern != PATTERN or not cfg.sliding_window_size or not cfg.use_qk_norm:
        raise ConfigError(f"HF OLMo 3 needs sliding_window_pattern={PATTERN}, sliding_window_size > 0 and use_qk_norm=true")
    if cfg.rope_type not in ("default", "yarn") or cfg.attention_bias or cfg.query_pre_attn_scalar:
        raise ConfigError("HF OLMo 3 needs rope_type default or yarn, attention_bias=false and query_pre_attn_scalar=0")
    if list(cfg.mlp_activations) != ["silu", "linear"] or cfg.logits_via_embedding and cfg.normalize_embedding_logits:
        raise ConfigError("HF OLMo 3 needs mlp_activations=[silu, linear] and (tied) normalize_embedding_logits=false")
    if cfg.attn_logits_soft_cap or cfg.final_logits_soft_cap:
        raise ConfigError("HF OLMo 3 has no logit soft caps; export needs attn_logits_soft_cap=0 and final_logits_soft_cap=0")
    local_theta = cfg.local_rope_max_timescale or cfg.rope_max_timescale
    if not cfg.local_rope_max_timescale and cfg.rope_type != "default":
        raise ConfigError(
            "HF OLMo 3 scales the global layers' RoPE only; export needs local_rope_max_timescale > 0 "
            "(this config scales every layer's, MaxText's olmo3)"
        )
    hf = common_config_to_hf(cfg, "olmo3", "Olmo3ForCausalLM")
    hf.update(
        sliding_window=cfg.sliding_window_size,
        layer_types=hf_layer_types(cfg.base_num_decoder_layers, PATTERN),
        rope_parameters={
            "full_attention": rope_to_hf(cfg),
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
    )
    return hf
