"""Checkpoints across layouts: scan_layers on <-> off and any mesh <-> any other, on resume
and when loading weights; the checkpoint records the layout it was written with.

Reference runs are uninterrupted 6-step runs (checkpoints at 3 and 6); a resume starts from
a copy of such a run with its step-6 checkpoint removed, so the only difference from the
reference is the layout of the steps after 3.
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxtron.config import load_config
from nnxtron.convert.runs import load_model
from nnxtron.errors import ConfigError
from nnxtron.parallel.mesh import make_mesh
from nnxtron.params import detect_layout, flatten, split_layer_path, unstack_layers
from nnxtron.train.checkpoint import Checkpointer
from nnxtron.train.loop import Trainer, _check_same_model
from nnxtron.train.state import model_shardings
from tests.helpers import load_parameters, stack_layers
from tests.integration.conftest import train_overrides

LAYERS = 2
FAST = {"eval_interval": -1, "enable_tensorboard": False}
MESHES = {
    "fsdp8": {},
    "data2_fsdp2_tensor2": {"ici_data_parallelism": 2, "ici_fsdp_parallelism": 2, "ici_tensor_parallelism": 2},
    "fsdp4_tensor2": {"ici_fsdp_parallelism": 4, "ici_tensor_parallelism": 2},
}
# Bounds, measured on 8 fake CPU devices (jax 0.10.2, float32, the test suite's XLA flags:
# tests/conftest.py). "state" = params and Adam moments, max over leaves of max|a - b| / max|b|,
# compared in layer-list layout.
# - scan_layers flipped on resume: losses bitwise equal scanned -> unrolled, 6.0e-8 relative
#   unrolled -> scanned; state 4.5e-7 and 3.9e-7. From scratch the two layouts give losses
#   within 6.1e-8 and states within 7.5e-6 after 6 steps: XLA fuses the scanned body and the
#   unrolled layers differently, and Adam's division by small second moments amplifies it.
#   (With XLA's MLIR fusion emitters, the default outside the tests, the flipped losses were
#   bitwise equal both ways and the from-scratch states within 9.6e-7.)
# - mesh changed on resume (fsdp=8 -> data2 x fsdp2 x tensor2 or fsdp4 x tensor2): losses
#   9.4e-8 relative, state 7.1e-7 (the reduction order changes).
# - restore itself is exact: parameters restored on another mesh or in the other layout are
#   bitwise equal. Logits computed from them are not (other reduction order / fusion): max
#   |diff| 1.6e-6 on another mesh, 1.2e-6 with the other layout, against max |logits| 6.9
#   (2.3e-7 and 1.7e-7 of it).
STATE_RTOL = 5e-6
SCRATCH_STATE_RTOL = 3e-5  # two layouts from scratch, 6 steps
LOSS_RTOL = 1e-6
LOGITS_RTOL = 1e-6  # of max |logits|


def _overrides(corpus, base, run, **extra):
    return train_overrides(corpus, base, run, **{**FAST, **extra})


def _train(corpus, base, run, **extra):
    return Trainer(load_config(overrides=_overrides(corpus, base, run, **extra)), progress=False).run()


def _resume_copy(base, source, name):
    """A copy of run ``source`` interrupted after step 3 (its step-6 checkpoint removed)."""
    shutil.copytree(Path(base) / source, Path(base) / name)
    shutil.rmtree(Path(base) / name / "checkpoints" / "6")


def _layer_list(state) -> dict[str, np.ndarray]:
    """The whole train state (params, Adam moments, step) as host arrays in layer-list layout."""
    return {k: np.asarray(v) for k, v in unstack_layers(flatten(state), LAYERS).items()}


def _max_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k])) / (np.max(np.abs(b[k])) or 1.0)) for k in a)


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """Uninterrupted 6-step runs, scanned and unrolled, on the default fsdp=8 mesh."""
    base = str(tmp_path_factory.mktemp("layout_runs"))
    return base, {scan: _train(corpus, base, f"straight-{scan}", scan_layers=scan) for scan in (True, False)}


@pytest.fixture(scope="module")
def flipped(corpus, runs):
    """Each reference run resumed at step 3 with the other scan_layers."""
    base, straight = runs
    out = {}
    for scan in (True, False):
        name = f"flip-from-{scan}"
        _resume_copy(base, f"straight-{scan}", name)
        out[scan] = _train(corpus, base, name, scan_layers=not scan)
    return out


@pytest.mark.parametrize("scan", [True, False], ids=["scanned->unrolled", "unrolled->scanned"])
def test_resume_with_the_other_scan_layout_continues_the_loss_curve(runs, flipped, scan):
    _, straight = runs
    resumed = flipped[scan]
    assert resumed.start_step == 3 and resumed.end_step == 6
    np.testing.assert_allclose(resumed.losses, straight[scan].losses[3:], rtol=LOSS_RTOL, atol=0)
    a, b = _layer_list(straight[scan].state), _layer_list(resumed.state)
    assert any(k.startswith("opt_state/") and "/layers/layers/1/" in k for k in a)  # Adam moments too
    assert _max_rel(b, a) <= STATE_RTOL


def test_scanned_and_unrolled_runs_agree(runs):
    """Context for the bound above: the two layouts run from scratch agree to float32 noise."""
    _, straight = runs
    np.testing.assert_allclose(straight[True].losses, straight[False].losses, rtol=LOSS_RTOL, atol=0)
    assert _max_rel(_layer_list(straight[True].state), _layer_list(straight[False].state)) <= SCRATCH_STATE_RTOL


@pytest.mark.parametrize("mesh", ["data2_fsdp2_tensor2", "fsdp4_tensor2"])
def test_resume_on_another_mesh_continues_the_loss_curve(corpus, runs, mesh):
    base, straight = runs
    name = f"mesh-{mesh}"
    _resume_copy(base, "straight-True", name)
    resumed = _train(corpus, base, name, **MESHES[mesh])
    assert resumed.start_step == 3
    np.testing.assert_allclose(resumed.losses, straight[True].losses[3:], rtol=LOSS_RTOL, atol=0)
    assert _max_rel(_layer_list(resumed.state), _layer_list(straight[True].state)) <= STATE_RTOL
    mesh_shape = Checkpointer(Path(base) / name / "checkpoints", 10).read_meta(6)["layout"]["mesh_shape"]
    want = {
        "stage": 1,
        "data": 1,
        "fsdp": 8,
        "context": 1,
        "expert": 1,
        "tensor": 1,
        **{k.split("_")[1]: v for k, v in MESHES[mesh].items()},
    }
    assert mesh_shape == want


def _logits(model, tokens):
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits)(state, jnp.asarray(tokens)))


TOKENS = np.random.default_rng(0).integers(3, 320, size=(8, 32)).astype(np.int32)


def _assert_close_logits(actual, desired):
    scale = float(np.max(np.abs(desired)))
    np.testing.assert_allclose(actual, desired, rtol=0, atol=LOGITS_RTOL * scale)


@pytest.mark.parametrize("mesh", ["data2_fsdp2_tensor2", "fsdp4_tensor2"])
def test_restore_on_another_mesh_reshards_exactly(runs, mesh):
    base, _ = runs
    run = Path(base) / "straight-True"
    overrides = [f"{k}={v}" for k, v in MESHES[mesh].items()]
    saved, moved = load_model(run), load_model(run, overrides)
    a, b = flatten(nnx.state(saved, nnx.Param)), flatten(nnx.state(moved, nnx.Param))
    cfg = load_config(run / "config.yml", overrides)
    want = flatten(model_shardings(cfg, make_mesh(cfg))[3])
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)  # values: bitwise
        assert b[key].sharding.is_equivalent_to(want[key], b[key].ndim), key  # placed on the new mesh
    _assert_close_logits(_logits(moved, TOKENS), _logits(saved, TOKENS))


@pytest.mark.parametrize("scan", [True, False], ids=["scanned-ckpt", "unrolled-ckpt"])
def test_load_model_with_the_other_scan_layout_gives_identical_logits(runs, scan):
    base, _ = runs
    run = Path(base) / f"straight-{scan}"
    same, other = load_model(run), load_model(run, [f"scan_layers={str(not scan).lower()}"])
    assert other.config.scan_layers is (not scan)
    a, b = _layer_list(nnx.state(same, nnx.Param)), _layer_list(nnx.state(other, nnx.Param))
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)  # the weights: bitwise
    _assert_close_logits(_logits(other, TOKENS), _logits(same, TOKENS))


def test_meta_records_the_layout(runs, flipped):
    base, _ = runs
    fsdp8 = {"stage": 1, "data": 1, "fsdp": 8, "context": 1, "expert": 1, "tensor": 1}
    for run, scan in (("straight-True", True), ("straight-False", False), ("flip-from-True", False)):
        meta = Checkpointer(Path(base) / run / "checkpoints", 10).read_meta(6)
        assert meta["layout"] == {"scan_layers": scan, "num_layers": {"layers": LAYERS}, "mesh_shape": fsdp8, "num_devices": 8}
        assert meta["config"]["scan_layers"] is scan


def _rewrite_meta(step_dir: Path, edit) -> None:
    path = step_dir / "meta" / "metadata"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


@pytest.mark.parametrize("record", ["config-only", "nothing"])
def test_older_checkpoints_and_params_only_checkpoints_load_in_either_layout(runs, corpus, tmp_path, record):
    """Without a layout record: the config in meta tells the layout, else the array names do
    (e.g. a params-only checkpoint from `convert from-hf` written before layouts were recorded)."""
    base, straight = runs
    reference = _layer_list(straight[False].state["params"])
    source = Checkpointer(tmp_path / "ckpt", 1)  # params only, unrolled, like `convert from-hf`
    source.save(6, {"params": straight[False].state["params"]}, {"config": {"scan_layers": False}})
    source.wait()

    def strip(meta):
        meta.pop("layout")
        if record == "nothing":
            meta.pop("config")
        return meta

    _rewrite_meta(tmp_path / "ckpt" / "6", strip)
    assert source.stored_layout(6)["scan_layers"] is False
    for scan in (True, False):
        cfg = load_config(overrides=_overrides(corpus, base, "x", scan_layers=scan))
        _, abstract, _, shardings, _ = model_shardings(cfg, make_mesh(cfg))
        params = load_parameters(tmp_path / "ckpt", cfg, abstract, shardings)
        loaded = _layer_list(params)
        assert loaded.keys() == reference.keys()
        for key in reference:
            np.testing.assert_array_equal(loaded[key], reference[key], err_msg=key)


def test_resume_may_change_scan_layers_but_not_the_model(runs, corpus):
    base, _ = runs
    run = Path(base) / "straight-True"
    _check_same_model(run, load_config(overrides=_overrides(corpus, base, "straight-True", scan_layers=False)))
    with pytest.raises(ConfigError, match="was created with base_emb_dim=64"):
        _check_same_model(run, load_config(overrides=_overrides(corpus, base, "straight-True", base_emb_dim=32)))


@pytest.mark.parametrize("scan", [True, False])
def test_a_different_layer_count_is_still_refused_across_layouts(runs, corpus, scan):
    base, _ = runs
    cfg = load_config(overrides=_overrides(corpus, base, "x", scan_layers=not scan, base_num_decoder_layers=3))
    _, abstract, _, shardings, _ = model_shardings(cfg, make_mesh(cfg))
    with pytest.raises(ConfigError, match="created with base_num_decoder_layers=2 but this config has base_num_decoder_layers=3"):
        load_parameters(Path(base) / f"straight-{scan}", cfg, abstract, shardings)


def test_layer_conversions_work_under_any_prefix():
    scanned = {
        "embed/embedding": np.zeros((3, 2)),
        "layers/layers/mlp/wo/kernel": np.arange(12.0).reshape(2, 3, 2),
        "opt_state/1/0/mu/layers/layers/mlp/wo/kernel": -np.arange(12.0).reshape(2, 3, 2),
        "opt_state/1/0/count": np.int32(4),
    }
    unrolled = unstack_layers(scanned, 2)
    assert sorted(unrolled) == sorted(
        ["embed/embedding", "opt_state/1/0/count"]
        + [f"{p}layers/layers/{i}/mlp/wo/kernel" for p in ("", "opt_state/1/0/mu/") for i in (0, 1)]
    )
    np.testing.assert_array_equal(unrolled["opt_state/1/0/mu/layers/layers/1/mlp/wo/kernel"], -np.arange(6.0, 12.0).reshape(3, 2))
    back = stack_layers(unrolled, 2, np.stack)
    assert back.keys() == scanned.keys() and all(np.array_equal(back[k], scanned[k]) for k in scanned)
    assert detect_layout(scanned) == (True, {"layers": 2}) and detect_layout(unrolled) == (False, {"layers": 2})
    assert split_layer_path("opt_state/1/0/mu/layers/layers/3/a/b") == ("opt_state/1/0/mu/layers/layers/", 3, "a/b")
    assert split_layer_path("opt_state/mu/moe_layers/layers/a") == ("opt_state/mu/moe_layers/layers/", None, "a")
    assert split_layer_path("xlayers/layers/a") is None
    with pytest.raises(ValueError, match="missing layers \\[1\\]"):
        stack_layers({k: v for k, v in unrolled.items() if "/1/" not in k}, 2, np.stack)
    with pytest.raises(ValueError, match="leading axis 2 is not the layer count 3"):
        unstack_layers(scanned, 3)


def test_layer_conversions_with_two_stacks_of_different_depths():
    """DeepSeek layout: dense_layers (1 layer) and moe_layers (3 layers), each with its count."""
    counts = {"dense_layers": 1, "moe_layers": 3}
    scanned = {
        "dense_layers/layers/mlp/wo/kernel": np.arange(4.0).reshape(1, 2, 2),
        "moe_layers/layers/mlp/wo": np.arange(24.0).reshape(3, 2, 2, 2),
        "opt_state/0/mu/moe_layers/layers/mlp/wo": -np.arange(24.0).reshape(3, 2, 2, 2),
        "mtp/depths/0/projection/kernel": np.ones((4, 2)),
    }
    unrolled = unstack_layers(scanned, counts)
    assert sorted(k for k in unrolled if k.startswith("moe_layers")) == [f"moe_layers/layers/{i}/mlp/wo" for i in range(3)]
    assert "dense_layers/layers/0/mlp/wo/kernel" in unrolled and "mtp/depths/0/projection/kernel" in unrolled
    np.testing.assert_array_equal(unrolled["opt_state/0/mu/moe_layers/layers/2/mlp/wo"], -np.arange(16.0, 24.0).reshape(2, 2, 2))
    assert detect_layout(scanned) == (True, counts) and detect_layout(unrolled) == (False, counts)
    back = stack_layers(unrolled, counts, np.stack)
    assert back.keys() == scanned.keys() and all(np.array_equal(back[k], scanned[k]) for k in scanned)
    with pytest.raises(ValueError, match="no layer count for stack 'moe_layers'"):
        unstack_layers(scanned, {"dense_layers": 1})
