"""MFU of a llama-style model's train step on one accelerator, GPU or TPU.

    python benchmarks/accelerator_mfu.py [--model NAME] [--batch N] [--seq 2048] [--remat POLICY]
                                         [--steps 10] [--set key=value ...] [--two-kernel-backward] [--out FILE|-]

Models (bfloat16 activations, float32 master weights, synthetic data, one device, tied
embeddings, heads of 64):

* ``llama1b`` (the default on a GPU): Llama 3.2 1B's shape, emb 2048, 16 layers, 32 query /
  8 key-value heads, MLP 8192, vocab 128256; batch 8, ``remat_policy=none``; target >= 50%.
* ``llama552m`` (the default on a TPU): emb 2048, 8 layers, 32 / 8 heads, MLP 8192, vocab
  32000 (issue 46's model, which fits one v5e chip); batch 4, ``scan_layers=false
  remat_policy=none`` (the best measured there: benchmarks/results/tpu_mfu-TPU_v5_lite.json;
  unrolled, nothing is recomputed and XLA's temporaries are 5.2 GB, against 19 GB scanned); target >= 55%.
* ``mixtral_style``: Mixtral's block (8 experts, top-2 softmax) at emb 2048, 8 layers, 32 / 8
  heads, experts of 1024, vocab 32000, untied (618M parameters, 16 bytes each with Adam: what
  fits one v5e chip); batch 4, ``remat_policy=none`` (32.3% on the chip); target >= 40%.
* ``deepseek3_style``: DeepSeek-V3's block (MLA with kv rank 512, 16 heads, 64 routed experts
  top-6 + 1 shared, sigmoid routing with correction bias) at emb 2048, 4 layers (1 dense of
  MLP 4096, 3 MoE with experts of 256), vocab 32000 (~510M parameters); batch 4, ``none`` (32.4% on
  the chip); target >= 30%. Both MoE models run unrolled (``scan_layers=false``) with nothing
  recomputed, the fastest measured there (their temporaries: 6.4 and 5.6 GB).

MoE MFU counts the FLOPs of the routed experts each token visits (top-k), not all experts.
The routed tokens go through ``grouped_matmul=auto`` (``ragged_dot`` on a TPU: within 7% of Pallas
megablox ``gmm`` at its best tiling on these shapes, and faster on DeepSeek's;
``benchmarks/tpu_grouped_matmul.py``).
The splash kernel's backward is the library's (one kernel, ``layers.splash.FUSED_BACKWARD``);
``--two-kernel-backward`` measures the two-kernel one it replaced.

It runs ``nnxtron bench`` (the Trainer's own step) and reports tokens/s and MFU against the
device's dense bf16 peak (``nnxtron.runtime.peak.KNOWN_PEAK_TFLOPS``, or ``--set
peak_tflops=...``). It refuses to run on a CPU: these models there say nothing about MFU.
The project never needs an accelerator; this script is the one place that measures one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

COMMON = [
    "model_name=default", "decoder_block=llama2", "base_emb_dim=2048", "base_num_query_heads=32", "base_num_kv_heads=8",
    "head_dim=64", "base_mlp_dim=8192", "logits_via_embedding=true", "rope_max_timescale=500000",
    "dtype=bfloat16", "weight_dtype=float32", "dataset_type=synthetic", "ici_fsdp_parallelism=1",
]  # fmt: skip
LLAMA_1B = [*COMMON, "base_num_decoder_layers=16", "vocab_size=128256", "normalization_layer_epsilon=1e-5", "scan_layers=true"]
LLAMA_552M = [*COMMON, "base_num_decoder_layers=8", "vocab_size=32000", "scan_layers=false"]
MOE_COMMON = ["dtype=bfloat16", "weight_dtype=float32", "dataset_type=synthetic", "scan_layers=false", "vocab_size=32000"]
MIXTRAL_STYLE = [
    "model_name=mixtral-8x7b", *MOE_COMMON, "base_emb_dim=2048", "base_num_query_heads=32", "base_num_kv_heads=8",
    "head_dim=64", "base_mlp_dim=1024", "base_moe_mlp_dim=1024", "base_num_decoder_layers=8",
]  # fmt: skip
DEEPSEEK3_STYLE = [
    "model_name=deepseek3-tiny", *MOE_COMMON, "base_emb_dim=2048", "base_num_query_heads=16", "base_num_kv_heads=16",
    "q_lora_rank=0", "kv_lora_rank=512", "base_mlp_dim=4096", "base_moe_mlp_dim=256", "num_experts=64",
    "num_experts_per_tok=6", "shared_experts=1", "base_num_decoder_layers=4", "first_num_dense_layers=1",
]  # fmt: skip
MODELS = {  # name: (overrides, default batch, default remat policy)
    "llama1b": (LLAMA_1B, 8, "none"),
    "llama552m": (LLAMA_552M, 4, "none"),
    "mixtral_style": (MIXTRAL_STYLE, 4, "none"),
    "deepseek3_style": (DEEPSEEK3_STYLE, 4, "none"),
}
DEFAULT_MODEL = {"gpu": "llama1b", "tpu": "llama552m"}


def overrides(args: argparse.Namespace, backend: str = "gpu") -> list[str]:
    """The config of the run: the model, the batch, the remat policy and the user's ``--set`` values."""
    model, batch, remat = MODELS[args.model or DEFAULT_MODEL.get(backend, "llama1b")]
    return [
        *model, f"per_device_batch_size={args.batch or batch}", f"max_target_length={args.seq}",
        f"remat_policy={args.remat or remat}", *args.set,
    ]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default=None, help="default: llama1b on a GPU, llama552m on a TPU")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: the model's)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--remat", default=None, help="remat_policy (default: the model's)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other config override")
    parser.add_argument(
        "--two-kernel-backward", action="store_true", help="the splash kernel's two-kernel backward (default: one kernel)"
    )
    parser.add_argument(
        "--out", default=None, help="JSON result file (default benchmarks/results/accelerator_mfu-<device>.json; '-' = none)"
    )
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    import jax

    backend = jax.default_backend()
    if backend not in ("gpu", "tpu"):
        raise SystemExit(f"accelerator_mfu.py measures a GPU or a TPU; this machine's JAX backend is {backend!r}")
    from nnxtron.layers import splash
    from nnxtron.tools.bench import run_bench

    if args.two_kernel_backward:
        splash.FUSED_BACKWARD = False
    result = {**run_bench(None, overrides(args, backend), steps=args.steps), "fused_backward": splash.FUSED_BACKWARD}
    print(json.dumps(result, indent=1))
    if args.out != "-":
        device = result["device_kind"].replace(" ", "_") or backend
        out = Path(args.out) if args.out else RESULTS / f"accelerator_mfu-{device}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"MFU {100 * result['mfu']:.1f}% ({result['tokens_per_s']:,.0f} tokens/s on {result['device_kind']})", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
