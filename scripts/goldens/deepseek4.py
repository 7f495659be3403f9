"""DeepSeek-V4 case ``deepseek4`` (S=160): sliding / CSA / HCA layers, hash + top-k MoE, mHC, sinks, no YaRN;
model.safetensors uses upstream names (reverse mapping). Plus a YaRN variant (same weights / input_ids, yarn on the
"compress" rope only): ``config_yarn.json`` and ``golden_yarn.safetensors``."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from goldens.harness import (
    EXPERTS_IMPL,
    MIN_ROUTING_GAP,
    VOCAB,
    Case,
    Run,
    assert_reproduces,
    capture,
    diff_by_position,
    first_diff,
    logits,
    redraw_hash_table,
    reload,
    save_fused,
    variant,
    variant_logits,
    write_golden,
)

# Parameters / buffers that HF initialises to constants (0 or 1): redrawn from this seed.
DS4_EXTRA_SEED = 5678
# YaRN variant (config_yarn.json / golden_yarn.safetensors): same weights and input_ids, flat
# yarn dict -> DeepseekV4Config.__post_init__ puts it on the "compress" rope only (CSA / HCA attention,
# compressor, indexer) with attention_factor forced to 1.0; sliding layers keep the plain "main" rope.
# original_max_position_embeddings 256 (= max_position_embeddings 4096 / factor 16, so HF does not warn)
# puts the 4 compress frequencies (theta 1.6e5, 8 rotated dims) at: 0 kept, 1 in the ramp (weight 1/2),
# 2 and 3 divided by 16. (64 would divide 1..3 by 16 and leave no frequency inside the ramp.)
DS4_YARN = {
    "rope_type": "yarn",
    "factor": 16.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}

_RENAMES = [  # HF module key fragment -> key fragment written by save_pretrained (upstream hub names)
    (".self_attn.compressor.indexer.position_bias", ".attn.indexer.compressor.ape"),
    (".self_attn.compressor.indexer.kv_proj.", ".attn.indexer.compressor.wkv."),
    (".self_attn.compressor.indexer.gate_proj.", ".attn.indexer.compressor.wgate."),
    (".self_attn.compressor.indexer.kv_norm.", ".attn.indexer.compressor.norm."),
    (".self_attn.compressor.indexer.q_b_proj.", ".attn.indexer.wq_b."),
    (".self_attn.compressor.indexer.scorer.weights_proj.", ".attn.indexer.weights_proj."),
    (".self_attn.compressor.position_bias", ".attn.compressor.ape"),
    (".self_attn.compressor.kv_proj.", ".attn.compressor.wkv."),
    (".self_attn.compressor.gate_proj.", ".attn.compressor.wgate."),
    (".self_attn.compressor.kv_norm.", ".attn.compressor.norm."),
    (".self_attn.sinks", ".attn.attn_sink"),
    (".self_attn.q_a_proj.", ".attn.wq_a."),
    (".self_attn.q_a_norm.", ".attn.q_norm."),
    (".self_attn.q_b_proj.", ".attn.wq_b."),
    (".self_attn.kv_proj.", ".attn.wkv."),
    (".self_attn.kv_norm.", ".attn.norm."),
    (".self_attn.o_a_proj.", ".attn.wo_a."),
    (".self_attn.o_b_proj.", ".attn.wo_b."),
    (".input_layernorm.", ".attn_norm."),
    (".post_attention_layernorm.", ".ffn_norm."),
    (".attn_hc.", ".hc_attn_"),
    (".ffn_hc.", ".hc_ffn_"),
    (".mlp.gate.e_score_correction_bias", ".ffn.gate.bias"),
    (".mlp.gate.", ".ffn.gate."),
    (".mlp.shared_experts.gate_proj.", ".ffn.shared_experts.w1."),
    (".mlp.shared_experts.up_proj.", ".ffn.shared_experts.w3."),
    (".mlp.shared_experts.down_proj.", ".ffn.shared_experts.w2."),
    (".mlp.experts.", ".ffn.experts."),  # fused gate_up_proj / down_proj: split per expert into w1, w3 / w2
]


def _hub_name(key: str) -> str:
    if key == "lm_head.weight":
        return "head.weight"
    for a, b in _RENAMES:
        if a in key:
            return key.replace(a, b)
    return key


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    """HF initialises sinks, mHC base/scale, compressor position biases and the hash
    table ``tid2eid`` to constants (0 / 1); give them non-trivial values."""
    gen = torch.Generator().manual_seed(DS4_EXTRA_SEED)

    def randn(t):
        return torch.randn(t.shape, generator=gen, dtype=torch.float32)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "sinks":
            p.copy_(0.5 * randn(p))
        elif leaf in ("base", "hc_base") or leaf == "position_bias":
            p.copy_(0.1 * randn(p))
        elif leaf in ("scale", "hc_scale"):
            p.copy_(1.0 + 0.1 * randn(p))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):  # [V, k] token -> k distinct experts
            redraw_hash_table(b, model.config.n_routed_experts, gen)


@torch.no_grad()
def _check_indexer_margins(model: torch.nn.Module, input_ids: torch.Tensor) -> None:
    """No (near-)tie between the k-th and (k+1)-th visible indexer score: torch.topk's tie order
    is unspecified, so a tie would make the golden depend on it."""
    scorers = []
    for i, layer in enumerate(model.model.layers):
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            scorers.append((i, comp.indexer.scorer))
    scores = [out.float() for _, out in capture(model, input_ids, scorers).values()]
    k, rate = model.config.index_topk, model.config.compress_rates["compressed_sparse_attention"]
    worst = float("inf")
    for sc in scores:
        seq = sc.shape[1]
        for t in range(seq):
            visible = (t + 1) // rate
            if visible <= k:
                continue
            top = torch.sort(sc[:, t, :visible], dim=-1, descending=True).values
            worst = min(worst, float((top[:, k - 1] - top[:, k]).min()))
    print(f"  indexer: smallest gap between the k-th and (k+1)-th visible score: {worst:.3e}")
    assert worst > 1e-6, "indexer top-k has a (near-)tie; change the seed or the indexer size"


@torch.no_grad()
def check_top_k(run: Run) -> None:
    """Refuse near-ties at the k-th choice of every top-k: the indexer's and the top-k routers'
    (``sqrtsoftplus(logits) + e_score_correction_bias``; the hash-routed layer has no choice)."""
    _check_indexer_margins(run.model, run.input_ids)
    cfg = run.model.config
    k = cfg.num_experts_per_tok
    routers = [(i, layer.mlp.gate) for i, layer in enumerate(run.model.model.layers) if not layer.mlp.is_hash]
    for i, (_, (rlogits, _, indices)) in sorted(capture(run.model, run.input_ids, routers).items()):
        gate = run.model.model.layers[i].mlp.gate
        choice = gate.score_fn(rlogits.float()) + gate.e_score_correction_bias
        top = choice.topk(k + 1, dim=-1)
        assert torch.equal(top.indices[:, :k].sort(-1).values, indices.sort(-1).values), "router re-derivation differs"
        margin = float((top.values[:, k - 1] - top.values[:, k]).min())
        print(f"  layer {i} router: sqrtsoftplus + bias, top-{k}; min gap k-th vs (k+1)-th {margin:.3e}")
        assert margin > MIN_ROUTING_GAP, "routing too close to a tie for a float32 parity test"


@torch.no_grad()
def _check(run: Run) -> None:
    cfg = run.model.config
    print(f"  layer_types: {cfg.layer_types}; mlp_layer_types: {cfg.mlp_layer_types}")
    print(f"  compress_rates: {cfg.compress_rates}; qk_rope_head_dim {cfg.qk_rope_head_dim}")
    print(f"  rope_parameters: {cfg.rope_parameters}")
    rot = run.model.model.rotary_emb
    for k in sorted(vars(rot)):
        if "attention_scaling" in k or k == "rope_type":
            print(f"    rotary {k}: {getattr(rot, k)}")
    for name, buf in rot.named_buffers():
        if "original" not in name:
            print(f"    rotary {name}: {[f'{x:.4e}' for x in buf.float().tolist()]}")
    check_top_k(run)
    for name, over in (
        ("index_topk=64 (all entries)", dict(index_topk=64)),
        ("routed_scaling_factor=1.0", dict(routed_scaling_factor=1.0)),
        ("swiglu_limit=10.0", dict(swiglu_limit=10.0)),
        ("hc_sinkhorn_iters=1", dict(hc_sinkhorn_iters=1)),
    ):
        diff = diff_by_position(run.logits, variant_logits(run, **over))
        print(f"  vs {name}: max diff {float(diff.max()):.3e} (first differing position {first_diff(diff)})")


def _fused_check(run: Run) -> None:
    """``save_fused`` (hub keys renamed), then print the full key correspondence."""
    fused, _ = save_fused(run)
    cfg = run.model.config
    for layer in range(cfg.num_hidden_layers):
        tag = f"layers.{layer}."
        print(
            f"  layer {layer} ({cfg.layer_types[layer]}, {cfg.mlp_layer_types[layer]}): "
            "fused (state_dict) key -> save_pretrained key [shape]"
        )
        for key in sorted(fused):
            if tag in key:
                hk = _hub_name(key) if ".experts." not in key else "(per expert: ffn.experts.{e}.w1/w3/w2)"
                print(f"    {key:62s} -> {hk:50s} {list(fused[key].shape)} {str(fused[key].dtype)[6:]}")
    for key in sorted(fused):
        if "layers." not in key:
            print(f"    {key:62s} -> {_hub_name(key):50s} {list(fused[key].shape)}")
    print("  fused check: == hub weights (renamed; gate_up_proj[e] = cat(w1_e, w3_e)), logits bit-identical")


@torch.no_grad()
def _yarn_variant(run: Run) -> None:
    """Same weights / input_ids with YaRN on the compress rope: writes config_yarn.json (what
    ``save_pretrained`` writes for that config) and golden_yarn.safetensors, then checks them."""
    model, d, input_ids, case = run.model, run.dir, run.input_ids, run.case
    ymodel = variant(run, rope_parameters=dict(DS4_YARN))
    ycfg = ymodel.config
    comp, main = ycfg.rope_parameters["compress"], ycfg.rope_parameters["main"]
    print(f"  yarn variant: rope_parameters['compress'] = {comp}")
    print(f"                rope_parameters['main']     = {main}")
    assert comp["rope_type"] == "yarn" and comp["attention_factor"] == 1.0
    assert main == model.config.rope_parameters["main"], "yarn must not touch the main (sliding) rope"

    rot, rot0 = ymodel.model.rotary_emb, model.model.rotary_emb
    inv, inv0 = rot.compress_inv_freq.float(), rot0.compress_inv_freq.float()
    dim, theta, factor = ycfg.qk_rope_head_dim, comp["rope_theta"], comp["factor"]
    assert torch.equal(inv0, 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)))
    print(f"  compress rope (theta {theta:g}, {dim} rotated dims; i: default -> yarn inv_freq, ratio, wavelength):")
    for j, (a, b) in enumerate(zip(inv0.tolist(), inv.tolist())):
        print(f"    {j}: {a:.6e} -> {b:.6e}  ({a / b:7.4f}x)  {2 * math.pi / a:10.1f}")
    print(
        f"  attention_scaling (cos/sin factor): compress {rot.compress_attention_scaling} "
        f"(default rope {rot0.compress_attention_scaling}), main {rot.main_attention_scaling}; "
        f"softmax scale {ymodel.model.layers[1].self_attn.scaling} = head_dim^-0.5 (no mscale)"
    )
    assert rot.compress_attention_scaling == 1.0 and rot.main_attention_scaling == 1.0
    assert torch.equal(rot.main_inv_freq, rot0.main_inv_freq)
    assert ymodel.model.layers[1].self_attn.scaling == model.model.layers[1].self_attn.scaling
    for name, m in ymodel.named_modules():  # compressor / indexer rotaries get the same yarn frequencies
        if name != "model.rotary_emb" and name.endswith("rotary_emb"):
            assert torch.equal(m.compress_inv_freq, rot.compress_inv_freq), name
    ratio = inv0 / inv
    kept, full = (ratio - 1).abs() < 1e-6, (ratio - factor).abs() < 1e-3
    ramp = ~kept & ~full
    print(f"  yarn: {int(kept.sum())} kept, {int(ramp.sum())} in the ramp, {int(full.sum())} divided by {factor:g}")
    assert kept.any() and full.any() and ramp.any(), "yarn must change some, not all, compress frequencies"

    _check_indexer_margins(ymodel, input_ids)
    ylogits = logits(ymodel, input_ids)
    assert ylogits.shape == run.logits.shape and ylogits.dtype == torch.float32
    diff = diff_by_position(ylogits, run.logits)
    print(
        f"  yarn vs default-rope golden: max diff {float(diff.max()):.3e} "
        f"(first differing position {first_diff(diff)}; max diff at positions < 16: {float(diff[:16].max()):.3e})"
    )
    assert float(diff.max()) > 1e-3, "yarn on the compress rope has no visible effect"

    with tempfile.TemporaryDirectory() as tmp:  # config.json exactly as save_pretrained writes it
        ymodel.save_pretrained(tmp, safe_serialization=True)
        assert (Path(tmp) / "model.safetensors").read_bytes() == (d / "model.safetensors").read_bytes()
        shutil.copyfile(Path(tmp) / "config.json", d / "config_yarn.json")
    write_golden(d / "golden_yarn.safetensors", input_ids, ylogits)
    base_json = json.loads((d / "config.json").read_text())
    yarn_json = json.loads((d / "config_yarn.json").read_text())
    assert {k for k in base_json.keys() | yarn_json.keys() if base_json.get(k) != yarn_json.get(k)} == {"rope_parameters"}
    assert yarn_json["rope_parameters"]["main"] == base_json["rope_parameters"]["main"]
    assert case.config_cls.from_json_file(str(d / "config_yarn.json")).rope_parameters == ycfg.rope_parameters

    # Reload config_yarn.json (as config.json) + model.safetensors with from_pretrained: bit-identical.
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(d / "config_yarn.json", Path(tmp) / "config.json")
        shutil.copyfile(d / "model.safetensors", Path(tmp) / "model.safetensors")
        reloaded = reload(case, tmp)
    assert reloaded.config._experts_implementation == EXPERTS_IMPL
    assert reloaded.config.rope_parameters == ycfg.rope_parameters
    assert_reproduces(reloaded, d / "golden_yarn.safetensors", input_ids, f"{case.name}: yarn reload")
    print("  yarn reload check (config_yarn.json + model.safetensors): logits bit-identical")


CASES = (
    Case(
        "deepseek4",
        DeepseekV4Config,
        DeepseekV4ForCausalLM,
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=4,
            layer_types=[
                "sliding_attention",  # compress ratio 0
                "compressed_sparse_attention",  # ratio 4 (CSA, with indexer)
                "heavily_compressed_attention",  # ratio 128 (HCA)
                "compressed_sparse_attention",
            ],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],  # num_hash_layers = 1
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            partial_rotary_factor=0.25,  # qk_rope_head_dim 8
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=16,
            moe_intermediate_size=16,  # routed and shared experts (keeps the files < 1.5 MB)
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            scoring_func="sqrtsoftplus",
            norm_topk_prob=True,
            routed_scaling_factor=1.5,
            swiglu_limit=0.5,
            sliding_window=16,
            index_n_heads=16,  # with 4 heads, relu zeroes whole scores often and exact ties decide the top-k
            index_head_dim=16,
            index_topk=8,  # < 40 compressed entries at S=160
            hc_mult=4,
            hc_sinkhorn_iters=20,
            hc_eps=1e-6,
            rope_theta=10000.0,
            compress_rope_theta=160000.0,
            rope_parameters={"rope_type": "default"},  # no YaRN on the compressed layers
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            attention_bias=False,
            tie_word_embeddings=False,
        ),
        checks=(_check, _fused_check, _yarn_variant),
        moe=True,
        seq_len=160,  # HCA windows of 128 must close
        tie_checks=(check_top_k,),
        adversarial_seq_len=157,  # one HCA window of 128 closes; 39 CSA entries of 4, the last one incomplete
        adversarial_window=13,
        randomize=_randomize,
        hub_name=_hub_name,
        hub_experts=("w1", "w3", "w2"),
        versions={"deepseek4_extra_seed": DS4_EXTRA_SEED},
    ),
)
