"""Llama 4 (text decoder): NoPE layers, chunked attention, interleaved MoE with top-1 sigmoid routing.

HF ``Llama4ForCausalLM`` (``model_type: llama4_text``). The pre-norm block (``models/prenorm.py``) with:

* RoPE layers: interleaved RoPE (llama3 scaling from the checkpoint), then — with
  ``use_qk_norm`` — a weightless L2 norm of q and k; attention within aligned chunks of
  ``chunk_attn_window_size`` tokens;
* NoPE layers (``(i + 1) % nope_layer_interval == 0``): no RoPE, full causal attention,
  queries scaled by the temperature tuning ``log1p(floor((pos + 1) / floor_scale)) * scale + 1``;
* MoE layers (``(i + 1) % interleave_moe_layer_step == 0``): router top-1 on the raw
  logits, ``sigmoid(logit)`` scales the expert *input*, plus one shared expert; the other
  layers are the dense SwiGLU of ``base_mlp_dim`` (HF ``intermediate_size_mlp``).

Scanned as cycle blocks of ``inhomogeneous_layer_cycle_interval`` layers. HF keeps the
experts fused and input-major: ``experts.gate_up_proj [E, D, 2F]`` (gate = first F
columns) and ``experts.down_proj [E, F, D]`` — exactly nnxtron's ``wi_0|wi_1`` and ``wo``.

MaxText (``decoder_block=llama4``) names a MoE layer's router and experts
``Llama4MoEBlock_0/MoeBlock_0/{gate/kernel,wi_0,wi_1,wo}`` and its shared expert
``Llama4MoEBlock_0/shared_experts/...``; it scales the queries at run time (no folded query
kernel) and its L2 qk norm has no weights, so the values are nnxtron's. Scanned, it always
scans ``Llama4ScannableBlock``s of ``inhomogeneous_layer_cycle_interval`` layers
(``decoder/layers/layers_{j}/...``, even a block of one) and has no remainder.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from nnxtron.config.layout import PLAIN, LayerKind, cycle_length
from nnxtron.config.schema import Config
from nnxtron.errors import CheckpointError, ConfigError
from nnxtron.models.family import Golden, StrategyRow, WeightMap
from nnxtron.models.hf_common import (
    GQA_WEIGHTS,
    common_config_from_hf,
    common_config_to_hf,
    gated_mlp_weights,
    optional_size,
    refuse_attention_soft_cap,
)
from nnxtron.models.maxtext_map import Rule, expert_rules, mlp_rules, pre_norm_map
from nnxtron.models.prenorm import PreNormBlock, pre_norm_family

NORM_WEIGHTS = (
    WeightMap("pre_attention_norm/scale", "input_layernorm.weight"),
    WeightMap("post_attention_norm/scale", "post_attention_layernorm.weight"),
)
MOE_WEIGHTS = (
    WeightMap("mlp/router/kernel", "feed_forward.router.weight", 1),
    WeightMap("mlp/wi_0", "feed_forward.experts.gate_up_proj", split_part=0, split_parts=2),
    WeightMap("mlp/wi_1", "feed_forward.experts.gate_up_proj", split_part=1, split_parts=2),
    WeightMap("mlp/wo", "feed_forward.experts.down_proj"),
) + gated_mlp_weights("mlp/shared", "feed_forward.shared_expert")


def make_block(cfg: Config, rngs: nnx.Rngs, kind: LayerKind = PLAIN) -> PreNormBlock:
    return PreNormBlock(cfg, rngs, kind, qk_norm="l2")


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    if kind.moe:
        return NORM_WEIGHTS + GQA_WEIGHTS + MOE_WEIGHTS
    return NORM_WEIGHTS + GQA_WEIGHTS + gated_mlp_weights("mlp", "feed_forward")


def _interval(name: str, flags: list[int], *, is_set) -> int:
    """The interval ``n`` such that layer ``i`` is marked iff ``(i + 1) % n == 0`` (0: none marked)."""
    marked = [i for i, flag in enumerate(flags) if is_set(flag)]
    if not marked:
        return 0
    n = marked[0] + 1
    if marked != [i for i in range(len(flags)) if (i + 1) % n == 0]:
        raise ConfigError(f"HF {name} {flags} is not periodic ('every {n}th layer'); decoder_block llama4 supports only that")
    return n


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """nnxtron config values for an HF ``llama4_text`` ``config.json``."""
    if hf.get("attention_bias"):
        raise ConfigError("HF attention_bias=true is not supported by decoder_block llama4")
    layers = int(hf["num_hidden_layers"])
    values = common_config_from_hf({**hf, "intermediate_size": hf["intermediate_size_mlp"]}, "llama4")
    no_rope = list(hf.get("no_rope_layers") or [1] * layers)  # 1 = RoPE, 0 = NoPE
    nope = _interval("no_rope_layers", no_rope, is_set=lambda flag: not flag)
    moe_flags = [1 if i in set(hf.get("moe_layers") or []) else 0 for i in range(layers)]
    step = _interval("moe_layers", moe_flags, is_set=bool)
    chunk = int(hf.get("attention_chunk_size") or 0)
    expected_types = ["chunked_attention" if chunk and no_rope[i] else "full_attention" for i in range(layers)]
    if hf.get("layer_types") and list(hf["layer_types"]) != expected_types:
        raise ConfigError(
            f"HF layer_types {hf['layer_types']} is not 'chunked on RoPE layers, full on NoPE layers'; not supported"
        )
    if int(hf.get("num_experts_per_tok", 1)) != 1:
        raise ConfigError("HF Llama 4 with num_experts_per_tok != 1 is not supported (the router scales the expert input)")
    values.update(
        rope_interleave=True,
        use_qk_norm=bool(hf.get("use_qk_norm", False)),
        nope_layer_interval=nope,
        chunk_attn_window_size=chunk,
        temperature_tuning=bool(hf.get("attn_temperature_tuning", False)) and nope > 0,
        temperature_tuning_floor_scale=float(hf.get("floor_scale", 8192)),
        temperature_tuning_scale=float(hf.get("attn_scale", 0.1)),
        max_position_embeddings=optional_size(hf, "max_position_embeddings", 8192, zero_is_default=True),
    )
    if step:
        values.update(
            num_experts=int(hf["num_local_experts"]),
            num_experts_per_tok=1,
            base_moe_mlp_dim=int(hf["intermediate_size"]),
            shared_experts=1,
            routed_score_func="sigmoid",
            router_scales_expert_input=True,
            norm_topk_prob=False,
            interleave_moe_layer_step=step,
        )
    return values


def config_to_hf(cfg: Config) -> dict[str, Any]:
    if cfg.attention_type != "global" or cfg.sliding_window_size or cfg.sliding_window_pattern or not cfg.rope_interleave:
        raise ConfigError("HF Llama 4 needs attention_type=global, no sliding window and rope_interleave=true")
    refuse_attention_soft_cap(cfg, "Llama 4")
    moe = cfg.num_experts > 1
    if moe and (
        not cfg.router_scales_expert_input
        or cfg.shared_experts != 1
        or cfg.first_num_dense_layers
        or cfg.dense_layers
        or cfg.routed_bias
    ):
        raise ConfigError(
            "HF Llama 4 MoE is top-1 sigmoid routing scaling the expert input (router_scales_expert_input=true) "
            "with shared_experts=1, no dense prefix or dense_layers and no router bias"
        )
    if cfg.rope_type not in ("default", "llama3"):
        raise ConfigError("HF Llama 4 needs rope_type default or llama3")
    layers = cfg.base_num_decoder_layers
    nope = cfg.nope_layer_interval
    no_rope = [0 if nope and (i + 1) % nope == 0 else 1 for i in range(layers)]
    hf = common_config_to_hf(cfg, "llama4_text", "Llama4ForCausalLM")
    hf.update(
        intermediate_size=cfg.base_moe_mlp_dim if moe else cfg.base_mlp_dim,
        intermediate_size_mlp=cfg.base_mlp_dim,
        use_qk_norm=cfg.use_qk_norm,
        no_rope_layers=no_rope,
        no_rope_layer_interval=nope or layers + 1,
        attention_chunk_size=cfg.chunk_attn_window_size or None,
        layer_types=["chunked_attention" if cfg.chunk_attn_window_size and r else "full_attention" for r in no_rope],
        attn_temperature_tuning=cfg.temperature_tuning,
        floor_scale=cfg.temperature_tuning_floor_scale,
        attn_scale=cfg.temperature_tuning_scale,
        num_local_experts=cfg.num_experts if moe else 1,
        num_experts_per_tok=1,
        interleave_moe_layer_step=cfg.interleave_moe_layer_step if moe else 0,
        moe_layers=[i for i in range(layers) if moe and (i + 1) % cfg.interleave_moe_layer_step == 0],
        router_aux_loss_coef=cfg.load_balance_loss_weight,
    )
    return hf


def maxtext_moe_rules(cfg: Config) -> tuple[Rule, ...]:
    """MaxText's Llama 4 MoE layer: the router and routed experts, then the shared expert."""
    moe = "Llama4MoEBlock_0/"
    return (*expert_rules(f"{moe}MoeBlock_0/"), *mlp_rules(f"{moe}shared_experts/", "mlp/shared/"))


def maxtext_scan_cycle(cfg: Config) -> int:
    """MaxText's scanned block: ``inhomogeneous_layer_cycle_interval`` layers (nnxtron's cycle: the
    interval, or the pattern's period where MaxText's interval 1 would not build this model)."""
    cycle = cycle_length(cfg)
    if cfg.base_num_decoder_layers % cycle:
        raise CheckpointError(
            f"MaxText scans Llama 4 in whole blocks of {cycle} layers (no remainder); "
            f"base_num_decoder_layers={cfg.base_num_decoder_layers} is not a multiple"
        )
    return cycle


MAXTEXT = dataclasses.replace(pre_norm_map(maxtext_moe_rules), scan_cycle=maxtext_scan_cycle, scan_blocks=True)

FAMILIES = (
    pre_norm_family(
        "llama4",
        "llama4_text",
        "Llama4ForCausalLM",
        layer_weights,
        config_from_hf,
        config_to_hf,
        make_block,
        maxtext=MAXTEXT,
        hf_multimodal_type="llama4",
        hf_vision_prefixes=("vision_model.", "multi_modal_projector."),
        goldens=(Golden("llama4", "llama4"),),
        strategy_rows=(StrategyRow("llama4-tiny", True, "save_dot_except_mlp", "data2_fsdp4", 2),),
    ),
)
