"""GPT-OSS case ``gpt_oss``: 2 layers (sliding window 8, then global), GQA 4q/2kv of 8, attention sinks,
q/k/v/o biases, YaRN x32 from 4096 untruncated (theta 1.5e5), 4 experts top-2 (softmax over the chosen
logits of a biased router), experts a clamped SwiGLU (limit 1, so that the clamp bites) with biases and
HF's interleaved ``gate_up_proj``, untied head (nnxtron ``decoder_block=gpt_oss``)."""

from __future__ import annotations

import torch
from transformers import GptOssConfig, GptOssForCausalLM

from goldens.harness import MIN_ROUTING_GAP, VOCAB, Case, Run, capture, logits, position_split, variant, variant_logits

# HF initialises the expert and projection biases to zeros and the sinks / router bias at std 0.02, and its
# experts' outputs stay far below swiglu_limit: from this seed, in `named_parameters()` order, the experts'
# weights are redrawn at EXPERT_STD and every bias and sink at BIAS_STD / SINK_STD, so that each of them
# (and the clamp at LIMIT) moves the logits.
GPT_OSS_SEED = 2468
EXPERT_STD = 0.3
BIAS_STD = 0.05
SINK_STD = 1.0
LIMIT = 1.0
ROUTER = "mlp.router.weight"


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(GPT_OSS_SEED)
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            std = EXPERT_STD
        elif name.endswith("sinks"):
            std = SINK_STD
        elif name.endswith("bias"):
            std = BIAS_STD
        else:
            continue
        p.copy_(std * torch.randn(p.shape, generator=gen, dtype=torch.float32))


def _routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    return [(i, layer.mlp.router) for i, layer in enumerate(model.model.layers)]


@torch.no_grad()
def router_check(run: Run) -> None:
    """HF's routing re-derived (biased logits, top-k, softmax over the chosen logits), and the gap between the
    k-th and (k+1)-th logit above MIN_ROUTING_GAP (a float32 reimplementation must choose the same experts)."""
    k = run.model.config.num_experts_per_tok
    for i, (args, (_, w_hf, idx_hf)) in capture(run.model, run.input_ids, _routers(run.model)).items():
        router = run.model.model.layers[i].mlp.router
        x = args[0].reshape(-1, args[0].shape[-1])
        scores = torch.nn.functional.linear(x, router.weight, router.bias)
        top = scores.topk(k + 1, dim=-1)
        assert torch.equal(top.indices[:, :k], idx_hf) and torch.allclose(torch.softmax(top.values[:, :k], -1), w_hf)
        margin = float((top.values[:, k - 1] - top.values[:, k]).min())
        load = torch.bincount(idx_hf.flatten(), minlength=scores.shape[-1]).tolist()
        print(f"  layer {i} router: top-{k} of logits + bias, softmax; min gap {margin:.3e}; tokens per expert {load}")
        assert margin > MIN_ROUTING_GAP, "routing too close to a tie for a float32 parity test"


@torch.no_grad()
def _effects(run: Run) -> None:
    """The sinks, each kind of bias, the clamp and the gate/up interleave each move the logits; the window
    acts from its position on; the checkpoint holds the fused expert tensors (no per-expert layout)."""
    state = run.model.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state and state["model.layers.0.mlp.experts.gate_up_proj"].shape == (
        4,
        32,
        64,
    )
    for suffix in ("sinks", "q_proj.bias", "o_proj.bias", "router.bias", "gate_up_proj_bias", "down_proj_bias"):
        zeroed = {key: torch.zeros_like(v) if key.endswith(suffix) else v for key, v in state.items()}
        diff = float((logits(variant(run, state_dict=zeroed), run.input_ids) - run.logits).abs().max())
        print(f"  max|logits - logits({suffix} = 0)| = {diff:.3e}")
        assert diff > 1e-3, f"{suffix} has no visible effect"
    swapped = {}
    for key, v in state.items():  # gate <-> up: the interleave read the other way round
        swapped[key] = v.reshape(*v.shape[:-1], -1, 2).flip(-1).reshape(v.shape) if "gate_up_proj" in key else v
    diff = float((logits(variant(run, state_dict=swapped), run.input_ids) - run.logits).abs().max())
    print(f"  max|logits - logits(gate <-> up)| = {diff:.3e}")
    assert diff > 1e-3
    diff = float((variant_logits(run, swiglu_limit=1e4) - run.logits).abs().max())
    print(f"  max|logits - logits(swiglu_limit {LIMIT} -> 1e4)| = {diff:.3e}")
    assert diff > 1e-3, "the clamp does not bite"
    w = run.case.kwargs["sliding_window"]
    inside, beyond, first = position_split(run, w, sliding_window=256)
    print(f"  sliding_window={w}: vs no window, max diff at positions <{w}: {inside:.3e}, >={w}: {beyond:.3e} (first {first})")


CASES = (
    Case(
        "gpt_oss",
        GptOssConfig,
        GptOssForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=2,  # default layer_types: sliding, full
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
            sliding_window=8,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
            swiglu_limit=LIMIT,
            attention_bias=True,
            tie_word_embeddings=False,
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
        ),
        checks=(router_check, _effects),
        moe=True,
        router=ROUTER,
        tie_checks=(router_check,),
        randomize=_randomize,
        versions={
            "gpt_oss_seed": GPT_OSS_SEED,
            "gpt_oss_expert_std": EXPERT_STD,
            "gpt_oss_bias_std": BIAS_STD,
            "gpt_oss_sink_std": SINK_STD,
        },
    ),
)
