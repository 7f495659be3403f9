"""Model FLOPs per token and the device's peak FLOP/s (for TFLOP/s and MFU)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from nnxtron.config.schema import Config
from nnxtron.models.pattern import LayerKind

# Dense peak TFLOP/s per chip for bf16 matmuls (vendor figures, without sparsity).
KNOWN_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L4": 121.0,
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,
    "TPU v5e": 197.0,
    "TPU v5p": 459.0,
    "TPU v6 lite": 918.0,
}


def _compressed_params(cfg: Config, kind: LayerKind) -> int:
    """Matmul params one token goes through in a DeepSeek-V4 attention layer of ``kind``
    (projections, compressor, indexer) plus its two hyper-connection mixes."""
    d, h, hd, lora = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.resolved_head_dim, cfg.q_lora_rank
    params = d * lora + lora * h * hd + d * hd + h * hd * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d
    if kind.attention == "hca":
        params += 2 * d * hd
    elif kind.attention == "csa":
        c, heads = cfg.indexer_head_dim, cfg.indexer_n_heads
        params += 2 * d * 2 * hd + 2 * d * 2 * c + lora * heads * c + d * heads
    k = cfg.mhc_expansion_rate
    return params + 2 * (2 + k) * k * k * d


def _attention_params(cfg: Config) -> tuple[int, int, int]:
    """(matmul params of one attention layer, query heads, q.k + p.v width per head)."""
    d, h = cfg.base_emb_dim, cfg.base_num_query_heads
    if cfg.attention_type == "mla":
        qk, v, rope = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
        lora = cfg.q_lora_rank
        query = d * lora + lora * h * qk if lora else d * h * qk
        kv = d * (cfg.kv_lora_rank + rope) + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + v)
        return query + kv + h * v * d, h, qk + v
    k, hd = cfg.base_num_kv_heads, cfg.resolved_head_dim
    return d * (h + 2 * k) * hd + h * hd * d, h, 2 * hd


def _ffn_params(cfg: Config, moe: bool) -> int:
    """Matmul params one token goes through in a feed-forward layer (active experts only)."""
    d = cfg.base_emb_dim
    if not moe:
        return len(cfg.mlp_activations) * d * cfg.base_mlp_dim + d * cfg.base_mlp_dim  # gated: 3 matrices, plain: 2
    experts = cfg.num_experts_per_tok + cfg.shared_experts
    return d * cfg.num_experts + 3 * d * cfg.base_moe_mlp_dim * experts


def _keys_seen(cfg: Config, kind: LayerKind) -> float:
    """Keys a query attends to, on average over a causal sequence of ``max_target_length``."""
    seq = cfg.max_target_length
    if kind.attention in ("csa", "hca"):  # the sliding window plus the visible compressed entries
        window = min(cfg.sliding_window_size, seq)
        ratio = cfg.csa_compress_ratio if kind.attention == "csa" else cfg.hca_compress_ratio
        entries = seq / ratio / 2  # complete entries, on average over the sequence
        if kind.attention == "csa":
            entries = min(entries, cfg.indexer_topk)
        return window - (window * window) / (2 * seq) + entries
    if kind.attention == "chunked":
        chunk = min(cfg.chunk_attn_window_size, seq)
        return (chunk + 1) / 2
    window = min(cfg.sliding_window_size, seq) if kind.attention == "sliding" else seq
    return window - (window * window) / (2 * seq) if window < seq else seq / 2


def training_flops_per_token(cfg: Config) -> float:
    """Model FLOPs per trained token: 6 x active matmul params + causal attention (fwd + bwd).

    Every layer counts by its kind (MoE or dense; global, sliding or chunked attention).
    DeepSeek-V4 layers count their compressors, indexer and hyper-connection mixes.
    MoE layers count the router, the ``num_experts_per_tok`` routed and the shared
    experts a token actually uses; MTP depths count as one more layer each (of the last
    layer's kind) plus their [2D -> D] projection and output head.
    """
    from nnxtron.models.pattern import layer_kinds  # (imports the config only)

    d = cfg.base_emb_dim
    attn_params, heads, width = _attention_params(cfg)
    kinds = list(layer_kinds(cfg))
    kinds += [kinds[-1]] * cfg.mtp_num_layers

    def attention(kind: LayerKind) -> int:
        return _compressed_params(cfg, kind) if cfg.attention_type == "compressed" else attn_params

    matmul_params = sum(attention(kind) + _ffn_params(cfg, kind.moe) for kind in kinds)
    matmul_params += (1 + cfg.mtp_num_layers) * d * cfg.vocab_size + cfg.mtp_num_layers * 2 * d * d
    # q.k and p.v: 2 flops per multiply-add over the keys each query sees, per head
    attention = sum(2 * heads * width * _keys_seen(cfg, kind) for kind in kinds)
    return 6.0 * matmul_params + 3.0 * attention


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "nnxtron" / "peak_flops.json"


def measure_matmul_flops(dtype: str = "float32", size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a square matmul on the default device (best of ``repeats``)."""
    a = jnp.ones((size, size), dtype)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def peak_flops_per_device(cfg: Config) -> tuple[float, str]:
    """Peak FLOP/s of one device and where it came from (config, table or probe)."""
    if cfg.peak_tflops > 0:
        return cfg.peak_tflops * 1e12, "config peak_tflops"
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", "") or ""
    for name, tflops in KNOWN_PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return tflops * 1e12, f"table ({kind})"
    key = f"{device.platform}:{kind}:{cfg.dtype}:{jax.device_count()}"
    cache = _cache_file()
    try:
        cached = json.loads(cache.read_text())
    except (OSError, ValueError):
        cached = {}
    if not isinstance(cached, dict):
        cached = {}
    if key not in cached:
        cached[key] = measure_matmul_flops(cfg.dtype)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(cached, indent=1))
        except OSError:
            pass  # read-only home: measure again next time
    return float(cached[key]), f"matmul probe ({key}, cached in {cache})"


def peak_flops_total(cfg: Config) -> tuple[float, str]:
    """Peak FLOP/s of all devices together (for MFU). Accelerators: per-device peak x device
    count; CPU: the probe already measures the whole CPU, which fake devices share."""
    peak, source = peak_flops_per_device(cfg)
    if jax.devices()[0].platform != "cpu":
        peak *= jax.device_count()
    return peak, source
