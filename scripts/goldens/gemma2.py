"""Gemma 2 case ``gemma2``: sliding / global layers alternating (4 layers, local first), window 8, one RoPE base,
``(1 + w)`` pre and post norms, attention and final logit soft caps, query_pre_attn_scalar 24 (not head_dim),
sqrt(D) embedding scale, tied head (nnxtron ``decoder_block=gemma2``)."""

from __future__ import annotations

import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from goldens.harness import VOCAB, Case, Run, position_split, variant_logits


@torch.no_grad()
def _sharpen(model: torch.nn.Module) -> None:
    """Query and key weights x 8: attention logits O(1) (HF's std 0.02 init leaves them O(0.02), where a cap bends nothing)."""
    for name, param in model.named_parameters():
        if "q_proj" in name or "k_proj" in name:
            param.mul_(8.0)


@torch.no_grad()
def _check(run: Run) -> None:
    """The alternation, both soft caps, the post norms and the window each move the logits."""
    model, logits = run.model, run.logits
    cfg = model.config
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2, cfg.layer_types
    print(f"  layer_types: {cfg.layer_types}; embed_scale sqrt(64); scaling = 24**-0.5")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        ref = variant_logits(run, **{key: None})
        d = float((ref - logits).abs().max())
        print(f"  {key} {getattr(cfg, key)}: max|logits - uncapped| = {d:.3e}")
        assert d > 1e-3, f"{key} has no visible effect"
    state = model.state_dict()
    post = {k: torch.zeros_like(v) if "post_" in k and "norm" in k else v for k, v in state.items()}
    assert sum("post_" in k and "norm" in k for k in state) == 2 * cfg.num_hidden_layers
    d = float((variant_logits(run, state_dict=post) - logits).abs().max())
    print(f"  max|logits - logits(post-norm w = 0)| = {d:.3e}")
    assert d > 1e-3, "the post norms' weights have no visible effect"
    w = run.case.kwargs["sliding_window"]
    inside, beyond, first = position_split(run, w, sliding_window=256)
    print(f"  sliding_window={w}: vs no window, max diff at positions <{w}: {inside:.3e}, >={w}: {beyond:.3e} (first {first})")
    assert inside < 1e-5 < beyond


CASES = (
    Case(
        "gemma2",
        Gemma2Config,
        Gemma2ForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,  # default layer_types: sliding, full, sliding, full
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            sliding_window=8,
            query_pre_attn_scalar=24,  # not head_dim (16), as gemma-2-27b (144, head_dim 128)
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            attn_logit_softcapping=1.0,  # attention logits here are O(1) (_sharpen), output logits O(0.5):
            # 50 / 30 would be no-ops
            final_logit_softcapping=0.5,
            attention_bias=False,
            tie_word_embeddings=True,
        ),
        checks=(_check,),
        zero_centered_norms=True,
        randomize=_sharpen,
    ),
)
