"""Does `nnxtron plan --search` rank configurations the way they run? Measured on fake CPU devices.

For each of a few small models, the search runs on 8 fake CPU devices with the ``cpu``
preset (this machine's matmul FLOP/s, elementwise bandwidth, collective latency and cost of
faulting in fresh memory, measured and shared by the 8 devices; no overlap: the fake devices
share the cores; the compiled program's own matmul FLOPs) and a memory limit
large enough for every candidate; of the configurations it compiled, ranked by prediction,
``--per-model`` evenly spaced from the best to the worst are kept (the best always: the
search compiles near the top, and skips what cannot beat its best fit). Each of them is then trained by ``nnxtron bench`` in a fresh process on the same 8 fake devices,
in interleaved rounds (every configuration once per round, the fastest step of all rounds
kept, so a load change on the shared machine hits all of them alike). The report is
Spearman's rank correlation between predicted and measured step times, per model and over
all configurations, and the measured / predicted ratio of each.

Run: ``.venv/bin/python benchmarks/plan_search_rank.py [--rounds 2] [--per-model 5] [--budget 150]``
(about 20 minutes on 2 cores); ``--quick`` checks the machinery on one model and 3 configurations.
Writes ``benchmarks/results/plan_search_rank.json``.
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

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from nnxtron.runtime.fake_devices import fake_device_env  # noqa: E402
from nnxtron.tools.search import SearchRequest, measure_host_cpu, search, with_memory  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ranking import spearman, spread  # noqa: E402

DEVICES = 8
RESULTS = Path(__file__).resolve().parent / "results" / "plan_search_rank.json"
MODELS: dict[str, list[str]] = {  # small enough to train a step in seconds, large enough that FLOPs count
    "llama (dense)": [
        "model_name=llama3.1-tiny", "base_emb_dim=256", "base_mlp_dim=1024", "base_num_query_heads=8",
        "base_num_kv_heads=4", "head_dim=32", "base_num_decoder_layers=4", "vocab_size=2048",
        "max_target_length=256", "per_device_batch_size=2",
    ],
    "qwen3-moe (8 experts)": [
        "model_name=qwen3-moe-tiny", "base_emb_dim=256", "base_moe_mlp_dim=256", "base_num_query_heads=8",
        "base_num_kv_heads=4", "head_dim=32", "base_num_decoder_layers=4", "vocab_size=2048",
        "max_target_length=256", "per_device_batch_size=2",
    ],
    "gemma3 (sliding window)": [
        "model_name=gemma3-tiny", "base_emb_dim=256", "base_mlp_dim=1024", "base_num_query_heads=8",
        "base_num_kv_heads=4", "head_dim=32", "base_num_decoder_layers=6", "vocab_size=2048",
        "max_target_length=256", "per_device_batch_size=2",
    ],
}  # fmt: skip
DATA = ["dataset_type=synthetic"]


def bench_step_seconds(overrides: list[str], steps: int, attempts: int = 2) -> float:
    """The fastest timed step of `nnxtron bench` in a fresh process on the fake devices.
    A run that dies is run again once: XLA:CPU aborts a collective whose device threads do
    not all arrive within 40 s, which a loaded 2-core machine can cause."""
    env = {**os.environ, **fake_device_env(DEVICES)}
    for _ in range(attempts):
        proc = subprocess.run(
            [sys.executable, "-m", "nnxtron", "bench", *overrides, "--steps", str(steps)],
            capture_output=True, text=True, env=env, check=False,
        )  # fmt: skip
        if proc.returncode == 0:
            return float(json.loads(proc.stdout.strip().splitlines()[-1])["step_seconds_min"])
    raise RuntimeError(f"nnxtron bench {' '.join(overrides)} failed: {proc.stderr[-2000:]}")


def run(models: dict[str, list[str]], per_model: int, rounds: int, steps: int, budget: float) -> dict[str, Any]:
    device = with_memory(measure_host_cpu(DEVICES), 16.0)
    rows: list[dict[str, Any]] = []
    for name, model in models.items():
        request = SearchRequest(None, [*model, *DATA], DEVICES, device, top=10**6, budget_seconds=budget)
        result = search(request)
        for entry in spread(result["top"], per_model):
            rows.append({"model": name, "overrides": [*model, *DATA, *entry["overrides"]], "configuration": entry["overrides"],
                         "predicted_s": entry["predicted"]["step_s"], "measured": []})  # fmt: skip
        print(f"{name}: {len(result['top'])} configurations from {result['compile'].get('compiled', 0)} compiled", flush=True)
        for row in rows[-per_model:]:
            print(f"  predicted {row['predicted_s']:.3f} s: {' '.join(row['configuration'])}", flush=True)
    for r in range(rounds):
        for row in rows if r % 2 == 0 else reversed(rows):  # interleaved, alternating order
            try:
                row["measured"].append(bench_step_seconds(row["overrides"], steps))
            except RuntimeError as err:  # reported, and the round's other rows still run
                print(f"round {r + 1}: {row['model']} {' '.join(row['configuration'])}: failed ({str(err)[-300:]})", flush=True)
                continue
            print(f"round {r + 1}: {row['model']} {' '.join(row['configuration'])}: {row['measured'][-1]:.3f} s", flush=True)
    rows = [row for row in rows if row["measured"]]
    for row in rows:
        row["measured_s"] = min(row["measured"])
        row["ratio"] = row["measured_s"] / row["predicted_s"]
    per_model_rho = {}
    for name in models:
        mine = [row for row in rows if row["model"] == name]
        if len(mine) >= 2:
            per_model_rho[name] = spearman([m["predicted_s"] for m in mine], [m["measured_s"] for m in mine])
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine_cpus": os.cpu_count(),
        "arguments": {"per_model": per_model, "rounds": rounds, "steps": steps, "budget_seconds": budget},
        "device": {k: v for k, v in device.__dict__.items()},
        "rows": rows,
        "spearman_per_model": per_model_rho,
        "spearman_all": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
        "configurations": len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-model", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget", type=float, default=150.0, help="seconds of search per model")
    parser.add_argument("--quick", action="store_true", help="one model, 3 configurations, one round")
    args = parser.parse_args()
    models = MODELS
    if args.quick:
        models = {"llama (dense)": MODELS["llama (dense)"]}
        args.per_model, args.rounds, args.steps, args.budget = 3, 1, 1, 90.0
    report = run(models, args.per_model, args.rounds, args.steps, args.budget)
    for row in report["rows"]:
        print(f"{row['model']:26} {' '.join(row['configuration']) or '(base)':70} predicted {row['predicted_s']:.3f} s  "
              f"measured {row['measured_s']:.3f} s  x{row['ratio']:.2f}")  # fmt: skip
    for name, rho in report["spearman_per_model"].items():
        print(f"Spearman rho, {name}: {rho:.3f}")
    print(f"Spearman rho, all {report['configurations']} configurations: {report['spearman_all']:.3f}")
    if not args.quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
