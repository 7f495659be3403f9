"""MoE train steps at their FLOP count: model FLOP/s of each expert path against a dense model.

Times the real train step (``nnxtron.tools.bench.run_bench``) of

* a Mixtral-style MoE (emb 256, 8 experts, top-2, expert MLP 256, 2 layers, batch 8 x 128)
  with ``moe_compute=grouped`` and ``grouped_matmul=blocked`` (padded row blocks,
  ``parallel/grouped_matmul.py``), with ``grouped_matmul=ragged_dot`` (JAX's ``ragged_dot``:
  on CPU and GPU a dense product over every expert) and with ``moe_compute=dense`` (every
  expert on every token);
* the dense model with the same active parameters (``num_experts=1``, MLP 2 x 256 = 512:
  the same embedding, attention and layers);
* ``deepseek3-tiny`` with one MTP depth, batch 1 x 128 (the DeepSeek-V3 reference command)
  on each expert path.

``model_tflops_per_s`` counts the routed experts a token uses (``config/flops.py``), so a
MoE path at its FLOP count comes close to the dense model's figure (issue 25's target:
within 1.5x). The configs run interleaved for ``--rounds`` rounds; each reports its best
median step. Not in CI. Run: ``.venv/bin/python benchmarks/moe_flops.py [--steps N]
[--rounds R] [--skip-deepseek]`` (several minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from nnxtron.tools.bench import run_bench  # noqa: E402

SYNTHETIC = ["dataset_type=synthetic", "compilation_cache_dir="]
MIXTRAL = [
    "model_name=mixtral-tiny",
    "base_emb_dim=256",
    "base_num_query_heads=4",
    "base_num_kv_heads=4",
    "head_dim=64",
    "base_moe_mlp_dim=256",
    "num_experts=8",
    "num_experts_per_tok=2",
    "base_num_decoder_layers=2",
    "vocab_size=1024",
    "per_device_batch_size=8",
    "max_target_length=128",
    *SYNTHETIC,
]
DEEPSEEK = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "per_device_batch_size=1", "max_target_length=128", *SYNTHETIC]
PATHS = {
    "grouped, blocked": ["moe_compute=grouped", "grouped_matmul=blocked"],
    "grouped, ragged_dot": ["moe_compute=grouped", "grouped_matmul=ragged_dot"],
    "dense (every expert)": ["moe_compute=dense"],
}


def configs(deepseek: bool) -> dict[str, list[str]]:
    """Name -> overrides: the Mixtral-style MoE per path, its dense twin, deepseek3-tiny per path."""
    out = {f"mixtral-style, {path}": MIXTRAL + args for path, args in PATHS.items()}
    out["dense model, same active parameters"] = MIXTRAL + ["num_experts=1", "base_mlp_dim=512"]
    if deepseek:
        out.update({f"deepseek3-tiny + MTP, {path}": DEEPSEEK + args for path, args in PATHS.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-deepseek", action="store_true")
    args = parser.parse_args()
    runs = configs(not args.skip_deepseek)
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name, overrides in runs.items():
            result = run_bench(None, overrides, steps=args.steps)
            if name not in best or result["step_seconds"] < best[name]["step_seconds"]:
                best[name] = result
            print(f"{name}: {result['step_seconds']:.3f} s/step, {result['model_tflops_per_s'] * 1e3:.2f} GFLOP/s", flush=True)
    dense = best["dense model, same active parameters"]["model_tflops_per_s"]
    print("\n| config | s/step | model GFLOP/s | dense model / this (FLOP/s) | step vs blocked |")
    print("|---|---|---|---|---|")
    for name, result in best.items():
        family = name.split(",")[0]
        blocked = best.get(f"{family}, grouped, blocked", result)["step_seconds"]
        flops = result["model_tflops_per_s"]
        versus = f"{dense / flops:.2f}" if family != "deepseek3-tiny + MTP" else "-"
        print(
            f"| {name} | {result['step_seconds']:.3f} | {flops * 1e3:.2f} | {versus} | {result['step_seconds'] / blocked:.2f} |"
        )


if __name__ == "__main__":
    main()
