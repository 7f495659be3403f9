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
(``measure_host_cpu``), for the ranking validation on a laptop. Two things set it apart:
the program compiled on the fake devices is the one that runs there, so the cost model
takes its matmul FLOPs from the compiled program (``runs_compiled_program``; an accelerator
lowers grouped matmuls, attention kernels and fusions its own way, so it gets the model's
FLOP count), and XLA:CPU allocates a step's temporaries anew each step, so the kernel
zero-fills every page of them at first touch (``fresh_temp_seconds_per_byte``, measured;
an accelerator's allocator keeps its memory, 0).
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

from nnxtron.runtime.peak import measure_matmul_flops

GB = 1e9
EFFICIENCY = 0.6  # achieved / peak matmul FLOP/s of a large, compute-bound step (MaxText reports 50-65% MFU on H100/TPU)
OVERLAP = 0.8  # the share of the compute time that can hide data/fsdp/stage collectives
PAGE = 4096  # bytes of a memory page the kernel zero-fills at first touch


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
    efficiency: float = EFFICIENCY  # achieved / peak matmul FLOP/s
    overlap: float = OVERLAP  # the share of compute time that hides data/fsdp/stage collectives
    runs_compiled_program: bool = False  # matmul FLOPs from the compiled program (cpu), else the model's count
    fresh_temp_seconds_per_byte: float = 0.0  # per byte of a step's temporaries faulted in fresh each step

    @property
    def backend(self) -> str:
        """The JAX backend this device is, as ``layers.attention.resolve_attention`` names it."""
        return "tpu" if self.name.startswith("tpu") else "cpu" if self.name == "cpu" else "gpu"

    def required_bytes(self, resident_bytes: float, temp_bytes: float) -> float:
        """The device memory a compiled step needs, from XLA's memory analysis: its resident
        buffers (arguments + outputs - donated, code) and its temporaries.

        On a TPU the test is XLA:TPU's own: the temporaries alone within the memory
        ("the total memory required for HLO temporaries exceeds available HBM"), and the
        resident state within it. The sum is not a limit there: on a v5e chip (15.75 GiB)
        the 552M model ran with resident + temporaries of 15.8-17.6 GiB, and the chip's own
        peak (``peak_memory_in_bytes``) was 13.0-14.7 GiB (benchmarks/results/plan_search_tpu.json).
        Elsewhere both are held at once: their sum."""
        if self.backend == "tpu":
            return max(resident_bytes, temp_bytes)
        return resident_bytes + temp_bytes


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
    """This machine's fake CPU devices. They share its cores and its memory bus, so each gets
    the measured throughput divided by their number:

    - FLOP/s: a 512 x 512 float32 matmul;
    - memory bandwidth: ``x + 1`` on an array sharded over the devices, 8 MiB a device (the
      size of a small model's activations), bytes read and written over the time;
    - collective latency: an all-reduce of one float over the devices (a memory copy between
      fake devices: intra- and inter-node bandwidth are the memory bandwidth);
    - fresh memory: the time to fault in a page of newly mapped memory, less the time to
      write it again, per byte; the devices' faults go through one process's memory map in
      turn, so each device pays for all of them (x the device count).

    Nothing overlaps (the devices share the cores) and the efficiency is 1 (the FLOP/s are a
    measured matmul of the step's own kind)."""
    n = devices or jax.device_count()
    flops = measure_matmul_flops("float32", size=512, repeats=5)
    bandwidth = _elementwise_bandwidth(n)
    latency = _collective_latency(n)
    fresh = _fresh_page_seconds() / PAGE * n
    per_device = bandwidth / n
    return DevicePreset(
        "cpu", flops / n, 0.0, per_device, per_device, per_device, per_device, n, "measured", latency,
        efficiency=1.0, overlap=0.0, runs_compiled_program=True, fresh_temp_seconds_per_byte=fresh,
    )  # fmt: skip


def _elementwise_bandwidth(devices: int) -> float:
    """Bytes per second of ``x + 1`` (read and write) over this process's devices, 8 MiB each,
    when it has ``devices`` of them; else on one device, 8 MiB x ``devices``."""
    size = 2 * 2**20 * devices  # float32 elements: 8 MiB a device
    x = jnp.ones(size, jnp.float32)
    if jax.device_count() == devices > 1:
        mesh = jax.make_mesh((devices,), ("x",))
        x = jax.device_put(x, jax.NamedSharding(mesh, jax.P("x")))
    return 2 * x.nbytes / _best_seconds(jax.jit(lambda v: v + 1), x)


def _fresh_page_seconds(size: int = 64 * 2**20, repeats: int = 5) -> float:
    """Seconds to fault in one page of newly mapped memory: writing a fresh anonymous mapping
    less writing one already faulted in, per page (best of ``repeats``)."""
    kept = mmap.mmap(-1, size)
    np.frombuffer(kept, np.uint8).fill(0)

    def fresh() -> None:
        region = mmap.mmap(-1, size)
        view = np.frombuffer(region, np.uint8)
        view.fill(1)
        del view
        region.close()

    def again() -> None:
        np.frombuffer(kept, np.uint8).fill(1)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    seconds = max(best(fresh) - best(again), 0.0)
    kept.close()
    return seconds / (size / PAGE)


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
