"""Qwen2 case ``qwen2``: Llama's layer with biased ``q_proj`` / ``k_proj`` / ``v_proj`` (none on ``o_proj``),
GQA (4q/2kv), RoPE theta 1e6, untied head (nnxtron ``decoder_block=qwen2``, ``attention_bias=true``)."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from goldens.harness import Case, Run, logits, variant
from goldens.llama import DENSE_COMMON

# HF initialises the q/k/v biases to zeros (a golden that could not tell a dropped bias from a kept one):
# from this seed, in `named_parameters()` order, every one of them is redrawn as QWEN2_BIAS_STD * randn,
# about the size of the projections' own outputs here (std ~0.16), so every bias moves the logits.
QWEN2_BIAS_SEED = 1357
QWEN2_BIAS_STD = 0.2
BIASED = ("q_proj.bias", "k_proj.bias", "v_proj.bias")


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(QWEN2_BIAS_SEED)
    biases = [p for name, p in model.named_parameters() if name.endswith(BIASED)]
    for p in biases:
        p.copy_(QWEN2_BIAS_STD * torch.randn(p.shape, generator=gen, dtype=torch.float32))
    assert len(biases) == 3 * model.config.num_hidden_layers, len(biases)


@torch.no_grad()
def _bias_check(run: Run) -> None:
    """The saved q/k/v biases are non-zero, o_proj has none, and each kind of bias moves the logits."""
    state = run.model.state_dict()
    assert not any(k.endswith("o_proj.bias") for k in state), "HF Qwen2's o_proj has no bias"
    for suffix in BIASED:
        found = {k: v for k, v in state.items() if k.endswith(suffix)}
        assert found and all(float(v.abs().min()) > 0 for v in found.values()), suffix
        zeroed = {k: torch.zeros_like(v) if k.endswith(suffix) else v for k, v in state.items()}
        diff = float((logits(variant(run, state_dict=zeroed), run.input_ids) - run.logits).abs().max())
        print(f"  max|logits - logits({suffix} = 0)| = {diff:.3e}")
        assert diff > 1e-3, f"{suffix} has no visible effect"


CASES = (
    Case(
        "qwen2",
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(
            {k: v for k, v in DENSE_COMMON.items() if k not in ("attention_bias", "mlp_bias")},  # Qwen2: fixed biases
            rms_norm_eps=1e-6,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            use_sliding_window=False,
            tie_word_embeddings=False,  # untied: the tied goldens' greedy generation repeats the last prompt token
        ),
        checks=(_bias_check,),
        randomize=_randomize,
        versions={"qwen2_bias_seed": QWEN2_BIAS_SEED, "qwen2_bias_std": QWEN2_BIAS_STD},
    ),
)
