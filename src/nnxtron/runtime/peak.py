"""The devices' peak FLOP/s (for TFLOP/s and MFU): the config's ``peak_tflops``, a vendor
table, or the highest FLOP/s a matmul probe has measured on this machine.

Model FLOPs per token, the other half of MFU, are ``config/flops.py``.

**The probe's peak is the highest ever measured, and every run measures again.** A peak is
what the machine can do, and a probe under load measures less: the cores are shared with
other processes (a test suite, a second run) and with the run's own start-up. Measured once
and cached for good, as before, one low reading fixed every later run's MFU too high (the
"CPU MFU 87%" of issue 47). Measured on the project's 2-core CPU machine (AMD EPYC, AVX-512
with AVX512-BF16, under KVM; jax 0.10.2) while another test suite loaded it (load average
4-6), 1024 x 1024 products with a float32 result, 12 probes each:

- float32 operands: best of 5 products 247-302 GFLOP/s (median 252; once 495); probing
  for >= 0.25 s: 251-433. The hardware's float32 peak: 2 cores x 64 FLOP/cycle (two 512-bit
  FMA pipes) x ~3.9 GHz ~ 500 GFLOP/s.
- bfloat16 operands: best of 5 489-955 GFLOP/s (median 882); >= 0.25 s: 874-988.
- inside ``nnxtron train`` (the default float32 model) the probe read 130 GFLOP/s and was
  cached; the run's steps reached 59-89 GFLOP/s, so MFU read 45-69% where it is 12-18% of
  the machine's ~500. The project's toolchain notes give "80-140 GFLOP/s float32, 75-100
  bfloat16" for machines of this kind: single probes vary that much with the load.

So each run probes for at least ``PROBE_SECONDS`` (and ``PROBE_REPEATS`` products; about a
quarter of a second, against seconds of compiling) and keeps the higher of that and the
cached value (``remember_peak``): a reading under load never lowers the peak, and one
unloaded moment of any run raises it for good. The probe's operands have the step's matmul
dtype (``cfg.dtype``) and its result is float32, as ``layers/matmul.py`` computes the weight
products on CPU; the cache is per device kind, dtype and device count.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

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


PROBE_SIZE = 1024  # 2 GFLOP a product: ~4-8 ms on the 2-core CPU above
PROBE_REPEATS = 10  # timed products at the least
PROBE_SECONDS = 0.25  # and for at least this long: more chances of a moment without other load


def measure_matmul_flops(dtype: str = "float32", size: int = 1024, repeats: int = 5, min_seconds: float = 0.0) -> float:
    """FLOP/s of a square matmul on the default device (the fastest of ``repeats`` products, more
    while ``min_seconds`` have not passed), accumulated in float32 as the models' weight products
    are (``layers/matmul.py``): a bfloat16 probe asks for a float32 result, which CPUs with
    bfloat16 matrix units run several times faster."""
    a = jnp.ones((size, size), dtype)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    matmul(a, a).block_until_ready()
    best, count, begin = float("inf"), 0, time.perf_counter()
    while count < repeats or time.perf_counter() - begin < min_seconds:
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
        count += 1
    return 2.0 * size**3 / best


def remember_peak(cached: Any, key: str, measured: float) -> tuple[dict[str, Any], float]:
    """(the cache to store, the peak): the higher of ``measured`` and the cached value of ``key``.
    A cache that is not a dict, or no positive finite number under ``key`` (a torn file, an
    older format), counts as nothing measured."""
    cached = dict(cached) if isinstance(cached, dict) else {}
    old = cached.get(key)
    valid = isinstance(old, (int, float)) and not isinstance(old, bool) and math.isfinite(old) and old > 0
    peak = max(float(old), measured) if valid else measured
    cached[key] = peak
    return cached, peak


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
        stored = json.loads(cache.read_text())
    except (OSError, ValueError):
        stored = {}
    measured = measure_matmul_flops(cfg.dtype, PROBE_SIZE, PROBE_REPEATS, PROBE_SECONDS)
    stored, peak = remember_peak(stored, key, measured)
    if peak == measured:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(stored, indent=1))
            os.replace(tmp, cache)  # a run reading it meanwhile sees the old file or the new one
        except OSError:
            pass  # read-only home: this run's measurement is the peak
    return peak, f"matmul probe ({key}: the highest measured here, {measured / 1e12:.3f} now; kept in {cache})"


def peak_flops_total(cfg: Config) -> tuple[float, str]:
    """Peak FLOP/s of all devices together (for MFU). Accelerators: per-device peak x device
    count; CPU: the probe already measures the whole CPU, which fake devices share."""
    peak, source = peak_flops_per_device(cfg)
    if jax.devices()[0].platform != "cpu":
        peak *= jax.device_count()
    return peak, source
