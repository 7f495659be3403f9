"""Llama 4 case ``llama4``: chunked attention (8), NoPE layer 3 with temperature tuning, L2 qk-norm, llama3 RoPE,
dense / MoE interleave (top-1 sigmoid + shared expert); experts saved fused ([E, D, 2F]), so no fused.safetensors.

Llama 4's experts have no ``experts_implementation`` switch (always one bmm over all experts), so it is not a
``moe`` case; its router is ``feed_forward.router.weight``."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from transformers import Llama4ForCausalLM, Llama4TextConfig

from goldens.harness import MIN_ROUTING_GAP, VOCAB, Case, Run, capture, llama3_rope_check, position_split, variant_logits


@torch.no_grad()
def router_check(run: Run) -> None:
    """Top-1 routers: the margin between the best and the second-best router logit is no near-tie."""
    model = run.model
    routers = [(i, layer.feed_forward.router) for i, layer in enumerate(model.model.layers) if layer.is_moe_layer]
    for i, (_, (scores, rlogits)) in sorted(capture(model, run.input_ids, routers).items()):
        top = rlogits.topk(2, dim=-1)
        margin = float((top.values[:, 0] - top.values[:, 1]).min())
        load = torch.bincount(top.indices[:, 0], minlength=rlogits.shape[-1]).tolist()
        s_sel = scores.max(dim=-1).values
        assert torch.allclose(s_sel, torch.sigmoid(top.values[:, 0]))
        assert bool(torch.isneginf(rlogits).any()) is False and int((scores > 0).sum()) == scores.shape[0]
        print(
            f"  layer {i} router: top-1 on raw logits, score sigmoid(logit) scales the expert INPUT; "
            f"min top1-top2 logit gap {margin:.3e}; tokens per expert {load}"
        )
        assert margin > MIN_ROUTING_GAP


@torch.no_grad()
def _check(run: Run) -> None:
    model, logits = run.model, run.logits
    cfg = model.config
    assert cfg.no_rope_layers == [1, 1, 1, 0] and cfg.moe_layers == [1, 3], (cfg.no_rope_layers, cfg.moe_layers)
    assert cfg.layer_types == ["chunked_attention"] * 3 + ["full_attention"], cfg.layer_types
    print(f"  no_rope_layers (1 = uses RoPE): {cfg.no_rope_layers}; moe_layers: {cfg.moe_layers}")
    print(f"  layer_types: {cfg.layer_types}")
    llama3_rope_check(run)
    router_check(run)
    for name, over, first in (
        ("attn_temperature_tuning=False", dict(attn_temperature_tuning=False), 7),
        ("attention_chunk_size=None", dict(attention_chunk_size=None), 8),
    ):
        inside, beyond, first_diff = position_split(run, first, **over)
        print(
            f"  vs {name}: max diff positions <{first}: {inside:.3e}, "
            f">={first}: {beyond:.3e} (first differing position {first_diff})"
        )
    ref = variant_logits(run, use_qk_norm=False)
    print(f"  vs use_qk_norm=False: max diff {float((ref - logits).abs().max()):.3e}")
    pos = torch.arange(run.case.seq_len, dtype=torch.float32)
    temp = torch.log1p(torch.floor((pos + 1.0) / cfg.floor_scale)) * cfg.attn_scale + 1.0
    print(
        f"  temperature (NoPE layer q multiplier) at positions 0,6,7,15,23,47: "
        f"{[round(float(temp[p]), 6) for p in (0, 6, 7, 15, 23, 47)]}"
    )
    # Saved layout == in-memory layout (no conversion mapping for llama4_text).
    hub = load_file(str(run.dir / "model.safetensors"))
    sd = model.state_dict()
    assert set(hub) == set(sd) and all(torch.equal(hub[k], sd[k]) for k in hub)
    print(f"  model.safetensors == model.state_dict() ({len(hub)} tensors); layer 0 (dense) and 1 (MoE) keys:")
    for key in sorted(hub):
        if ".layers.0." in key or ".layers.1." in key:
            print(f"    {key:55s} {list(hub[key].shape)}")


CASES = (
    Case(
        "llama4",
        Llama4TextConfig,
        Llama4ForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=48,  # per-expert (routed and shared expert) F; 2F != D
            intermediate_size_mlp=96,  # dense-layer F
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-5,
            max_position_embeddings=256,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,  # moe_layers = [1, 3]
            no_rope_layer_interval=4,  # no_rope_layers = [1, 1, 1, 0]: layer 3 is NoPE
            attention_chunk_size=8,
            use_qk_norm=True,
            attn_temperature_tuning=True,
            floor_scale=8,
            attn_scale=0.1,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            attention_bias=False,
            tie_word_embeddings=False,
        ),
        checks=(_check,),
        router="feed_forward.router.weight",
        tie_checks=(router_check,),
    ),
)
