"""DeepSeek-V3 case ``deepseek3``: MLA (q/kv LoRA), YaRN RoPE (interleaved, mscale), 1 dense + 2 MoE layers,
sigmoid router with random ``e_score_correction_bias``, group-limited top-k, shared expert, scaling 2.5."""

from __future__ import annotations

import math

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from goldens.harness import (
    MIN_ROUTING_GAP,
    VOCAB,
    Case,
    Run,
    capture_router_io,
    logits,
    moe_gates,
    sorted_choice,
    variant_logits,
    write_and_check_fused,
)


def _yarn_check(run: Run) -> None:
    model = run.model
    cfg = model.config
    rope = cfg.rope_parameters
    dim = cfg.qk_rope_head_dim
    inv_plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    inv = model.model.rotary_emb.inv_freq.float()
    print("  rope yarn check (i: unscaled -> scaled inv_freq, ratio):")
    for j, (a, b) in enumerate(zip(inv_plain.tolist(), inv.tolist())):
        print(f"    {j}: {a:.6e} -> {b:.6e}  ({a / b:7.3f}x)")
    mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
    expect = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * mscale * mscale
    scaling = model.model.layers[0].self_attn.scaling
    print(
        f"  attention_scaling (cos/sin factor) = {model.model.rotary_emb.attention_scaling}; softmax scale = "
        f"{scaling:.8f} = qk_head_dim^-0.5 * mscale^2 (mscale {mscale:.6f})"
    )
    assert model.model.rotary_emb.attention_scaling == 1.0
    assert math.isclose(scaling, expect, rel_tol=1e-12)
    ratio = inv_plain / inv
    assert bool((ratio - 1).abs().min() < 1e-6) and bool((ratio - rope["factor"]).abs().min() < 1e-3)
    assert bool(((ratio > 1 + 1e-3) & (ratio < rope["factor"] - 1e-3)).any()), "no frequency in the yarn ramp"


def _route(
    s: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, k: int, fill: float = float("-inf")
) -> tuple[torch.Tensor, float, float]:
    """DeepSeek-V3 selection as HF does it (experts of dropped groups set to -inf).

    Returns (indices [T, k], expert margin, group margin)."""
    c = s + bias
    t, e = c.shape
    gs = c.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)  # [T, G]
    gmargin = float("inf")
    if topk_group < n_group:
        gtop = gs.topk(topk_group + 1, dim=-1)
        gmargin = float((gtop.values[:, topk_group - 1] - gtop.values[:, topk_group]).min())
    gidx = gs.topk(topk_group, dim=-1).indices
    gmask = torch.zeros_like(gs).scatter_(1, gidx, 1.0).bool()
    emask = gmask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
    cm = c.masked_fill(~emask, fill)
    top = cm.topk(k + 1, dim=-1)
    return top.indices[:, :k], float((top.values[:, k - 1] - top.values[:, k]).min()), gmargin


@torch.no_grad()
def router_check(run: Run) -> None:
    """Re-derive HF's routing; the groups and the correction bias both change the selection and the logits."""
    model, input_ids = run.model, run.input_ids
    cfg = model.config
    k, g, tg = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
    seen = capture_router_io(model, input_ids)
    for i, gate in moe_gates(model):
        x, (logits_hf, w_hf, idx_hf) = seen[i]
        x = x.reshape(-1, x.shape[-1])
        s = torch.sigmoid(torch.nn.functional.linear(x.float(), gate.weight.float()))
        b = gate.e_score_correction_bias
        assert bool((b != 0).all()), "e_score_correction_bias not set"
        idx, emargin, gmargin = _route(s, b, g, tg, k)
        w = s.gather(1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
        assert torch.equal(sorted_choice(idx)[0], sorted_choice(idx_hf)[0]), "routing re-derivation differs"
        assert torch.allclose(sorted_choice(idx, w)[1], sorted_choice(idx_hf, w_hf)[1], rtol=1e-6, atol=0)

        chosen = sorted_choice(idx)[0]

        def ndiff(other, ref=chosen):
            return int((sorted_choice(other)[0] != ref).any(-1).sum())

        plain = (s + b).topk(k, dim=-1).indices  # bias, no groups
        nobias = _route(s, torch.zeros_like(b), g, tg, k)[0]  # groups, no bias
        neither = s.topk(k, dim=-1).indices
        zero_fill = _route(s, b, g, tg, k, fill=0.0)[0]  # DeepSeek reference / older HF masking
        n = idx.shape[0]
        print(
            f"  layer {i} router: sigmoid(fp32) + bias, groups {g}/{tg}, top-{k}; re-derived = HF; "
            f"min gaps: expert {emargin:.3e}, group {gmargin:.3e}; bias range "
            f"[{float(b.min()):+.4f}, {float(b.max()):+.4f}]"
        )
        print(
            f"    tokens whose expert set differs from group-limited+bias: plain top-k (+bias, no groups) "
            f"{ndiff(plain)}/{n}, groups without bias {ndiff(nobias)}/{n}, plain top-k of sigmoid {ndiff(neither)}/{n}; masking dropped groups with 0.0 instead of -inf {ndiff(zero_fill)}/{n} "
            f"(min selected score+bias {float((s + b).gather(1, idx).min()):+.4f})"
        )
        assert ndiff(plain) > 0, "group-limited routing selects the same experts as plain top-k"
        assert ndiff(nobias) > 0, "e_score_correction_bias does not change the selection"
        assert min(emargin, gmargin) > MIN_ROUTING_GAP, "routing too close to a tie for a float32 parity test"
    d_groups = float((variant_logits(run, n_group=1, topk_group=1) - run.logits).abs().max())
    print(f"  max|logits - logits(n_group=1, topk_group=1)| = {d_groups:.3e}")
    assert d_groups > 1e-4
    saved = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    for n, b in model.named_buffers():
        if n in saved:
            b.zero_()
    d_bias = float((logits(model, input_ids) - run.logits).abs().max())
    for n, b in model.named_buffers():
        if n in saved:
            b.copy_(saved[n])
    assert torch.equal(logits(model, input_ids), run.logits)
    print(f"  max|logits - logits(e_score_correction_bias = 0)| = {d_bias:.3e}")
    assert d_bias > 1e-4


# Shared with the MTP case (goldens/deepseek3_mtp.py).
DEEPSEEK3_KWARGS = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_hidden_layers=3,
    first_k_dense_replace=1,  # layer 0 dense, layers 1-2 MoE
    intermediate_size=96,  # dense-layer MLP
    moe_intermediate_size=32,  # routed and shared experts
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=163840,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    rope_interleave=True,
    attention_bias=False,
    tie_word_embeddings=False,
)


CASES = (
    Case(
        "deepseek3",
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        DEEPSEEK3_KWARGS,
        checks=(_yarn_check, router_check, write_and_check_fused),
        moe=True,
        tie_checks=(router_check,),
    ),
)
