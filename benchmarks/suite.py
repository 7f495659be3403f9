"""The benchmark suite: every performance target of nnxtron as a ratio measured in one run.

    python benchmarks/suite.py [--quick] [--only CASE ...] [--out FILE.md]

Each case runs in a fresh Python process (its own compile caches and device setup) and
reports rows of ``measured / baseline = ratio``, where the baseline is measured in the
same process: the plain-JAX step for host overhead, 4 layers for compile time, the
machine's own matmul peak for MFU, its own memory bandwidth for decoding, the training
demand for the data pipeline. The Markdown table goes to stdout and ``--out`` (default
``benchmarks/results/suite-<backend>.md``), the raw numbers next to it as JSON.
No threshold here or in the tests is a timing assertion: targets are printed, not enforced.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))  # the cases' scripts (host_overhead, data_pipeline, accelerator_mfu)

# The CPU throughput model of the performance issue: llama2-style, emb 256, 4 heads of 64,
# MLP 1024, 4 layers, vocab 32000, batch 4 x 256, bfloat16 activations, float32 weights.
THROUGHPUT_MODEL = [
    "model_name=default", "decoder_block=llama2", "base_emb_dim=256", "base_num_query_heads=4", "base_num_kv_heads=4",
    "head_dim=64", "base_mlp_dim=1024", "base_num_decoder_layers=4", "vocab_size=32000", "max_target_length=256",
    "dtype=bfloat16", "weight_dtype=float32", "dataset_type=synthetic", "remat_policy=none",
]  # fmt: skip
QUICK_MODEL = ["model_name=llama2-tiny", "vocab_size=256", "dataset_type=synthetic", "max_target_length=64"]
NO_CACHE = ["compilation_cache_dir="]  # compile timings are cold compiles


def _devices_batch(per_device: int) -> list[str]:
    import jax

    return [f"per_device_batch_size={per_device / jax.device_count():g}"]


def _throughput_model(quick: bool) -> list[str]:
    """The overrides of the throughput model (batch 4 in all), or the tiny model with ``quick``."""
    return QUICK_MODEL if quick else THROUGHPUT_MODEL + _devices_batch(4)


def matmul_peak(dtype: str, quick: bool) -> float:
    """FLOP/s of a square matmul measured now (best of 5): the MFU baseline of this run."""
    from nnxtron.runtime.peak import measure_matmul_flops

    return measure_matmul_flops(dtype, size=512 if quick else 2048, repeats=5)


def _train_row(name: str, overrides: list[str], steps: int, quick: bool) -> dict[str, Any]:
    """Tokens/s and MFU of one config's real train step against this run's matmul peak."""
    from nnxtron.config.loader import load_config
    from nnxtron.tools.bench import run_bench

    dtype = load_config(None, overrides).dtype
    peak = matmul_peak(dtype, quick)
    result = run_bench(None, [*overrides, f"peak_tflops={peak / 1e12}"], steps=steps)
    return {
        "case": name, "measured": f"{result['params'] / 1e6:.1f}M params: {result['tokens_per_s']:,.0f} tok/s, {result['model_tflops_per_s'] * 1e3:.1f} GFLOP/s",
        "baseline": f"{dtype} matmul peak {peak / 1e9:.1f} GFLOP/s", "ratio": result["mfu"], "ratio_name": "MFU",
        "target": "report", "detail": {k: result[k] for k in ("params", "tokens_per_step", "step_seconds", "compile_seconds", "mfu", "loss")},
    }  # fmt: skip


def case_throughput(quick: bool) -> list[dict[str, Any]]:
    """Target 3: the CPU throughput model, tokens/s and MFU (``attention=auto``)."""
    rows = [
        _train_row("train step: throughput model (llama2-style, bf16/f32)", _throughput_model(quick), 3 if quick else 10, quick)
    ]
    rows[0]["target"] = "as fast as XLA allows"
    return rows


def case_attention(quick: bool) -> list[dict[str, Any]]:
    """Target 4: the attention implementations on the throughput model, step time vs `xla`."""
    from nnxtron.tools.bench import run_bench

    model = _throughput_model(quick)
    times = {impl: run_bench(None, [*model, f"attention={impl}"], steps=3 if quick else 10)["step_seconds"]
             for impl in ("xla", "dot_product")}  # fmt: skip
    return [{
        "case": "train step: attention=dot_product (jax.nn.dot_product_attention) vs xla",
        "measured": f"{times['dot_product'] * 1e3:.0f} ms/step", "baseline": f"xla {times['xla'] * 1e3:.0f} ms/step",
        "ratio": times["dot_product"] / times["xla"], "ratio_name": "time ratio", "target": "default per backend: the faster",
        "detail": times,
    }]  # fmt: skip


def case_families(quick: bool) -> list[dict[str, Any]]:
    """Target 5: train steps of several sizes and families, including MoE, with MFU."""
    configs = {  # the parameter count (vocabulary included) goes into the row's measured column
        "llama2-tiny": ["model_name=llama2-tiny", "vocab_size=256"],
        "default model (llama2)": ["model_name=default"],
        "mixtral-tiny (MoE: 4 experts, top 2)": ["model_name=mixtral-tiny"],
        "deepseek3-tiny (MLA + MoE: 16 experts, top 8; vocabulary 129k)": ["model_name=deepseek3-tiny"],
        "gemma3-tiny (sliding window)": ["model_name=gemma3-tiny"],
    }
    if quick:
        configs = dict(list(configs.items())[:1])
    rows = []
    for name, overrides in configs.items():
        rows.append(_train_row(f"train step: {name}", [*overrides, "dataset_type=synthetic"], 2 if quick else 5, quick))
    return rows


def case_compile(quick: bool) -> list[dict[str, Any]]:
    """Target 2: cold compile of the scanned step, 48 layers vs 4 (trace and XLA apart)."""
    from nnxtron.tools.bench import run_bench

    model = _throughput_model(quick)
    depths = (2, 6) if quick else (4, 48)
    runs = {n: run_bench(None, [*model, *NO_CACHE, "scan_layers=true", f"base_num_decoder_layers={n}"], steps=1)
            for n in depths}  # fmt: skip
    small, large = (runs[n] for n in depths)
    return [{
        "case": f"compile, scan_layers=true: {depths[1]} layers vs {depths[0]}",
        "measured": f"{large['compile_seconds']:.2f} s (trace+lower {large['trace_lower_seconds']:.2f}, XLA {large['xla_compile_seconds']:.2f})",
        "baseline": f"{small['compile_seconds']:.2f} s (trace+lower {small['trace_lower_seconds']:.2f}, XLA {small['xla_compile_seconds']:.2f})",
        "ratio": large["compile_seconds"] / small["compile_seconds"], "ratio_name": "time ratio", "target": "<= 1.3",
        "detail": {n: {k: r[k] for k in ("trace_lower_seconds", "xla_compile_seconds", "compile_seconds")} for n, r in runs.items()},
    }]  # fmt: skip


def case_compile_cache(quick: bool) -> list[dict[str, Any]]:
    """Target 2: a restarted process loads the step from the persistent compilation cache."""
    model = _throughput_model(quick)
    with tempfile.TemporaryDirectory(prefix="nnxtron-cache-") as cache:
        settings = [f"compilation_cache_dir={cache}", "compilation_cache_min_compile_seconds=0"]
        cold, warm = (_child_bench([*model, *settings]) for _ in range(2))
    return [{
        "case": "compile on restart with the persistent cache (warm vs cold)",
        "measured": f"{warm['compile_seconds']:.2f} s (XLA {warm['xla_compile_seconds']:.2f})",
        "baseline": f"cold {cold['compile_seconds']:.2f} s (XLA {cold['xla_compile_seconds']:.2f})",
        "ratio": warm["compile_seconds"] / cold["compile_seconds"], "ratio_name": "time ratio", "target": "< 1 (no recompile)",
        "detail": {"cold": cold, "warm": warm},
    }]  # fmt: skip


def _child_bench(overrides: list[str]) -> dict[str, Any]:
    """``nnxtron bench --steps 1`` in a new process (a restart), its JSON line."""
    cmd = [sys.executable, "-m", "nnxtron", "bench", *overrides, "--steps", "1"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def case_host_overhead(quick: bool) -> list[dict[str, Any]]:
    """Target 1: nnxtron's train step vs a minimal plain-JAX step of the same function."""
    import host_overhead

    args = ["--out", "-"] + (["--repeats", "3", "--steps", "5"] if quick else [])
    result = host_overhead.main(args)
    return [{
        "case": f"host overhead ({mode}): tiny model, nnxtron vs plain jax.jit",
        "measured": f"{result[f'nnxtron_{mode}_step_ms']:.2f} ms/step", "baseline": f"plain {result[f'plain_{mode}_step_ms']:.2f} ms/step",
        "ratio": result[f"ratio_{mode}"], "ratio_name": "time ratio", "target": "<= 1.02", "detail": result["parity"],
    } for mode in ("sync", "async")]  # fmt: skip


def memory_bandwidth(quick: bool) -> float:
    """Bytes/s of a large elementwise pass (read + write), best of 5: the decoding baseline."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((2**22 if quick else 2**26,), jnp.float32)
    bump = jax.jit(lambda a: a + 1.0)
    bump(x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        bump(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * x.nbytes / best


def case_decode(quick: bool) -> list[dict[str, Any]]:
    """Decoding: tokens/s at batch 1, 2, 4, ... 32, and bytes a decode step must read
    (weights + KV cache) per second against this run's memory bandwidth (model bandwidth
    utilisation); then the batch scaling: tokens/s at batch 16 over batch 1, next to what a
    step bound by the bytes it reads would give, ``16 (W + C) / (W + 16 C)`` for weights
    ``W`` and one row's cache ``C``."""
    from nnxtron.config.loader import load_config
    from nnxtron.infer.paging import Paging
    from nnxtron.tools.bench import run_decode_bench

    base = ["model_name=llama2-tiny", "vocab_size=256", "max_target_length=32", "max_new_tokens=8"] if quick else []
    bandwidth = memory_bandwidth(quick)
    rows, rates, bytes_read = [], {}, {}
    for batch in (1, 16) if quick else (1, 2, 4, 8, 16, 32):
        overrides = [*base, *_devices_batch(batch)]
        cfg = load_config(None, overrides)
        result = run_decode_bench(None, overrides, steps=2 if quick else 3)
        length = cfg.max_target_length + cfg.max_new_tokens
        itemsize = 2 if cfg.dtype == "bfloat16" else 4
        cache = 2 * batch * length * cfg.base_num_decoder_layers * cfg.base_num_kv_heads * cfg.resolved_head_dim * itemsize
        weights = result["params"] * (2 if cfg.weight_dtype == "bfloat16" else 4)
        rate = (weights + cache) / result["decode_step_seconds"]
        rates[batch], bytes_read[batch] = result["decode_tokens_per_s"], (weights, cache / batch)
        rows.append({
            "case": f"decode: {cfg.model_name} model, batch {batch}, prompt {cfg.max_target_length}",
            "measured": f"{result['decode_tokens_per_s']:,.0f} tok/s (prefill {result['prefill_tokens_per_s']:,.0f} tok/s), "
                        f"{rate / 1e9:.2f} GB/s read",
            "baseline": f"memory bandwidth {bandwidth / 1e9:.2f} GB/s", "ratio": rate / bandwidth, "ratio_name": "MBU",
            "target": "report", "detail": result,
        })  # fmt: skip
    weights, per_row = bytes_read[16]
    bound = 16 * (weights + per_row) / (weights + 16 * per_row)
    rows.append({
        "case": "decode: tokens/s at batch 16 / batch 1",
        "measured": f"{rates[16]:,.0f} / {rates[1]:,.0f} tok/s",
        "baseline": f"bytes-bound model {bound:.1f}x", "ratio": rates[16] / rates[1], "ratio_name": "speed-up",
        "target": ">= 8 (issue 27)", "detail": {"tokens_per_s": rates, "bytes_bound_speedup": bound},
    })  # fmt: skip
    for batch in (1, 16):  # the serving engine's paged cache (block tables set on the host every step)
        overrides = [*base, *_devices_batch(batch)]
        paged = run_decode_bench(None, overrides, steps=2 if quick else 3, paging=Paging(block_size=16, max_sequences=batch))
        rows.append({
            "case": f"decode, paged cache (blocks of 16): batch {batch}",
            "measured": f"{paged['decode_tokens_per_s']:,.0f} tok/s", "baseline": f"{rates[batch]:,.0f} tok/s unpaged",
            "ratio": paged["decode_tokens_per_s"] / rates[batch], "ratio_name": "paged / unpaged", "target": "report",
            "detail": paged,
        })  # fmt: skip
    return rows


def case_data(quick: bool) -> list[dict[str, Any]]:
    """Data pipeline: tokens/s of the default pipeline vs what the default model trains on."""
    import data_pipeline

    small = ["--documents", "30", "--batches", "20", "--repeats", "1", "--train-steps", "2"] if quick else ["--repeats", "3"]
    result = data_pipeline.main([*small, "--threads-sweep", "2", "--train-demand"])
    default = next(r for r in result["rows"] if r["format"] == "text" and r["read_threads"] == 2)
    return [{
        "case": "data pipeline: text corpus, byte tokenizer, 2 read threads + prefetch",
        "measured": f"{default['tokens_per_s'] / 1e6:.2f} M tok/s", "baseline": f"training demand {result['train']['tokens_per_s']:,.0f} tok/s",
        "ratio": default["ratio_vs_train"], "ratio_name": "supply/demand", "target": ">> 1", "detail": result["train"],
    }]  # fmt: skip


def case_accelerator_mfu(quick: bool) -> list[dict[str, Any]]:
    """A llama-style model on one GPU (1B, target 50%) or TPU (552M, target 55%)
    (``benchmarks/accelerator_mfu.py``); skipped, and said so, on a CPU."""
    import jax

    backend = jax.default_backend()
    if backend not in ("gpu", "tpu"):
        return [{"case": "accelerator MFU, llama-style 1B (GPU) / 552M (TPU)", "measured": f"not run: no GPU or TPU ({backend} backend)",
                 "baseline": "-", "ratio": None, "ratio_name": "MFU", "target": ">= 0.5 (GPU), >= 0.55 (TPU)", "detail": None}]  # fmt: skip
    import accelerator_mfu

    result = accelerator_mfu.main(["--out", "-"])
    model, target = ("552M", ">= 0.55") if backend == "tpu" else ("1B", ">= 0.5")
    return [{
        "case": f"{backend.upper()} MFU, llama-style {model}", "measured": f"{result['tokens_per_s']:,.0f} tok/s",
        "baseline": f"peak {result['peak_tflops']:.0f} TFLOP/s ({result['peak_source']})", "ratio": result["mfu"],
        "ratio_name": "MFU", "target": target, "detail": result,
    }]  # fmt: skip


CASES: dict[str, Callable[[bool], list[dict[str, Any]]]] = {
    "host_overhead": case_host_overhead,
    "compile": case_compile,
    "compile_cache": case_compile_cache,
    "throughput": case_throughput,
    "attention": case_attention,
    "families": case_families,
    "decode": case_decode,
    "data": case_data,
    "accelerator_mfu": case_accelerator_mfu,
}


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else float("nan")
    device = jax.devices()[0]
    return {"cpu": cpu, "usable_cpus": cpus, "memory_gib": round(memory, 1), "backend": jax.default_backend(),
            "device_kind": getattr(device, "device_kind", ""), "devices": jax.device_count(), "jax": jax.__version__,
            "python": platform.python_version(), "platform": platform.platform()}  # fmt: skip


def render(rows: list[dict[str, Any]], about: dict[str, Any]) -> str:
    """The Markdown table (and a one-line machine description above it)."""
    lines = [
        f"Machine: {about['cpu']}, {about['usable_cpus']} CPUs, {about['memory_gib']} GiB; backend {about['backend']} "
        f"({about['device_kind']}, {about['devices']} device(s)); jax {about['jax']}, Python {about['python']}.",
        "",
        "| case | measured | baseline (same run) | ratio | target |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = "-" if row["ratio"] is None else f"{row['ratio_name']} {row['ratio']:.3g}"
        lines.append(f"| {row['case']} | {row['measured']} | {row['baseline']} | {ratio} | {row['target']} |")
    return "\n".join(lines) + "\n"


def run_case(name: str, quick: bool) -> list[dict[str, Any]]:
    """One case in a fresh process (``--case``), its rows."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, "--case", name, "--json", out.name] + (["--quick"] if quick else [])
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"benchmark case {name!r} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), help="run these cases only (default: all)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the suite runs, not the machine's speed")
    parser.add_argument(
        "--out", type=Path, default=None, help="the Markdown file (default benchmarks/results/suite-<backend>.md)"
    )
    parser.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)  # one case, in this process
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        rows = CASES[args.case](args.quick)
        args.json.write_text(json.dumps(rows, default=str))
        return rows
    rows = []
    for name in args.only or list(CASES):
        start = time.perf_counter()
        rows += run_case(name, args.quick)
        print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    about = machine()
    table = render(rows, about)
    print(table, end="")
    out = args.out or RESULTS / f"suite-{about['backend']}{'-quick' if args.quick else ''}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    out.with_suffix(".json").write_text(json.dumps({"machine": about, "rows": rows}, indent=1, default=str) + "\n")
    return rows


if __name__ == "__main__":
    main()
