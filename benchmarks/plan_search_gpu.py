"""Does `nnxtron plan --search` predict step times on a real GPU? Its candidates, measured on one.

The search compiles on CPU and a GPU machine is lent briefly, so the check has two halves:

    python benchmarks/plan_search_gpu.py predict [--device h200] [--budget 300]
        (any machine) searches two Llama shapes (``MODELS``: the 1B of ``accelerator_mfu.py`` and 8
        layers of the 8B, bfloat16 compute over float32 weights) on ``devices=1`` with the
        device preset and no memory limit (see MEMORY_GIB), and writes every compiled
        configuration, ranked, to ``benchmarks/results/plan_search_gpu-predicted.json``.
    python benchmarks/plan_search_gpu.py measure [--count 5] [--steps 5] [--out FILE]
        (on the GPU) trains ``--count`` of each model's, evenly spread from the best to the
        worst prediction, each with ``nnxtron bench`` in a fresh process, and writes predicted and
        measured step times, their ratio and Spearman's rho to ``plan_search_gpu.json``.

One device has no collectives: this checks the compute side of the cost model (model FLOPs,
remat recompute, accumulation, ``efficiency`` and the optimizer update) against the GPU.
``measure`` refuses to run without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accelerator_mfu import LLAMA_1B  # noqa: E402
from ranking import spearman, spread  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PREDICTED = RESULTS / "plan_search_gpu-predicted.json"
MODELS: dict[str, list[str]] = {
    "llama 1B (batch 8 x 2048)": [*LLAMA_1B, "per_device_batch_size=8", "max_target_length=2048"],
    "llama 8B shape, 8 layers (batch 2 x 4096)": [
        *LLAMA_1B, "base_emb_dim=4096", "base_num_decoder_layers=8", "head_dim=128", "base_mlp_dim=14336",
        "logits_via_embedding=false", "per_device_batch_size=2", "max_target_length=4096",
    ],
}  # fmt: skip
# XLA:CPU materialises the attention scores a GPU's flash kernel never writes (remat none
# saves 16 layers of them: over 141 GB on CPU); the GPU run is the memory check here
MEMORY_GIB = 1000.0


def predict(device_name: str, budget: float) -> dict[str, Any]:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from nnxtron.tools.search import SearchRequest, preset, search, with_memory

    device = with_memory(preset(device_name, 1), MEMORY_GIB)
    rows = []
    for name, model in MODELS.items():
        result = search(SearchRequest(None, model, 1, device, top=10**6, budget_seconds=budget))
        for e in result["top"]:
            rows.append({"model": name, "overrides": [*model, *e["overrides"]], "configuration": e["overrides"],
                         "predicted": e["predicted"], "peak_bytes": e["peak_bytes"]})  # fmt: skip
            print(f"{name}: predicted {e['predicted']['step_s']:.3f} s: {' '.join(e['overrides']) or '(base)'}")
    report = {"date": time.strftime("%Y-%m-%d"), "device": device.__dict__, "rows": rows}
    PREDICTED.parent.mkdir(parents=True, exist_ok=True)
    PREDICTED.write_text(json.dumps(report, indent=1) + "\n")
    return report


def bench(overrides: list[str], steps: int, timeout: float) -> dict[str, Any]:
    """``nnxtron bench`` in a fresh process: its JSON line, or the error."""
    cmd = [sys.executable, "-m", "nnxtron", "bench", *overrides, "--steps", str(steps)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(count: int, steps: int, timeout: float, out: Path) -> dict[str, Any]:
    import jax

    if jax.default_backend() != "gpu":
        raise SystemExit(f"measure runs on a GPU; this machine's JAX backend is {jax.default_backend()!r}")
    predicted = json.loads(PREDICTED.read_text())
    chosen = []
    for name in dict.fromkeys(r["model"] for r in predicted["rows"]):
        chosen += spread([r for r in predicted["rows"] if r["model"] == name], count)
    rows = []
    for row in chosen:
        result = bench(row["overrides"], steps, timeout)
        entry = {
            "model": row["model"],
            "configuration": row["configuration"],
            "predicted_s": row["predicted"]["step_s"],
            **result,
        }
        if "error" not in result:
            entry["measured_s"] = result["step_seconds_min"]
            entry["ratio"] = entry["measured_s"] / entry["predicted_s"]
            print(f"predicted {entry['predicted_s']:.3f} s, measured {entry['measured_s']:.3f} s "
                  f"(MFU {100 * result['mfu']:.1f}%): {' '.join(row['configuration']) or '(base)'}", flush=True)  # fmt: skip
        else:
            print(f"failed: {' '.join(row['configuration'])}: {result['error'][-600:]}", flush=True)
        rows.append(entry)
        out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")  # what ran so far survives a cut-off lease
    done = [r for r in rows if "measured_s" in r]

    def rho(subset: list[dict[str, Any]]) -> float | None:
        return spearman([r["predicted_s"] for r in subset], [r["measured_s"] for r in subset]) if len(subset) >= 2 else None

    per_model = {name: rho([r for r in done if r["model"] == name]) for name in dict.fromkeys(r["model"] for r in rows)}
    report = {"date": time.strftime("%Y-%m-%d"), "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
              "predicted_with": predicted["device"]["name"], "rows": rows, "spearman_per_model": per_model,
              "spearman_all": rho(done)}  # fmt: skip
    out.write_text(json.dumps(report, indent=1) + "\n")
    for name, value in per_model.items():
        print(f"Spearman rho, {name}: {value}")
    print(f"Spearman rho over all {len(done)} configurations: {report['spearman_all']}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("predict")
    p.add_argument("--device", default="h200")
    p.add_argument("--budget", type=float, default=300.0, help="seconds of search")
    m = sub.add_parser("measure")
    m.add_argument("--count", type=int, default=5)
    m.add_argument("--steps", type=int, default=5)
    m.add_argument("--timeout", type=float, default=180.0, help="seconds per configuration")
    m.add_argument("--out", type=Path, default=RESULTS / "plan_search_gpu.json")
    args = parser.parse_args()
    if args.mode == "predict":
        predict(args.device, args.budget)
    else:
        measure(args.count, args.steps, args.timeout, args.out)


if __name__ == "__main__":
    main()
