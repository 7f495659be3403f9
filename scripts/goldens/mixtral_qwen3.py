"""Mixtral and Qwen3 cases: ``mixtral`` (4 experts top-2), ``qwen3`` (dense, qk-norm, tied) and
``qwen3_moe`` / ``qwen3_moe_norenorm`` (8 experts top-2, ``norm_topk_prob`` True / False)."""

from __future__ import annotations

import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from goldens.harness import (
    MIN_ROUTING_GAP,
    VOCAB,
    Case,
    Run,
    capture_router_io,
    moe_gates,
    sorted_choice,
    variant_logits,
    write_and_check_fused,
)
from goldens.llama import DENSE_COMMON

# Mixtral / Qwen3-MoE: same attention shapes as the dense cases (4 q heads, 2 kv heads, head_dim 16).
_MOE_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
)

_QWEN3_MOE = dict(
    _MOE_COMMON,
    rms_norm_eps=1e-6,
    num_hidden_layers=2,
    intermediate_size=96,  # dense MLP size (the layers in mlp_only_layers or off the sparse step)
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    use_sliding_window=False,
    attention_bias=False,
    tie_word_embeddings=False,
)


def _mixtral_hub_name(key: str) -> str:
    return key.replace(".mlp.", ".block_sparse_moe.")


@torch.no_grad()
def softmax_router_check(run: Run) -> None:
    """Mixtral / Qwen3-MoE: re-derive HF's routing (softmax in fp32, top-k, optional renorm)."""
    cfg = run.model.config
    k = cfg.num_experts_per_tok
    renorm = getattr(cfg, "norm_topk_prob", True)  # Mixtral always renormalises
    seen = capture_router_io(run.model, run.input_ids)
    for i, gate in moe_gates(run.model):
        x, (logits_hf, w_hf, idx_hf) = seen[i]
        x = x.reshape(-1, x.shape[-1])
        logits = torch.nn.functional.linear(x, gate.weight)  # activation dtype (fp32 here)
        probs = torch.softmax(logits.float(), dim=-1)
        top = probs.topk(k + 1, dim=-1)
        idx, w = top.indices[:, :k], top.values[:, :k]
        if renorm:
            w = w / w.sum(dim=-1, keepdim=True)
        assert torch.equal(logits, logits_hf)
        assert torch.equal(sorted_choice(idx)[0], sorted_choice(idx_hf)[0]), "routing re-derivation differs"
        assert torch.allclose(sorted_choice(idx, w)[1], sorted_choice(idx_hf, w_hf.float())[1], rtol=1e-6, atol=0)
        margin = float((top.values[:, k - 1] - top.values[:, k]).min())
        load = torch.bincount(idx.flatten(), minlength=probs.shape[-1]).tolist()
        print(
            f"  layer {i} router: softmax(fp32) top-{k}{' renorm' if renorm else ''}; re-derived = HF; "
            f"min prob gap k-th vs (k+1)-th = {margin:.3e}; tokens per expert {load}; "
            f"sum of weights in [{float(w_hf.sum(-1).min()):.4f}, {float(w_hf.sum(-1).max()):.4f}]"
        )
        assert margin > MIN_ROUTING_GAP, "routing too close to a tie for a float32 parity test"


def _norenorm_check(run: Run) -> None:
    ref = variant_logits(run, norm_topk_prob=True)
    d = float((run.logits - ref).abs().max())
    print(f"  max|logits - logits(norm_topk_prob=True)| = {d:.3e}")
    assert d > 1e-4, "norm_topk_prob has no effect"


@torch.no_grad()
def _dense_layers_check(run: Run) -> None:
    """HF's rule: layer i is MoE iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    cfg = run.model.config
    moe = [hasattr(layer.mlp, "experts") for layer in run.model.model.layers]
    rule = [i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0 for i in range(len(moe))]
    print(f"  decoder_sparse_step {cfg.decoder_sparse_step}, mlp_only_layers {cfg.mlp_only_layers}: MoE layers {moe}")
    assert moe == rule and any(moe) and not all(moe), moe


CASES = (
    Case(
        "mixtral",
        MixtralConfig,
        MixtralForCausalLM,
        dict(
            _MOE_COMMON,
            num_hidden_layers=2,
            intermediate_size=96,  # per-expert F
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            sliding_window=None,
            tie_word_embeddings=False,
        ),
        checks=(softmax_router_check, write_and_check_fused),
        moe=True,
        tie_checks=(softmax_router_check,),
        hub_name=_mixtral_hub_name,
        hub_experts=("w1", "w3", "w2"),
    ),
    Case(
        "qwen3",
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            {k: v for k, v in DENSE_COMMON.items() if k != "mlp_bias"},
            rms_norm_eps=1e-6,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            use_sliding_window=False,
            tie_word_embeddings=True,
        ),
    ),
    Case(
        "qwen3_moe",
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(_QWEN3_MOE, norm_topk_prob=True),
        checks=(softmax_router_check, write_and_check_fused),
        moe=True,
        tie_checks=(softmax_router_check,),
    ),
    Case(
        "qwen3_moe_norenorm",
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(_QWEN3_MOE, norm_topk_prob=False),
        checks=(softmax_router_check, _norenorm_check, write_and_check_fused),
        moe=True,
        tie_checks=(softmax_router_check,),
        seed=1,  # not MODEL_SEED: its weights differ from `qwen3_moe`
    ),
    Case(  # dense layers anywhere: layers 0, 2 (sparse step 2) and 3 (mlp_only_layers) -> nnxtron dense_layers
        "qwen3_moe_dense",
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(_QWEN3_MOE, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True),
        checks=(softmax_router_check, _dense_layers_check, write_and_check_fused),
        moe=True,
        tie_checks=(softmax_router_check,),
        seed=2,
    ),
    Case(  # a dense prefix: layer 0 -> nnxtron first_num_dense_layers 1 (a stack of its own)
        "qwen3_moe_prefix",
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(_QWEN3_MOE, num_hidden_layers=3, mlp_only_layers=[0], norm_topk_prob=True),
        checks=(softmax_router_check, _dense_layers_check, write_and_check_fused),
        moe=True,
        tie_checks=(softmax_router_check,),
        seed=3,
    ),
)
