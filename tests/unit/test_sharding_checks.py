"""Unsharded-parameter check, context-parallel activation layout, offload support checks."""

import jax
import pytest

import nnxtron.parallel.remat as remat
from nnxtron.config import derive
from nnxtron.errors import ConfigError
from nnxtron.parallel.mesh import make_mesh
from nnxtron.parallel.sharding import logical_to_spec, unsharded_report
from nnxtron.train.optimizer import make_optimizer
from nnxtron.train.state import model_shardings, setup
from tests.conftest import tiny_config

P = jax.sharding.PartitionSpec


def _setup(**overrides):
    cfg = tiny_config("llama3.1-tiny", **overrides)
    tx, _ = make_optimizer(cfg, derive(cfg, 8))
    return setup(cfg, make_mesh(cfg), tx)


def test_default_rules_leave_only_norm_scales_unsharded():
    cfg = tiny_config("llama3.1-tiny", ici_fsdp_parallelism=4, ici_tensor_parallelism=2)
    mesh = make_mesh(cfg)
    _, params, _, shardings, _ = model_shardings(cfg, mesh)
    fraction, offenders = unsharded_report(params, shardings, mesh)
    assert {path.rsplit("/", 1)[0].split("/")[-1] for path, *_ in offenders} == {
        "pre_attention_norm",
        "post_attention_norm",
        "final_norm",
    }
    assert 0 < fraction < 0.02


def test_too_many_unsharded_elements_is_an_error_naming_the_offenders():
    rules = [
        [name, []] if name in ("embed", "vocab", "mlp") else [name, list(axes)] for name, axes in tiny_config().logical_axis_rules
    ]
    with pytest.raises(ConfigError) as err:
        _setup(ici_fsdp_parallelism=8, logical_axis_rules=rules)
    message = str(err.value)
    assert "100.0% of parameter elements" in message and "sharding_tolerance=0.02" in message
    assert "layers/layers/mlp/wi_0/kernel (3, 64, 176) P(None, None, None)" in message and "\n" not in message
    _setup(ici_fsdp_parallelism=8, logical_axis_rules=rules, sharding_tolerance=1.0)  # an explicit opt-out works


def test_pure_data_parallelism_has_nothing_to_shard():
    cfg = tiny_config("llama3.1-tiny", ici_data_parallelism=8, ici_fsdp_parallelism=1)
    mesh = make_mesh(cfg)
    _, params, _, shardings, _ = model_shardings(cfg, mesh)
    assert unsharded_report(params, shardings, mesh) == (0.0, [])


def test_context_parallelism_shards_activations_along_the_sequence():
    cfg = tiny_config("llama3.1-tiny", ici_fsdp_parallelism=2, ici_context_parallelism=4)
    mesh = make_mesh(cfg)
    rules = cfg.logical_axis_rules
    assert dict(mesh.shape) == {"stage": 1, "data": 1, "fsdp": 2, "context": 4, "expert": 1, "tensor": 1}
    assert logical_to_spec(("activation_batch", "activation_length", "activation_embed"), rules, mesh) == P(
        "fsdp", "context", None
    )
    assert logical_to_spec(("activation_batch", "activation_kv_length", "activation_kv_heads", None), rules, mesh) == P(
        "fsdp", None, None, None
    )
    assert logical_to_spec(("embed", "mlp"), rules, mesh) == P(("fsdp", "context"), None)  # params split over context too


def test_context_parallelism_needs_a_divisible_sequence():
    with pytest.raises(ConfigError, match="max_target_length=30 does not divide over ici_context_parallelism=4"):
        derive(tiny_config("llama3.1-tiny", ici_fsdp_parallelism=2, ici_context_parallelism=4, max_target_length=30), 8)


def test_offloading_needs_host_memory(monkeypatch):
    assert remat.host_memory_available()  # the CPU backend has pinned_host memory
    monkeypatch.setattr(remat, "host_memory_available", lambda: False)
    monkeypatch.setattr("nnxtron.train.state.host_memory_available", lambda: False)
    with pytest.raises(ConfigError, match="remat_policy=qkv_proj_offloaded offloads activations"):
        _setup(remat_policy="qkv_proj_offloaded")
    with pytest.raises(ConfigError, match="remat_policy=custom offloads"):
        _setup(remat_policy="custom", context="offload")
    with pytest.raises(ConfigError, match="parameter_memory_host_offload=true needs 'pinned_host' memory"):
        _setup(parameter_memory_host_offload=True)
    _setup(remat_policy="custom", context="device")  # no offload: fine
