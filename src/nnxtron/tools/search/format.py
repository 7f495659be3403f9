"""The text `nnxtron plan --search` prints (``--json`` prints ``search``'s dict instead)."""

from __future__ import annotations

from typing import Any

from nnxtron.tools.plan import text_table

GIB = 1024**3
SHORT = {
    "gradient_accumulation_steps": "accum",
    "num_pipeline_microbatches": "microbatches",
    "remat_policy": "remat",
    "parameter_memory_host_offload": "offload params",
    "optimizer_memory_host_offload": "offload opt",
}


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def describe(entry: dict[str, Any]) -> str:
    """``fsdp 8 x tensor 2, remat full, accum 2``: the mesh axes above 1 and the other settings."""
    mesh = " x ".join(f"{axis} {size}" for axis, size in entry["mesh"].items() if size > 1) or "1 device"
    values = {k: str(v).lower() for k, v in entry["values"].items()}
    parts = [mesh, f"remat {values['remat_policy']}"]
    if values["gradient_accumulation_steps"] != "1":
        parts.append(f"accum {values['gradient_accumulation_steps']}")
    if entry["mesh"]["stage"] > 1:
        parts.append(f"microbatches {values['num_pipeline_microbatches']}")
    parts += [SHORT[k] for k in ("parameter_memory_host_offload", "optimizer_memory_host_offload") if values[k] == "true"]
    return ", ".join(parts)


def _peak(device: dict[str, Any]) -> str:
    """A preset's matmul peak: the vendor's bf16 figure, or what ``cpu`` measured per device."""
    if device["runs_compiled_program"]:
        return f"{device['peak_flops'] / 1e9:.1f} GFLOP/s measured per device"
    return f"{device['peak_flops'] / 1e12:.0f} TFLOP/s bf16"


def format_search(result: dict[str, Any]) -> str:
    d = result["device"]
    compile_stats = result["compile"]
    pruned = sum(result["pruned"].values())
    lines = [
        f"plan --search: model_name={result['model_name']} on {result['devices']} x {d['name']} "
        f"({_peak(d)}, {result['memory_bytes'] / GIB:.1f} GiB, "
        f"{d['devices_per_node']} per node; efficiency {result['efficiency']:g}, overlap {result['overlap']:g})",
        f"searched in {result['seconds']:.0f} s (budget {result['budget_seconds']:.0f} s): {result['considered']} "
        f"configurations, {pruned} pruned by the cheap rules, {compile_stats.get('compiled', 0)} compiled "
        f"({sum(r['fits'] for r in result['compiled'])} fit)"
        + "".join(f", {n} {what}" for what, n in compile_stats.items() if what != "compiled" and n),
    ]
    if result["pinned"]:
        lines.append("pinned: " + ", ".join(f"{k}={v}" for k, v in result["pinned"].items()))
    rows = []
    for rank, entry in enumerate(result["top"], 1):
        p = entry["predicted"]
        rows.append(
            [
                str(rank),
                _seconds(p["step_s"]),
                f"{100 * p['mfu']:.1f}%",
                f"{entry['peak_bytes'] / GIB:.1f}",
                f"{entry['headroom_bytes'] / GIB:.1f}",
                _seconds(p["compute_s"]),
                _seconds(p["memory_s"] + p["fresh_temp_s"]),
                _seconds(p["exposed_comm_s"]),
                f"{100 * p['bubble_fraction']:.1f}%",
                describe(entry),
            ]
        )
    headers = ["#", "step", "MFU", "peak GiB", "headroom", "compute", "memory", "exposed comm", "bubble", "configuration"]
    lines += ["", *text_table(headers, rows, {1, 2, 3, 4, 5, 6, 7, 8})]
    lines += ["", "run it (the overrides of each, after the model's own):"]
    lines += [f"  {rank}: " + " ".join(e["overrides"]) for rank, e in enumerate(result["top"], 1)]
    pruned_lines = [f"  {n} x {why}" for why, n in sorted(result["pruned"].items(), key=lambda kv: -kv[1])[:5]]
    if pruned_lines:
        lines += ["", "pruned before compiling (most common reasons):", *pruned_lines]
    return "\n".join(lines) + "\n"
