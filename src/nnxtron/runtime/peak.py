"""The devices' peak FLOP/s (for TFLOP/s and MFU): the config's ``peak_tflops``, a vendor
table, or a matmul probe measured once per device kind and cached.

Model FLOPs per token, the other half of MFU, are ``config/flops.py``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from nnxtron.config.schema import Config

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


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "nnxtron" / "peak_flops.json"


def measure_matmul_flops(dtype: str = "float32", size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a square matmul on the default device (best of ``repeats``), accumulated in
    float32 as the models' weight products are (``layers/matmul.py``): a bfloat16 probe asks
    for a float32 result, which CPUs with bfloat16 matrix units run several times faster."""
    a = jnp.ones((size, size), dtype)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
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
    key = f"{device.platform}:{kind}:{cfg.dtype}:{jax.device_count()}:f32-accumulation"
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
