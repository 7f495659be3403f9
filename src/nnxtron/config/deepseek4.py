"""DeepSeek-V4's config rules: its keys' checks, its layer kinds and its matmul count.

The pure part of the family (``models/deepseek4/`` holds its blocks, layers and HF map):
``compress_ratios`` gives each layer its attention kind (0 sliding window only,
``csa_compress_ratio`` compressed sparse attention with the indexer,
``hca_compress_ratio`` heavily compressed attention) and the first
``first_num_hash_layers`` layers route experts by the token -> expert table. The keys
themselves are the DeepSeek-V4 section of ``schema.py`` (flat MaxText-style names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nnxtron.errors import ConfigError

if TYPE_CHECKING:
    from nnxtron.config.schema import Config

# keys read by decoder_block=deepseek4 only -> their value for every other family (base.yml's)
OPTIONS_OFF: dict[str, Any] = {
    "mhc_expansion_rate": 1,
    "first_num_hash_layers": 0,
    "mlp_activations_limit": 0,
    "compress_ratios": (),
}


def attention_kind(cfg: Config, i: int) -> str:
    """The attention kind of layer ``i``: ``sliding``, ``csa`` or ``hca``."""
    ratio = cfg.compress_ratios[i]
    return "sliding" if ratio == 0 else "csa" if ratio == cfg.csa_compress_ratio else "hca"


def hash_routed(cfg: Config, i: int) -> bool:
    """Whether layer ``i`` routes experts by the token -> expert table."""
    return i < cfg.first_num_hash_layers


def period(cfg: Config) -> int:
    """The smallest period of ``compress_ratios`` after the hash-routed prefix (a leftover
    shorter than the period must repeat its start)."""
    ratios = cfg.compress_ratios[cfg.first_num_hash_layers :]
    return next((p for p in range(1, len(ratios) + 1) if all(r == ratios[i % p] for i, r in enumerate(ratios))), 1)


def attention_params(cfg: Config, attention: str) -> int:
    """Matmul params one token goes through in an attention layer of kind ``attention``
    (projections, compressor, indexer) plus its two hyper-connection mixes."""
    d, h, hd, lora = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.resolved_head_dim, cfg.q_lora_rank
    params = d * lora + lora * h * hd + d * hd + h * hd * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d
    if attention == "hca":
        params += 2 * d * hd
    elif attention == "csa":
        c, heads = cfg.indexer_head_dim, cfg.indexer_n_heads
        params += 2 * d * 2 * hd + 2 * d * 2 * c + lora * heads * c + d * heads
    k = cfg.mhc_expansion_rate
    return params + 2 * (2 + k) * k * k * d


def keys_seen(cfg: Config, attention: str) -> float:
    """Keys a query of a ``csa`` / ``hca`` layer attends to, on average over a causal
    sequence of ``max_target_length``: the sliding window plus the visible compressed entries."""
    seq = cfg.max_target_length
    window = min(cfg.sliding_window_size, seq)
    ratio = cfg.csa_compress_ratio if attention == "csa" else cfg.hca_compress_ratio
    entries = seq / ratio / 2  # complete entries, on average over the sequence
    if attention == "csa":
        entries = min(entries, cfg.indexer_topk)
    return window - (window * window) / (2 * seq) + entries


def check(cfg: Config) -> None:
    """The DeepSeek-V4 keys, consistent with decoder_block=deepseek4 (``config/families.py`` runs
    this for it only; ``checks.check_family`` keeps ``OPTIONS_OFF`` and attention_type=compressed
    to it)."""
    if cfg.attention_type != "compressed":
        raise ConfigError("decoder_block=deepseek4 and attention_type=compressed go together; set both or neither")
    layers = cfg.base_num_decoder_layers
    if len(cfg.compress_ratios) != layers:
        raise ConfigError(
            f"compress_ratios has {len(cfg.compress_ratios)} entries but base_num_decoder_layers={layers}; "
            "give one ratio per layer"
        )
    allowed = (0, cfg.csa_compress_ratio, cfg.hca_compress_ratio)
    bad = sorted({r for r in cfg.compress_ratios if r not in allowed})
    if bad:
        raise ConfigError(
            f"compress_ratios entries {bad} are not supported: use 0 (sliding), csa_compress_ratio="
            f"{cfg.csa_compress_ratio} (CSA) or hca_compress_ratio={cfg.hca_compress_ratio} (HCA)"
        )
    if cfg.csa_compress_ratio == cfg.hca_compress_ratio:
        raise ConfigError("csa_compress_ratio and hca_compress_ratio must differ")
    if cfg.num_experts == 1:
        raise ConfigError("decoder_block=deepseek4 has MoE layers only; set num_experts > 1")
    if cfg.first_num_hash_layers > layers:
        raise ConfigError(f"first_num_hash_layers={cfg.first_num_hash_layers} exceeds base_num_decoder_layers={layers}")
    if cfg.first_num_dense_layers or cfg.dense_layers:
        raise ConfigError("decoder_block=deepseek4 has no dense layers; set first_num_dense_layers=0 and dense_layers=[]")
    if cfg.mtp_num_layers:
        raise ConfigError("mtp_num_layers > 0 is not supported with decoder_block=deepseek4 (HF drops its MTP layer)")
    if not cfg.rope_interleave:  # models/deepseek4/compressed.py: rope_specs rotates adjacent pairs, as HF does
        raise ConfigError("decoder_block=deepseek4 rotates adjacent pairs (HF DeepSeek-V4); set rope_interleave=true")
    if cfg.qk_rope_head_dim > cfg.resolved_head_dim or cfg.qk_rope_head_dim > cfg.indexer_head_dim:
        raise ConfigError("qk_rope_head_dim must be at most head_dim and indexer_head_dim (RoPE on the last dims)")
    if cfg.base_num_kv_heads != 1:
        raise ConfigError("attention_type=compressed shares one key/value head: set base_num_kv_heads=1")
    if (cfg.base_num_query_heads * cfg.resolved_head_dim) % cfg.o_groups:
        raise ConfigError(f"o_groups={cfg.o_groups} must divide base_num_query_heads x head_dim")
    if not cfg.q_lora_rank or not cfg.sliding_window_size:
        raise ConfigError("attention_type=compressed needs q_lora_rank > 0 and sliding_window_size > 0")
