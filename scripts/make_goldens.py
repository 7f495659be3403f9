"""Generate the HuggingFace golden logits used by nnxtron's conversion tests.

Tiny, randomly initialised HF models (no download needed) are built, saved
with ``save_pretrained`` and run once in float32 / eager attention (and eager
experts for MoE models) on a fixed batch of token ids. For every case
``<out>/<case>/`` receives:

* ``config.json``        -- written by ``model.save_pretrained``
* ``model.safetensors``  -- float32 weights written by ``model.save_pretrained``
                            (transformers 5 writes MoE experts in the per-expert
                            hub layout, e.g. ``experts.{e}.w1.weight``)
* ``golden.safetensors`` -- ``input_ids`` (int32, [2, S]) and ``logits``
                            (float32, [2, S, V]) of the HF forward pass
* ``fused.safetensors``  -- MoE cases only: the same weights in transformers'
                            in-memory fused layout (``model.state_dict()``:
                            ``mlp.experts.gate_up_proj [E, 2F, D]``,
                            ``mlp.experts.down_proj [E, D, F]``)

plus ``<out>/versions.json`` recording the torch / transformers versions.

Cases:

* ``llama2``  -- LlamaForCausalLM, MHA, plain RoPE (theta 1e4), untied head.
* ``llama31`` -- LlamaForCausalLM, GQA (4q/2kv), llama3 RoPE scaling
                 (theta 5e5, factor 8, original_max_position_embeddings 64),
                 tied embeddings / lm_head.
* ``mistral`` -- MistralForCausalLM, GQA, theta 1e6, sliding_window=8.
* ``mixtral`` -- MixtralForCausalLM, 2 layers, 4 experts top-2, theta 1e6.
* ``qwen2``   -- Qwen2ForCausalLM: GQA, theta 1e6, untied head, q/k/v projection biases
                 (redrawn non-zero; no o_proj bias).
* ``gemma``   -- GemmaForCausalLM: multi-query (4q/1kv), (1 + w) norms, GeGLU, sqrt(D) embedding
                 scale, tied head.
* ``qwen3``   -- Qwen3ForCausalLM (qk-norm), GQA, theta 1e6, tied embeddings.
* ``qwen3_moe`` / ``qwen3_moe_norenorm`` -- Qwen3MoeForCausalLM, 8 experts
                 top-2, ``norm_topk_prob`` True / False.
* ``deepseek3`` -- DeepseekV3ForCausalLM: MLA (q/kv LoRA), YaRN RoPE
                 (interleaved, mscale), 1 dense + 2 MoE layers, sigmoid router
                 with random ``e_score_correction_bias``, group-limited top-k
                 (n_group 4, topk_group 2), shared expert, scaling 2.5.
* ``gemma2``  -- Gemma2ForCausalLM: sliding / global alternating (4 layers), window 8, attention and
                 final logit soft caps (1.0, 0.5: query/key weights x 8 so the cap bends), query_pre_attn_scalar
                 24, (1 + w) pre and post norms, sqrt(D) embedding scale, tied head.
* ``gemma3``  -- Gemma3ForCausalLM: 5 sliding : 1 global (8 layers), window 8, per-layer-type
                 RoPE (1e4 / 1e6 linear x8), (1 + w) norms, sqrt(D) embedding scale, final softcap.
* ``gemma4``  -- Gemma4ForCausalLM: sliding / full (4 layers, S 32), global layers of their own shape (one kv head,
                 ``attention_k_eq_v``), proportional RoPE 0.25, weightless v norm, 4 experts top-2 beside the MLP
                 (router scale, per-expert scale), ``layer_scalar``, tied head, final softcap; also HF's float64 logits.
* ``gpt_oss`` -- GptOssForCausalLM: sliding / full (2 layers), window 8, attention sinks, q/k/v/o biases, YaRN x32
                 untruncated, 4 experts top-2 (biased router, softmax over the chosen logits), clamped SwiGLU
                 experts with biases and the interleaved ``gate_up_proj`` (saved fused: no fused.safetensors).
* ``qwen3_next`` -- Qwen3NextForCausalLM: Gated DeltaNet / gated full attention / DeltaNet (3 layers), partial RoPE,
                 4 experts top-2 + a sigmoid-gated shared expert, zero-centred norms (HF's torch delta-rule fallback).
* ``qwen3_5`` -- Qwen3_5MoeForCausalLM: ``qwen3_next``'s case with Qwen3.5's split DeltaNet projections.
* ``olmo3``   -- Olmo3ForCausalLM: 3 sliding : 1 global (4 layers), window 8, norms on the sublayer
                 outputs, whole-projection q/k norms, per-layer-type RoPE (default / YaRN x8), untied.
* ``llama4``  -- Llama4ForCausalLM: chunked attention (8), NoPE layer 3 with temperature tuning,
                 L2 qk-norm, llama3 RoPE, dense / MoE interleave (top-1 sigmoid + shared expert);
                 experts saved fused ([E, D, 2F]), so no fused.safetensors.
* ``deepseek4`` -- DeepseekV4ForCausalLM (S=160): sliding / CSA / HCA layers, hash + top-k MoE,
                 mHC, sinks, no YaRN; model.safetensors uses upstream names (reverse mapping).
                 Plus a YaRN variant (same weights / input_ids, yarn on the "compress" rope only):
                 ``config_yarn.json`` and ``golden_yarn.safetensors``.
* ``gpt2``    -- GPT2LMHeadModel: pre-LayerNorm (with bias), fused QKV Conv1D ([in, out]) with bias,
                 ``gelu_new`` (tanh) MLP with bias, learned positions, tied head, final LayerNorm;
                 LayerNorm weights / all biases / ``wpe`` / ``mlp.c_fc`` weights redrawn so that they
                 matter. Reference for nnxtron's ``gpt3`` decoder block.

Regenerate (CPU only, takes well under a minute)::

    pip install -e '.[golden]'          # torch==2.13.0, transformers 5.x
    OMP_NUM_THREADS=1 python scripts/make_goldens.py --out tests/assets/golden
    # or only some cases: ... --cases mixtral qwen3_moe
    # the adversarial variants (scaled weights, shifted vectors, odd lengths; goldens/adversarial.py):
    OMP_NUM_THREADS=1 python scripts/make_goldens.py --out tests/assets/golden --adversarial

The script is deterministic (fixed seeds, one thread). After writing, each
directory is reloaded with ``from_pretrained`` and its logits are asserted to
be bit-identical to the stored ones (for MoE cases also after loading
``fused.safetensors`` into a fresh model).

Code layout: ``scripts/goldens/harness.py`` (shared constants, model building, file writing, common
checks) and one module per family (``goldens/llama.py``, ``qwen2.py``, ``mixtral_qwen3.py``, ``deepseek3.py``,
``gemma.py``, ``gemma2.py``, ``gemma3.py``, ``gemma4.py``, ``olmo3.py``, ``gpt_oss.py``, ``qwen3_next.py``, ``qwen3_5.py``, ``llama4.py``, ``deepseek4.py``, ``gpt2.py``) holding its case configs and checks.
Which cases exist is the family registry's: each family's record declares its goldens
(``Golden(name, generator)`` in ``goldens=``, ``nnxtron/models/family.py``) and ``goldens/__init__.py``
collects them in the registry's order; nothing in this script or the shared modules names a family.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
_SCRIPTS = str(Path(__file__).resolve().parent)
if _SCRIPTS not in sys.path:  # `goldens` sits next to this file; also when this file is loaded by path
    sys.path.insert(0, _SCRIPTS)

import torch  # noqa: E402
import transformers  # noqa: E402
from goldens import CASES  # noqa: E402
from goldens.adversarial import adversarial, settings  # noqa: E402
from goldens.harness import make_case, versions  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("tests/assets/golden"))
    parser.add_argument("--cases", nargs="+", choices=list(CASES), help="only these cases (default: all)")
    parser.add_argument("--adversarial", action="store_true", help="write the adversarial variants to <out>/adversarial")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    cases, out = CASES, args.out
    if args.adversarial:
        cases, out = {name: adversarial(case) for name, case in CASES.items()}, args.out / "adversarial"
    out.mkdir(parents=True, exist_ok=True)
    info = versions(cases.values())
    if args.adversarial:
        info["adversarial"] = settings(CASES.values())
    (out / "versions.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for name, case in cases.items():
        if not args.cases or name in args.cases:
            make_case(case, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
