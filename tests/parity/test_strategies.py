"""Strategy parity: scanned vs unrolled, remat policies, sharded meshes vs one device.

Every pair runs the same weights on the same batch and compares the loss, the input
cotangent and every parameter gradient (nnxtron.tools.parity.assert_grad_parity).
Measured on this CPU in float32 (2026-11): scan vs unroll and remat pairs agree to
<= 3e-7 relative (aggregate), sharded vs single device to <= 5e-7; the bounds below
leave ~10x headroom and are far below what a real bug produces (a dropped residual or
mask changes gradients by O(1)).
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from nnxtron.config.stacks import layer_counts
from nnxtron.models.build import build_model
from nnxtron.parallel.mesh import make_mesh
from nnxtron.parallel.sharding import logical_to_spec, state_shardings
from nnxtron.params import flatten, layer_list_layout
from nnxtron.tools.parity import assert_grad_parity, loss_and_grads
from tests.conftest import random_batch, tiny_config

BOUNDS = dict(loss_rtol=1e-6, rel=1e-5, abs_frac=1e-6, aggregate_rel=5e-6)
# per case: config overrides. The patterned families (gemma3, llama4, gpt3, deepseek4) compare
# scanned with unrolled gradients (same seed, so also the same init) in test_matrix's family rows
# and scanned with unrolled logits against their HF goldens.
CASES = {"llama3.1-tiny": {}, "mistral-tiny": {}}


def _result(model_name, batch, mesh=None, **overrides):
    cfg = tiny_config(model_name, **CASES[model_name], **overrides)
    model = build_model(cfg)
    return loss_and_grads(model, batch, mesh=make_mesh(cfg) if mesh else None), model


@pytest.fixture(scope="module", params=list(CASES))
def reference(request):
    """Scanned, fully rematerialised, single device: the reference for every pair."""
    cfg = tiny_config(request.param, **CASES[request.param])
    batch = random_batch(cfg, batch=8, seq=24, packed=True)
    result, model = _result(request.param, batch)
    return request.param, batch, result, model


def test_scan_and_unroll_build_identical_weights(reference):
    name, _, _, scanned = reference
    unrolled = build_model(tiny_config(name, **CASES[name], scan_layers=False))
    n = layer_counts(scanned.config)
    a = layer_list_layout(nnx.state(scanned, nnx.Param), n)
    b = layer_list_layout(nnx.state(unrolled, nnx.Param), n)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@nnx.jit
def _logits(model, batch):
    return model(batch["inputs"], batch["positions"], batch["segment_ids"]).logits


def test_scanned_vs_unrolled(reference):
    name, batch, ref, scanned = reference
    unrolled_result, unrolled = _result(name, batch, scan_layers=False)
    logits_a = _logits(scanned, batch)
    logits_b = _logits(unrolled, batch)
    # jitted float32 calls: measured max diff 1.2e-5 on logits of magnitude ~10
    np.testing.assert_allclose(logits_a, logits_b, rtol=1e-5, atol=2e-5)
    assert_grad_parity(unrolled_result, ref, **BOUNDS)


@pytest.mark.parametrize("policy", ["none", "minimal"])
def test_remat_policies_compute_the_same_function(reference, policy):
    name, batch, ref, _ = reference
    result, _ = _result(name, batch, remat_policy=policy)
    assert_grad_parity(result, ref, **BOUNDS)


@pytest.mark.parametrize(
    "mesh", [dict(ici_fsdp_parallelism=4, ici_tensor_parallelism=2), dict(ici_data_parallelism=2, ici_fsdp_parallelism=4)]
)
def test_sharded_vs_single_device(reference, mesh):
    name, batch, ref, _ = reference
    result, _ = _result(name, batch, mesh=True, **mesh)
    assert_grad_parity(result, ref, **BOUNDS)


def test_parameter_shardings_follow_the_rules():
    cfg = tiny_config("llama3.1-tiny", ici_fsdp_parallelism=4, ici_tensor_parallelism=2)
    mesh = make_mesh(cfg)
    model = build_model(cfg)
    shardings = flatten(
        jax.tree.map(lambda s: s.spec, state_shardings(nnx.state(model, nnx.Param), mesh, cfg.logical_axis_rules))
    )
    P = jax.sharding.PartitionSpec
    assert shardings["embed/embedding"] == P("tensor", "fsdp")  # (vocab, embed)
    assert shardings["layers/layers/attention/query/kernel"] == P(
        None, "fsdp", "tensor", None
    )  # (layers, embed, q_heads, head_dim)
    assert shardings["layers/layers/attention/key/kernel"] == P(None, "fsdp", "tensor", None)
    assert shardings["layers/layers/attention/out/kernel"] == P(None, "tensor", None, "fsdp")
    assert shardings["layers/layers/mlp/wi_0/kernel"] == P(None, "fsdp", "tensor")
    assert shardings["layers/layers/mlp/wo/kernel"] == P(None, "tensor", "fsdp")
    assert shardings["layers/layers/pre_attention_norm/scale"] == P(None, None)
    assert shardings["final_norm/scale"] == P(None)
    batch = NamedSharding(mesh, logical_to_spec(("activation_batch", "activation_length"), cfg.logical_axis_rules, mesh))
    assert batch.spec == P("fsdp", None)  # data axis has size 1 here


def test_parity_helper_catches_a_wrong_gradient(reference):
    """The bounds are tight enough to see one slightly wrong leaf."""
    _, _, ref, _ = reference
    broken = dataclasses.replace(ref, param_grads=dict(ref.param_grads))
    key = sorted(k for k in ref.param_grads if k.endswith("pre_attention_norm/scale"))[1]  # the second layer's
    broken.param_grads[key] = ref.param_grads[key] * 1.001
    with pytest.raises(AssertionError, match="aggregate gradient"):
        assert_grad_parity(broken, ref, **BOUNDS)
    # with the aggregate bound switched off, the per-leaf bound names the wrong leaf
    with pytest.raises(AssertionError, match="pre_attention_norm"):
        assert_grad_parity(broken, ref, **{**BOUNDS, "aggregate_rel": 1.0})
