"""Accelerator presets for `nnxtron plan --search`: peak FLOP/s, memory and link bandwidths.

Every figure is the vendor's per-chip number (NVIDIA H100/H200/B200 datasheets for the SXM
parts in an HGX/DGX 8-GPU node; Google Cloud's TPU v5e/v5p/v6e system-architecture pages).
Two rules turn them into what the cost model uses:

- **link bandwidth** is one direction per device: NVLink's "900 GB/s" and the TPUs'
  "bidirectional ICI bandwidth per chip" are halved; the inter-node figure is the node's
  NICs divided by its devices (H100/H200/B200: one 400 Gb/s ConnectX-7 per GPU, 50 GB/s;
  TPU: the data-centre network between slices).
- a **node** is the group that shares the fast links: 8 GPUs behind NVSwitch, or a TPU
  pod (v5e/v6e: 256 chips on the 2-D torus; v5p: the largest schedulable slice, 6144).

Figures marked "assumed" in ``notes`` are not on the vendor's page and are our estimate.
The ``cpu`` preset describes this machine's fake CPU devices and is measured at run time
(``measure_host_cpu``), for the ranking validation on a laptop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from nnxtron.runtime.peak import measure_matmul_flops

GB = 1e9


@dataclass(frozen=True)
class DevicePreset:
    name: str
    peak_flops: float  # dense bf16 matmul FLOP/s per device
    memory_bytes: float  # HBM per device
    memory_bytes_per_s: float  # HBM bandwidth per device
    intra_node_bytes_per_s: float  # one direction, per device, inside a node
    inter_node_bytes_per_s: float  # one direction, per device, between nodes
    host_bytes_per_s: float  # host <-> device (PCIe), for offloaded state
    devices_per_node: int
    notes: str = ""
    collective_latency_s: float = 10e-6  # fixed cost of one collective (launch + synchronisation); assumed


PRESETS: dict[str, DevicePreset] = {
    p.name: p
    for p in (
        DevicePreset("h100", 989e12, 80 * GB, 3.35e12, 450 * GB, 50 * GB, 64 * GB, 8, "SXM5; PCIe Gen5 x16"),
        DevicePreset("h200", 989e12, 141 * GB, 4.8e12, 450 * GB, 50 * GB, 64 * GB, 8, "SXM; PCIe Gen5 x16"),
        DevicePreset(
            "b200", 2250e12, 192 * GB, 8e12, 900 * GB, 50 * GB, 64 * GB, 8, "NVLink 5 1.8 TB/s; HGX B200 exposes 180 GB per GPU"
        ),
        DevicePreset(
            "tpu-v5e",
            197e12,
            16 * GB,
            819 * GB,
            200 * GB,
            25e9 / 8,
            32 * GB,
            256,
            "ICI 400 GB/s bidirectional; DCN 2 x 100 Gb/s per 8-chip host; host link assumed PCIe Gen4 x16",
        ),
        DevicePreset(
            "tpu-v5p",
            459e12,
            95 * GB,
            2765 * GB,
            600 * GB,
            50e9 / 8,
            32 * GB,
            6144,
            "ICI 1200 GB/s bidirectional (3-D torus); DCN 50 Gb/s per chip; host link assumed PCIe Gen4 x16",
        ),
        DevicePreset(
            "tpu-v6e",
            918e12,
            32 * GB,
            1638 * GB,
            400 * GB,
            100e9 / 8,
            64 * GB,
            256,
            "ICI 800 GB/s bidirectional; DCN assumed 100 Gb/s per chip; PCIe Gen5",
        ),
    )  # fmt: skip
}


def preset(name: str, devices: int | None = None) -> DevicePreset:
    """The preset called ``name`` (``ValueError`` naming the known ones otherwise);
    ``cpu`` is measured here, shared by ``devices`` fake devices."""
    key = name.strip().lower()
    if key == "cpu":
        return measure_host_cpu(devices)
    if key not in PRESETS:
        raise ValueError(f"--device {name!r} is not a known preset; choose one of {', '.join([*PRESETS, 'cpu'])}")
    return PRESETS[key]


def measure_host_cpu(devices: int | None = None) -> DevicePreset:
    """This machine's fake CPU devices: they share its cores and its memory bus, so each
    gets the measured matmul FLOP/s and copy bandwidth divided by their number. A collective
    between fake devices is a memory copy, so intra- and inter-node bandwidth are the same."""
    n = devices or jax.device_count()
    flops = measure_matmul_flops("float32", size=512, repeats=5)
    x = jnp.ones(16 * 2**20, jnp.float32)  # 64 MiB
    bandwidth = 2 * x.nbytes / _best_seconds(jax.jit(lambda x: x + 1), x)  # read + write
    latency = _collective_latency(n)
    per_device = bandwidth / n
    return DevicePreset("cpu", flops / n, 0.0, per_device, per_device, per_device, per_device, n, "measured", latency)


def _best_seconds(fn, *args, repeats: int = 5) -> float:
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def _collective_latency(devices: int) -> float:
    """Seconds of an all-reduce of one float over this process's devices (the rendezvous of
    the fake devices' threads), when it has ``devices`` of them; else a 100 us guess."""
    if jax.device_count() != devices or devices == 1:
        return 100e-6
    mesh = jax.make_mesh((devices,), ("x",))
    x = jax.device_put(jnp.ones((devices,), jnp.float32), jax.NamedSharding(mesh, jax.P("x")))
    total = jax.jit(lambda v: v.sum(), out_shardings=jax.NamedSharding(mesh, jax.P()))
    return _best_seconds(total, x, repeats=20)


def with_memory(p: DevicePreset, memory_gib: float | None) -> DevicePreset:
    """``p`` with ``--device-memory-gib`` in place of its HBM (when given)."""
    return p if memory_gib is None else replace(p, memory_bytes=memory_gib * 1024**3)
