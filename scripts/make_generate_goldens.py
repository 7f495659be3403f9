"""HF greedy-generation goldens: transformers' ``generate`` on the stored golden models.

For each case in ``tests/assets/golden/<case>/`` (written by ``make_goldens.py``), the
model is reloaded with ``from_pretrained`` (float32, eager attention and experts) and
decodes greedily with its own KV cache from the first ``PROMPT`` tokens of both rows of
the golden ``input_ids``. ``<case>/generate.safetensors`` receives:

* ``prompt_ids`` (int32, [2, PROMPT]) and ``generated`` (int32, [2, NEW]);
* ``margins`` (float32, [2, NEW]): top-1 minus top-2 logit at each step. The script
  refuses a case whose smallest margin is below ``MIN_MARGIN`` (a near-tie could flip
  under float32 rounding and make the comparison flaky).

``NEW`` = 24 new tokens: prompt + generation (36 tokens) runs past the sliding windows and
attention chunks (8) of the cases that have them, and past DeepSeek-V4's compression
ratios (4, 8).

The cases are ``goldens.CASES`` (every golden the family registry declares, in its order); a case
with routed experts is reloaded with transformers' eager expert loop too (``impl``).

Regenerate (CPU only, a few seconds per case)::

    pip install -e '.[golden]'
    OMP_NUM_THREADS=1 python scripts/make_generate_goldens.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_SCRIPTS = str(Path(__file__).resolve().parent)
if _SCRIPTS not in sys.path:  # `goldens` sits next to this file; also when this file is loaded by path
    sys.path.insert(0, _SCRIPTS)

import torch  # noqa: E402
from goldens import CASES  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

PROMPT, NEW = 12, 24
MIN_MARGIN = 1e-5  # nnxtron matches the HF logits to <= 8e-7 (test_hf_golden.py): a 1e-5 margin cannot flip


def impl(case: str) -> dict[str, str]:
    """Eager attention; eager experts too for a case with routed experts (the golden's own formulation)."""
    chosen = dict(attn_implementation="eager")
    if CASES[case].routed:
        chosen["experts_implementation"] = "eager"
    return chosen


@torch.no_grad()
def generate_case(directory: Path, case: str) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **impl(case)).eval()
    prompt = load_file(str(directory / "golden.safetensors"))["input_ids"][:, :PROMPT].to(torch.long)
    model.generation_config.eos_token_id = None  # random models: never stop early
    model.generation_config.pad_token_id = 0
    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
        output_scores=True, return_dict_in_generate=True, use_cache=True,
    )  # fmt: skip
    scores = torch.stack(out.scores, dim=1)  # [2, NEW, V] (no logits processors in greedy)
    top2 = torch.topk(scores, 2, dim=-1).values
    margins = (top2[..., 0] - top2[..., 1]).to(torch.float32)
    if float(margins.min()) < MIN_MARGIN:
        raise SystemExit(f"{case}: a greedy step has a top-2 margin of {float(margins.min()):.2e} < {MIN_MARGIN}")
    generated = out.sequences[:, PROMPT:].to(torch.int32)
    assert torch.equal(generated.to(torch.long), scores.argmax(-1)), case
    return {
        "prompt_ids": prompt.to(torch.int32).contiguous(),
        "generated": generated.contiguous(),
        "margins": margins.contiguous(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--golden", type=Path, default=Path("tests/assets/golden"))
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    margins = args.golden / "generate_margins.json"
    summary = json.loads(margins.read_text()) if margins.exists() else {}  # the cases not regenerated keep theirs
    for case in args.cases:
        tensors = generate_case(args.golden / case, case)
        save_file(tensors, str(args.golden / case / "generate.safetensors"))
        summary[case] = round(float(tensors["margins"].min()), 5)
        print(f"[{case}] {tensors['generated'].tolist()} (smallest margin {summary[case]})")
    margins.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
