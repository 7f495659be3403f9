"""Qwen3.5 case ``qwen3_5``: Qwen3-Next's case (``goldens/qwen3_next.py``: the same shapes, init tweaks and
seeds) on HF ``Qwen3_5MoeForCausalLM`` (the text decoder of Qwen3.5-35B-A3B; nnxtron ``decoder_block=qwen3_5``):
3 layers (Gated DeltaNet, full attention, DeltaNet) whose DeltaNet has Qwen3.5's split input projections
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), HF's interleaved mRoPE (on text: the plain
partial RoPE), 4 experts top-2 (always renormalised) plus a sigmoid-gated shared expert. Its forward runs HF's
torch chunked delta rule and conv fallbacks."""

from __future__ import annotations

import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from goldens.harness import Case, Run
from goldens.mixtral_qwen3 import softmax_router_check
from goldens.qwen3_next import CASES as QWEN3_NEXT_CASES
from goldens.qwen3_next import GATE_STD, QWEN3_NEXT_SEED, _randomize, zeroing_moves_the_logits

NEXT = QWEN3_NEXT_CASES[0]
# Qwen3_5MoeTextConfig has no intermediate_size, norm_topk_prob (always true) or decoder_sparse_step; its
# layer pattern is layer_types
ABSENT = ("intermediate_size", "norm_topk_prob", "full_attention_interval")
KWARGS = {key: value for key, value in NEXT.kwargs.items() if key not in ABSENT}
KWARGS["layer_types"] = ["linear_attention", "full_attention", "linear_attention"]


@torch.no_grad()
def _effects(run: Run) -> None:
    """The layer pattern is HF's; each split DeltaNet projection, the conv, the decay, the gated norm, the attention
    gate and the shared expert gate move the logits; the checkpoint holds the per-expert hub layout."""
    assert run.model.config.layer_types == KWARGS["layer_types"]
    state = run.model.state_dict()
    assert not any("in_proj_qkvz" in key or "in_proj_ba" in key for key in state)
    zeroing_moves_the_logits(
        run,
        (
            "in_proj_z.weight",
            "in_proj_b.weight",
            "in_proj_a.weight",
            "conv1d.weight",
            "A_log",
            "dt_bias",
            "linear_attn.norm.weight",
        ),
    )


CASES = (
    Case(
        "qwen3_5",
        Qwen3_5MoeTextConfig,
        Qwen3_5MoeForCausalLM,
        KWARGS,
        checks=(softmax_router_check, _effects),
        moe=True,
        zero_centered_norms=True,
        randomize=_randomize,
        tie_checks=(softmax_router_check,),
        seed=NEXT.seed,
        versions={"qwen3_next_seed": QWEN3_NEXT_SEED, "qwen3_next_gate_std": GATE_STD},
    ),
)
