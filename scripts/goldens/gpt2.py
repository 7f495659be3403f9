"""GPT-2 case ``gpt2``: pre-LayerNorm (with bias), fused QKV Conv1D ([in, out]) with bias, ``gelu_new`` (tanh) MLP
with bias, learned positions, tied head, final LayerNorm. Reference for nnxtron's ``gpt3`` decoder block."""

from __future__ import annotations

import math

import torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel

from goldens.harness import VOCAB, Case, Run, capture, logits, variant, variant_logits

# HF initialises LayerNorms to (1, 0), Conv1D biases to 0 and `wpe` with std 0.02. From this
# seed (parameter by parameter, in `named_parameters()` order) every LayerNorm weight is redrawn as
# 1 + GPT2_STD * randn, every bias as GPT2_STD * randn and `wpe.weight` as GPT2_STD * randn; then
# (same generator, second pass) every `mlp.c_fc.weight` as GPT2_FC_STD * randn, so that the MLP
# pre-activations are O(1) and tanh-gelu (`gelu_new`) vs exact gelu is visible in the logits.
# Not recorded in versions.json (kept unchanged for the older cases); documented in the README.
GPT2_EXTRA_SEED = 2468
GPT2_STD = 0.1
GPT2_FC_STD = 0.3


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    """LayerNorm weights 1 + 0.1*randn, every bias 0.1*randn, wpe 0.1*randn, then (second pass,
    same generator) every mlp.c_fc.weight GPT2_FC_STD*randn (seed GPT2_EXTRA_SEED)."""
    gen = torch.Generator().manual_seed(GPT2_EXTRA_SEED)

    def randn(t):
        return torch.randn(t.shape, generator=gen, dtype=torch.float32)

    n_ln = n_bias = 0
    for name, p in model.named_parameters():
        if name.endswith(".bias"):  # ln_1/ln_2/ln_f, attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
            p.copy_(GPT2_STD * randn(p))
            n_bias += 1
        elif name.split(".")[-2] in ("ln_1", "ln_2", "ln_f") and name.endswith(".weight"):
            p.copy_(1.0 + GPT2_STD * randn(p))
            n_ln += 1
        elif name == "transformer.wpe.weight":
            p.copy_(GPT2_STD * randn(p))
    # Second pass, after the redraws above (which it leaves unchanged): larger MLP input weights.
    n_fc = 0
    for name, p in model.named_parameters():
        if name.endswith(".mlp.c_fc.weight"):
            p.copy_(GPT2_FC_STD * randn(p))
            n_fc += 1
    n_layer = model.config.n_layer
    assert n_ln == 2 * n_layer + 1 and n_bias == 6 * n_layer + 1 and n_fc == n_layer, (n_ln, n_bias, n_fc)


def _reference_logits(w: dict[str, torch.Tensor], input_ids: torch.Tensor, cfg: GPT2Config) -> torch.Tensor:
    """Plain-torch GPT-2 forward from the saved weights (documents the layout the README describes)."""
    f = torch.nn.functional
    nh, eps = cfg.n_head, cfg.layer_norm_epsilon
    b, s = input_ids.shape
    x = w["transformer.wte.weight"][input_ids.long()] + w["transformer.wpe.weight"][:s]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        h = f.layer_norm(x, (x.shape[-1],), w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
        qkv = h @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]  # Conv1D: x @ W[in, out] + b
        q, k, v = (t.reshape(b, s, nh, -1).transpose(1, 2) for t in qkv.split(x.shape[-1], dim=-1))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        att = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
        att = att.transpose(1, 2).reshape(b, s, -1)
        x = x + att @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = f.layer_norm(x, (x.shape[-1],), w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
        h = f.gelu(h @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"], approximate="tanh")
        x = x + h @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    x = f.layer_norm(x, (x.shape[-1],), w["transformer.ln_f.weight"], w["transformer.ln_f.bias"], eps)
    return x @ w["transformer.wte.weight"].T  # tied head


@torch.no_grad()
def _check(run: Run) -> None:
    model, input_ids = run.model, run.input_ids
    cfg = model.config
    hub = load_file(str(run.dir / "model.safetensors"))
    sd = model.state_dict()
    assert "lm_head.weight" not in hub and model.lm_head.weight is model.transformer.wte.weight
    assert set(sd) == set(hub) | {"lm_head.weight"} and all(torch.equal(hub[k], sd[k]) for k in hub)
    assert not any(k.endswith((".attn.bias", ".masked_bias")) for k in hub), "causal-mask buffers saved"
    buffers = [n for n, _ in model.named_buffers()]
    print(f"  model buffers: {buffers}  (no attn.bias / masked_bias causal-mask buffers)")
    print(f"  model.safetensors == model.state_dict() minus tied lm_head.weight ({len(hub)} tensors):")
    for key in sorted(hub):
        if ".h." not in key or ".h.0." in key:
            print(f"    {key:40s} {list(hub[key].shape)}")
    print("    ... same for transformer.h.1. and transformer.h.2.")
    scales = {float(layer.attn.scaling) for layer in model.transformer.h}
    assert scales == {0.25}, scales
    print(
        f"  attention scale: {scales.pop()} (= 1/sqrt(head_dim 16)); activation {type(model.transformer.h[0].mlp.act).__name__}"
    )
    ref = _reference_logits(hub, input_ids, cfg)
    d_ref = float((ref - run.logits).abs().max())
    print(f"  plain-torch re-implementation from model.safetensors (Conv1D [in, out], q|k|v, tanh gelu): max diff {d_ref:.3e}")
    assert d_ref < 1e-4
    for name, keep in (
        ("all biases = 0", lambda k: not k.endswith(".bias")),
        ("wpe = 0", lambda k: k != "transformer.wpe.weight"),
    ):
        other = variant(run, state_dict={k: v if keep(k) else torch.zeros_like(v) for k, v in sd.items()})
        diff = float((logits(other, input_ids) - run.logits).abs().max())
        print(f"  max|logits - logits({name})| = {diff:.3e}")
        assert diff > 1e-3, name
    ref = variant_logits(run, activation_function="gelu")
    diff = float((ref - run.logits).abs().max())
    acts = [(i, layer.mlp.act) for i, layer in enumerate(model.transformer.h)]
    pre = torch.cat([args[0].flatten() for args, _ in capture(model, input_ids, acts).values()])
    gap = float((torch.nn.functional.gelu(pre, approximate="tanh") - torch.nn.functional.gelu(pre)).abs().max())
    print(
        f"  max|logits - logits(activation_function='gelu', exact erf)| = {diff:.3e} "
        f"(MLP pre-activations in [{float(pre.min()):.3f}, {float(pre.max()):.3f}], std {float(pre.std()):.3f}; "
        f"max|gelu_new - gelu| on them {gap:.3e})"
    )
    assert diff > 1e-5, "gelu vs gelu_new not resolved (parity TOL is 2e-6)"


CASES = (
    Case(
        "gpt2",
        GPT2Config,
        GPT2LMHeadModel,
        dict(
            vocab_size=VOCAB,
            n_embd=64,
            n_head=4,  # head_dim 16
            n_layer=3,
            n_inner=256,  # explicit (= 4 * n_embd)
            n_positions=64,
            layer_norm_epsilon=1e-5,
            activation_function="gelu_new",  # tanh approximation
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False,
            reorder_and_upcast_attn=False,
            tie_word_embeddings=True,
        ),
        checks=(_check,),
        randomize=_randomize,
    ),
)
