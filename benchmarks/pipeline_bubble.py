"""Pipeline schedules against their bubble model, on fake CPU devices, in one run.

On fake CPU devices every "device" shares the same cores, so a pipelined step costs all
the work the stages do — including the bubble iterations, where a stage computes on
nothing. In FLOPs the pipelined step is ``iterations / (M·R) = 1 / (1 - bubble)`` times
the same model without a pipeline (fsdp over the same devices); the script checks that
count in the compiled program (dot FLOPs, each loop body times its trip count) and
measures the time ratio next to it.

The time ratio is larger than the FLOP ratio when fixed per-op costs dominate — the case
for this tiny model on 2 shared cores: each executed HLO op (thunk) and each collective
(a rendezvous of the device threads) costs about the same whatever its size, and a
pipelined device runs ``iterations × layers_per_stage`` block applications on a
microbatch where an fsdp device runs ``P`` on its whole batch (``M/S`` times more ops
for the same FLOPs), plus per-iteration fsdp weight gathers. The table therefore also
reports the executed-op and collective counts of each step (from the compiled HLO) as
ratios to fsdp; docs/pipeline.md ("Memory and bubble") has the profile.

Each schedule is compiled once, then the schedules are timed in interleaved rounds
(``--rounds`` x ``--steps``) and each keeps its fastest step, so a load change on the
shared machine hits all rows alike; the process CPU time of the step (all threads) is
reported next to the wall time, as it is less sensitive to other jobs on the machine. (On real accelerators the stages run in parallel
and the bubble is idle time instead; the same fraction is what ``nnxtron plan`` and
``nnxtron bench`` report.)

Run: ``.venv/bin/python benchmarks/pipeline_bubble.py [--rounds N] [--steps N]`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import time
from collections import Counter
from typing import Any

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from nnxtron.config.derived import derive  # noqa: E402
from nnxtron.config.loader import load_config  # noqa: E402
from nnxtron.config.pipeline import pipeline_spec  # noqa: E402
from nnxtron.data.sources import make_sources  # noqa: E402
from nnxtron.parallel.mesh import make_mesh  # noqa: E402
from nnxtron.train.optimizer import make_optimizer  # noqa: E402
from nnxtron.train.state import init_state, setup  # noqa: E402
from nnxtron.train.step import batch_sharding, device_batch, make_train_step  # noqa: E402

MODEL = [
    "base_num_decoder_layers=8",
    "dataset_type=synthetic",
    "per_device_batch_size=2",
    "max_target_length=128",
    "remat_policy=none",
    "compilation_cache_dir=",
]
GPIPE = ["ici_pipeline_parallelism=4", "num_layers_per_pipeline_stage=2"]
SCHEDULES = {
    "sequential (fsdp 8)": ["ici_fsdp_parallelism=8"],
    "GPipe, 4 stages x 2 layers, M=4": GPIPE,
    "GPipe, 4 stages x 2 layers, M=8": [*GPIPE, "num_pipeline_microbatches=8"],
    "GPipe, M=8, pipeline_fsdp_ag_once": [*GPIPE, "num_pipeline_microbatches=8", "pipeline_fsdp_ag_once=true"],
    "circular, 4 stages x 2 repeats, M=4": ["ici_pipeline_parallelism=4"],
    "circular, 4 stages x 2 repeats, M=8": ["ici_pipeline_parallelism=4", "num_pipeline_microbatches=8"],
}
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
_NO_WORK = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "conditional", "call"}


def hlo_counts(text: str) -> dict[str, float]:
    """Dot FLOPs, executed ops and collectives of one step of a compiled (per-device) HLO
    module, each computation counted as often as it runs (loop bodies x their known trip
    count). ``cost_analysis()`` counts a loop body once, so it cannot compare a scanned
    pipeline with a scanned stack."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
        if head:
            current = head.group(2)
            comps[current] = []
            entry = current if head.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    calls: dict[str, list[tuple[str, int, bool]]] = {}  # callee, times, fused (part of the caller's op)
    flops, ops, colls = Counter(), Counter(), Counter()
    for name, lines in comps.items():
        shapes: dict[str, list[int]] = {}
        calls[name] = []
        for line in lines:
            inst = re.match(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\w+)\[([0-9,]*)\]\S*\s+([\w\-]+)\((.*)$", line)
            tup = re.match(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\(.*?\)\s+([\w\-]+)\(", line)
            if inst:
                var, dims, op, rest = inst.group(1), [int(d) for d in inst.group(3).split(",") if d], inst.group(4), inst.group(5)
                shapes[var] = dims
            elif tup:
                op, rest = tup.group(2), line
            else:
                continue
            if op == "dot":
                lhs = shapes.get(re.match(r"%([\w.\-]+)", rest).group(1), [])
                contract = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest).group(1)
                flops[name] += 2 * math.prod(dims) * math.prod(lhs[int(i)] for i in contract.split(",") if i)
            if op not in _NO_WORK:
                ops[name] += 1
            if op in COLLECTIVES:
                colls[name] += 1
            trips = re.search(r'known_trip_count":\{"n":"(\d+)"', rest)
            for key, callee in re.findall(r"(body|condition|calls|to_apply)=%([\w.\-]+)", rest):
                calls[name].append((callee, int(trips.group(1)) if trips and key == "body" else 1, key in ("calls", "to_apply")))

    total = Counter()

    def walk(name: str, times: int, fused: bool) -> None:
        total["dot_flops"] += flops[name] * times
        if not fused:
            total["ops"] += ops[name] * times
            total["collectives"] += colls[name] * times
        for callee, n, inner in calls[name]:
            walk(callee, times * n, fused or inner)

    walk(entry, 1, False)
    return dict(total)


def build(overrides: list[str]) -> dict[str, Any]:
    """The real train step of MODEL + overrides, compiled, with its state and one batch."""
    cfg = load_config(None, MODEL + overrides)
    derived = derive(cfg, jax.device_count())
    mesh = make_mesh(cfg)
    tx, schedule = make_optimizer(cfg, derived)
    model_setup = setup(cfg, mesh, tx)
    source, _ = make_sources(cfg, derived.global_batch_size)
    data = source.iterator(0, 1)
    try:
        batch = device_batch(next(data), batch_sharding(cfg, model_setup))
    finally:
        data.close()
    step = make_train_step(cfg, model_setup, tx, schedule)
    state = init_state(cfg, model_setup, tx)
    compiled = step.lower(state, batch).compile()
    for _ in range(2):  # warm-up
        state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    spec = pipeline_spec(cfg)
    return {
        "compiled": compiled,
        "state": state,
        "batch": batch,
        "bubble": spec.bubble_fraction if spec else 0.0,
        "counts": hlo_counts(compiled.as_text()),
        "times": [],
        "cpu": [],
    }


def time_steps(run: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        run["state"], metrics = run["compiled"](run["state"], run["batch"])  # the input state is donated
        jax.block_until_ready((run["state"], metrics))
        run["times"].append(time.perf_counter() - t0)
        run["cpu"].append(time.process_time() - c0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all schedules")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per schedule per round")
    args = parser.parse_args()
    runs = {}
    for name, overrides in SCHEDULES.items():
        runs[name] = build(overrides)
        print(f"compiled {name}: {runs[name]['counts']}", flush=True)
    for r in range(args.rounds):
        for run in runs.values():
            time_steps(run, args.steps)
        print(f"round {r + 1}: " + ", ".join(f"{min(run['times']) * 1e3:.0f}" for run in runs.values()) + " ms", flush=True)
    base = next(iter(runs.values()))
    ratio = lambda run, key: run["counts"][key] / base["counts"][key]  # noqa: E731
    print(
        "\n| schedule | bubble | model 1/(1-bubble) | dot FLOPs ratio | executed ops ratio | collectives / step "
        "| measured time ratio | ms/step (best) | CPU time ratio | CPU ms/step (best) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, run in runs.items():
        print(
            f"| {name} | {run['bubble']:.3f} | {1 / (1 - run['bubble']):.2f} | {ratio(run, 'dot_flops'):.2f} "
            f"| {ratio(run, 'ops'):.2f} | {run['counts']['collectives']:.0f} | {min(run['times']) / min(base['times']):.2f} "
            f"| {min(run['times']) * 1e3:.0f} | {min(run['cpu']) / min(base['cpu']):.2f} | {min(run['cpu']) * 1e3:.0f} |"
        )


if __name__ == "__main__":
    main()
