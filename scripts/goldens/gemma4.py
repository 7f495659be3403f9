"""Gemma 4 case ``gemma4``: HF ``Gemma4ForCausalLM`` as Gemma 4 26B-A4B's text decoder, tiny: 4 layers (sliding,
full, sliding, full), window 8; global layers with 2x wider heads, one key/value head and ``attention_k_eq_v`` (no
``v_proj``: values = keys' projection), proportional RoPE on a quarter of their frequencies (1e6; sliding: default
RoPE, 1e4); q/k norms, the weightless v norm, plain ``x * w`` norms; 4 routed experts (top-2) beside each layer's
MLP (router norm, ``router.scale``, ``per_expert_scale``), ``layer_scalar``; sqrt(D) embedding scale, tied head, final
logit soft cap. The golden also holds HF's float64 logits (``logits_float64``, rounded to float32): the reference of
the parity test."""

from __future__ import annotations

import copy

import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

from goldens.harness import (
    MIN_ROUTING_GAP,
    VOCAB,
    Case,
    Run,
    capture,
    logits,
    position_split,
    variant,
    variant_logits,
    write_golden,
)

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
GEMMA4_SEED = 2482  # the first of 2468-2495 whose routers (plain and adversarial) keep gaps > 1e-4
# the router sees rms(h) * scale / sqrt(D): at the harness's ROUTER_STD its probabilities are all near 1 / E and
# near ties common; its projection is drawn at this std instead (logits of about unit size)
ROUTER_PROJ_STD = 1.0
VECTOR_STD = 0.2  # router.scale, per_expert_scale and layer_scalar start at 1: redrawn as 1 + VECTOR_STD * randn


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    """The vectors HF starts at ones (and the layer_scalar buffer) drawn around 1, so that each matters; the
    router's projection at ``ROUTER_PROJ_STD``."""
    gen = torch.Generator().manual_seed(GEMMA4_SEED)
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith(("router.scale", "router.per_expert_scale", "layer_scalar")):
            p.copy_(1.0 + VECTOR_STD * torch.randn(p.shape, generator=gen))
        elif name.endswith("router.proj.weight"):
            p.copy_(ROUTER_PROJ_STD * torch.randn(p.shape, generator=gen))


@torch.no_grad()
def router_check(run: Run) -> None:
    """Re-derive HF's routing from the router's input: weightless RMS norm x scale / sqrt(D), softmax over all
    experts (fp32), top-k renormalised, x per_expert_scale; refuse a near tie between the k-th and (k+1)-th."""
    model, k = run.model, run.model.config.top_k_experts
    routers = [(i, layer.router) for i, layer in enumerate(model.model.layers)]
    for i, router in routers:
        (x, *_), (_, w_hf, idx_hf) = capture(model, run.input_ids, [(i, router)])[i]
        h = router.norm(x) * router.scale * model.config.hidden_size**-0.5
        probs = torch.softmax(torch.nn.functional.linear(h, router.proj.weight).float(), dim=-1)
        top = probs.topk(k + 1, dim=-1)
        idx, w = top.indices[:, :k], top.values[:, :k]
        w = w / w.sum(dim=-1, keepdim=True) * router.per_expert_scale[idx]
        assert torch.equal(idx, idx_hf) and torch.allclose(w, w_hf, rtol=1e-6, atol=0), f"layer {i}: routing differs"
        margin = float((top.values[:, k - 1] - top.values[:, k]).min())
        print(f"  layer {i} router: re-derived = HF; min prob gap k-th vs (k+1)-th = {margin:.3e}")
        assert margin > MIN_ROUTING_GAP, "routing too close to a tie for a float32 parity test"


@torch.no_grad()
def _effects(run: Run) -> None:
    """The global layers' shape and RoPE are HF's; the soft cap, the window and the vectors drawn around 1 each
    move the logits."""
    model, cfg = run.model, run.model.config
    assert cfg.layer_types == LAYER_TYPES
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        assert (attn.head_dim, attn.v_proj is None) == ((16, True) if i % 2 else (8, False)), i
    rot = model.model.rotary_emb
    full = rot.full_attention_inv_freq.float()
    plain = 1.0 / (1e6 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert torch.equal(full[:2], plain[:2]) and not full[2:].any(), full  # 0.25 * 16 / 2 = 2 rotating pairs
    print(f"  full_attention inv_freq (proportional 0.25 of 16): {full.tolist()}")
    capped = variant_logits(run, final_logit_softcapping=None)
    print(f"  max|logits - uncapped| = {float((capped - run.logits).abs().max()):.3e}")
    assert float((capped - run.logits).abs().max()) > 1e-4
    window = run.case.kwargs["sliding_window"]
    inside, beyond, first = position_split(run, window, sliding_window=256)
    print(f"  sliding_window={window}: before {inside:.3e}, from it {beyond:.3e} (first differing position {first})")
    state = model.state_dict()
    for suffix in ("router.scale", "router.per_expert_scale", "layer_scalar"):
        ones = {key: torch.ones_like(v) if key.endswith(suffix) else v for key, v in state.items()}
        diff = float((logits(variant(run, state_dict=ones), run.input_ids) - run.logits).abs().max())
        print(f"  max|logits - logits({suffix} = 1)| = {diff:.3e}")
        assert diff > 1e-3, f"{suffix} has no visible effect"


@torch.no_grad()
def exact_reference(run: Run) -> None:
    """Add ``logits_float64`` to ``golden.safetensors``: HF's logits of the same model run in float64, rounded to
    float32 (3e-8 at these logits, half the file of float64)."""
    model = copy.deepcopy(run.model).to(torch.float64)
    exact = model(input_ids=run.input_ids.long(), use_cache=False).logits
    print(f"  max|float32 logits - float64 logits| (HF) = {float((run.logits.double() - exact).abs().max()):.3e}")
    write_golden(run.dir / "golden.safetensors", run.input_ids, run.logits, logits_float64=exact.to(torch.float32))


CASES = (
    Case(
        "gemma4",
        Gemma4TextConfig,
        Gemma4ForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=24,
            intermediate_size=24,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            global_head_dim=16,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            layer_types=LAYER_TYPES,
            sliding_window=8,
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
            },
            hidden_size_per_layer_input=0,
            num_kv_shared_layers=0,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=8,
            final_logit_softcapping=1.0,  # logits here are O(1): a cap of 30 would be a no-op
            tie_word_embeddings=True,
        ),
        # float32 rounding alone moves HF's logits here by 2.3e-6 from the same model in float64 (every sublayer's
        # small output is RMS-normalised: ~1e-6 relative per layer), so the golden also holds HF's float64 logits
        checks=(router_check, _effects, exact_reference),
        moe=True,
        router="router.proj.weight",
        randomize=_randomize,
        tie_checks=(router_check,),
        seq_len=32,  # past the window of 8; with the float64 logits the directory stays under 300 kB
        versions={"gemma4_seed": GEMMA4_SEED, "gemma4_vector_std": VECTOR_STD, "gemma4_router_std": ROUTER_PROJ_STD},
    ),
)
