"""HF import/export: exact round trips and one-line errors for bad checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from nnxtron.convert.hf import from_hf, hf_config_to_nnxtron, read_hf_config, to_hf
from nnxtron.errors import CheckpointError, ConfigError

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "golden"
CASES = (
    "llama2", "llama31", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "qwen3_moe_dense", "qwen3_moe_prefix", "deepseek3", "deepseek3_mtp",
    "gemma", "gemma2", "gemma3", "gemma4", "olmo3", "gpt_oss", "qwen3_next", "qwen3_5",
    "llama4", "gpt2", "deepseek4",
)  # fmt: skip


def _params(model) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_bit_identical(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert a[key].tobytes() == b[key].tobytes(), key


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.fixture(scope="module")
def models() -> dict[tuple[str, bool], nnx.Module]:
    return {(case, scan): from_hf(GOLDEN / case, scan_layers=scan) for case in CASES for scan in (True, False)}


@pytest.fixture()
def golden_copy(tmp_path: Path) -> Path:
    """A writable copy of the llama2 golden checkpoint (config + weights only)."""
    out = tmp_path / "llama2"
    out.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(GOLDEN / "llama2" / name, out / name)
    return out


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("case", CASES)
def test_export_reproduces_hf_file(models, tmp_path: Path, case: str, scan: bool) -> None:
    out = to_hf(models[case, scan], tmp_path / "out")
    original = load_file(str(GOLDEN / case / "model.safetensors"))
    _assert_bit_identical(load_file(str(out / "model.safetensors")), original)
    assert hf_config_to_nnxtron(out) == hf_config_to_nnxtron(GOLDEN / case)
    assert read_hf_config(out)["model_type"] == read_hf_config(GOLDEN / case)["model_type"]
    again = from_hf(out, scan_layers=scan)
    _assert_bit_identical(_params(again), _params(models[case, scan]))
    assert again.config == models[case, scan].config


@pytest.mark.parametrize("case", CASES)
def test_unrolled_export_imports_scanned(models, tmp_path: Path, case: str) -> None:
    out = to_hf(models[case, False], tmp_path / "out")
    _assert_bit_identical(_params(from_hf(out, scan_layers=True)), _params(models[case, True]))


def test_bfloat16_round_trip(tmp_path: Path) -> None:
    model = from_hf(GOLDEN / "llama31", dtype="bfloat16")
    assert model.config.dtype == model.config.weight_dtype == "bfloat16"
    out = to_hf(model, tmp_path / "bf16")
    written = load_file(str(out / "model.safetensors"))
    original = load_file(str(GOLDEN / "llama31" / "model.safetensors"))
    _assert_bit_identical(written, {k: v.astype(ml_dtypes.bfloat16) for k, v in original.items()})
    _assert_bit_identical(_params(from_hf(out, dtype="bfloat16")), _params(model))


def test_sharded_checkpoint_and_ignored_buffers(models, golden_copy: Path) -> None:
    tensors = load_file(str(golden_copy / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)  # older HF saves it
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[:10], "model-00002-of-00002.safetensors": keys[10:]}
    for name, names in shards.items():
        save_file({k: tensors[k] for k in names}, str(golden_copy / name))
    weight_map = {k: name for name, names in shards.items() for k in names}
    (golden_copy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (golden_copy / "model.safetensors").unlink()
    _assert_bit_identical(_params(from_hf(golden_copy)), _params(models["llama2", True]))


def test_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    with pytest.raises(ConfigError) as err:
        from_hf(tmp_path)
    assert "'bert'" in _one_line(err) and "llama" in str(err.value)


def test_missing_dir_config_or_bad_json(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as err:
        from_hf(tmp_path / "nope")
    assert "does not exist" in _one_line(err)
    with pytest.raises(CheckpointError) as err:
        from_hf(tmp_path)
    assert "config.json" in _one_line(err)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError) as err:
        read_hf_config(tmp_path)
    assert "not valid JSON" in _one_line(err)


def test_missing_weights_file(golden_copy: Path) -> None:
    (golden_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as err:
        from_hf(golden_copy)
    assert "model.safetensors" in _one_line(err)


def test_missing_tensor(golden_copy: Path) -> None:
    tensors = load_file(str(golden_copy / "model.safetensors"))
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, str(golden_copy / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        from_hf(golden_copy, scan_layers=False)
    assert "'model.layers.2.mlp.up_proj.weight' is missing" in _one_line(err)


def test_wrong_shape(golden_copy: Path) -> None:
    tensors = load_file(str(golden_copy / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((32, 64), np.float32)
    save_file(tensors, str(golden_copy / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        from_hf(golden_copy)
    message = _one_line(err)
    assert "model.layers.1.self_attn.k_proj.weight" in message and "[32, 64]" in message and "[64, 64]" in message


def test_unexpected_tensor(golden_copy: Path) -> None:
    tensors = load_file(str(golden_copy / "model.safetensors"))
    tensors["model.layers.3.mlp.up_proj.weight"] = np.zeros((176, 64), np.float32)
    save_file(tensors, str(golden_copy / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        from_hf(golden_copy)
    assert "model.layers.3.mlp.up_proj.weight" in _one_line(err)


def test_bad_override_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as err:
        from_hf(GOLDEN / "llama2", scan_layer=False)
    assert "scan_layer" in _one_line(err)


def test_to_hf_refuses_to_overwrite(models, tmp_path: Path) -> None:
    out = to_hf(models["mistral", True], tmp_path / "out")
    with pytest.raises(CheckpointError) as err:
        to_hf(models["llama2", True], out)
    assert "overwrite=True" in _one_line(err)
    assert read_hf_config(out)["model_type"] == "mistral"  # untouched
    to_hf(models["llama2", True], out, overwrite=True)
    assert read_hf_config(out)["model_type"] == "llama"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]


def test_router_bias_keeps_float32_when_weights_load_as_bfloat16() -> None:
    """The correction bias is not a parameter: it is read straight into float32, never
    rounded through weight_dtype."""
    model = from_hf(GOLDEN / "deepseek3", dtype="bfloat16")
    stored = load_file(str(GOLDEN / "deepseek3" / "model.safetensors"))
    bias = np.asarray(model.moe_layers.layers.mlp.router_bias[...])
    assert bias.dtype == np.float32
    for i in range(bias.shape[0]):
        np.testing.assert_array_equal(bias[i], stored[f"model.layers.{i + 1}.mlp.gate.e_score_correction_bias"])
    assert model.moe_layers.layers.mlp.wi_0[...].dtype == ml_dtypes.bfloat16
