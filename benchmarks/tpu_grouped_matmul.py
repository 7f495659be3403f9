"""Grouped matmul on a TPU, forward and forward + backward: ``ragged_dot`` vs Pallas megablox ``gmm``.

    python benchmarks/tpu_grouped_matmul.py [--repeats 10] [--out FILE|-]

The shapes are the routed-expert matmuls of ``benchmarks/accelerator_mfu.py``'s MoE models at
batch 4 x 2048 (bfloat16): Mixtral-style (8 experts, top-2: 16,384 rows, emb 2048, experts of
1024) and DeepSeek-V3-style (64 experts, top-6: 49,152 rows, experts of 256), each as the
up projection ``[M, 2048] x [G, 2048, N]`` and the down projection ``[M, N] x [G, N, 2048]``.
Group sizes are those of uniformly random top-k routing. For each method it reports the
median time of the forward and of the forward + backward (``jax.vjp``: the input gradient
and the weight gradient) and the TFLOP/s at the routed FLOP count (2MKN forward, 6MKN
forward + backward), and the error of each against ``ragged_dot`` in float32.

It refuses to run off a TPU (interpret mode says nothing about speed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tpu_attention import median_seconds  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {  # name: (rows, k, n, groups)
    "mixtral_up": (16384, 2048, 1024, 8),
    "mixtral_down": (16384, 1024, 2048, 8),
    "deepseek3_up": (49152, 2048, 256, 64),
    "deepseek3_down": (49152, 256, 2048, 64),
}
TILINGS = ((512, 512, 512), (512, 1024, 1024), (512, 2048, 256), (1024, 512, 256), (256, 1024, 256), (512, 256, 1024))


def _inputs(rows: int, k: int, n: int, groups: int):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 4)
    lhs = jax.random.normal(keys[0], (rows, k), jnp.float32).astype(jnp.bfloat16)
    rhs = (jax.random.normal(keys[1], (groups, k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(keys[2], (rows, n), jnp.float32).astype(jnp.bfloat16)
    sizes = jnp.zeros((groups,), jnp.int32).at[jax.random.randint(keys[3], (rows,), 0, groups)].add(1)
    return lhs, rhs, cot, sizes


def _method(name: str, tiling: tuple[int, int, int] | None):
    import jax
    import jax.numpy as jnp

    if name == "ragged_dot":
        return lambda lhs, rhs, sizes: jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.bfloat16)
    if name == "dense":  # the baseline: one plain matmul of the same FLOPs (every row times group 0)
        return lambda lhs, rhs, sizes: jnp.dot(lhs, rhs[0], preferred_element_type=jnp.bfloat16)
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    return lambda lhs, rhs, sizes: gmm(lhs, rhs, sizes, jnp.bfloat16, tiling)


def measure(shape: tuple[int, int, int, int], method: str, tiling, repeats: int, reference=None) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    rows, k, n, groups = shape
    lhs, rhs, cot, sizes = _inputs(*shape)
    op = _method(method, tiling)
    forward = jax.jit(op)

    @jax.jit
    def forward_backward(lhs, rhs, sizes, cot):
        out, vjp = jax.vjp(lambda a, b: op(a, b, sizes), lhs, rhs)
        return (out, *vjp(cot))

    fwd_s = median_seconds(forward, (lhs, rhs, sizes), repeats)
    both_s = median_seconds(forward_backward, (lhs, rhs, sizes, cot), repeats)
    flops = 2 * rows * k * n
    row = {
        "method": method, "tiling": tiling, "forward_ms": 1e3 * fwd_s, "forward_backward_ms": 1e3 * both_s,
        "forward_tflops": flops / fwd_s / 1e12, "forward_backward_tflops": 3 * flops / both_s / 1e12,
    }  # fmt: skip
    values = [v.astype(jnp.float32) for v in forward_backward(lhs, rhs, sizes, cot)]
    if reference is not None:
        row["error"] = max(float(jnp.max(jnp.abs(v - r)) / jnp.max(jnp.abs(r))) for v, r in zip(values, reference))
    return row, values


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shapes", nargs="*", default=sorted(SHAPES), choices=sorted(SHAPES))
    parser.add_argument(
        "--out", default=None, help="JSON result file (default benchmarks/results/tpu_grouped_matmul-<chip>.json; '-' = none)"
    )
    args = parser.parse_args(argv)
    import jax

    if jax.default_backend() != "tpu":
        raise SystemExit(f"tpu_grouped_matmul.py measures a TPU; this machine's JAX backend is {jax.default_backend()!r}")
    result: dict[str, Any] = {"chip": jax.devices()[0].device_kind, "jax": jax.__version__, "shapes": {}}
    for name in args.shapes:
        shape = SHAPES[name]
        row, reference = measure(shape, "ragged_dot", None, args.repeats)
        rows = [row, measure(shape, "dense", None, args.repeats)[0]]
        for tiling in TILINGS:
            if shape[1] % tiling[1] or shape[2] % tiling[2]:
                continue
            try:
                rows.append(measure(shape, "gmm", tiling, args.repeats, reference)[0])
            except Exception as e:  # a tiling the kernel refuses: recorded, not fatal
                rows.append({"method": "gmm", "tiling": tiling, "refused": f"{type(e).__name__}: {str(e)[:200]}"})
        result["shapes"][name] = {"rows_k_n_groups": shape, "runs": rows}
        for r in rows:
            print(name, json.dumps(r), file=sys.stderr, flush=True)
        if args.out != "-":  # after each shape: a run cut short keeps what it measured
            out = Path(args.out) if args.out else RESULTS / f"tpu_grouped_matmul-{result['chip'].replace(' ', '_')}.json"
            out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
