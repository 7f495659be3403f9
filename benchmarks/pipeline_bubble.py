"""Pipeline schedules against their bubble model, on fake CPU devices, in one run.

On fake CPU devices every "device" shares the same cores, so a pipelined step costs all
the work the stages do — including the bubble iterations, where a stage computes on
nothing. Relative to the same model without a pipeline (fsdp over the same devices) the
step should therefore take about ``1 / (1 - bubble)`` as long: this script measures that
ratio for GPipe and circular schedules and prints a Markdown table next to the model's
prediction. (On real accelerators the stages run in parallel and the bubble is idle
time instead; the same fraction is what ``nnxtron plan`` and ``nnxtron bench`` report.)

Run: ``.venv/bin/python benchmarks/pipeline_bubble.py [--steps N]`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from nnxtron.tools.bench import run_bench  # noqa: E402

MODEL = [
    "base_num_decoder_layers=8",
    "dataset_type=synthetic",
    "per_device_batch_size=2",
    "max_target_length=128",
    "remat_policy=none",
]
SCHEDULES = {
    "sequential (fsdp 8)": ["ici_fsdp_parallelism=8"],
    "GPipe, 4 stages x 2 layers, M=4": ["ici_pipeline_parallelism=4", "num_layers_per_pipeline_stage=2"],
    "GPipe, 4 stages x 2 layers, M=8": [
        "ici_pipeline_parallelism=4",
        "num_layers_per_pipeline_stage=2",
        "num_pipeline_microbatches=8",
    ],
    "circular, 4 stages x 2 repeats, M=4": ["ici_pipeline_parallelism=4"],
    "circular, 4 stages x 2 repeats, M=8": ["ici_pipeline_parallelism=4", "num_pipeline_microbatches=8"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    steps = parser.parse_args().steps
    rows = []
    baseline = None
    for name, overrides in SCHEDULES.items():
        result = run_bench(None, MODEL + overrides, steps=steps)
        seconds = result["step_seconds"]
        baseline = seconds if baseline is None else baseline
        bubble = result["pipeline_bubble_fraction"] or 0.0
        rows.append((name, bubble, 1 / (1 - bubble), seconds / baseline, seconds))
        print(f"{name}: {seconds * 1e3:.1f} ms/step", flush=True)
    print("\n| schedule | bubble fraction | predicted time ratio 1/(1-bubble) | measured ratio | ms/step |")
    print("|---|---|---|---|---|")
    for name, bubble, predicted, measured, seconds in rows:
        print(f"| {name} | {bubble:.3f} | {predicted:.2f} | {measured:.2f} | {seconds * 1e3:.1f} |")


if __name__ == "__main__":
    main()
