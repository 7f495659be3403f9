"""HF conversion pieces shared by several families: weight maps of the common modules,
RoPE parameters, the ``config.json`` entries every Llama-style family reads and writes,
and the check that a config has an HF equivalent."""

from __future__ import annotations

from typing import Any

from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.models.family import WeightMap

NORM_WEIGHTS = (
    WeightMap("pre_attention_norm/scale", "input_layernorm.weight"),
    WeightMap("post_attention_norm/scale", "post_attention_layernorm.weight"),
)
GQA_WEIGHTS = (
    WeightMap("attention/query/kernel", "self_attn.q_proj.weight", 1),
    WeightMap("attention/key/kernel", "self_attn.k_proj.weight", 1),
    WeightMap("attention/value/kernel", "self_attn.v_proj.weight", 1),
    WeightMap("attention/out/kernel", "self_attn.o_proj.weight", 2),
)
# the query/key/value biases (HF Qwen2): flat [heads * head_dim] in HF, [heads, head_dim] in nnxtron (reshaped only)
GQA_BIAS_WEIGHTS = tuple(
    WeightMap(f"attention/{name}/bias", f"self_attn.{proj}.bias", conv1d=True)
    for name, proj in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"))
)
QK_NORM_WEIGHTS = (
    WeightMap("attention/query_norm/scale", "self_attn.q_norm.weight"),
    WeightMap("attention/key_norm/scale", "self_attn.k_norm.weight"),
)


def gated_mlp_weights(prefix: str, hf_prefix: str) -> tuple[WeightMap, ...]:
    """A GatedMLP at ``prefix`` <-> HF ``{hf_prefix}.{gate,up,down}_proj``."""
    return (
        WeightMap(f"{prefix}/wi_0/kernel", f"{hf_prefix}.gate_proj.weight", 1),
        WeightMap(f"{prefix}/wi_1/kernel", f"{hf_prefix}.up_proj.weight", 1),
        WeightMap(f"{prefix}/wo/kernel", f"{hf_prefix}.down_proj.weight", 1),
    )


def routed_expert_weights(
    router: str, experts: str, names: tuple[str, str, str], fused_router: str = ""
) -> tuple[WeightMap, ...]:
    """The MoE router and experts <-> HF: ``{experts}.{e}.{gate,up,down name}.weight`` per
    expert (hub layout) or the fused ``mlp.experts.gate_up_proj`` / ``down_proj``."""
    gate, up, down = names
    return (
        WeightMap("mlp/router/kernel", f"{router}.weight", 1, fused_key=f"{fused_router}.weight" if fused_router else ""),
        WeightMap("mlp/wi_0", f"{experts}.{{e}}.{gate}.weight", 1, "mlp.experts.gate_up_proj", 0, 2),
        WeightMap("mlp/wi_1", f"{experts}.{{e}}.{up}.weight", 1, "mlp.experts.gate_up_proj", 1, 2),
        WeightMap("mlp/wo", f"{experts}.{{e}}.{down}.weight", 1, "mlp.experts.down_proj"),
    )


def top_weights(cfg: Config) -> tuple[WeightMap, ...]:
    maps = [WeightMap("embed/embedding", "model.embed_tokens.weight"), WeightMap("final_norm/scale", "model.norm.weight")]
    if not cfg.logits_via_embedding:
        maps.append(WeightMap("logits/kernel", "lm_head.weight", 1))
    return tuple(maps)


def optional_size(hf: dict[str, Any], field: str, default: int, *, zero_is_default: bool = False) -> int:
    """An HF ``config.json`` size or count that may be left out: absent or null is ``default``,
    as transformers reads it. A value must be a whole number >= 1 (true/false, ``4.5`` and
    ``"4"`` raise where they are read: ``convert/hf_values.py``); 0 is ``default`` only where
    transformers also reads 0 so (``zero_is_default``), else a ValueError naming the field."""
    value = hf.get(field)
    if value is None:
        return default
    number = int(value)
    if number == 0 and zero_is_default:
        return default
    if number < 1:
        raise ValueError(f"{field}={number} where a size or count >= 1 belongs (null or no entry: the default)")
    return number


def rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """nnxtron RoPE values from an HF config (transformers 5 ``rope_parameters`` or 4.x keys)."""
    rope = dict(hf.get("rope_parameters") or {})
    if not rope:  # transformers 4.x layout
        rope = dict(hf.get("rope_scaling") or {})
        rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    out: dict[str, Any] = {"rope_max_timescale": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if kind == "default":
        out["rope_type"] = "default"
    elif kind == "llama3":
        out.update(
            rope_type="llama3",
            rope_scaling_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    elif kind == "yarn":
        if rope.get("attention_factor") is not None:
            raise ConfigError("HF yarn rope_parameters with an explicit attention_factor are not supported")
        if rope.get("truncate", True) not in (True, False):
            raise ConfigError(f"HF yarn rope_parameters truncate={rope['truncate']!r} is not true or false")
        out.update(
            rope_type="yarn",
            rope_scaling_factor=float(rope["factor"]),
            rope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            max_position_embeddings=optional_size(
                hf, "max_position_embeddings", int(rope["original_max_position_embeddings"]), zero_is_default=True
            ),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            mscale=float(rope.get("mscale") or 0.0),  # 0 = absent (HF semantics)
            mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
            rope_truncate=bool(rope.get("truncate", True)),  # GPT-OSS: false
        )
    else:
        raise ConfigError(f"HF rope_type '{kind}' is not supported; supported: default, llama3, yarn")
    return out


def rope_to_hf(cfg: Config) -> dict[str, Any]:
    """The HF ``rope_parameters`` of ``cfg``."""
    rope: dict[str, Any] = {"rope_theta": cfg.rope_max_timescale, "rope_type": cfg.rope_type}
    if cfg.rope_type == "llama3":
        rope.update(
            factor=cfg.rope_scaling_factor,
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
        )
    elif cfg.rope_type == "yarn":
        rope.update(
            factor=cfg.rope_scaling_factor,
            original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
            beta_fast=cfg.beta_fast,
            beta_slow=cfg.beta_slow,
            mscale=cfg.mscale,
            mscale_all_dim=cfg.mscale_all_dim,
        )
        if not cfg.rope_truncate:  # HF's default is true
            rope["truncate"] = False
    return rope


# HF activation names of the tanh-approximated GELU (nnxtron's ``gelu``); Gemma's legacy ``gelu`` is read so by
# transformers (GemmaConfig turns it into ``gelu_pytorch_tanh``)
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")


def common_config_from_hf(
    hf: dict[str, Any],
    decoder_block: str,
    head_dim_zero_is_default: bool = False,
    qkv_bias: bool = False,
    gelu_acts: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The config values every pre-norm family reads the same way from an HF ``config.json``.
    ``head_dim_zero_is_default``: the HF class's attention reads ``config.head_dim or hidden_size //
    num_attention_heads`` (transformers 5: Mistral, Mixtral); the others (Llama, Qwen3, Llama 4)
    build 0-wide projections for head_dim 0, which cannot hold the weights: refused. ``qkv_bias``:
    the HF class always biases its query, key and value projections (Qwen2, which has no
    ``attention_bias`` entry): ``attention_bias=true``; elsewhere HF ``attention_bias=true`` is refused.
    ``gelu_acts``: the family's ``hidden_act`` values that are the tanh GELU (Gemma: its gated GeGLU MLP,
    ``mlp_activations=[gelu, linear]``); otherwise only silu."""
    act = hf.get("hidden_act", gelu_acts[0] if gelu_acts else "silu")
    if act not in (gelu_acts or ("silu",)):
        raise ConfigError(f"HF hidden_act '{act}' is not supported; only {' / '.join(gelu_acts or ('silu',))}")
    for flag in ("mlp_bias",) if qkv_bias else ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"HF {flag}=true is not supported by decoder_block {decoder_block}")
    heads, width = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    values = {
        "decoder_block": decoder_block,
        "base_emb_dim": width,
        "base_num_query_heads": heads,
        "base_num_kv_heads": optional_size(hf, "num_key_value_heads", heads),  # 0: HF divides the heads by it
        "head_dim": optional_size(hf, "head_dim", width // heads, zero_is_default=head_dim_zero_is_default),
        "base_mlp_dim": int(hf["intermediate_size"]),
        "base_num_decoder_layers": int(hf["num_hidden_layers"]),
        "vocab_size": int(hf["vocab_size"]),
        "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
        "normalize_embedding_logits": False,  # HF's tied head: x @ E^T
        "sliding_window_size": int(hf.get("sliding_window") or 0),
        "rope_interleave": False,
        "mlp_activations": ["gelu" if gelu_acts else "silu", "linear"],
    }
    if qkv_bias:
        values["attention_bias"] = True
    # the context the model was made for (generate, serve and the export keep it); HF keeps 0 but
    # reads it nowhere for these RoPE types, so 0 is "not given" (nnxtron's default bounds decoding)
    positions = optional_size(hf, "max_position_embeddings", 0, zero_is_default=True)
    if positions:
        values["max_position_embeddings"] = positions
    values.update(rope_from_hf(hf))
    return values


def window_off_from_hf(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Qwen2 / Qwen3: HF uses ``sliding_window`` only with ``use_sliding_window`` (some of its layers
    sliding), which is refused; without it the window entry is not read: ``sliding_window_size=0``."""
    if hf.get("use_sliding_window"):
        raise ConfigError(f"HF use_sliding_window=true ({family} sliding layers) is not supported; use a checkpoint without it")
    return {"sliding_window_size": 0}


def hf_layer_types(layers: int, pattern: int) -> list[str]:
    """HF's ``layer_types`` of ``layers`` layers, every ``pattern``-th one global (Gemma 2 / 3, OLMo 3)."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]


def hf_ties_head(cfg: Config, input_scale: bool = False) -> bool:
    """Whether HF's tied head (``x @ E^T``) is this config's: tied, and the tied logits are not
    rescaled (``layers/embed.py: tied_logit_scale``: ``normalize_embedding_logits`` divides by
    ``sqrt(emb_dim)``, which a family with an ``input_scale`` of ``sqrt(emb_dim)`` multiplies back).
    Otherwise the HF export unties the head (``convert/hf.py``: ``lm_head`` = the scaled table)."""
    return cfg.logits_via_embedding and cfg.normalize_embedding_logits == input_scale


def common_config_to_hf(cfg: Config, model_type: str, architecture: str, qkv_bias: bool = False) -> dict[str, Any]:
    """The HF ``config.json`` entries shared by the pre-norm families; ``qkv_bias``: the HF class always
    biases its query, key and value projections (and has no ``attention_bias`` entry), the others none."""
    if cfg.attention_bias != qkv_bias:
        raise ConfigError(
            f"HF {architecture} {'always biases' if qkv_bias else 'has no biases on'} its query/key/value projections; "
            f"export needs attention_bias={str(qkv_bias).lower()}"
        )
    hf = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": cfg.base_emb_dim,
        "num_attention_heads": cfg.base_num_query_heads,
        "num_key_value_heads": cfg.base_num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "intermediate_size": cfg.base_mlp_dim,
        "num_hidden_layers": cfg.base_num_decoder_layers,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.normalization_layer_epsilon,
        "hidden_act": "silu",
        "tie_word_embeddings": hf_ties_head(cfg),
        "rope_parameters": rope_to_hf(cfg),
        "max_position_embeddings": max(cfg.max_target_length, cfg.max_position_embeddings),
        "attention_bias": False,
        "dtype": cfg.weight_dtype,
    }
    if qkv_bias:
        del hf["attention_bias"]
    return hf


PATTERN_FIELDS = (
    "sliding_window_pattern",
    "nope_layer_interval",
    "chunk_attn_window_size",
    "temperature_tuning",
    "trainable_position_size",
    "query_pre_attn_scalar",
    "local_rope_max_timescale",
    "attn_logits_soft_cap",
)


def refuse_attention_soft_cap(cfg: Config, family: str) -> None:
    """An HF class whose import nnxtron keeps without an attention logit soft cap: export refuses one."""
    if cfg.attn_logits_soft_cap:
        raise ConfigError(
            f"HF {family} (as nnxtron imports it) has no attention logit soft cap; export needs attn_logits_soft_cap=0"
        )


def check_exportable(
    cfg: Config, family: str, *, moe: bool = False, qk_norm: bool = False, mla: bool = False, dense_layers: bool = False
) -> None:
    """Raise when ``cfg`` uses a feature the HF class of ``family`` lacks (a Llama-style one);
    ``dense_layers``: the class has dense layers among its MoE layers (Qwen3-MoE)."""
    for name in PATTERN_FIELDS:
        if getattr(cfg, name):
            raise ConfigError(f"{name} has no HF {family} equivalent; export needs {name}=0/false (or a family that has it)")
    if cfg.interleave_moe_layer_step != 1 and not dense_layers:
        raise ConfigError(f"interleave_moe_layer_step has no HF {family} equivalent; export needs 1")
    if cfg.dense_layers and not dense_layers:
        raise ConfigError(f"dense_layers has no HF {family} equivalent; export needs dense_layers=[]")
    if cfg.rope_type == "linear":
        raise ConfigError(f"rope_type=linear is not exported for HF {family}; use default, llama3 or yarn")
    if cfg.num_experts > 1 and not moe:
        raise ConfigError(f"num_experts > 1 has no HF {family} equivalent; export a MoE family (mixtral, qwen3_moe, deepseek)")
    if cfg.use_qk_norm != qk_norm:
        raise ConfigError(f"HF {family} needs use_qk_norm={str(qk_norm).lower()}")
    if (cfg.attention_type == "mla") != mla:
        raise ConfigError(f"HF {family} needs attention_type={'mla' if mla else 'global'}")
