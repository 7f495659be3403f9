"""Gemma 4's config rule (``models/gemma4.py`` holds its block and maps): the text decoder of Gemma 4 26B-A4B and
31B (MaxText's ``decoder_block=gemma4``, HF ``Gemma4ForCausalLM``). Layer ``i`` is global iff
``(i + 1) % sliding_window_pattern == 0`` (6 in the releases: MaxText's ``GEMMA4_ATTENTION_PATTERN``), else
sliding-window. Global layers have a head width, key/value heads and RoPE of their own (``global_head_dim``,
``global_num_kv_heads``; ``share_kv_projections``: their values are the key projection; ``global_rope_proportion``
of the frequencies rotate); every layer has q/k RMSNorms and a weightless value norm, unscaled logits
(``query_pre_attn_scalar=1``), the sandwich norms, a GeGLU MLP and a learned ``layer_scalar``. With ``num_experts >
1`` every layer also has routed experts beside the MLP (MaxText: the MLP is the shared expert, ``shared_experts=1``,
``base_mlp_dim`` wide). Gemma 4 small (E2B / E4B: per-layer inputs, key/value sharing across layers, MaxText's
``gemma4_small``) is not built."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nnxtron.errors import ConfigError

if TYPE_CHECKING:
    from nnxtron.config.schema import Config

PATTERN = 6  # MaxText's GEMMA4_ATTENTION_PATTERN: five sliding layers, then a global one
ACTIVATIONS = ("gelu", "linear")  # GeGLU (HF gelu_pytorch_tanh), the MLP and the experts alike
# read by decoder_block=gemma4 only -> their value for every other family
OPTIONS_OFF = {
    "global_head_dim": 0,
    "global_num_kv_heads": 0,
    "share_kv_projections": False,
    "global_rope_proportion": 1.0,
    "local_rope_proportion": 1.0,
}
# MaxText keys only MaxText's gemma4 block reads (config/maxtext_keys.py passes them on for it alone)
MAXTEXT_KEYS = frozenset({*OPTIONS_OFF, "global_rope_max_timescale", "v_norm_with_scale"})


def check(cfg: Config) -> None:
    """The rule of ``decoder_block=gemma4`` (``config/families.py`` runs it for it only)."""
    if not cfg.sliding_window_pattern or not cfg.sliding_window_size:
        raise ConfigError(
            "decoder_block gemma4 has sliding-window layers with a global one every sliding_window_pattern layers; set "
            f"sliding_window_pattern > 0 ({PATTERN} in the gemma4-* presets, MaxText's) and sliding_window_size > 0"
        )
    if cfg.attention_type != "global" or not cfg.use_qk_norm or cfg.attention_bias or cfg.query_pre_attn_scalar != 1.0:
        raise ConfigError(
            "decoder_block gemma4's attention is GQA with q/k RMSNorms, no biases and unscaled logits; set "
            "attention_type=global, use_qk_norm=true, attention_bias=false and query_pre_attn_scalar=1"
        )
    if cfg.attn_logits_soft_cap or cfg.chunk_attn_window_size or cfg.nope_layer_interval or cfg.attention_sink:
        raise ConfigError(
            "decoder_block gemma4 has no attention soft cap, chunks, NoPE layers or sinks; set attn_logits_soft_cap=0, "
            "chunk_attn_window_size=0, nope_layer_interval=0 and attention_sink=false"
        )
    if cfg.rope_type != "default" or cfg.rope_interleave:
        raise ConfigError(
            "decoder_block gemma4 rotates halves with unscaled frequencies (proportional on the global layers: "
            "global_rope_proportion); set rope_type=default and rope_interleave=false"
        )
    if tuple(cfg.mlp_activations) != ACTIVATIONS:
        raise ConfigError(f"decoder_block gemma4's MLP and experts are GeGLU; set mlp_activations={list(ACTIVATIONS)}")
    head_dims = (cfg.resolved_head_dim, cfg.global_head_dim or cfg.resolved_head_dim)
    if any(dim % 2 for dim in head_dims):
        raise ConfigError(
            f"decoder_block gemma4 rotates pairs (i, i + d/2): head_dim and global_head_dim must be even, got {head_dims}"
        )
    if cfg.mtp_num_layers:
        raise ConfigError("decoder_block gemma4: mtp_num_layers > 0 is not supported (Gemma 4 has no MTP layers)")
    check_experts(cfg)


def check_experts(cfg: Config) -> None:
    """Dense (31B: no experts, no shared expert) or routed experts on every layer beside the MLP (26B-A4B)."""
    if cfg.num_experts == 1:
        if cfg.shared_experts:
            raise ConfigError("decoder_block gemma4 without routed experts has no shared expert; set shared_experts=0")
        return
    if cfg.first_num_dense_layers or cfg.dense_layers or cfg.interleave_moe_layer_step != 1:
        raise ConfigError(
            "decoder_block gemma4's routed experts are on every layer; set first_num_dense_layers=0, dense_layers=[] "
            "and interleave_moe_layer_step=1"
        )
    if cfg.shared_experts != 1:
        raise ConfigError(
            "decoder_block gemma4's layers keep their MLP (base_mlp_dim wide) beside the routed experts: MaxText's one "
            f"shared expert; set shared_experts=1, not {cfg.shared_experts}"
        )
    if cfg.routed_score_func != "softmax" or cfg.routed_bias or cfg.routed_scaling_factor != 1.0:
        raise ConfigError(
            "decoder_block gemma4 routes by the softmax over all experts, then scales each chosen expert by its "
            "per_expert_scale; set routed_score_func=softmax, routed_bias=false and routed_scaling_factor=1"
        )
    if cfg.mlp_activations_limit or cfg.router_scales_expert_input or cfg.n_routing_groups != -1:
        raise ConfigError(
            "decoder_block gemma4's experts have no clamp, input scaling or group-limited routing; set "
            "mlp_activations_limit=0, router_scales_expert_input=false and n_routing_groups=-1"
        )
