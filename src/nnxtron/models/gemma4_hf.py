"""Gemma 4's HF maps (``models/gemma4.py`` is the family: block and family record): the weights of a layer and
``Gemma4TextConfig``'s ``config.json`` (``model_type: gemma4_text``; in the hub's multimodal checkpoints its
``text_config``).

HF names per layer: ``input_layernorm``, ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
``post_feedforward_layernorm``, ``self_attn.{q,k,v,o}_proj`` (no ``v_proj`` on a global layer with
``attention_k_eq_v``), ``self_attn.{q,k}_norm`` (``v_norm`` has no weight), ``mlp.{gate,up,down}_proj``,
``layer_scalar`` ``[1]`` (a buffer in HF); MoE layers add ``router.{proj.weight, scale, per_expert_scale}``,
``experts.gate_up_proj [E, 2F, D]`` and ``experts.down_proj [E, D, F]`` (one ``nn.Linear`` weight per expert,
stacked: what ``save_pretrained`` writes) and ``{pre_feedforward_layernorm_2, post_feedforward_layernorm_{1,2}}``.

The global layers' shape: hub configs name ``global_head_dim`` and ``num_global_key_value_heads`` (HF reads the
latter only with ``attention_k_eq_v``); transformers 5.25 writes them back as ``per_layer_config`` (layer index ->
``head_dim`` / ``num_key_value_heads``). Both are read; the export writes the hub's form. RoPE: one
``rope_parameters`` entry per layer type, ``default`` or ``proportional`` (with ``partial_rotary_factor``).
Gemma 4 small (``hidden_size_per_layer_input`` > 0, ``num_kv_shared_layers`` > 0) is refused by name.
"""

from __future__ import annotations

from typing import Any

from nnxtron.config.layout import LayerKind, attention_shape
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.models.family import WeightMap
from nnxtron.models.hf_common import (
    GELU_TANH,
    QK_NORM_WEIGHTS,
    gated_mlp_weights,
    hf_layer_types,
    hf_ties_head,
    optional_size,
)

ARCHITECTURE = "Gemma4ForCausalLM"
NORM_WEIGHTS = (
    WeightMap("pre_attention_norm/scale", "input_layernorm.weight"),
    WeightMap("post_attention_norm/scale", "post_attention_layernorm.weight"),
    WeightMap("pre_ffw_norm/scale", "pre_feedforward_layernorm.weight"),
    WeightMap("post_ffw_norm/scale", "post_feedforward_layernorm.weight"),
    WeightMap("layer_scalar", "layer_scalar"),
)
EXPERT_WEIGHTS = (
    WeightMap("post_mlp_norm/scale", "post_feedforward_layernorm_1.weight"),
    WeightMap("experts/pre_norm/scale", "pre_feedforward_layernorm_2.weight"),
    WeightMap("experts/post_norm/scale", "post_feedforward_layernorm_2.weight"),
    WeightMap("experts/router_scale", "router.scale"),
    WeightMap("experts/router/kernel", "router.proj.weight", 1),
    WeightMap("experts/per_expert_scale", "router.per_expert_scale"),
    WeightMap("experts/wi_0", "experts.gate_up_proj", split_part=0, split_parts=2, stacked_linear=True),
    WeightMap("experts/wi_1", "experts.gate_up_proj", split_part=1, split_parts=2, stacked_linear=True),
    WeightMap("experts/wo", "experts.down_proj", stacked_linear=True),
)


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    """One layer of ``kind``: a global layer with ``share_kv_projections`` has no value projection."""
    attention = [
        WeightMap("attention/query/kernel", "self_attn.q_proj.weight", 1),
        WeightMap("attention/key/kernel", "self_attn.k_proj.weight", 1),
        WeightMap("attention/out/kernel", "self_attn.o_proj.weight", 2),
    ]
    if not attention_shape(cfg, kind)[2]:
        attention.append(WeightMap("attention/value/kernel", "self_attn.v_proj.weight", 1))
    maps = (*NORM_WEIGHTS, *attention, *QK_NORM_WEIGHTS, *gated_mlp_weights("mlp", "mlp"))
    return (*maps, *EXPERT_WEIGHTS) if kind.moe else maps


def _pattern(hf: dict[str, Any], layers: int) -> int:
    """The period of HF's ``layer_types``: a global layer every P-th, nothing else (HF forces the last layer
    global, so a count that is not a multiple of P does not repeat)."""
    types = list(hf.get("layer_types") or hf_layer_types(layers, 6))
    if "full_attention" not in types:
        raise ConfigError(f"HF Gemma 4 layer_types {types} has no full_attention layer")
    pattern = types.index("full_attention") + 1
    if types != hf_layer_types(layers, pattern) or layers % pattern:
        raise ConfigError(
            f"HF layer_types {types} is not 'global every Pth layer' over a multiple of P layers; decoder_block gemma4 "
            "runs that pattern only (sliding_window_pattern)"
        )
    return pattern


def _global_shape(hf: dict[str, Any], types: list[str]) -> tuple[int, int]:
    """(global_head_dim, global_num_kv_heads) from the hub's keys or transformers' ``per_layer_config``."""
    heads, head_dim = optional_size(hf, "num_key_value_heads", int(hf["num_attention_heads"])), optional_size(hf, "head_dim", 256)
    per_layer = hf.get("per_layer_config")
    if per_layer is None:
        kv = optional_size(hf, "num_global_key_value_heads", heads) if hf.get("attention_k_eq_v") else heads
        return optional_size(hf, "global_head_dim", 512), kv
    shapes = set()
    for i, kind in enumerate(types):
        own = dict(per_layer.get(str(i)) or per_layer.get(i) or {})
        shape = (int(own.pop("head_dim", head_dim)), int(own.pop("num_key_value_heads", heads)))
        if own or (kind == "sliding_attention" and shape != (head_dim, heads)):
            raise ConfigError(f"HF per_layer_config of layer {i} ({kind}) is not a global layer's head_dim / kv heads")
        if kind == "full_attention":
            shapes.add(shape)
    if len(shapes) != 1:
        raise ConfigError(f"HF per_layer_config gives the global layers several shapes {sorted(shapes)}; nnxtron needs one")
    return shapes.pop()


def _rope(hf: dict[str, Any], layer_type: str, default: dict[str, Any]) -> tuple[float, float]:
    """(theta, rotated share) of one layer type's ``rope_parameters`` (``default`` or ``proportional``)."""
    rope = (hf.get("rope_parameters") or {}).get(layer_type) or default
    kind = rope.get("rope_type", "default")
    if kind not in ("default", "proportional") or float(rope.get("factor", 1.0)) != 1.0:
        raise ConfigError(f"HF Gemma 4 {layer_type} rope {rope} is not supported; only default or proportional, unscaled")
    share = float(rope.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0
    return float(rope.get("rope_theta", default["rope_theta"])), share


def _refuse_unsupported(hf: dict[str, Any]) -> None:
    for key in ("hidden_size_per_layer_input", "num_kv_shared_layers"):
        if hf.get(key):
            raise ConfigError(
                f"HF Gemma 4 {key}={hf[key]} is Gemma 4 small (E2B / E4B: per-layer inputs, key/value sharing across "
                "layers), which nnxtron does not build; decoder_block gemma4 is Gemma 4 26B-A4B and 31B"
            )
    for key in ("use_bidirectional_attention", "attention_bias"):
        if hf.get(key):
            raise ConfigError(f"HF Gemma 4 {key}={hf[key]} is not supported by decoder_block gemma4")
    if hf.get("hidden_activation", GELU_TANH[0]) not in GELU_TANH:
        raise ConfigError(f"HF hidden_activation '{hf['hidden_activation']}' is not supported; only gelu_pytorch_tanh")


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """nnxtron config values for an HF ``gemma4_text`` ``config.json``."""
    _refuse_unsupported(hf)
    layers, heads, width = int(hf["num_hidden_layers"]), int(hf["num_attention_heads"]), int(hf["hidden_size"])
    pattern = _pattern(hf, layers)
    global_head_dim, global_kv = _global_shape(hf, hf_layer_types(layers, pattern))
    local_theta, local_share = _rope(hf, "sliding_attention", {"rope_theta": 10000.0})
    theta, share = _rope(hf, "full_attention", {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6})
    values: dict[str, Any] = {
        "decoder_block": "gemma4",
        "base_emb_dim": width,
        "base_num_query_heads": heads,
        "base_num_kv_heads": optional_size(hf, "num_key_value_heads", heads),
        "head_dim": optional_size(hf, "head_dim", 256),
        "global_head_dim": global_head_dim,
        "global_num_kv_heads": global_kv,
        "share_kv_projections": bool(hf.get("attention_k_eq_v", False)),
        "base_mlp_dim": int(hf["intermediate_size"]),
        "base_num_decoder_layers": layers,
        "vocab_size": int(hf["vocab_size"]),
        "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", True)),
        "normalize_embedding_logits": True,  # with the sqrt(emb_dim) input scale: HF's tied head x @ E^T
        "final_logits_soft_cap": float(hf.get("final_logit_softcapping") or 0.0),
        "mlp_activations": ["gelu", "linear"],
        "use_qk_norm": True,
        "query_pre_attn_scalar": 1.0,
        "sliding_window_size": int(hf["sliding_window"]),
        "sliding_window_pattern": pattern,
        "local_rope_max_timescale": local_theta,
        "local_rope_proportion": local_share,
        "rope_max_timescale": theta,
        "global_rope_proportion": share,
        "rope_type": "default",
        "rope_interleave": False,
        "max_position_embeddings": optional_size(hf, "max_position_embeddings", 131072, zero_is_default=True),
    }
    if hf.get("enable_moe_block"):
        values.update(
            num_experts=int(hf["num_experts"]),
            num_experts_per_tok=int(hf["top_k_experts"]),
            base_moe_mlp_dim=int(hf["moe_intermediate_size"]),
            shared_experts=1,  # the layer's MLP beside the experts: MaxText's shared expert
            norm_topk_prob=True,  # HF always renormalises the top-k weights
            routed_score_func="softmax",
        )
    return values


def config_to_hf(cfg: Config) -> dict[str, Any]:
    """The HF ``config.json`` of a gemma4 config (``config/gemma4.py`` has already checked its rules)."""
    layers, pattern = cfg.base_num_decoder_layers, cfg.sliding_window_pattern
    if layers % pattern:
        raise ConfigError(
            f"HF Gemma 4 makes its last layer global: {layers} layers with a global one every {pattern} cannot be "
            f"exported; use a multiple of sliding_window_pattern={pattern} layers"
        )
    kv_heads = cfg.global_num_kv_heads or cfg.base_num_kv_heads
    if kv_heads != cfg.base_num_kv_heads and not cfg.share_kv_projections:
        raise ConfigError(
            "HF Gemma 4 reads num_global_key_value_heads only with attention_k_eq_v; export needs "
            "share_kv_projections=true or global_num_kv_heads=0"
        )
    if cfg.num_experts > 1 and not cfg.norm_topk_prob:
        raise ConfigError(f"HF {ARCHITECTURE}'s router always renormalises the top-k weights; export needs norm_topk_prob=true")
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "gemma4_text",
        "hidden_size": cfg.base_emb_dim,
        "num_attention_heads": cfg.base_num_query_heads,
        "num_key_value_heads": cfg.base_num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "global_head_dim": cfg.global_head_dim or cfg.resolved_head_dim,
        "num_global_key_value_heads": kv_heads,
        "attention_k_eq_v": cfg.share_kv_projections,
        "intermediate_size": cfg.base_mlp_dim,
        "num_hidden_layers": layers,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.normalization_layer_epsilon,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": hf_ties_head(cfg, input_scale=True),
        "final_logit_softcapping": cfg.final_logits_soft_cap or None,
        "sliding_window": cfg.sliding_window_size,
        "layer_types": hf_layer_types(layers, pattern),
        "rope_parameters": {
            "sliding_attention": _rope_to_hf(cfg.local_rope_max_timescale or cfg.rope_max_timescale, cfg.local_rope_proportion),
            "full_attention": _rope_to_hf(cfg.rope_max_timescale, cfg.global_rope_proportion),
        },
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "attention_bias": False,
        "max_position_embeddings": max(cfg.max_target_length, cfg.max_position_embeddings),
        "enable_moe_block": cfg.num_experts > 1,
        "dtype": cfg.weight_dtype,
    }
    if cfg.num_experts > 1:
        hf.update(num_experts=cfg.num_experts, top_k_experts=cfg.num_experts_per_tok, moe_intermediate_size=cfg.base_moe_mlp_dim)
    return hf


def _rope_to_hf(theta: float, share: float) -> dict[str, Any]:
    if share == 1.0:
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": "proportional", "partial_rotary_factor": share, "rope_theta": theta}
