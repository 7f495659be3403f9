"""DeepSeek-V3 case ``deepseek3_mtp``: the ``deepseek3`` architecture (model seed 5) with one multi-token
prediction layer, as the hub checkpoint stores it (``num_nextn_predict_layers`` 1, ``model.layers.3.*``).

transformers' ``DeepseekV3ForCausalLM`` has no MTP (it ignores ``model.layers.61.*`` on load and does not
build the layer), so the reference is written here from HF's own modules, following DeepSeek-V3's
definition (the report's section 2.2, and the layer's weight names in the hub checkpoint):

    h_0 = the main model's last hidden state before the final norm
    x   = eh_proj([enorm(embed(tok[t+1])) ; hnorm(h_0[t])])         eh_proj: Linear(2D -> D), no bias
    h_1 = DeepseekV3DecoderLayer(layer_idx 3)(x)                      (MoE: 3 >= first_k_dense_replace)
    mtp_logits[t] = shared_head.head(shared_head.norm(h_1[t]))         head = the model's lm_head

``golden.safetensors`` adds ``mtp_logits`` ([2, 47, 256], positions 0..46: those with a token ahead).
``model.safetensors`` is ``save_pretrained``'s file plus the MTP layer in the hub layout (per-expert
keys), with its copies of ``embed_tokens`` and of the head (``shared_head.head``).
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

from goldens.deepseek3 import DEEPSEEK3_KWARGS, _route, router_check
from goldens.harness import BIAS_SCALE, MIN_ROUTING_GAP, NORM_STD, ROUTER_STD, Case, Run, capture, write_golden

MTP_SEED = 8765
INIT_STD = 0.02  # DeepSeek-V3's initializer_range, as the main layers


def _mtp_modules(config: DeepseekV3Config) -> dict[str, torch.nn.Module]:
    """The MTP layer's modules, initialised like the golden's main layers (norms 1 + 0.1 randn, router
    std 0.1, correction bias 0.05 randn, other weights 0.02 randn)."""
    d = config.hidden_size
    modules = {
        "enorm": DeepseekV3RMSNorm(d, eps=config.rms_norm_eps),
        "hnorm": DeepseekV3RMSNorm(d, eps=config.rms_norm_eps),
        "eh_proj": torch.nn.Linear(2 * d, d, bias=False),
        "layer": DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers),
        "shared_head.norm": DeepseekV3RMSNorm(d, eps=config.rms_norm_eps),
    }
    gen = torch.Generator().manual_seed(MTP_SEED)
    with torch.no_grad():
        for prefix, module in modules.items():
            for name, p in module.named_parameters():
                full = f"{prefix}.{name}"
                if "norm" in full:
                    p.copy_(1.0 + NORM_STD * torch.randn(p.shape, generator=gen))
                elif name == "mlp.gate.weight":
                    p.copy_(ROUTER_STD * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(INIT_STD * torch.randn(p.shape, generator=gen))
            for name, b in module.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(BIAS_SCALE * torch.randn(b.shape, generator=gen))
    for module in modules.values():
        module.to(torch.float32).eval()
    return modules


def _hub_tensors(modules: dict[str, torch.nn.Module], model: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors under hub names: routed experts split per expert, the copies added."""
    tensors: dict[str, torch.Tensor] = {}
    for name, module in modules.items():
        for key, t in module.state_dict().items():
            key = key if name == "layer" else f"{name}.{key}"
            if key.endswith("mlp.experts.gate_up_proj"):  # [E, 2F, D] -> gate_proj / up_proj per expert
                f = t.shape[1] // 2
                for e in range(t.shape[0]):
                    tensors[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = t[e, :f]
                    tensors[f"{prefix}mlp.experts.{e}.up_proj.weight"] = t[e, f:]
            elif key.endswith("mlp.experts.down_proj"):  # [E, D, F]
                for e in range(t.shape[0]):
                    tensors[f"{prefix}mlp.experts.{e}.down_proj.weight"] = t[e]
            else:
                tensors[prefix + key] = t
    tensors[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight
    tensors[prefix + "shared_head.head.weight"] = model.lm_head.weight
    return {k: v.detach().contiguous().clone() for k, v in tensors.items()}


@torch.no_grad()
def mtp_check(run: Run) -> None:
    """Compute the MTP logits, add them to golden.safetensors and the MTP layer to model.safetensors."""
    model, ids = run.model, run.input_ids.long()
    config = model.config
    modules = _mtp_modules(config)
    seq = ids.shape[1]
    hidden = capture(model, run.input_ids, [(0, model.model.norm)])[0][0][0]  # the final norm's input, [B, S, D]
    ahead = model.model.embed_tokens(ids[:, 1:])  # [B, S - 1, D]: tok[t + 1] at t = 0 .. S - 2
    x = modules["eh_proj"](torch.cat([modules["enorm"](ahead), modules["hnorm"](hidden[:, :-1])], dim=-1))
    positions = torch.arange(seq - 1)[None].expand(ids.shape[0], -1)
    cos_sin = model.model.rotary_emb(x, positions)
    causal = torch.full((seq - 1, seq - 1), torch.finfo(torch.float32).min).triu(1)[None, None]
    gate = modules["layer"].mlp.gate
    seen = {}
    hook = gate.register_forward_hook(lambda mod, args, out: seen.__setitem__("x", args[0]))
    try:
        out = modules["layer"](x, attention_mask=causal, position_ids=positions, position_embeddings=cos_sin)
    finally:
        hook.remove()
    out = out[0] if isinstance(out, tuple) else out
    scores = torch.sigmoid(torch.nn.functional.linear(seen["x"].reshape(-1, x.shape[-1]).float(), gate.weight.float()))
    k, groups, kept = config.num_experts_per_tok, config.n_group, config.topk_group
    _, expert_gap, group_gap = _route(scores, gate.e_score_correction_bias, groups, kept, k)
    print(f"  MTP layer router: min gaps expert {expert_gap:.3e}, group {group_gap:.3e}")
    assert min(expert_gap, group_gap) > MIN_ROUTING_GAP, "MTP routing too close to a tie for a float32 parity test"
    mtp_logits = model.lm_head(modules["shared_head.norm"](out)).float()
    print(
        f"  MTP depth 1: logits {list(mtp_logits.shape)}, max|mtp logit| {float(mtp_logits.abs().max()):.4f}, "
        f"max|mtp - main logits at t| {float((mtp_logits - run.logits[:, :-1]).abs().max()):.4f}"
    )
    write_golden(run.dir / "golden.safetensors", run.input_ids, run.logits, mtp_logits=mtp_logits)
    weights = load_file(str(run.dir / "model.safetensors"))
    mtp = _hub_tensors(modules, model, f"model.layers.{config.num_hidden_layers}.")
    assert not set(mtp) & set(weights)
    save_file({**weights, **mtp}, str(run.dir / "model.safetensors"), metadata={"format": "pt"})
    print(
        f"  model.safetensors: {len(weights)} tensors + {len(mtp)} of the MTP layer (model.layers.{config.num_hidden_layers}.*)"
    )


CASES = (
    Case(
        "deepseek3_mtp",
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        dict(DEEPSEEK3_KWARGS, num_nextn_predict_layers=1),
        checks=(router_check, mtp_check),
        moe=True,
        tie_checks=(router_check,),  # no MTP layer: the adversarial file is what transformers saves (mtp_num_layers 0)
        seed=5,
    ),
)
