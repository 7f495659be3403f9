"""Qwen3.5's HF ``config.json`` maps (``models/qwen3_5.py`` is the family: block and weights): HF
``Qwen3_5MoeTextConfig`` (``model_type`` ``qwen3_5_moe_text``) is ``Qwen3NextConfig`` less ``intermediate_size``,
``norm_topk_prob`` (its router always renormalises the top-k weights), ``decoder_sparse_step`` and
``mlp_only_layers`` (every layer is MoE), so the maps are Qwen3-Next's (``models/qwen3_next_hf.py``) around that.

Its ``rope_parameters`` may name ``mrope_section`` / ``mrope_interleaved``: HF's multimodal RoPE, which on text
(the three position ids equal) is the plain RoPE; they are not read. Kept apart from the block as Qwen3-Next's
(``tests/flags/read_sites_not_proven.py``: CONVERSION).
"""

from __future__ import annotations

from typing import Any

from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.models import qwen3_next_hf

MODEL_TYPE, ARCHITECTURE = "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"
MULTIMODAL_TYPE = "qwen3_5_moe"  # Qwen3_5MoeForConditionalGeneration (the hub checkpoints): text_config is this
ABSENT = ("intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")  # not in its config


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """nnxtron config values for an HF ``qwen3_5_moe_text`` ``config.json`` (the ``ABSENT`` keys, which HF's
    class does not read, are not read here either)."""
    text = {key: value for key, value in hf.items() if key not in ABSENT}
    moe = int(hf["moe_intermediate_size"])  # base_mlp_dim: MaxText's qwen3.5 presets set it to the expert width
    return qwen3_next_hf.config_from_hf({**text, "intermediate_size": moe, "norm_topk_prob": True}, "qwen3_5")


def config_to_hf(cfg: Config) -> dict[str, Any]:
    """The HF ``config.json`` of a qwen3_5 config (``config/qwen3_next.py`` has already checked its rules)."""
    if not cfg.norm_topk_prob:
        raise ConfigError(f"HF {ARCHITECTURE}'s router always renormalises the top-k weights; export needs norm_topk_prob=true")
    hf = qwen3_next_hf.config_to_hf(cfg, MODEL_TYPE, ARCHITECTURE)
    return {key: value for key, value in hf.items() if key not in ABSENT}
