"""Gemma (v1) case ``gemma``: multi-query attention (4 query heads, 1 key/value head, as gemma-2b), ``(1 + w)``
norms, GeGLU (tanh GELU), sqrt(D) embedding scale, tied head (nnxtron ``decoder_block=gemma``)."""

from __future__ import annotations

import torch
from transformers import GemmaConfig, GemmaForCausalLM

from goldens.harness import VOCAB, Case, Run, logits, variant


@torch.no_grad()
def _check(run: Run) -> None:
    """The embedding scale and the (1 + w) norms each move the logits."""
    model, cfg = run.model, run.model.config
    scale = float(model.model.embed_tokens.embed_scale)
    assert abs(scale - 8.0) < 1e-6 and cfg.hidden_act == "gelu_pytorch_tanh", (scale, cfg.hidden_act)
    print(f"  embed_scale = {scale} (sqrt(64)); hidden_act {cfg.hidden_act}; kv heads {cfg.num_key_value_heads}")
    state = model.state_dict()
    norms = {k: v for k, v in state.items() if "norm" in k}
    assert len(norms) == 2 * cfg.num_hidden_layers + 1 and all(float(v.abs().max()) > 0 for v in norms.values())
    zeroed = {k: torch.zeros_like(v) if "norm" in k else v for k, v in state.items()}
    diff = float((logits(variant(run, state_dict=zeroed), run.input_ids) - run.logits).abs().max())
    print(f"  max|logits - logits(norm w = 0, i.e. x_hat * 1)| = {diff:.3e}")
    assert diff > 1e-3, "the zero-centred norm weights have no visible effect"


CASES = (
    Case(
        "gemma",
        GemmaConfig,
        GemmaForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,  # multi-query, as gemma-2b
            head_dim=16,
            hidden_act="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            attention_bias=False,
            tie_word_embeddings=True,
        ),
        checks=(_check,),
        zero_centered_norms=True,
    ),
)
