"""Per-device memory of the train step with context parallelism: ring attention against
gathered keys and values, from ``nnxtron plan`` (XLA's memory analysis of the compiled step
on fake CPU devices; nothing is allocated).

The devices are fixed (8) and the global batch too (8 rows of ``--seq`` tokens), so every
device holds the same number of tokens at every context size C: the rows split over the
``fsdp`` axis (8 / C ways) and each row's sequence over ``context`` (C ways). Gathered keys
and values then give each device ``B/(8/C) x S/C`` queries against all S keys: the scores
stay the same size whatever C. Ring attention holds ``S/C`` keys at a time (``S/2C`` per
half-block with load balancing): its scores fall as 1/C. The table prints the temporaries
(activations, gradients, optimizer intermediates) and the peak per device.

Run: ``.venv/bin/python benchmarks/ring_memory.py [--seq 4096] [--sizes 1 2 4 8]``
(about a minute per compile on 2 cores).
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from nnxtron.config import load_config  # noqa: E402
from nnxtron.tools.plan import make_plan  # noqa: E402

MIB = 1024**2
STRATEGIES = {
    "all_gather": dict(context_parallel_strategy="all_gather"),
    "ring": dict(context_parallel_strategy="ring", context_parallel_load_balance=False),
    "ring + load balance": dict(context_parallel_strategy="ring", context_parallel_load_balance=True),
}


def measure(model: str, seq: int, context: int, strategy: dict) -> dict[str, int]:
    cfg = load_config(
        values=dict(
            model_name=model,
            max_target_length=seq,
            per_device_batch_size=1,
            ici_context_parallelism=context,
            ici_fsdp_parallelism=8 // context,
            remat_policy="full",
            **strategy,
        )
    )
    return make_plan(cfg)["memory"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.1-tiny")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    print(f"{args.model}, 8 devices, global batch 8 x {args.seq} tokens, remat full, float32; MiB per device\n")
    print("| context C | strategy | temporaries | peak |")
    print("|---|---|---|---|")
    for context in args.sizes:
        for name, strategy in STRATEGIES.items():
            if context == 1 and name != "all_gather":
                continue  # one context shard: every strategy is the plain attention
            memory = measure(args.model, args.seq, context, strategy)
            print(f"| {context} | {name} | {memory['temp_bytes'] / MIB:.1f} | {memory['peak_bytes'] / MIB:.1f} |", flush=True)


if __name__ == "__main__":
    main()
