"""Gemma 3 case ``gemma3``: 5 sliding : 1 global (8 layers), window 8, per-layer-type RoPE (1e4 / 1e6 linear x8),
``(1 + w)`` norms, sqrt(D) embedding scale, final logit softcap."""

from __future__ import annotations

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from goldens.harness import VOCAB, Case, Run, position_split, variant_logits


@torch.no_grad()
def _check(run: Run) -> None:
    model, logits = run.model, run.logits
    cfg = model.config
    expect = ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
    assert cfg.layer_types == expect, cfg.layer_types
    print(f"  layer_types: {cfg.layer_types}")
    print(f"  embed_scale = {float(model.model.embed_tokens.embed_scale)} (sqrt(64)); scaling = 16**-0.5")
    rot = model.model.rotary_emb
    dim = cfg.head_dim
    for lt, theta, factor in (("sliding_attention", 1e4, 1.0), ("full_attention", 1e6, 8.0)):
        inv = getattr(rot, f"{lt}_inv_freq").float()
        plain = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        assert torch.allclose(inv, plain / factor, rtol=1e-6, atol=0), lt
        print(
            f"  rope {lt}: theta {theta:g}, inv_freq = plain / {factor:g}; attention_scaling "
            f"{getattr(rot, f'{lt}_attention_scaling')}"
        )
    norm_w = [float(p.abs().max()) for n, p in model.named_parameters() if "norm" in n]
    print(f"  norm weights w (applied as 1 + w): max|w| = {max(norm_w):.3f}")
    ref = variant_logits(run, final_logit_softcapping=None)
    d = float((ref - logits).abs().max())
    print(
        f"  final softcap {cfg.final_logit_softcapping}: max|logit| {float(logits.abs().max()):.4f} (uncapped {float(ref.abs().max()):.4f}); "
        f"max|logits - uncapped| = {d:.3e}"
    )
    assert d > 1e-4
    w = run.case.kwargs["sliding_window"]
    inside, beyond, first = position_split(run, w, sliding_window=256)
    print(
        f"  sliding_window={w}: vs no window, max diff at positions <{w}: {inside:.3e}, "
        f">={w}: {beyond:.3e} (first differing position {first})"
    )


CASES = (
    Case(
        "gemma3",
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=8,  # default pattern (i+1) % 6: layers 0-4 sliding, 5 global, 6-7 sliding
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            sliding_window=8,
            query_pre_attn_scalar=16,
            # transformers 5.x: one rope dict per layer type.
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            },
            final_logit_softcapping=1.0,  # logits here are O(0.5): a cap of 30 would be a no-op
            attn_logit_softcapping=None,
            attention_bias=False,
            tie_word_embeddings=True,
        ),
        checks=(_check,),
        zero_centered_norms=True,
    ),
)
