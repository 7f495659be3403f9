"""OLMo 3 case ``olmo3``: 3 sliding : 1 global layers (4 layers), window 8, norms on the sublayer outputs,
qk-norm over the whole q / k projection, per-layer-type RoPE (sliding: default, global: YaRN x8), GQA 4q/2kv,
untied head (nnxtron ``decoder_block=olmo3``)."""

from __future__ import annotations

import torch
from transformers import Olmo3Config, Olmo3ForCausalLM

from goldens.harness import VOCAB, Case, Run, logits, position_split, variant


@torch.no_grad()
def _check(run: Run) -> None:
    """The layer pattern, the per-type RoPE (YaRN on the global layer only), the window, and the qk-norm
    weights' shape (the whole projection) and effect."""
    model, cfg = run.model, run.model.config
    assert cfg.layer_types == ["sliding_attention"] * 3 + ["full_attention"], cfg.layer_types
    rot = model.model.rotary_emb
    plain = 1.0 / (5e5 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert torch.allclose(rot.sliding_attention_inv_freq.float(), plain, rtol=1e-6, atol=0)
    assert not torch.allclose(rot.full_attention_inv_freq.float(), plain, rtol=1e-3, atol=0)
    assert rot.sliding_attention_attention_scaling == 1.0 and rot.full_attention_attention_scaling > 1.2
    print(f"  layer_types {cfg.layer_types}; rope: sliding default, full yarn (x{rot.full_attention_attention_scaling:.4f})")
    q_norm = model.model.layers[0].self_attn.q_norm.weight
    assert q_norm.shape == (4 * 16,), q_norm.shape
    state = model.state_dict()
    ones = {k: torch.ones_like(v) if k.endswith(("q_norm.weight", "k_norm.weight")) else v for k, v in state.items()}
    diff = float((logits(variant(run, state_dict=ones), run.input_ids) - run.logits).abs().max())
    print(f"  q/k_norm weights [heads * head_dim]; max|logits - logits(q/k norm w = 1)| = {diff:.3e}")
    assert diff > 1e-3
    w = run.case.kwargs["sliding_window"]
    inside, beyond, first = position_split(run, w, sliding_window=256)
    print(f"  sliding_window={w}: vs no window, max diff at positions <{w}: {inside:.3e}, >={w}: {beyond:.3e} (first {first})")


CASES = (
    Case(
        "olmo3",
        Olmo3Config,
        Olmo3ForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,  # default layer_types: (i+1) % 4 -> layers 0-2 sliding, 3 global
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            hidden_act="silu",
            rms_norm_eps=1e-6,
            max_position_embeddings=65536,
            sliding_window=8,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "original_max_position_embeddings": 8192,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                },
            },
            attention_bias=False,
            tie_word_embeddings=False,
            pad_token_id=None,  # HF's defaults (1, 50279) lie outside the tiny vocabulary
            eos_token_id=None,
        ),
        checks=(_check,),
    ),
)
