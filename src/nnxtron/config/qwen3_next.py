"""Qwen3-Next's config rule, shared by Qwen3.5's text decoder (``models/qwen3_next.py``, ``models/qwen3_5.py``
hold their blocks and maps): layers alternate Gated DeltaNet linear attention (``layers/gated_deltanet.py``; the ``gdn_*`` keys, MaxText's names) and gated full
attention: layer ``i`` is full attention iff ``(i + 1) % inhomogeneous_layer_cycle_interval == 0``
(MaxText's ``Qwen3NextDecoderLayer`` rule, HF's ``full_attention_interval``; one cycle is one scanned block).
Full attention has zero-centred q/k RMSNorms, partial RoPE (``partial_rotary_factor``) and a sigmoid output
gate; every layer has a routed MoE (softmax top-k) plus one sigmoid-gated shared expert."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nnxtron.errors import ConfigError

if TYPE_CHECKING:
    from nnxtron.config.schema import Config

ACTIVATIONS = ("silu", "linear")
# read by decoder_block=qwen3_next / qwen3_5 only -> their value for every other family (MaxText's defaults)
OPTIONS_OFF = {
    "gdn_conv_kernel_dim": 4,
    "gdn_key_head_dim": 128,
    "gdn_value_head_dim": 128,
    "gdn_num_key_heads": 16,
    "gdn_num_value_heads": 32,
    "gdn_chunk_size": 64,
    "partial_rotary_factor": 1.0,
}


def is_full_attention(cfg: Config, i: int) -> bool:
    """Whether layer ``i`` (0-based) of a qwen3_next config is full attention (else Gated DeltaNet)."""
    interval = cfg.inhomogeneous_layer_cycle_interval
    return interval > 0 and (i + 1) % interval == 0


def layer_attention(cfg: Config, i: int) -> str:
    """The attention kind of layer ``i``: ``global`` (full attention) or ``linear`` (Gated DeltaNet)."""
    return "global" if is_full_attention(cfg, i) else "linear"


def period(cfg: Config) -> int:
    """The period of the layer pattern: one full-attention layer per interval."""
    return max(cfg.inhomogeneous_layer_cycle_interval, 1)


def rotary_dim(cfg: Config) -> int:
    """The RoPE width of the full-attention heads: ``int(head_dim * partial_rotary_factor)`` (HF's)."""
    return int(cfg.resolved_head_dim * cfg.partial_rotary_factor)


def check(cfg: Config) -> None:
    """The rule of ``decoder_block=qwen3_next`` and ``qwen3_5`` (``config/families.py`` runs it for them only)."""
    if cfg.inhomogeneous_layer_cycle_interval < 1:
        raise ConfigError(
            f"decoder_block {cfg.decoder_block} has one full-attention layer every inhomogeneous_layer_cycle_interval layers "
            "(MaxText's rule, HF full_attention_interval); set it >= 1 (4 in the qwen3-next-* presets)"
        )
    if cfg.num_experts < 2 or cfg.first_num_dense_layers or cfg.dense_layers or cfg.interleave_moe_layer_step != 1:
        raise ConfigError(
            f"decoder_block {cfg.decoder_block} has a routed MoE on every layer; set num_experts > 1, first_num_dense_layers=0, "
            "dense_layers=[] and interleave_moe_layer_step=1"
        )
    if cfg.shared_experts < 1:
        raise ConfigError(f"decoder_block {cfg.decoder_block} has a sigmoid-gated shared expert; set shared_experts >= 1")
    if tuple(cfg.mlp_activations) != ACTIVATIONS:
        raise ConfigError(f"decoder_block {cfg.decoder_block}'s MLPs are SwiGLU; set mlp_activations={list(ACTIVATIONS)}")
    if cfg.routed_score_func != "softmax" or cfg.routed_bias or cfg.mlp_activations_limit:
        raise ConfigError(
            f"decoder_block {cfg.decoder_block} routes by the softmax over its router logits without a bias or clamp; set "
            "routed_score_func=softmax, routed_bias=false and mlp_activations_limit=0"
        )
    if cfg.attention_type != "global" or not cfg.use_qk_norm or cfg.attention_bias:
        raise ConfigError(
            f"decoder_block {cfg.decoder_block}'s full attention is GQA with zero-centred q/k RMSNorms and no biases; set "
            "attention_type=global, use_qk_norm=true and attention_bias=false"
        )
    if cfg.sliding_window_size or cfg.sliding_window_pattern or cfg.chunk_attn_window_size or cfg.nope_layer_interval:
        raise ConfigError(
            f"decoder_block {cfg.decoder_block} fixes its own layer pattern (inhomogeneous_layer_cycle_interval); set "
            "sliding_window_size=0, sliding_window_pattern=0, chunk_attn_window_size=0 and nope_layer_interval=0"
        )
    if cfg.gdn_num_value_heads % cfg.gdn_num_key_heads:
        raise ConfigError(
            f"gdn_num_value_heads={cfg.gdn_num_value_heads} must be a multiple of gdn_num_key_heads={cfg.gdn_num_key_heads}"
        )
    if rotary_dim(cfg) % 2 or rotary_dim(cfg) == 0:
        raise ConfigError(f"head_dim x partial_rotary_factor = {rotary_dim(cfg)} rotary dims; it must be even and > 0")
    check_strategies(cfg)


def check_strategies(cfg: Config) -> None:
    """What the Gated DeltaNet layers do not run under (refused by name, never run wrong)."""
    if cfg.ici_context_parallelism != 1:
        raise ConfigError(
            f"decoder_block {cfg.decoder_block}'s Gated DeltaNet recurrence runs along the whole sequence; context "
            "parallelism is not supported: set ici_context_parallelism=1"
        )
    if cfg.mtp_num_layers:
        raise ConfigError(f"decoder_block {cfg.decoder_block}: mtp_num_layers > 0 is not supported (HF drops its MTP layers)")
