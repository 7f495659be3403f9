"""MoE expert capacity per sequence (``capacity_scope=sequence``, MaxText's rule) against a NumPy
transcription of MaxText 0.2.5's dense path (``RoutedMoE.generate_masks`` + ``dense_matmul``),
how it differs from the call-wide capacity, and how a MaxText config selects it."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxtron.config.loader import load_config, load_config_report
from nnxtron.errors import ConfigError
from nnxtron.layers.moe import MoE, expert_capacity, keep_mask
from nnxtron.tools.parity import assert_grad_parity
from tests.conftest import tiny_config
from tests.parity.test_expert_parallel import AXES, MESHES, _mesh, _result, _run
from tests.parity.test_expert_parallel import BASE as EP_BASE
from tests.unit.test_moe import _values, forward, inputs, make

BASE = Path(__file__).resolve().parents[1] / "assets" / "maxtext" / "base.yml"
MIXTRAL = dict(routed_score_func="softmax", norm_topk_prob=True)


def maxtext_dense(x, idx, weights, wi_0, wi_1, wo, factor):
    """MaxText's ``dense_matmul`` with ``capacity_factor > 0`` in float64: masks by a cumulative
    count over the fused (position, slot) axis of each row, then dispatch / expert FFN / combine
    einsums. Returns (output [B, S, D], kept [B, S, k])."""
    batch, seq, k = idx.shape
    experts = wi_0.shape[0]
    capacity = int(max(math.ceil(seq * k / experts) * factor, factor))
    mask = np.eye(experts, dtype=np.int64)[idx]  # [B, S, k, E]
    count = np.cumsum(mask.reshape(batch, seq * k, experts), axis=1).reshape(batch, seq, k, experts)
    trunc = mask * (count <= capacity)
    update = np.zeros((batch, seq, experts))
    np.put_along_axis(update, idx, weights, axis=-1)  # reshape_and_update_weights
    update *= trunc.sum(2)
    position = (mask * count).sum(2) * trunc.sum(2)  # 1-based slot in the expert's capacity, 0 = dropped
    combine = update[..., None] * np.eye(capacity + 1)[position][..., 1:]  # [B, S, E, C]
    dispatch = np.einsum("bsm,bsec->ebcm", x, combine.astype(bool).astype(np.float64))
    gate, up = np.einsum("ebcm,emh->ebch", dispatch, wi_0), np.einsum("ebcm,emh->ebch", dispatch, wi_1)
    hidden = gate / (1 + np.exp(-gate)) * up
    out = np.einsum("ebcm,bsec->bsm", np.einsum("ebch,ehm->ebcm", hidden, wo), combine)
    return out, trunc.sum(-1).astype(bool)


def routing(moe, x):
    weights, idx = (_values(lambda m, x, i=i: m.route(x)[i], moe, x) for i in (0, 1))
    return weights.astype(np.float64), idx


def expert_weights(moe):
    return [np.asarray(w[...], np.float64) for w in (moe.wi_0, moe.wi_1, moe.wo)]


@pytest.mark.parametrize(("seq", "k", "experts", "factor", "sequence", "call"), [
    (8, 2, 4, 1.25, 5, 10),  # ceil(4) * 1.25 = 5 per row; ceil(1.25 * 2 * 8 * 2 / 4) = 10 per call
    (6, 2, 4, 1.25, 3, 8),  # ceil(3) * 1.25 = 3.75 -> 3: MaxText floors after the ceil
    (8, 2, 4, 0.1, 0, 1),  # int(max(0.4, 0.1)) = 0: every assignment dropped
    (3, 1, 8, 2.0, 2, 2),  # max(ceil(3/8) * 2, 2) = 2
])  # fmt: skip
def test_capacity_rounding_is_maxtexts(seq, k, experts, factor, sequence, call):
    assert expert_capacity("sequence", factor, 2, seq, k, experts) == sequence
    assert expert_capacity("call", factor, 2, seq, k, experts) == call


def test_tied_router_drops_per_sequence_not_per_call():
    """A zero router ties every expert: each token picks experts [0, 1]. Per sequence (capacity
    int(max(ceil(8 * 2 / 4) * 0.5, 0.5)) = 2) the first 2 tokens of *each* row keep both slots;
    over the call (capacity ceil(0.5 * 32 / 4) = 4) the first 4 tokens of row 0 keep them and
    row 1 gets nothing."""
    idx = jnp.broadcast_to(jnp.array([0, 1]), (2, 8, 2))
    per_row = np.asarray(keep_mask(idx, 4, 0.5, "sequence"))
    per_call = np.asarray(keep_mask(idx, 4, 0.5, "call"))
    np.testing.assert_array_equal(per_row[:, :2], True)
    np.testing.assert_array_equal(per_row[:, 2:], False)
    np.testing.assert_array_equal(per_call[0, :4], True)
    np.testing.assert_array_equal(per_call[0, 4:], False)
    np.testing.assert_array_equal(per_call[1], False)
    np.testing.assert_array_equal(np.asarray(keep_mask(idx, 4, -1.0, "sequence")), True)


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_sequence_capacity_matches_maxtexts_dense_path(factor):
    moe, _ = make(capacity_factor=factor, capacity_scope="sequence", **MIXTRAL)
    moe.router.kernel[...] = moe.router.kernel[...].at[:, 0].add(0.4)  # skew towards expert 0 so rows overflow
    x = inputs()
    weights, idx = routing(moe, x)
    ref, kept = maxtext_dense(np.asarray(x, np.float64), idx, weights, *expert_weights(moe), factor)
    assert not kept.all(), "the routing must overflow the capacity"
    np.testing.assert_array_equal(np.asarray(keep_mask(jnp.asarray(idx), 4, factor, "sequence")), kept)
    np.testing.assert_allclose(np.asarray(forward(moe, x)[0]), ref, rtol=1e-5, atol=2e-6)


def test_sequence_capacity_is_independent_of_the_other_rows_call_capacity_is_not():
    """The defining difference: per sequence, a row's output does not depend on the rows batched
    with it (microbatching and gradient accumulation compute the same function); over the call it does."""
    x = inputs(batch=4)
    outputs = {}
    for scope in ("sequence", "call"):
        moe, _ = make(capacity_factor=1.0, capacity_scope=scope, **MIXTRAL)
        moe.router.kernel[...] = moe.router.kernel[...].at[:, 0].add(0.4)
        whole, halves = forward(moe, x)[0], [forward(moe, x[i : i + 2])[0] for i in (0, 2)]
        outputs[scope] = (np.asarray(whole), np.concatenate([np.asarray(h) for h in halves]))
    np.testing.assert_allclose(*outputs["sequence"], rtol=1e-6, atol=1e-7)
    assert np.abs(outputs["call"][0] - outputs["call"][1]).max() > 1e-3
    assert np.abs(outputs["sequence"][0] - outputs["call"][0]).max() > 1e-3


def test_sequence_capacity_gradient_flows_through_kept_assignments_only():
    moe, _ = make(capacity_factor=0.5, capacity_scope="sequence", **MIXTRAL)
    moe.router.kernel[...] = jnp.zeros_like(moe.router.kernel[...])  # ties: experts [0, 1]; 2 tokens per row kept
    x = inputs()
    grad = np.asarray(_values(lambda m, x: jax.grad(lambda x: jnp.sum(m(x)[0] ** 2))(x), moe, x))
    assert np.abs(grad[:, :2]).min() > 0 and np.abs(grad[:, 2:]).max() < 1e-6  # dropped tokens: only the router path (zero)


# --- how a MaxText config selects it ----------------------------------------------------------------
TINY_MOE = ["model_name=mixtral-tiny"]


def test_maxtext_capacity_factor_on_the_dense_path_is_per_sequence():
    cfg, report = load_config_report(BASE, [*TINY_MOE, "sparse_matmul=false", "capacity_factor=1.25"])
    assert (cfg.capacity_factor, cfg.capacity_scope) == (1.25, "sequence")
    line = report.startup_lines(cfg)[-1]
    assert "with expert capacity (capacity_factor=1.25, capacity_scope=sequence)" in line


def test_maxtext_capacity_factor_on_the_sparse_path_is_unread():
    cfg, report = load_config_report(BASE, [*TINY_MOE, "capacity_factor=1.25"])  # sparse_matmul=true: MaxText's default
    assert (cfg.capacity_factor, cfg.capacity_scope) == (-1.0, "call")
    line = report.startup_lines(cfg)[-1]
    assert "dropless" in line and "MaxText reads capacity_factor on its dense path only" in line


def test_nnxtron_capacity_keeps_its_own_scope_and_the_scope_needs_a_factor():
    cfg = load_config(None, [*TINY_MOE, "capacity_factor=1.25"])
    assert (cfg.capacity_factor, cfg.capacity_scope) == (1.25, "call")
    with pytest.raises(ConfigError, match="capacity_scope=sequence needs capacity_factor > 0"):
        load_config(None, [*TINY_MOE, "capacity_scope=sequence"])


@pytest.mark.parametrize(("args", "accepted"), [
    (["ragged_buffer_factor=1.0"], True),  # one expert shard, no ring-of-experts ragged sort: unread
    (["ragged_buffer_factor=1.0", "sparse_matmul=false"], True),
    (["ragged_buffer_factor=1.0", "ici_expert_parallelism=2"], False),
    (["ragged_buffer_factor=1.0", "use_ring_of_experts=true", "use_ragged_sort=true"], False),
    (["eval_ragged_buffer_factor=2.0", "ici_expert_parallelism=-1"], False),
])  # fmt: skip
def test_ragged_buffer_is_refused_where_maxtext_drops_at_it(args, accepted):
    if accepted:
        assert load_config(BASE, [*TINY_MOE, *args]).capacity_factor == -1.0
    else:
        with pytest.raises(ConfigError, match="ragged_buffer_factor=.* is refused: MaxText's sparse path with expert"):
            load_config(BASE, [*TINY_MOE, *args])


def test_sequence_capacity_under_expert_parallelism_matches_unsharded():
    """Per-row capacity under EP (tokens sharded over data x expert, gathered for dispatch): the
    output and gradients equal the unsharded layer's (bounds of tests/parity/test_expert_parallel.py)."""
    ep = dict(zip(AXES, MESHES["ep4_data2"]))
    cfg = tiny_config("llama2-tiny", **EP_BASE, **MIXTRAL, capacity_factor=1.0, capacity_scope="sequence",
                      **{f"ici_{a}_parallelism": s for a, s in ep.items()})  # fmt: skip
    with nnx.use_eager_sharding(False):
        moe = MoE(cfg, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (8, 4, cfg.base_emb_dim), jnp.float32)
    cot = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    assert not np.asarray(keep_mask(jnp.asarray(moe.route(x)[1]), 8, 1.0, "sequence")).all()  # rows overflow
    ref, got = _run(cfg, moe, x, cot, None), _run(cfg, moe, x, cot, _mesh("ep4_data2"))
    np.testing.assert_allclose(np.asarray(got[0][1][0]), np.asarray(ref[0][1][0]), rtol=1e-5, atol=5e-6)
    assert_grad_parity(_result(got), _result(ref), loss_rtol=1e-5, rel=1e-5, abs_frac=1e-6, aggregate_rel=1e-5)
