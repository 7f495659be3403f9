"""nnxtron reproduces the HF transformers forward pass on the golden checkpoints.

Goldens (tests/assets/golden, see its README) are tiny random HF models with float32
logits from transformers 5.24. Measured max |logits - golden| (float32, CPU, jax 0.10.2):

    case                 scan_layers=true  scan_layers=false
    llama2               2.7e-7            2.4e-7
    llama31              2.4e-7            2.4e-7
    mistral              2.8e-7            2.7e-7
    mixtral              2.2e-7
    qwen3                3.6e-7
    qwen3_moe            2.4e-7
    qwen3_moe_norenorm   2.1e-7
    deepseek3            1.8e-7   (MLA + YaRN, dense prefix + MoE stacks, groups + bias)
    gemma3               7.7e-7            8.2e-7   (6-layer pattern block + 2-layer remainder)
    llama4               3.4e-7            3.3e-7   (one 4-layer cycle: chunked, MoE, NoPE)
    gpt2                 2.7e-7            2.5e-7   (decoder_block gpt3 through the GPT-2 adaptor)
    deepseek4            3.0e-7            3.3e-7   (S 160: sliding / CSA + indexer / HCA, hash + top-k MoE, mHC)
    gemma4               1.5e-6            2.0e-6   (against HF float64; HF float32's own error 1.4e-6: below)

(logits are O(1): max |golden| is 0.66-1.24). TOL below leaves ~5x headroom. Gemma 4 normalises every
sublayer's small output (the sandwich norms, the experts' own norms, the value norm): HF's own float32 logits are
1.4e-6 from its float64 ones on its golden, so that golden holds HF's float64 logits too and the bound there is TOL
beyond HF's float32 error, as for the adversarial goldens below. The MoE
cases also load the transformers>=5 fused expert layout (``fused.safetensors``).

The adversarial goldens (``golden/adversarial``, ``scripts/goldens/adversarial.py``) are every
case again with weights x2-3, every 1-D parameter shifted, new correction biases and hash
tables, non-default epsilons, odd lengths (37; deepseek4 157) and windows that do not divide
them. There float32 rounding alone moves HF's own logits by 0.62e-6 (qwen3_moe_dense) to 2.3e-6
(gemma3) from the same model run in float64, so the reference is HF's float64 logits and the
bound is TOL beyond HF's own float32 error on that golden. Measured max |logits - HF float64|,
scan / unrolled, against HF float32's own error:

    case                 scan     unrolled   HF float32
    llama2               6.7e-7   6.9e-7     9.3e-7
    llama31              7.8e-7   6.7e-7     8.2e-7
    mistral              7.0e-7   8.1e-7     9.8e-7
    mixtral              6.9e-7   6.6e-7     7.4e-7
    qwen3                1.0e-6   1.0e-6     1.0e-6
    qwen3_moe            8.8e-7   8.3e-7     1.4e-6
    qwen3_moe_norenorm   9.6e-7   8.7e-7     1.1e-6
    qwen3_moe_dense      6.3e-7   6.8e-7     6.2e-7
    qwen3_moe_prefix     1.0e-6   9.6e-7     1.2e-6
    deepseek3            5.8e-7   6.6e-7     6.6e-7
    deepseek3_mtp        7.3e-7   6.9e-7     7.2e-7   (its adversarial file has no MTP layer)
    gemma3               1.7e-6   2.6e-6     2.3e-6
    llama4               6.6e-7   6.5e-7     7.4e-7
    gpt2                 9.7e-7   9.3e-7     9.1e-7
    deepseek4            1.3e-6   1.4e-6     1.4e-6
    gemma4               2.3e-6   3.0e-6     3.8e-6

nnxtron's float32 forward is about as far from float64 as HF's (TOL 2e-6 alone would fail only
gemma3 unrolled, at 1.3x); the features these goldens break are listed in the mutation script
(``adversarial-only`` mutants), which the plain goldens do not catch.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from nnxtron.convert.hf import from_hf, hf_config_to_nnxtron, to_hf
from nnxtron.models.registry import FAMILIES
from tests.helpers import forward_logits

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "golden"
ADVERSARIAL = GOLDEN / "adversarial"
# every golden the families declare (Family.goldens, in the registry's order); MOE_CASES: those whose fused layout is loaded too
CASES = tuple(golden.name for family in FAMILIES.values() for golden in family.goldens)
MOE_CASES = tuple(golden.name for family in FAMILIES.values() for golden in family.goldens if golden.fused_checked)
TOL = 2e-6


@pytest.fixture(scope="module")
def goldens() -> dict[str, dict[str, np.ndarray]]:
    return {case: load_file(str(GOLDEN / case / "golden.safetensors")) for case in CASES}


def _abs_diff(
    golden: dict[str, np.ndarray], case: str, directory: Path | None = None, reference: str = "logits", **overrides
) -> np.ndarray:
    """|nnxtron logits - golden[reference]| per element, [B, S, V]."""
    model = from_hf(directory or GOLDEN / case, **overrides)
    with jax.default_matmul_precision("highest"):  # no TF32 on accelerators
        logits = forward_logits(model, jnp.asarray(golden["input_ids"]))
    assert logits.dtype == jnp.float32 and logits.shape == golden[reference].shape
    return np.abs(np.asarray(logits, np.float64) - golden[reference])


def _reference(golden: dict[str, np.ndarray]) -> tuple[str, float]:
    """The logits a golden is compared with and the bound: HF's, within TOL; where the golden also holds HF's
    float64 logits (gemma4: every sublayer's small output RMS-normalised, HF's own float32 error 1.4e-6), those,
    within TOL beyond HF's float32 error (as the adversarial goldens)."""
    if "logits_float64" not in golden:
        return "logits", TOL
    return "logits_float64", TOL + float(np.abs(golden["logits"].astype(np.float64) - golden["logits_float64"]).max())


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf(goldens, case: str, scan: bool) -> None:
    reference, bound = _reference(goldens[case])
    diff = float(_abs_diff(goldens[case], case, reference=reference, scan_layers=scan).max())
    assert diff <= bound, f"{case} scan_layers={scan}: max |logits - golden {reference}| = {diff:.3g} > {bound:.3g}"


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("case", CASES)
def test_adversarial_logits_match_hf(case: str, scan: bool) -> None:
    """nnxtron's float32 forward is within TOL of the exact function (HF in float64) beyond HF's own float32 error."""
    golden = load_file(str(ADVERSARIAL / case / "golden.safetensors"))
    hf_float32_error = float(np.abs(golden["logits"] - golden["logits_float64"]).max())
    diff = float(_abs_diff(golden, case, ADVERSARIAL / case, "logits_float64", scan_layers=scan).max())
    bound = TOL + hf_float32_error
    assert diff <= bound, f"adversarial {case} scan_layers={scan}: max |logits - HF float64| = {diff:.3g} > {bound:.3g}"


@pytest.mark.parametrize("case", CASES)
def test_adversarial_goldens_are_adversarial(case: str) -> None:
    """Odd length, windows that do not divide it, non-default epsilons, and weights far from the plain init."""
    import json

    config = json.loads((ADVERSARIAL / case / "config.json").read_text())
    golden = load_file(str(ADVERSARIAL / case / "golden.safetensors"))
    length = golden["input_ids"].shape[1]
    assert length % 2 == 1
    for key in ("sliding_window", "attention_chunk_size"):
        if config.get(key):
            assert length % config[key] and config[key] != json.loads((GOLDEN / case / "config.json").read_text())[key]
    eps = config.get("rms_norm_eps", config.get("layer_norm_epsilon"))
    assert eps == 3e-4
    plain = load_file(str(GOLDEN / case / "model.safetensors"))
    weights = load_file(str(ADVERSARIAL / case / "model.safetensors"))
    matrices = [k for k, v in weights.items() if v.ndim >= 2 and v.dtype == np.float32 and k in plain]
    ratio = np.median([np.std(weights[k]) / np.std(plain[k]) for k in matrices])
    assert 1.8 < ratio < 3.2, ratio


def _mtp_logits(model, golden: dict[str, np.ndarray]) -> tuple[np.ndarray, float]:
    """Depth-1 MTP logits [B, S, V] and nnxtron's MTP loss, the last position without a target."""
    ids = jnp.asarray(golden["input_ids"])
    targets = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)
    loss_mask = jnp.ones(ids.shape, jnp.float32).at[:, -1].set(0.0)
    seen = []
    head = model.output_head
    model.output_head = lambda x: seen.append(head(x)) or seen[-1]  # the MTP depths call the shared head
    with jax.default_matmul_precision("highest"):
        out = model(ids, targets=targets, loss_mask=loss_mask)
    return np.asarray(seen[-1]), float(out.aux["mtp_loss"])


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_deepseek3_mtp_layer_matches_the_reference(goldens, scan: bool) -> None:
    """The hub layout's MTP layer (``model.layers.3``) imports as one MTP depth whose logits and loss
    match the reference built from HF's modules (scripts/goldens/deepseek3_mtp.py); measured 3.0e-7."""
    golden = goldens["deepseek3_mtp"]
    model = from_hf(GOLDEN / "deepseek3_mtp", scan_layers=scan)
    assert model.config.mtp_num_layers == 1
    logits, loss = _mtp_logits(model, golden)
    seq = golden["input_ids"].shape[1]
    diff = float(np.abs(logits[:, : seq - 1] - golden["mtp_logits"]).max())
    assert diff <= TOL, f"MTP logits: max |nnxtron - reference| = {diff:.3g}"
    reference = golden["mtp_logits"][:, : seq - 2].astype(np.float64)  # the positions with a target two ahead
    log_z = np.log(np.exp(reference - reference.max(-1, keepdims=True)).sum(-1)) + reference.max(-1)
    picked = np.take_along_axis(reference, golden["input_ids"][:, 2:, None].astype(np.int64), -1)[..., 0]
    assert abs(loss - float((log_z - picked).mean())) <= TOL * 10


def test_deepseek3_without_mtp_weights_imports_without_mtp(tmp_path: Path) -> None:
    """transformers' save_pretrained drops the MTP layer but keeps num_nextn_predict_layers 1: nnxtron
    then builds no MTP depth (as transformers does), and the export says so."""
    import json

    assert json.loads((GOLDEN / "deepseek3" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    model = from_hf(GOLDEN / "deepseek3")
    assert model.config.mtp_num_layers == 0
    assert json.loads((to_hf(model, tmp_path / "out") / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_an_mtp_layer_with_its_own_head_is_refused(tmp_path: Path) -> None:
    """nnxtron's MTP shares the model's embedding and head; a checkpoint whose MTP layer has another is one line."""
    from safetensors.numpy import save_file

    from nnxtron.errors import CheckpointError

    shutil.copy(GOLDEN / "deepseek3_mtp" / "config.json", tmp_path / "config.json")
    weights = load_file(str(GOLDEN / "deepseek3_mtp" / "model.safetensors"))
    weights["model.layers.3.shared_head.head.weight"] = weights["model.layers.3.shared_head.head.weight"] + 1.0
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="shared_head.head.weight' .* differs from 'lm_head.weight'") as err:
        from_hf(tmp_path)
    assert "\n" not in str(err.value)


def test_mtp_import_and_export_need_a_family_with_hf_mtp(tmp_path: Path) -> None:
    from nnxtron.errors import ConfigError
    from nnxtron.models.build import build_model
    from tests.conftest import tiny_config

    match = "mtp_num_layers=1: HF LlamaForCausalLM has no multi-token prediction"
    with pytest.raises(ConfigError, match=match):
        from_hf(GOLDEN / "llama2", mtp_num_layers=1)
    with pytest.raises(ConfigError, match=match):
        to_hf(build_model(tiny_config("llama2-tiny", mtp_num_layers=1)), tmp_path)
    assert not any(tmp_path.iterdir())  # nothing written


def test_llama3_rope_scaling_is_checked(goldens) -> None:
    """Dropping the llama3 RoPE scaling moves the logits far beyond the tolerance (measured 3.6e-3)."""
    diff = float(_abs_diff(goldens["llama31"], "llama31", rope_type="default").max())
    assert diff > 100 * TOL


def test_sliding_window_is_checked(goldens) -> None:
    """Without mistral's window (8) logits match up to position 7 and differ after (measured 0.68)."""
    diff = _abs_diff(goldens["mistral"], "mistral", sliding_window_size=0).max(axis=(0, 2))
    assert diff[:8].max() <= TOL
    assert diff[8:].min() > 100 * TOL


@pytest.mark.parametrize("case", MOE_CASES)
def test_fused_expert_layout_matches_hf(goldens, tmp_path: Path, case: str) -> None:
    """The transformers>=5 in-memory layout (experts fused into gate_up_proj/down_proj) loads too."""
    (tmp_path / case).mkdir()
    shutil.copy(GOLDEN / case / "config.json", tmp_path / case / "config.json")
    shutil.copy(GOLDEN / case / "fused.safetensors", tmp_path / case / "model.safetensors")
    diff = float(_abs_diff(goldens[case], case, tmp_path / case).max())
    assert diff <= TOL, f"{case} fused layout: max |logits - golden| = {diff:.3g} > {TOL}"


def test_deepseek_routing_details_are_checked(goldens) -> None:
    """Group-limited routing, YaRN's softmax mscale and the routed scaling factor each move
    the deepseek3 logits far beyond the tolerance (the golden exercises them: see its README)."""
    for overrides in (
        dict(n_routing_groups=-1, topk_routing_group=-1),
        dict(mscale_all_dim=0.0),
        dict(routed_scaling_factor=1.0),
    ):
        diff = float(_abs_diff(goldens["deepseek3"], "deepseek3", **overrides).max())
        assert diff > 100 * TOL, overrides


def test_qwen3_moe_renormalisation_is_checked(goldens) -> None:
    diff = float(_abs_diff(goldens["qwen3_moe_norenorm"], "qwen3_moe_norenorm", norm_topk_prob=True).max())
    assert diff > 100 * TOL


@pytest.mark.parametrize(
    "case, overrides",
    [
        ("gemma3", dict(final_logits_soft_cap=0.0)),  # measured 7.9e-2
        ("gemma3", dict(local_rope_max_timescale=0.0)),  # sliding layers on the global (scaled) RoPE
        ("gemma3", dict(sliding_window_pattern=3)),  # global every 3rd layer instead of every 6th
        ("gemma3", dict(sliding_window_pattern=1)),  # every layer global
        ("llama4", dict(temperature_tuning=False)),
        ("llama4", dict(chunk_attn_window_size=0)),
        ("llama4", dict(use_qk_norm=False)),
        ("llama4", dict(nope_layer_interval=0, temperature_tuning=False)),  # RoPE on the NoPE layer
        ("llama4", dict(rope_interleave=False)),
        ("deepseek4", dict(indexer_topk=64)),  # every CSA entry visible (measured in HF: 3.4e-1 from position 35)
        ("deepseek4", dict(mlp_activations_limit=10.0)),  # the SwiGLU clamp at 0.5 is active
        ("deepseek4", dict(sinkhorn_iterations=1)),
        ("deepseek4", dict(routed_scaling_factor=1.0)),
        ("deepseek4", dict(compressed_rope_max_timescale=10000.0)),
    ],
    ids=lambda v: v if isinstance(v, str) else ",".join(v),
)
def test_pattern_features_are_checked(goldens, case: str, overrides: dict) -> None:
    """Each family feature the goldens exercise moves the logits far beyond the tolerance."""
    diff = float(_abs_diff(goldens[case], case, **overrides).max())
    assert diff > 100 * TOL, f"{case} {overrides}: {diff:.3g}"


def test_temperature_tuning_starts_at_position_7(goldens) -> None:
    """floor_scale 8: the factor is 1 for positions 0..6, so logits up to position 6 are
    unchanged without it, and differ from position 7 on (NoPE layer 3)."""
    diff = _abs_diff(goldens["llama4"], "llama4", temperature_tuning=False).max(axis=(0, 2))
    assert diff[:7].max() <= TOL
    assert diff[7:].min() > 10 * TOL


@pytest.mark.parametrize(
    "case, model_type", [("gemma3", "gemma3"), ("llama4", "llama4"), ("qwen3_5", "qwen3_5_moe"), ("gemma4", "gemma4")]
)
@pytest.mark.parametrize("prefix", ["language_model.", "model.language_model."])
def test_multimodal_wrapper_loads_its_text_decoder(goldens, tmp_path: Path, case: str, model_type: str, prefix: str) -> None:
    """Hub Gemma 3 (4B+), Llama 4, Qwen3.5 and Gemma 4 checkpoints are ``*ForConditionalGeneration``: the text
    config sits in ``text_config`` and the text keys carry ``language_model.`` (what
    transformers 5.24 ``save_pretrained`` writes, checked with a tiny model) or the in-memory
    ``model.language_model.`` prefix; vision weights are present and not imported."""
    import json

    from safetensors.numpy import save_file

    text = json.loads((GOLDEN / case / "config.json").read_text())
    wrapper = {"model_type": model_type, "architectures": ["X"], "text_config": text, "vision_config": {"hidden_size": 8}}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    weights = load_file(str(GOLDEN / case / "model.safetensors"))
    if prefix == "language_model.":
        renamed = {prefix + key: value for key, value in weights.items()}
    else:
        renamed = {(prefix + key[len("model.") :] if key.startswith("model.") else key): value for key, value in weights.items()}
    others = {  # the wrapper's weights that are not the text decoder's (Qwen3.5: its vision tower and MTP layer)
        "gemma3": ("vision_tower.patch_embedding.weight", "multi_modal_projector.linear_1.weight"),
        "llama4": ("vision_model.patch_embedding.weight", "multi_modal_projector.linear_1.weight"),
        "qwen3_5": ("model.visual.patch_embed.proj.weight", "mtp.fc.weight"),
        "gemma4": ("model.vision_tower.encoder.w", "model.embed_vision.w", "model.audio_tower.w", "model.embed_audio.w"),
    }[case]
    for key in others:
        renamed[key] = np.ones((8, 3), np.float32)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    reference, bound = _reference(goldens[case])
    diff = float(_abs_diff(goldens[case], case, tmp_path, reference).max())
    assert diff <= bound, f"{case} {prefix}: {diff:.3g}"


def test_deepseek4_yarn_on_compressed_layers(tmp_path: Path) -> None:
    """HF applies YaRN (attention factor forced to 1) on the CSA/HCA layers, their compressors
    and the indexer, and plain RoPE on sliding layers: the ``config_yarn.json`` variant of the
    deepseek4 golden (same weights; logits move by 2.2e-1 from the default-RoPE golden)."""
    shutil.copy(GOLDEN / "deepseek4" / "config_yarn.json", tmp_path / "config.json")
    shutil.copy(GOLDEN / "deepseek4" / "model.safetensors", tmp_path / "model.safetensors")
    golden = load_file(str(GOLDEN / "deepseek4" / "golden_yarn.safetensors"))
    model = from_hf(tmp_path)
    assert model.config.rope_type == "yarn"
    with jax.default_matmul_precision("highest"):
        logits = np.asarray(forward_logits(model, jnp.asarray(golden["input_ids"])))
    diff = float(np.abs(logits - golden["logits"]).max())
    assert diff <= TOL, f"deepseek4 yarn: {diff:.3g}"  # measured 3.0e-7
    out = to_hf(model, tmp_path / "out")
    assert hf_config_to_nnxtron(out) == hf_config_to_nnxtron(tmp_path)
