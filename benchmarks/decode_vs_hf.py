"""Greedy generation: nnxtron's KV-cached decoding against HF transformers' ``generate``.

The same tiny HF model (a golden checkpoint, default ``tests/assets/golden/llama2``) is
loaded by both; each decodes ``--new`` tokens greedily after a ``--prompt``-token prompt for
``--batch`` rows, in the same process, on the CPU. The generated tokens must be equal
before anything is timed. Each side runs once to warm up (nnxtron compiles its prefill
and decode steps; torch warms its kernels), then ``--repeats`` timed runs; the median
wall time gives tokens/s (batch x new tokens / time) and the ratio nnxtron / HF.

Needs torch and transformers next to nnxtron::

    pip install -e '.[golden]'
    python benchmarks/decode_vs_hf.py [--case llama2] [--batch 1 8] [--prompt 32] [--new 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from nnxtron.convert.hf import from_hf
from nnxtron.infer.generate import generate

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "assets" / "golden"


def hf_generate(model, prompts: np.ndarray, new: int) -> np.ndarray:
    ids = torch.as_tensor(prompts, dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[:, prompts.shape[1] :].numpy()


def nnxtron_generate(model, cfg, prompts: np.ndarray, new: int) -> np.ndarray:
    return np.array(list(generate(model, [list(p) for p in prompts], cfg, new))).T


def median_seconds(fn, args: tuple, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", default="llama2")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    directory = GOLDEN / args.case
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ours = from_hf(directory)
    cfg = ours.config.model_copy(update={"decode_sampling_strategy": "greedy"})
    print(f"case {args.case}: prompt {args.prompt}, {args.new} new tokens, torch threads {torch.get_num_threads()}")
    print("| batch | HF generate tok/s | nnxtron tok/s | nnxtron / HF |")
    print("|---|---|---|---|")
    for batch in args.batch:
        prompts = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(batch, args.prompt))
        expected, produced = hf_generate(hf, prompts, args.new), nnxtron_generate(ours, cfg, prompts, args.new)
        if not np.array_equal(expected, produced):
            raise SystemExit(f"batch {batch}: nnxtron and HF generated different tokens; not timing")
        hf_s = median_seconds(hf_generate, (hf, prompts, args.new), args.repeats)
        ours_s = median_seconds(nnxtron_generate, (ours, cfg, prompts, args.new), args.repeats)
        tokens = batch * args.new
        print(f"| {batch} | {tokens / hf_s:,.0f} | {tokens / ours_s:,.0f} | {hf_s / ours_s:.2f} |")


if __name__ == "__main__":
    main()
