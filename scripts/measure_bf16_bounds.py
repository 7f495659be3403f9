"""Measure the bfloat16 parity bounds of the strategy matrix (``tests/parity/test_matrix.py``,
``test_pipeline.py``): every row run with ``dtype=bfloat16`` (activations) and ``weight_dtype=float32``
(master weights), compared with the same model's one-device baseline in bfloat16 (the strategy
pair: does the strategy compute the same function at the precision people train in?) and in
float32 (the bfloat16 error itself). Prints one markdown table per group and the maxima from
which ``BF16_BOUNDS`` / ``BF16_VS_FLOAT32_BOUNDS`` are set (docs/parity.md says how).

Run (about 15 minutes on 2 CPU cores)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/measure_bf16_bounds.py [--groups dense moe pipeline]

It prints where it ran (backend, device kind and count, JAX version) above the tables. On an
accelerator (``JAX_PLATFORMS`` unset: a TPU chip) the rows whose mesh needs more devices than
there are (every sharded row on one chip) are listed as skipped, not measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from nnxtron.tools.parity import GradResult, grad_differences  # noqa: E402
from tests.parity import test_matrix as matrix  # noqa: E402
from tests.parity import test_pipeline as pipeline  # noqa: E402

BF16 = (("dtype", "bfloat16"), ("weight_dtype", "float32"))
METRICS = ("loss", "input", "aggregate", "leaf_rel", "leaf_of_total")


def bf16(strategy: matrix.Strategy) -> matrix.Strategy:
    return dataclasses.replace(strategy, extra=strategy.extra + BF16)


Rows = Iterator[tuple[str, tuple[GradResult, GradResult, GradResult] | int]]


def devices_needed(strategy: matrix.Strategy) -> int:
    """How many devices the row's mesh spans (1: no mesh)."""
    mesh = matrix.MOE_MESHES[strategy.mesh] or {}
    return math.prod(v for k, v in mesh.items() if k.startswith("ici_"))


def dense_rows() -> Rows:
    """Row id -> (bf16 result, bf16 reference, float32 reference), for each row of a group, or
    the number of devices the row needs where there are fewer."""
    ref16, ref32 = matrix.run(bf16(matrix.BASELINE)), matrix.run(matrix.BASELINE)
    yield "baseline", (ref16, ref16, ref32)
    for strategy in matrix.ROWS:
        needed = devices_needed(strategy)
        yield strategy.id, needed if needed > jax.device_count() else (matrix.run(bf16(strategy)), ref16, ref32)


def moe_rows() -> Rows:
    refs = {lb: (matrix.run_moe(bf16(matrix.MOE_BASELINE), lb), matrix.run_moe(matrix.MOE_BASELINE, lb)) for lb in (True, False)}
    yield "moe-baseline", (refs[True][0], refs[True][0], refs[True][1])
    for strategy in matrix.MOE_ROWS:
        lb = strategy.accumulation == 1
        needed = devices_needed(strategy)
        yield "moe-" + strategy.id, needed if needed > jax.device_count() else (matrix.run_moe(bf16(strategy), lb), *refs[lb])


def pipeline_rows() -> Rows:
    for case, (model, overrides, stages, devices) in pipeline.CASES.items():
        if devices > jax.device_count():
            yield "pp-" + case, devices
            continue
        results = {}
        for dtype in ("bfloat16", "float32"):
            extra = dict(overrides, dtype=dtype, weight_dtype="float32")
            cfg = pipeline.tiny_config(model, **extra, **stages)
            pooled = cfg.load_balance_loss_weight > 0 and cfg.load_balance_convention == "nnxtron"
            accumulation = pipeline.pipeline_spec(cfg).microbatches if pooled else 1
            frozen = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(extra.items()))
            reference = pipeline._sequential(model, frozen, accumulation, devices)
            mesh = pipeline.make_mesh(cfg, jax.devices()[:devices])
            results[dtype] = (pipeline.loss_and_grads(pipeline.build_model(cfg), pipeline._batch(cfg), mesh=mesh), reference)
        yield "pp-" + case, (results["bfloat16"][0], results["bfloat16"][1], results["float32"][1])


GROUPS = {"dense": dense_rows, "moe": moe_rows, "pipeline": pipeline_rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", nargs="+", choices=list(GROUPS), default=list(GROUPS))
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    print(
        f"measured on: {jax.default_backend()}, {jax.device_count()} x {getattr(device, 'device_kind', '?')}, "
        f"jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        flush=True,
    )
    header = " | ".join(f"{m} (pair)" for m in METRICS) + " | " + " | ".join(f"{m} (vs f32)" for m in METRICS)
    for group in args.groups:
        print(f"\n### {group}\n\n| row | {header} |\n|---|" + "---|" * (2 * len(METRICS)), flush=True)
        worst = {m: [0.0, 0.0] for m in METRICS}
        for row, runs in GROUPS[group]():
            if isinstance(runs, int):
                print(f"| {row} | skipped: needs {runs} devices |", flush=True)
                continue
            pair, f32 = grad_differences(runs[0], runs[1]), grad_differences(runs[0], runs[2])
            cells = [f"{pair[m]:.2e}" for m in METRICS] + [f"{f32[m]:.2e}" for m in METRICS]
            print(f"| {row} | " + " | ".join(cells) + " |", flush=True)
            for m in METRICS:
                worst[m] = [max(worst[m][0], pair[m]), max(worst[m][1], f32[m])]
        print(
            "| **max** | "
            + " | ".join(f"{worst[m][0]:.2e}" for m in METRICS)
            + " | "
            + " | ".join(f"{worst[m][1]:.2e}" for m in METRICS)
            + " |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
