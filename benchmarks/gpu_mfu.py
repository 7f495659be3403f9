"""MFU of a llama-style 1B model's train step on one GPU (target >= 50%).

    python benchmarks/gpu_mfu.py [--batch 8] [--seq 2048] [--remat none] [--steps 10]
                                 [--set key=value ...] [--out FILE|-]

The model is Llama 3.2 1B's shape (emb 2048, 16 layers, 32 query / 8 key-value heads of
64, MLP 8192, vocab 128256, tied embeddings) with bfloat16 activations and float32
master weights, synthetic data, on one device. It runs ``nnxtron bench`` (the Trainer's
own step) and reports tokens/s and MFU against the device's dense bf16 peak
(``nnxtron.runtime.peak.KNOWN_PEAK_TFLOPS``, or ``--set peak_tflops=...``).

It refuses to run without a GPU: the 1B model on a CPU says nothing about GPU MFU.
The project never needs a GPU; this script is the one place that measures one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

LLAMA_1B = [
    "model_name=default", "decoder_block=llama2", "base_emb_dim=2048", "base_num_decoder_layers=16",
    "base_num_query_heads=32", "base_num_kv_heads=8", "head_dim=64", "base_mlp_dim=8192", "vocab_size=128256",
    "logits_via_embedding=true", "rope_max_timescale=500000", "normalization_layer_epsilon=1e-5",
    "dtype=bfloat16", "weight_dtype=float32", "dataset_type=synthetic", "scan_layers=true",
    "ici_fsdp_parallelism=1",
]  # fmt: skip


def overrides(args: argparse.Namespace) -> list[str]:
    """The config of the run: the 1B model, the batch and the user's ``--set`` values."""
    return [
        *LLAMA_1B, f"per_device_batch_size={args.batch}", f"max_target_length={args.seq}",
        f"remat_policy={args.remat}", *args.set,
    ]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--remat", default="none", help="remat_policy (none fits 1B on one 80+ GB GPU)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other config override")
    parser.add_argument(
        "--out", default=None, help="JSON result file (default benchmarks/results/gpu_mfu-<device>.json; '-' = none)"
    )
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    import jax

    if jax.default_backend() != "gpu":
        raise SystemExit(f"gpu_mfu.py measures a GPU; this machine's JAX backend is {jax.default_backend()!r}")
    from nnxtron.tools.bench import run_bench

    result = run_bench(None, overrides(args), steps=args.steps)
    print(json.dumps(result, indent=1))
    if args.out != "-":
        device = result["device_kind"].replace(" ", "_") or "gpu"
        out = Path(args.out) if args.out else RESULTS / f"gpu_mfu-{device}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"MFU {100 * result['mfu']:.1f}% ({result['tokens_per_s']:,.0f} tokens/s on {result['device_kind']})", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
