"""DeepSeek-V4 <-> HF: weight names and the ``config.json`` mapping.

``save_pretrained`` writes the upstream hub names (``attn.wq_a``, ``ffn.gate.bias``,
``hc_attn_fn``, ``head.weight``, per-expert ``ffn.experts.{e}.w1/w3/w2``...); the
in-memory module names (``self_attn.q_a_proj``, fused ``mlp.experts.gate_up_proj``...) load too.
Export writes the hub names.
"""

from __future__ import annotations

from typing import Any

from nnxtron.config.layout import LayerKind
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.models.family import WeightMap
from nnxtron.models.hf_common import optional_size, rope_from_hf


def _w(path: str, hub: str, module: str, in_dims: int = 0, **kw: Any) -> WeightMap:
    """A weight with its hub name (what save_pretrained writes) and its HF module name."""
    return WeightMap(path, hub, in_dims, fused_key=module, **kw)


def _compressor(path: str, hub: str, module: str) -> tuple[WeightMap, ...]:
    return (
        _w(f"{path}/wkv/kernel", f"{hub}.wkv.weight", f"{module}.kv_proj.weight", 1),
        _w(f"{path}/wgate/kernel", f"{hub}.wgate.weight", f"{module}.gate_proj.weight", 1),
        _w(f"{path}/position_bias", f"{hub}.ape", f"{module}.position_bias"),
        _w(f"{path}/norm/scale", f"{hub}.norm.weight", f"{module}.kv_norm.weight"),
    )


def _hc(path: str, hub: str, module: str) -> tuple[WeightMap, ...]:
    return tuple(_w(f"{path}/{name}", f"{hub}{name}", f"{module}.{name}") for name in ("fn", "base", "scale"))


ATTENTION_WEIGHTS = (
    _w("attention/wq_a/kernel", "attn.wq_a.weight", "self_attn.q_a_proj.weight", 1),
    _w("attention/q_norm/scale", "attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    _w("attention/wq_b/kernel", "attn.wq_b.weight", "self_attn.q_b_proj.weight", 1),
    _w("attention/wkv/kernel", "attn.wkv.weight", "self_attn.kv_proj.weight", 1),
    _w("attention/kv_norm/scale", "attn.norm.weight", "self_attn.kv_norm.weight"),
    _w("attention/wo_a", "attn.wo_a.weight", "self_attn.o_a_proj.weight", 2, conv1d=True),  # [g*o_lora, in] = [g, o_lora, in]
    _w("attention/wo_b/kernel", "attn.wo_b.weight", "self_attn.o_b_proj.weight", 1),
    _w("attention/sinks", "attn.attn_sink", "self_attn.sinks"),
)
COMPRESSOR_WEIGHTS = _compressor("attention/compressor", "attn.compressor", "self_attn.compressor")
INDEXER_WEIGHTS = _compressor("attention/indexer/compressor", "attn.indexer.compressor", "self_attn.compressor.indexer") + (
    _w("attention/indexer/wq_b/kernel", "attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight", 1),
    _w(
        "attention/indexer/weights_proj/kernel",
        "attn.indexer.weights_proj.weight",
        "self_attn.compressor.indexer.scorer.weights_proj.weight",
        1,
    ),
)
BLOCK_WEIGHTS = (
    *_hc("attention_hc", "hc_attn_", "attn_hc"),
    *_hc("mlp_hc", "hc_ffn_", "ffn_hc"),
    _w("pre_attention_norm/scale", "attn_norm.weight", "input_layernorm.weight"),
    _w("post_attention_norm/scale", "ffn_norm.weight", "post_attention_layernorm.weight"),
    _w("mlp/router/kernel", "ffn.gate.weight", "mlp.gate.weight", 1),
    WeightMap("mlp/wi_0", "ffn.experts.{e}.w1.weight", 1, "mlp.experts.gate_up_proj", 0, 2),
    WeightMap("mlp/wi_1", "ffn.experts.{e}.w3.weight", 1, "mlp.experts.gate_up_proj", 1, 2),
    WeightMap("mlp/wo", "ffn.experts.{e}.w2.weight", 1, "mlp.experts.down_proj"),
    _w("mlp/shared/wi_0/kernel", "ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight", 1),
    _w("mlp/shared/wi_1/kernel", "ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight", 1),
    _w("mlp/shared/wo/kernel", "ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight", 1),
)


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    maps = BLOCK_WEIGHTS + ATTENTION_WEIGHTS
    if kind.attention in ("csa", "hca"):
        maps += COMPRESSOR_WEIGHTS
    if kind.attention == "csa":
        maps += INDEXER_WEIGHTS
    if kind.hash:
        maps += (_w("mlp/tid2eid", "ffn.gate.tid2eid", "mlp.gate.tid2eid"),)
    elif cfg.routed_bias:
        maps += (_w("mlp/router_bias", "ffn.gate.bias", "mlp.gate.e_score_correction_bias"),)
    return maps


def top_weights(cfg: Config) -> tuple[WeightMap, ...]:
    if cfg.logits_via_embedding:
        raise ConfigError("decoder_block deepseek4 has an untied head: set logits_via_embedding=false")
    return (
        WeightMap("embed/embedding", "model.embed_tokens.weight"),
        WeightMap("final_norm/scale", "model.norm.weight"),
        _w("logits/kernel", "head.weight", "lm_head.weight", 1),
        *(WeightMap(f"hyper_head/{name}", f"model.hc_head.hc_{name}") for name in ("fn", "base", "scale")),
    )


RATIO_OF = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """nnxtron config values for an HF ``deepseek_v4`` ``config.json``."""
    layers = int(hf["num_hidden_layers"])
    rates = hf.get("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    csa, hca = int(rates["compressed_sparse_attention"]), int(rates["heavily_compressed_attention"])
    if hf.get("layer_types"):
        unknown = sorted(set(hf["layer_types"]) - set(RATIO_OF))
        if unknown:
            raise ConfigError(f"HF DeepSeek-V4 layer_types {unknown} are not supported; use {sorted(RATIO_OF)}")
        ratio = {"sliding_attention": 0, "compressed_sparse_attention": csa, "heavily_compressed_attention": hca}
        ratios = [ratio[t] for t in hf["layer_types"]]
    else:
        ratios = [int(r) for r in hf["compress_ratios"]]
    mlp_types = list(hf.get("mlp_layer_types") or ["hash_moe"] * min(layers, 3) + ["moe"] * max(0, layers - 3))
    hashed = sum(1 for t in mlp_types if t == "hash_moe")
    if mlp_types != ["hash_moe"] * hashed + ["moe"] * (layers - hashed):
        raise ConfigError(f"HF mlp_layer_types {mlp_types} must be hash_moe layers first, then moe layers")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError("HF DeepSeek-V4 with hidden_act other than silu or with biases is not supported")
    if hf.get("scoring_func", "sqrtsoftplus") not in ("sqrtsoftplus", "sigmoid", "softmax"):
        raise ConfigError(f"HF scoring_func '{hf['scoring_func']}' is not supported")
    rope = dict((hf.get("rope_parameters") or {}).get("compress") or {})
    main = dict((hf.get("rope_parameters") or {}).get("main") or {})
    head_dim = int(hf["head_dim"])
    partial = float(main.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 0.125)
    compress = rope_from_hf({**hf, "rope_parameters": {k: v for k, v in rope.items() if k != "attention_factor"}})
    if main.get("rope_type", "default") != "default":
        raise ConfigError(f"HF DeepSeek-V4 main rope_type '{main['rope_type']}' is not supported; only default")
    compress.pop("rope_max_timescale")
    return {
        "decoder_block": "deepseek4",
        "attention_type": "compressed",
        "base_emb_dim": int(hf["hidden_size"]),
        "base_num_query_heads": int(hf["num_attention_heads"]),
        "base_num_kv_heads": 1,
        "head_dim": head_dim,
        "qk_rope_head_dim": int(head_dim * partial),
        "q_lora_rank": int(hf["q_lora_rank"]),
        "o_groups": int(hf["o_groups"]),
        "o_lora_rank": int(hf["o_lora_rank"]),
        "sliding_window_size": int(hf["sliding_window"]),
        "compress_ratios": ratios,
        "csa_compress_ratio": csa,
        "hca_compress_ratio": hca,
        "rope_max_timescale": float(main.get("rope_theta", hf.get("rope_theta", 10000.0))),
        "compressed_rope_max_timescale": float(rope.get("rope_theta", hf.get("compress_rope_theta", 160000.0))),
        **compress,
        "rope_interleave": True,
        "indexer_n_heads": int(hf["index_n_heads"]),
        "indexer_head_dim": int(hf["index_head_dim"]),
        "indexer_topk": int(hf["index_topk"]),
        "mhc_expansion_rate": int(hf["hc_mult"]),
        "sinkhorn_iterations": int(hf["hc_sinkhorn_iters"]),
        "mhc_eps": float(hf.get("hc_eps", 1e-6)),
        "base_num_decoder_layers": layers,
        "vocab_size": int(hf["vocab_size"]),
        "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
        "normalize_embedding_logits": False,  # HF's (the head is untied)
        "num_experts": int(hf["n_routed_experts"]),
        "num_experts_per_tok": int(hf["num_experts_per_tok"]),
        "base_moe_mlp_dim": int(hf["moe_intermediate_size"]),
        "base_mlp_dim": int(hf["moe_intermediate_size"]),
        "shared_experts": int(hf.get("n_shared_experts", 1)),
        "routed_score_func": hf.get("scoring_func", "sqrtsoftplus"),
        "routed_bias": True,
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.5)),
        "first_num_hash_layers": hashed,
        "mlp_activations_limit": float(hf.get("swiglu_limit") or 0.0),
        "mlp_activations": ["silu", "linear"],
        "max_position_embeddings": optional_size(hf, "max_position_embeddings", 1048576, zero_is_default=True),
    }


def config_to_hf(cfg: Config) -> dict[str, Any]:
    if cfg.shared_experts != 1 or not cfg.routed_bias or not cfg.norm_topk_prob:
        raise ConfigError("HF DeepSeek-V4 has one shared expert, a correction bias and normalised top-k weights")
    kinds = {
        0: "sliding_attention",
        cfg.csa_compress_ratio: "compressed_sparse_attention",
        cfg.hca_compress_ratio: "heavily_compressed_attention",
    }
    partial = cfg.qk_rope_head_dim / cfg.resolved_head_dim
    compress: dict[str, Any] = {
        "rope_type": cfg.rope_type,
        "rope_theta": cfg.compressed_rope_max_timescale,
        "partial_rotary_factor": partial,
    }
    if cfg.rope_type == "yarn":
        compress.update(
            factor=cfg.rope_scaling_factor,
            original_max_position_embeddings=cfg.rope_original_max_position_embeddings,
            beta_fast=cfg.beta_fast,
            beta_slow=cfg.beta_slow,
            attention_factor=1.0,
        )
    elif cfg.rope_type != "default":
        raise ConfigError("HF DeepSeek-V4 compressed layers take rope_type default or yarn")
    layers = cfg.base_num_decoder_layers
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "hidden_size": cfg.base_emb_dim,
        "num_attention_heads": cfg.base_num_query_heads,
        "num_key_value_heads": 1,
        "head_dim": cfg.resolved_head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank,
        "sliding_window": cfg.sliding_window_size,
        "layer_types": [kinds[r] for r in cfg.compress_ratios],
        "compress_rates": {
            "compressed_sparse_attention": cfg.csa_compress_ratio,
            "heavily_compressed_attention": cfg.hca_compress_ratio,
        },
        "mlp_layer_types": ["hash_moe" if i < cfg.first_num_hash_layers else "moe" for i in range(layers)],
        "rope_theta": cfg.rope_max_timescale,
        "compress_rope_theta": cfg.compressed_rope_max_timescale,
        "partial_rotary_factor": partial,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": cfg.rope_max_timescale, "partial_rotary_factor": partial},
            "compress": compress,
        },
        "index_n_heads": cfg.indexer_n_heads,
        "index_head_dim": cfg.indexer_head_dim,
        "index_topk": cfg.indexer_topk,
        "hc_mult": cfg.mhc_expansion_rate,
        "hc_sinkhorn_iters": cfg.sinkhorn_iterations,
        "hc_eps": cfg.mhc_eps,
        "num_hidden_layers": layers,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.normalization_layer_epsilon,
        "tie_word_embeddings": False,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.base_moe_mlp_dim,
        "n_shared_experts": 1,
        "scoring_func": cfg.routed_score_func,
        "norm_topk_prob": True,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "swiglu_limit": cfg.mlp_activations_limit,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_nextn_predict_layers": 0,
        "dtype": cfg.weight_dtype,
    }
