"""Attention on a TPU: splash (Pallas) vs the xla and dot_product paths, forward + backward.

    python benchmarks/tpu_attention.py [--repeats 10] [--out FILE|-]

For each shape below (bfloat16 inputs, the 552M Llama's attention and the masks of the other
families) it reports the median time of one jitted forward + backward (``jax.vjp``) of each
implementation, and the parity of each against a float32 reference computed by the xla path
at ``precision=highest``: ``err = max|x - ref| / max|ref|`` over the output and the q/k/v
gradients. The bfloat16 bound the splash kernel is held to is calibrated by the xla path's own
bfloat16 error on the same inputs: ``splash_err <= 2 * xla_err`` (``ok``). Then the kernel's
block size is swept on the 552M shape, with the two-kernel backward and the fused one
(``layers.splash.block_size`` and ``FUSED_BACKWARD``), each with its error against the reference.

It refuses to run off a TPU (interpret mode says nothing about speed); the same code path is
proven on CPU by tests/unit/test_splash_attention.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {  # name: (batch, seq, query heads, kv heads, key dim, value dim, window, chunk, documents per row)
    "llama552m_causal": (4, 2048, 32, 8, 64, 64, 0, 0, 1),
    "llama552m_packed": (4, 2048, 32, 8, 64, 64, 0, 0, 4),
    "sliding_1024": (4, 2048, 32, 8, 64, 64, 1024, 0, 1),  # Mistral / Gemma 3 local layers
    "chunked_512": (4, 2048, 32, 8, 64, 64, 0, 512, 1),  # Llama 4 chunked layers
    "gemma_head256": (2, 2048, 8, 4, 256, 256, 0, 0, 1),
    "mla_192_128": (4, 2048, 16, 16, 192, 128, 0, 0, 1),  # DeepSeek-V3: key dim != value dim
}
BLOCKS = (128, 256, 512, 1024)


def _inputs(shape, dtype):
    import jax
    import numpy as np

    batch, seq, heads, kv_heads, dk, dv, _, _, docs = shape
    keys = jax.random.split(jax.random.key(0), 4)
    # drawn in float32, then cast: the bfloat16 inputs are the float32 reference's, rounded
    q = jax.random.normal(keys[0], (batch, seq, heads, dk)).astype(dtype)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, dk)).astype(dtype)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, dv)).astype(dtype)
    cot = jax.random.normal(keys[3], (batch, seq, heads, dv)).astype(dtype)
    segments = np.repeat(np.arange(1, docs + 1), -(-seq // docs))[:seq]
    return q, k, v, cot, np.broadcast_to(segments, (batch, seq)).astype(np.int32)


def _fwd_bwd(implementation: str, shape, block: int | None = None, fused_backward: bool | None = None):
    import jax

    from nnxtron.layers.attention import attend
    from nnxtron.layers.splash import splash_attention

    *_, dk, _, window, chunk, _ = shape
    scale = dk**-0.5

    def f(q, k, v, segments):
        if block is not None:
            return splash_attention(
                q,
                k,
                v,
                segments,
                scale=scale,
                sliding_window=window,
                chunk_size=chunk,
                block=block,
                fused_backward=fused_backward,
            )
        return attend(
            q, k, v, segments, scale=scale, sliding_window=window, chunk_size=chunk, dtype=q.dtype, implementation=implementation
        )

    def run(q, k, v, cot, segments):
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, segments), q, k, v)
        return (out, *vjp(cot))

    return jax.jit(run)


def median_seconds(fn, args, repeats: int) -> float:
    """The median wall time of ``fn(*args)`` over ``repeats`` calls, after one warm-up call."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _error(got, ref) -> float:
    import numpy as np

    worst = 0.0
    for g, r in zip(got, ref):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        worst = max(worst, float(np.abs(g - r).max() / max(np.abs(r).max(), 1e-30)))
    return worst


def measure_shape(name: str, shape, repeats: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    row: dict[str, Any] = {
        "shape": name,
        "dims": dict(zip(("batch", "seq", "heads", "kv_heads", "dk", "dv", "window", "chunk", "docs"), shape)),
    }
    bf16 = _inputs(shape, jnp.bfloat16)
    *arrays, segments = bf16
    f32 = (*(x.astype(jnp.float32) for x in arrays), segments)  # the same values, exactly
    with jax.default_matmul_precision("highest"):
        reference = _fwd_bwd("xla", shape)(*f32)
    dk, dv = shape[4], shape[5]
    implementations = ["xla", "splash"] + (["dot_product"] if dk == dv else [])
    for impl in implementations:
        fn = _fwd_bwd(impl, shape)
        row[f"{impl}_seconds"] = median_seconds(fn, bf16, repeats)
        row[f"{impl}_err"] = _error(fn(*bf16), reference)
    row["splash_speedup_vs_xla"] = row["xla_seconds"] / row["splash_seconds"]
    row["ok"] = row["splash_err"] <= 2 * row["xla_err"]
    return row


def block_sweep(repeats: int) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    shape = SHAPES["llama552m_causal"]
    args = _inputs(shape, jnp.bfloat16)
    *arrays, segments = args
    with jax.default_matmul_precision("highest"):
        reference = _fwd_bwd("xla", shape)(*(x.astype(jnp.float32) for x in arrays), segments)
    rows = []
    for block in BLOCKS:
        for fused in (False, True):
            fn = _fwd_bwd("splash", shape, block=block, fused_backward=fused)
            rows.append({"block": block, "fused_backward": fused, "splash_seconds": median_seconds(fn, args, repeats),
                         "splash_err": _error(fn(*args), reference)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per implementation (median)")
    parser.add_argument("--only", nargs="*", default=None, help="shapes to run (default: all)")
    parser.add_argument(
        "--out", default=None, help="JSON result (default benchmarks/results/tpu_attention-<device>.json; '-' = none)"
    )
    args = parser.parse_args(argv)
    import jax

    if jax.default_backend() != "tpu":
        raise SystemExit(f"tpu_attention.py measures a TPU; this machine's JAX backend is {jax.default_backend()!r}")
    rows = []
    for name in args.only or SHAPES:
        rows.append(measure_shape(name, SHAPES[name], args.repeats))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "shapes": rows,
        "block_sweep_llama552m": block_sweep(args.repeats),
    }
    print(json.dumps(result, indent=1))
    if args.out != "-":
        out = Path(args.out) if args.out else RESULTS / f"tpu_attention-{result['device_kind'].replace(' ', '_')}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
