"""MaxText checkpoints in and out (``convert/maxtext.py``), on checkpoints MaxText 0.2.5 wrote.

The assets (tests/assets/maxtext/checkpoints/README.md says how each was made) hold tiny
Llama 2, Mistral, Mixtral, DeepSeek-V3 (with MTP), Gemma, Gemma 2, Gemma 3, Qwen2, Qwen3, Qwen3-MoE, Qwen3-Next, Qwen3.5, OLMo 3,
GPT-3, GPT-OSS, Llama 4 and DeepSeek-V4 models and MaxText's toy blocks simple / simple_mlp (no HF counterpart: these logits are their reference),
scanned and unscanned, and MaxText's logits on fixed tokens from each (DeepSeek: MaxText's eager forward fails on CPU,
so its logits are checked on the reference runs' initial checkpoints, tests/assets/maxtext/reference).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxtron.cli import main
from nnxtron.config.loader import load_config
from nnxtron.config.stacks import layer_counts
from nnxtron.convert import maxtext_tree
from nnxtron.convert.maxtext import (
    checkpoint_config,
    from_maxtext,
    load_maxtext_model,
    read_maxtext_checkpoint,
    to_maxtext,
    write_maxtext_checkpoint,
)
from nnxtron.convert.runs import load_model
from nnxtron.errors import CheckpointError, ConfigError
from nnxtron.models.build import build_model
from nnxtron.params import flatten, unstack_layers
from tests.helpers import forward_logits

ASSETS = Path(__file__).parents[1] / "assets" / "maxtext" / "checkpoints"
CONFIGS = json.loads((ASSETS / "configs.json").read_text())
NAMES = sorted(p.name for p in ASSETS.iterdir() if p.is_dir())
WITH_LOGITS = [n for n in NAMES if (ASSETS / n / "logits.npy").is_file()]
REFERENCE = ASSETS.parent / "reference"
REFERENCE_SKIPPED = ("steps=", "learning_rate=", "dataset_type=", "per_device", "max_target", "sparse_matmul", "megablox")
TOKENS = ((jnp.arange(16, dtype=jnp.int32) * 7 + 3) % 32).reshape(2, 8)  # maxtext_logits.py's tokens
# measured: 6e-7 to 8e-7 (float32 on CPU; same function, different op order)
LOGITS_ATOL = 5e-6
# 8 layers, sandwich norms: measured 1.5e-6 (scanned), 6.0e-6 (unscanned; 3e-7 at position 0) alone, and 1.24e-5
# (unscanned) in a full CI run (float32, another op order than MaxText's)
GEMMA3_LOGITS_ATOL = 3e-5
# Qwen3-Next (4 layers): measured 3.4e-6 (scanned) / 3.9e-6 (unscanned) from MaxText's forward, but nnxtron's own
# scanned and unrolled forwards of the same weights differ by up to 3.0e-6 (one layout against MaxText: 5.7e-6; at 6
# layers 9.7e-6): the DeltaNet recurrence through L2-normalised keys amplifies float32 reordering, and MaxText's chunked
# delta rule (jax_chunk_gated_delta_rule) orders its ops otherwise than nnxtron's (HF's torch_chunk_gated_delta_rule).
# A misplaced weight moves them by far more (conv taps reversed: 2.9)
QWEN3_NEXT_LOGITS_ATOL = 1e-5
# Qwen3.5 (Qwen3-Next's layers; 4 layers, 2 key / 4 value heads): measured 9.5e-7 (scanned) and, unscanned, 1.3e-5 alone /
# 2.2e-5 under the suite's XLA flags from MaxText's forward — all of it at one token (row 1, the last), <= 1.0e-6
# elsewhere; nnxtron's two layouts of those weights agree to 7e-7. That token is ill-conditioned: a 3e-8 relative nudge
# of the embedding table moves nnxtron's own logits there by 1.8e-5..4.4e-5 (8e-7 elsewhere), so MaxText's other op
# order (its chunked delta rule) lands that far off. A misplaced channel group moves them by far more (query and key
# groups swapped: 2.6 / 3.9; b and a swapped: 0.27 / 0.75)
QWEN3_5_LOGITS_ATOL = 1e-4
# Gemma 4 (8 layers; sandwich norms, the experts' own norms and the value norm each renormalise a small output, as
# Gemma 3's): measured 4.9e-6 (scanned) from MaxText's forward, logits up to 3.1; a misplaced weight moves them by
# far more (see the gemma4 mutants)
GEMMA4_LOGITS_ATOL = 3e-5
MAXTEXT_BASE = str(ASSETS.parent / "base.yml")  # MaxText 0.2.5's base.yml


def keys(name: str, **extra: str) -> list[str]:
    family, layout = name.rsplit("_", 1)
    values = [*CONFIGS[family], f"scan_layers={'true' if layout == 'scanned' else 'false'}"]
    return values + [f"{k}={v}" for k, v in extra.items()]


def config(name: str, **extra: str):
    return checkpoint_config(None, keys(name, **extra))


def logits(name: str, **extra: str) -> np.ndarray:
    return np.asarray(forward_logits(load_maxtext_model(ASSETS / name, config(name, **extra)), TOKENS))


def test_every_family_and_layout_has_an_asset():
    """Every family has a MaxText map and a checkpoint MaxText wrote, scanned and unscanned."""
    from nnxtron.models.registry import FAMILIES

    families = {n.rsplit("_", 1)[0] for n in NAMES}
    assert set(CONFIGS) == families
    assert all(f"{f}_{s}" in NAMES for f in families for s in ("scanned", "unscanned"))
    covered = {config(f"{f}_scanned").decoder_block for f in families}
    assert covered == {name for name, family in FAMILIES.items() if family.maxtext is not None}
    assert set(FAMILIES) - covered == set()  # every family converts (Qwen3.5, the last one: models/qwen3_5_maxtext.py)


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_is_byte_exact(name, tmp_path):
    cfg = config(name)
    stored = read_maxtext_checkpoint(ASSETS / name)
    params, state = from_maxtext(stored, cfg)
    out = write_maxtext_checkpoint(to_maxtext(params, cfg, scanned=cfg.scan_layers, state=state), tmp_path / "out")
    assert out == tmp_path / "out" / "0" / "items"
    back = read_maxtext_checkpoint(tmp_path / "out")
    assert sorted(back) == sorted(stored)
    one = np.float32(1)
    for key, value in stored.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape, key
        if name.startswith("gpt3") and key.endswith("norm/scale"):
            # MaxText's GPT-3 LayerNorm multiplies by 1 + s; nnxtron (and HF) hold that float32 product,
            # so s comes back within an ulp of 1 (up to 2e-8 here): the multiplier itself is bit-exact
            assert (back[key] + one).tobytes() == (value + one).tobytes(), key
            assert np.abs(back[key] - value).max() <= 3e-8, key
            continue
        assert back[key].tobytes() == value.tobytes(), key


@pytest.mark.parametrize("name", [n for n in WITH_LOGITS if not n.startswith("gemma3")])
def test_logits_equal_maxtexts(name):
    got = logits(name)
    want = np.load(ASSETS / name / "logits.npy")
    bounds = {"qwen3_next": QWEN3_NEXT_LOGITS_ATOL, "qwen3_5": QWEN3_5_LOGITS_ATOL, "gemma4": GEMMA4_LOGITS_ATOL}
    bound = bounds.get(name.rsplit("_", 1)[0], LOGITS_ATOL)
    assert np.abs(got - want).max() <= bound


@pytest.mark.parametrize("name", ["llama2_scanned", "mixtral_unscanned", "gemma_unscanned"])
def test_hf_meaning_query_kernels_give_the_same_logits(name):
    """query_pre_attn_scalar=0: kernels rescaled by sqrt(head_dim) (MaxText folds 1/sqrt(head_dim) in)."""
    cfg = config(name, query_pre_attn_scalar="0")
    exact = from_maxtext(read_maxtext_checkpoint(ASSETS / name), config(name))[0]
    scaled = from_maxtext(read_maxtext_checkpoint(ASSETS / name), cfg)[0]
    query = [k for k in flatten(exact) if k.endswith("attention/query/kernel")]
    assert query and all(np.array_equal(flatten(scaled)[k], flatten(exact)[k] * 2.0) for k in query)  # head_dim 4
    got = logits(name, query_pre_attn_scalar="0")
    assert np.abs(got - np.load(ASSETS / name / "logits.npy")).max() <= LOGITS_ATOL


def gemma3_maxtext_config(name: str, *extra: str):
    """The MaxText config MaxText ran: its base.yml (normalize_embedding_logits=true) and the keys."""
    return checkpoint_config(MAXTEXT_BASE, [*keys(name), *extra])


@pytest.mark.parametrize("name", ["gemma3_scanned", "gemma3_unscanned"])
def test_gemma3_logits_equal_maxtexts(name):
    """MaxText's Gemma 3 config as MaxText ran it: the query scale derived from the overridden
    head_dim (1/sqrt(4), not the preset's 1/sqrt(256)), the tied head's table rounded to bfloat16
    (MaxText's attend_on_embedding, also in float32: tied_head_bf16), logits / sqrt(emb_dim)."""
    cfg = gemma3_maxtext_config(name)
    assert cfg.query_pre_attn_scalar == 4.0 and cfg.tied_head_bf16
    got = np.asarray(forward_logits(load_maxtext_model(ASSETS / name, cfg), TOKENS))
    assert np.abs(got - np.load(ASSETS / name / "logits.npy")).max() <= GEMMA3_LOGITS_ATOL


def test_from_maxtext_defaults_to_maxtexts_head_without_a_maxtext_file():
    """A MaxText checkpoint converted with command-line keys only computes MaxText's function:
    the tied head's bfloat16 table is the default (tied_head_bf16=false keeps HF's head)."""
    assert config("gemma3_scanned").tied_head_bf16
    assert not config("gemma3_scanned", tied_head_bf16="false").tied_head_bf16
    assert not config("llama2_scanned").tied_head_bf16  # untied head: not set


def test_gemma3_head_without_the_bf16_table_is_hfs_not_maxtexts():
    """tied_head_bf16 is read: without it the float32 head differs from MaxText's by ~5e-3."""
    name = "gemma3_scanned"
    cfg = gemma3_maxtext_config(name, "tied_head_bf16=false")
    got = np.asarray(forward_logits(load_maxtext_model(ASSETS / name, cfg), TOKENS))
    assert np.abs(got - np.load(ASSETS / name / "logits.npy")).max() > 1e-3


@pytest.mark.parametrize(
    "model, extra, scalar",
    [
        ("gemma3-4b", [], 256.0),  # the preset's sizes
        ("gemma3-4b", ["override_model_config=true", "head_dim=32"], 32.0),
        ("gemma3-12b", ["override_model_config=true", "head_dim=16"], 16.0),
        (
            "gemma3-27b",
            ["override_model_config=true", "base_emb_dim=512", "base_num_query_heads=4", "base_num_kv_heads=2"],
            128.0,
        ),
        ("gemma3-4b", ["override_model_config=true", "head_dim=32", "query_pre_attn_scalar=8"], 8.0),  # stated: kept
    ],
)
def test_gemma3_query_scale_follows_the_sizes_as_in_maxtext(model, extra, scalar):
    """MaxText's get_query_pre_attn_scalar: head_dim (4b, 12b), emb_dim // query heads (27b)."""
    assert load_config(MAXTEXT_BASE, [f"model_name={model}", *extra]).query_pre_attn_scalar == scalar
    assert load_config(None, [f"model_name={model}", *extra]).query_pre_attn_scalar == scalar


@pytest.mark.parametrize(
    "model, value",
    [("gemma3-4b", "false"), ("gemma3-4b", "true"), ("llama2-7b", "true"), ("llama2-7b", "false")],
)
def test_normalize_embedding_logits_is_honoured(model, value):
    """MaxText's key, both values, every family (was refused where it was not HF's head); MaxText's
    base.yml says true, which a tied MaxText config keeps (MaxText's head: logits / sqrt(emb_dim))."""
    tied = ["override_model_config=true", "logits_via_embedding=true"] if model == "llama2-7b" else []
    cfg = load_config(MAXTEXT_BASE, [f"model_name={model}", *tied, f"normalize_embedding_logits={value}"])
    assert cfg.logits_via_embedding and cfg.normalize_embedding_logits is (value == "true")
    assert load_config(MAXTEXT_BASE, [f"model_name={model}", *tied]).normalize_embedding_logits


@pytest.mark.parametrize("model", ["gpt3-52k", "gpt3-6b", "qwen3-0.6b", "qwen2.5-1.5b"])
def test_a_maxtext_model_config_that_sets_normalize_embedding_logits_wins_over_base_yml(model):
    """MaxText's configs/models/{gpt3-*,qwen3-*,qwen2.5-*}.yml set normalize_embedding_logits: false over
    base.yml's true: a MaxText config of these tied models computes HF's head x @ E^T, as MaxText
    does; setting the key against the model config is MaxText's conflict (override_model_config)."""
    cfg = load_config(MAXTEXT_BASE, [f"model_name={model}"])
    assert cfg.logits_via_embedding and cfg.normalize_embedding_logits is False
    with pytest.raises(ConfigError, match="normalize_embedding_logits"):
        load_config(MAXTEXT_BASE, [f"model_name={model}", "normalize_embedding_logits=true"])
    overridden = ["override_model_config=true", "normalize_embedding_logits=true"]
    assert load_config(MAXTEXT_BASE, [f"model_name={model}", *overridden]).normalize_embedding_logits


@pytest.mark.parametrize("family", ["llama2", "deepseek3", "gemma3", "qwen3_next", "qwen3_5", "gemma4"])
def test_scanned_and_unscanned_layouts_hold_the_same_weights(family):
    name = f"{family}_scanned"
    stored = read_maxtext_checkpoint(ASSETS / name)
    scanned_cfg, unscanned_cfg = config(name), config(name, scan_layers="false")
    scanned = flatten(from_maxtext(stored, scanned_cfg)[0])
    unscanned = flatten(from_maxtext(stored, unscanned_cfg)[0])
    assert {k: v.tobytes() for k, v in unstack_layers(scanned, layer_counts(scanned_cfg)).items()} == {
        k: v.tobytes() for k, v in unscanned.items()
    }
    # MaxText's unscanned names of the same weights read back to the same parameters
    params, state = from_maxtext(stored, scanned_cfg)
    as_unscanned = to_maxtext(params, scanned_cfg, scanned=False, state=state)
    assert not maxtext_tree.is_scanned(as_unscanned)
    assert {k: v.tobytes() for k, v in flatten(from_maxtext(as_unscanned, unscanned_cfg)[0]).items()} == {
        k: v.tobytes() for k, v in unscanned.items()
    }


def test_scan_axis_is_maxtexts_param_scan_axis():
    stored = read_maxtext_checkpoint(ASSETS / "mixtral_scanned")
    assert stored["decoder/layers/MoeBlock_0/wi_0"].shape == (4, 2, 8, 16)  # [experts, layers, emb, mlp]
    assert stored["decoder/layers/pre_self_attention_layer_norm/scale"].shape == (8, 2)


def test_reads_a_training_checkpoint_root_a_step_and_its_items():
    root = ASSETS / "llama2_scanned"
    whole = read_maxtext_checkpoint(root)
    for path in (root / "0", root / "0" / "items"):
        part = read_maxtext_checkpoint(path)
        assert sorted(part) == sorted(whole) and all(np.array_equal(part[k], whole[k]) for k in whole)


def test_deepseek_router_bias_is_model_state_and_mtp_is_converted():
    name = "deepseek3_scanned"
    params, state = from_maxtext(read_maxtext_checkpoint(ASSETS / name), config(name))
    assert set(flatten(state)) == {"moe_layers/layers/mlp/router_bias", "mtp/depths/0/block/mlp/router_bias"}
    assert any(k.startswith("mtp/depths/0/") for k in flatten(params))


@pytest.mark.parametrize("q_lora_rank", [0, 32])
def test_mla_with_and_without_a_query_lora_round_trips(q_lora_rank):
    """MaxText names MLA's query without a LoRA (DeepSeek-V2-Lite) `self_attention/query`,
    nnxtron `attention/wq`: the map used to name a variable nnxtron does not have."""
    cfg = load_config(values={"model_name": "deepseek3-test", "q_lora_rank": q_lora_rank})
    model = build_model(cfg)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    flat = to_maxtext(nnx.to_pure_dict(params), cfg, scanned=True, state=nnx.to_pure_dict(rest))
    back, _ = from_maxtext(flat, cfg)
    assert ("decoder/dense_layers/self_attention/query/kernel" in flat) == (q_lora_rank == 0)
    before, after = flatten(nnx.to_pure_dict(params)), flatten(back)
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)


def test_qwen3_next_remainder_block_round_trips():
    """6 layers = one scanned cycle of 4 and a remainder of 2 DeltaNet layers: MaxText 0.2.5's
    decoder/layers_remainder/local_layers, stacked on axis 1 (the shapes its trainer wrote for this model)."""
    cfg = checkpoint_config(None, [*keys("qwen3_next_scanned"), "base_num_decoder_layers=6"])
    _, shapes, _ = nnx.split(nnx.eval_shape(lambda: build_model(cfg)), nnx.Param, ...)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda v: rng.standard_normal(v.shape).astype(v.dtype), nnx.to_pure_dict(shapes))
    flat = to_maxtext(params, cfg, scanned=True)
    assert flat["decoder/layers/local_layers/input_layernorm/scale"].shape == (8, 1, 3)  # [emb, blocks, position]
    assert flat["decoder/layers/global_layer/input_layernorm/scale"].shape == (8, 1)
    assert flat["decoder/layers_remainder/local_layers/input_layernorm/scale"].shape == (8, 2)
    assert flat["decoder/layers_remainder/local_layers/mlp/routed_experts/wi_0"].shape == (4, 2, 8, 8)
    assert not any(k.startswith("decoder/layers_remainder/global_layer") for k in flat)
    before, after = flatten(params), flatten(from_maxtext(flat, cfg)[0])
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    unscanned = to_maxtext(params, cfg, scanned=False)
    assert maxtext_tree.unscan(flat, cfg).keys() == unscanned.keys()


def _random_params(cfg) -> dict:
    _, shapes, _ = nnx.split(nnx.eval_shape(lambda: build_model(cfg)), nnx.Param, ...)
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda v: rng.standard_normal(v.shape).astype(v.dtype), nnx.to_pure_dict(shapes))


def test_qwen3_5_fused_projections_are_maxtexts_per_key_head_groups():
    """MaxText's in_proj_qkvz [D, Hk W] holds, per key head h, its query, its key, then the values and the gates z of
    its r = Hv / Hk value heads; in_proj_ba [D, Hk 2 r] its r b's, then its r a's (MaxText's Qwen3NextGatedDeltaNet).
    nnxtron's split kernels hold all queries, all keys, all values; z, b and a per value head h r + j. Read
    independently of the conversion's code, on the checkpoint MaxText wrote (2 key heads, 2 value heads each)."""
    name = "qwen3_5_unscanned"
    cfg = config(name)
    stored = read_maxtext_checkpoint(ASSETS / name)
    params = flatten(from_maxtext(stored, cfg)[0])
    hk, r, dk, dv = 2, 2, 4, 4
    width = 2 * dk + 2 * r * dv
    qkvz, ba = stored["decoder/layers_0/attention/in_proj_qkvz/kernel"], stored["decoder/layers_0/attention/in_proj_ba/kernel"]
    assert qkvz.shape == (8, hk * width) and ba.shape == (8, hk * 2 * r)
    paths = {e.maxtext: e.path for e in maxtext_tree.entries(cfg)}  # nnxtron's names of layer 0's split kernels
    qkv, z, b, a = (params[paths[f"decoder/layers_0/attention/in_proj_{n}/kernel"]] for n in ("qkv", "z", "b", "a"))
    for h in range(hk):
        group = qkvz[:, h * width : (h + 1) * width]
        assert np.array_equal(qkv[:, h * dk : (h + 1) * dk], group[:, :dk])
        assert np.array_equal(qkv[:, hk * dk + h * dk : hk * dk + (h + 1) * dk], group[:, dk : 2 * dk])
        for j in range(r):
            value, gate = (
                group[:, 2 * dk + j * dv : 2 * dk + (j + 1) * dv],
                group[:, 2 * dk + (r + j) * dv : 2 * dk + (r + j + 1) * dv],
            )
            start = 2 * hk * dk + (h * r + j) * dv
            assert np.array_equal(qkv[:, start : start + dv], value)
            assert np.array_equal(z[:, h * r + j], gate)
            assert np.array_equal(b[:, h * r + j], ba[:, h * 2 * r + j])
            assert np.array_equal(a[:, h * r + j], ba[:, h * 2 * r + r + j])


def test_qwen3_5_nnxtron_to_maxtext_and_back_is_byte_exact():
    """8 layers = 4 scanned blocks of MaxText's Qwen3_5ScannableBlock (decoder/layers/layer_{0,1}, the blocks on
    axis 1), and unscanned; a layer count that is not a multiple of the cycle is refused scanned only."""
    cfg = checkpoint_config(None, [*keys("qwen3_5_scanned"), "base_num_decoder_layers=8"])
    params = _random_params(cfg)
    before = flatten(params)
    for scanned in (True, False):
        flat = to_maxtext(params, cfg, scanned=scanned)
        assert maxtext_tree.is_scanned(flat) == scanned
        after = flatten(from_maxtext(flat, cfg)[0])
        assert before.keys() == after.keys() and all(before[k].tobytes() == after[k].tobytes() for k in before)
    flat = to_maxtext(params, cfg, scanned=True)
    assert flat["decoder/layers/layer_0/attention/in_proj_qkvz/kernel"].shape == (8, 4, 2 * (2 * 4 + 2 * 2 * 4))
    assert flat["decoder/layers/layer_0/attention/conv1d/kernel"].shape == (4, 4, 1, 2 * 2 * 4 + 4 * 4)
    assert flat["decoder/layers/layer_1/attention/attention/query/kernel"].shape == (8, 4, 2, 16)
    assert not any("in_proj_qkv/" in k or "in_proj_z/" in k or k.startswith("decoder/layers_") for k in flat)
    assert maxtext_tree.unscan(flat, cfg).keys() == to_maxtext(params, cfg, scanned=False).keys()
    five = checkpoint_config(None, [*keys("qwen3_5_unscanned"), "base_num_decoder_layers=5"])
    params = _random_params(five)
    with pytest.raises(CheckpointError, match="whole blocks of 2 layers"):
        to_maxtext(params, five, scanned=True)
    unscanned = to_maxtext(params, five, scanned=False)  # layer 3: full attention, layer 4: Gated DeltaNet
    assert {"decoder/layers_3/attention/attention/query/kernel", "decoder/layers_4/attention/in_proj_qkvz/kernel"} <= set(
        unscanned
    )
    before, after = flatten(params), flatten(from_maxtext(unscanned, five)[0])
    assert before.keys() == after.keys() and all(before[k].tobytes() == after[k].tobytes() for k in before)


def reference_config(family: str):
    overrides = json.loads((REFERENCE / "manifest.json").read_text())["families"][family]["overrides"]
    keys = [k for k in overrides if not k.startswith(REFERENCE_SKIPPED)]
    return checkpoint_config(str(ASSETS.parent / "base.yml"), keys)


@pytest.mark.parametrize("family", ["deepseek3", "llama2", "mixtral"])
def test_reference_checkpoints_give_maxtexts_logits_and_round_trip(family, tmp_path):
    """MaxText's param-only checkpoints (save_params_to_path; DeepSeek's router bias in its
    params/MoEBiasVar collection) of the reference runs, with MaxText base.yml configs."""
    cfg = reference_config(family)
    source = REFERENCE / family / "initial_checkpoint"
    stored = read_maxtext_checkpoint(source)
    data = np.load(REFERENCE / family / "logits.npz")
    model = load_maxtext_model(source, cfg)
    out = model(jnp.asarray(data["inputs"]), jnp.asarray(data["inputs_position"]), jnp.asarray(data["inputs_segmentation"]))
    assert np.abs(np.asarray(out.logits) - data["logits"]).max() <= LOGITS_ATOL  # measured 1.2e-6 .. 1.7e-6
    params, state = from_maxtext(stored, cfg)
    write_maxtext_checkpoint(to_maxtext(params, cfg, scanned=True, state=state), tmp_path)
    back = read_maxtext_checkpoint(tmp_path)
    assert sorted(back) == sorted(stored) and all(back[k].tobytes() == stored[k].tobytes() for k in stored)


def _copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ASSETS / name, tmp_path / name))


@pytest.mark.parametrize(
    "name, extra, fragment",
    [
        ("llama2_scanned", {"base_emb_dim": "16"}, "has shape"),  # another model (sizes)
        ("llama2_scanned", {"base_num_decoder_layers": "3"}, "lacks"),
        ("mixtral_scanned", {"num_experts": "1", "num_experts_per_tok": "1"}, "lacks"),  # another model (names)
        ("llama2_unscanned", {"base_num_decoder_layers": "1"}, "does not use"),
        ("deepseek3_unscanned", {"mtp_num_layers": "0"}, "does not use"),
        ("qwen3_next_unscanned", {"gdn_value_head_dim": "8"}, "has shape"),  # a flat DeltaNet kernel of other heads
        ("qwen3_next_scanned", {"base_num_decoder_layers": "8"}, "lacks"),
        ("qwen3_5_unscanned", {"gdn_value_head_dim": "8"}, "has shape"),  # fused DeltaNet kernels of other heads
        ("qwen3_5_scanned", {"base_num_decoder_layers": "5"}, "whole blocks"),  # MaxText would drop the 5th layer
    ],
)
def test_a_checkpoint_of_another_model_is_refused(name, extra, fragment):
    with pytest.raises(CheckpointError, match=fragment):
        from_maxtext(read_maxtext_checkpoint(ASSETS / name), config(name, **extra))


def _damage_metadata(path: Path) -> None:
    meta = path / "items" / "_METADATA"
    meta.write_text(meta.read_text()[:-40])


def _drop_data(path: Path) -> None:
    for data in (path / "items").rglob("d/*"):
        data.unlink()


def _flip_manifest(path: Path) -> None:
    for manifest in (path / "items").rglob("manifest.ocdbt"):
        data = bytearray(manifest.read_bytes())
        data[len(data) // 2] ^= 0xFF
        manifest.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_damage_metadata, _drop_data, _flip_manifest])
def test_a_damaged_checkpoint_is_one_error(damage, tmp_path, capsys):
    source = _copy("mistral_unscanned", tmp_path)
    damage(source)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    code = main(["convert", "from-maxtext", str(source), str(tmp_path / "out"), *keys("mistral_unscanned")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("WARNING:absl")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine" and not (tmp_path / "out" / "config.yml").exists()


def test_not_a_checkpoint_and_nnxtron_checkpoints_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no MaxText checkpoint"):
        read_maxtext_checkpoint(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="not a directory"):
        read_maxtext_checkpoint(tmp_path / "missing")
    run = tmp_path / "run"
    assert main(["convert", "from-maxtext", str(ASSETS / "llama2_scanned"), str(run), *keys("llama2_scanned")]) == 0
    for path in (run, run / "checkpoints", run / "checkpoints" / "0", run / "checkpoints" / "0" / "params"):
        with pytest.raises(CheckpointError, match="nnxtron checkpoint, not a MaxText one"):
            read_maxtext_checkpoint(path)
    with pytest.raises(CheckpointError, match="already holds step 0"):
        write_maxtext_checkpoint({"a": np.zeros(1)}, ASSETS / "llama2_scanned")


def test_cli_from_maxtext_then_load_train_and_back(tmp_path):
    name = "mixtral_scanned"
    run = tmp_path / "run"
    assert main(["convert", "from-maxtext", str(ASSETS / name), str(run), *keys(name)]) == 0
    # what `nnxtron generate RUN` loads (its 32-id vocabulary fits no tokenizer, so not sampled here)
    got = np.asarray(forward_logits(load_model(run), TOKENS))
    assert np.abs(got - np.load(ASSETS / name / "logits.npy")).max() <= LOGITS_ATOL
    assert main(["convert", "to-maxtext", str(run), str(tmp_path / "mt"), "--unscanned"]) == 0
    back = read_maxtext_checkpoint(tmp_path / "mt")
    assert not maxtext_tree.is_scanned(back)
    stored = maxtext_tree.unscan(read_maxtext_checkpoint(ASSETS / name), load_config(None, keys(name)))
    assert sorted(back) == sorted(stored) and all(back[k].tobytes() == stored[k].tobytes() for k in stored)
    train = ["dataset_type=synthetic", "steps=1", "per_device_batch_size=1", "max_target_length=8", "sample_after_training=0"]
    base = [f"base_output_directory={tmp_path}", "--no-progress"]
    assert main(["train", *train, "run_name=a", f"init_from={run}", *base]) == 0
    assert main(["train", *keys(name), *train, "run_name=b", f"load_parameters_path={ASSETS / name}", *base]) == 0


def test_reads_the_nnx_decode_layout(tmp_path):
    """generate_param_only_checkpoint's layout: the bare tree, every leaf ``{"value": array}``
    (written here with Orbax: MaxText's own tool fails on these tiny checkpoints, README)."""
    import orbax.checkpoint as ocp

    stored = read_maxtext_checkpoint(ASSETS / "llama2_unscanned")
    tree: dict = {}
    for key, value in stored.items():
        node = tree
        for part in key.split("/"):
            node = node.setdefault(part, {})
        node["value"] = value
    with ocp.PyTreeCheckpointer() as writer:
        writer.save(tmp_path / "items", tree)
    back = read_maxtext_checkpoint(tmp_path)
    assert sorted(back) == sorted(stored) and all(np.array_equal(back[k], stored[k]) for k in stored)


@pytest.mark.parametrize("model, scale", [("llama2-tiny", 1.0), ("gemma3-tiny", None)])
def test_tied_head_bf16_is_maxtexts_attend_on_embedding(model, scale):
    """``x @ bf16(E * s)^T / s`` in float32: s = 1, or Gemma's sqrt(emb_dim) MaxText's table holds."""
    from nnxtron.models.build import build_model
    from tests.conftest import tiny_config

    decoder = build_model(tiny_config(model, logits_via_embedding=True, tied_head_bf16=True))
    s = scale or decoder.config.base_emb_dim**0.5
    x = np.random.default_rng(0).normal(size=(1, 3, decoder.config.base_emb_dim)).astype(np.float32)
    table = (np.asarray(decoder.embed.embedding[...], np.float32) * np.float32(s)).astype(jnp.bfloat16)
    want = x.astype(np.float64) @ table.astype(np.float64).T / s
    got = np.asarray(decoder.output_head(jnp.asarray(x)))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    hf = build_model(tiny_config(model, logits_via_embedding=True))  # the same weights (same seed)
    assert np.array_equal(np.asarray(hf.embed.embedding[...]), np.asarray(decoder.embed.embedding[...]))
    plain = np.asarray(hf.output_head(jnp.asarray(x)))
    assert np.abs(plain - want).max() > 1e-4 * np.abs(want).max()  # the float32 table: another function
