"""Qwen3-Next's Gated DeltaNet delta rule on this backend: chunked (what the layer runs) vs token by token.

    python benchmarks/delta_rule.py [--seq 4096] [--heads 32] [--dim 128] [--chunk 64] [--repeats 5] [--out FILE|-]

For one layer's shapes (batch 1, ``--heads`` value heads of ``--dim``, float32 inputs as the layer
gives them) it reports, for ``chunked_gated_delta_rule`` and ``gated_delta_rule``
(``layers/gated_deltanet.py``), each under the backend's default matmul precision and under
``jax.default_matmul_precision("highest")``:

* the error of the output and of the input gradients against the token-by-token rule computed on the
  host CPU at full float32 precision (the reference: HF's ``torch_recurrent_gated_delta_rule``);
* the median time of the forward + backward (``jax.grad`` of a sum of the output);
* the compiled gradient's temporaries (XLA's memory analysis).

On a TPU a float32 matmul at default precision runs in bfloat16 passes on the MXU, so the precision
columns say whether the delta rule needs ``highest`` there. Results:
``benchmarks/results/delta_rule-<chip>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
RESULTS = ROOT / "benchmarks" / "results"


def _inputs(seq: int, heads: int, dim: int, seed: int = 0) -> tuple:
    import numpy as np

    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(1, seq, heads, dim)).astype(np.float32) for _ in range(3))
    g = -rng.uniform(0.01, 0.5, size=(1, seq, heads)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(1, seq, heads)).astype(np.float32)
    restart = np.zeros((1, seq), bool)
    return q, k, v, g, beta, restart


def _grad_fn(rule: Any) -> Any:
    import jax
    import jax.numpy as jnp

    def loss(q, k, v, g, beta, restart):
        return jnp.sum(rule(q, k, v, g, beta, restart)[0])

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def _error(got: Any, ref: Any) -> float:
    import numpy as np

    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import functools

    import jax

    from nnxtron.layers.gated_deltanet import chunked_gated_delta_rule, gated_delta_rule

    inputs = _inputs(args.seq, args.heads, args.dim)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu), jax.default_matmul_precision("highest"):
        cpu_inputs = jax.device_put(inputs, cpu)
        reference = _grad_fn(gated_delta_rule)(*cpu_inputs)
        ref_out = jax.jit(gated_delta_rule)(*cpu_inputs)[0]
    rules = {"chunked": functools.partial(chunked_gated_delta_rule, chunk_size=args.chunk), "token_by_token": gated_delta_rule}
    rows = []
    for name, rule in rules.items():
        for precision in ("default", "highest"):
            with jax.default_matmul_precision(None if precision == "default" else "highest"):
                fn = _grad_fn(rule)
                device_inputs = jax.device_put(inputs)
                compiled = fn.lower(*device_inputs).compile()
                memory = compiled.memory_analysis()
                out = jax.jit(rule)(*device_inputs)[0]
                value, grads = fn(*device_inputs)
                jax.block_until_ready(grads)
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    jax.block_until_ready(fn(*device_inputs))
                    times.append(time.perf_counter() - start)
            row = {
                "rule": name,
                "precision": precision,
                "fwd_bwd_ms": round(statistics.median(times) * 1e3, 3),
                "temp_bytes": int(getattr(memory, "temp_size_in_bytes", 0) or 0),
                "output_rel_err": _error(out, ref_out),
                "grad_rel_err": {n: _error(a, b) for n, a, b in zip("q k v g beta".split(), grads, reference[1])},
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return {"seq": args.seq, "heads": args.heads, "dim": args.dim, "chunk": args.chunk, "runs": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--out", default=None, help="JSON result file (default benchmarks/results/delta_rule-<chip>.json; '-' = none)"
    )
    args = parser.parse_args(argv)
    import jax

    result = {"chip": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__, **measure(args)}
    result["date"] = time.strftime("%Y-%m-%d")
    if args.out != "-":
        out = Path(args.out) if args.out else RESULTS / f"delta_rule-{result['chip'].replace(' ', '_')}.json"
        out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
