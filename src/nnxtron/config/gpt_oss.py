"""GPT-OSS's config rule (``models/gpt_oss.py`` holds its block and maps): the pre-norm block with
attention sinks (``attention_sink``) and biases, 1 sliding : 1 global layers (MaxText's
``GPT_OSS_ATTENTION_PATTERN``, HF's ``layer_types``), and a routed MoE on every layer whose experts are
the clamped SwiGLU ``(clip(up, -L, L) + 1) * g * sigmoid(1.702 g)``, ``g = min(gate, L)``
(``mlp_activations=[sigmoid, linear]`` with ``mlp_activations_limit`` L, MaxText's spelling), with
biases (``mlp_bias``). Its router's logits have a trained bias (``routed_bias=true``: MaxText's
``GateLogit`` bias outside DeepSeek, HF's ``router.bias``), selection and weights alike, and the
weights are the softmax over the top-k logits (``routed_score_func=softmax``, ``norm_topk_prob=true``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nnxtron.errors import ConfigError

if TYPE_CHECKING:
    from nnxtron.config.schema import Config

PATTERN = 2  # layer i is global iff (i + 1) % 2 == 0: sliding, global, sliding, ...
ACTIVATIONS = ("sigmoid", "linear")  # the clamped SwiGLU g * sigmoid(1.702 g) * (up + 1)
# read by decoder_block=gpt_oss only (mlp_activations_limit: and by deepseek4) -> their value for every other family
OPTIONS_OFF = {"attention_sink": False, "mlp_bias": False, "mlp_activations_limit": 0}


def check(cfg: Config) -> None:
    """The rule of ``decoder_block=gpt_oss`` (``config/families.py`` runs it for it only)."""
    if cfg.num_experts < 2 or cfg.first_num_dense_layers or cfg.dense_layers or cfg.interleave_moe_layer_step != 1:
        raise ConfigError(
            "decoder_block gpt_oss has a routed MoE on every layer; set num_experts > 1, first_num_dense_layers=0, "
            "dense_layers=[] and interleave_moe_layer_step=1"
        )
    if cfg.shared_experts:
        raise ConfigError("decoder_block gpt_oss has no shared experts; set shared_experts=0")
    if tuple(cfg.mlp_activations) != ACTIVATIONS:
        raise ConfigError(
            f"decoder_block gpt_oss's experts are its clamped SwiGLU, mlp_activations={list(ACTIVATIONS)} (MaxText's "
            f"spelling); got {list(cfg.mlp_activations)}"
        )
    if cfg.sliding_window_pattern != PATTERN:
        raise ConfigError(
            f"decoder_block gpt_oss alternates sliding-window and global layers (MaxText's GPT_OSS_ATTENTION_PATTERN, HF "
            f"layer_types), so sliding_window_pattern={cfg.sliding_window_pattern} cannot apply; set "
            f"sliding_window_pattern={PATTERN}, as the gpt-oss-* presets do"
        )
    if cfg.attention_type != "global":
        raise ConfigError(
            f"decoder_block gpt_oss has grouped-query attention; set attention_type=global, not {cfg.attention_type}"
        )
    if cfg.routed_score_func != "softmax" or not cfg.norm_topk_prob:
        raise ConfigError(
            "decoder_block gpt_oss weighs its experts by the softmax over the top-k router logits; set "
            "routed_score_func=softmax and norm_topk_prob=true"
        )
    if cfg.routed_bias_update_rate:
        raise ConfigError(
            "decoder_block gpt_oss's routed_bias is a trained bias of the router logits (HF router.bias), not "
            "DeepSeek's selection bias; routed_bias_update_rate cannot apply: set it to 0"
        )
