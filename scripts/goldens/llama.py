"""Llama and Mistral cases: ``llama2`` (MHA, plain RoPE), ``llama31`` (GQA, llama3 RoPE, tied),
``mistral`` (GQA, sliding window 8)."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from goldens.harness import VOCAB, Case, Run, llama3_rope_check, position_split

# Shapes shared by the dense cases (also the base of `qwen3`).
DENSE_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=3,
    num_attention_heads=4,
    head_dim=16,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    attention_bias=False,
    mlp_bias=False,
)


def _sliding_check(run: Run) -> None:
    """The window changes nothing before position ``sliding_window`` and the logits from there on."""
    w = run.case.kwargs["sliding_window"]
    inside, beyond, first = position_split(run, w, sliding_window=None)
    print(
        f"  sliding_window={w}: max|logits - logits(no window)| positions <{w}: {inside:.3e}, "
        f">={w}: {beyond:.3e}  (first differing position: {first})"
    )


# transformers 5.x: RoPE settings live in `rope_parameters` (with `rope_theta` inside).
CASES = (
    Case(
        "llama2",
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            DENSE_COMMON,
            num_key_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
        ),
    ),
    Case(
        "llama31",
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            DENSE_COMMON,
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=True,
        ),
        checks=(llama3_rope_check,),
    ),
    Case(
        "mistral",
        MistralConfig,
        MistralForCausalLM,
        dict(
            {k: v for k, v in DENSE_COMMON.items() if k not in ("attention_bias", "mlp_bias")},
            num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            sliding_window=8,
            tie_word_embeddings=False,
        ),
        checks=(_sliding_check,),
    ),
)
