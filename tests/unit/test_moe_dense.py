"""``moe_compute=dense`` (MaxText's ``sparse_matmul=false``): every expert on every token with
einsums == the grouped ``ragged_dot`` path — output, aux loss, expert-load counts, loss and every
gradient — dropless and with capacity (per sequence: against the NumPy transcription of MaxText's
dense path in test_moe_capacity.py), under expert parallelism, and quantized the same way. The
blocked grouped matmul (``grouped_matmul=blocked``, ``parallel/grouped_matmul.py``) is held to the
same comparisons against ``ragged_dot`` in every case but the quantized ones (it is never quantized)."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx
from qwix._src.core import qarray

from nnxtron.config.loader import load_config, load_config_report
from nnxtron.config.pipeline import pipeline_spec
from nnxtron.layers.moe import MoE
from nnxtron.models import quant
from nnxtron.models.build import build_model
from nnxtron.parallel.mesh import make_mesh
from nnxtron.tools.parity import assert_grad_parity, loss_and_grads
from tests.conftest import tiny_config
from tests.parity.test_expert_parallel import _mesh, _result, _run
from tests.parity.test_pipeline import BOUNDS as PIPELINE_BOUNDS
from tests.parity.test_pipeline import PP2_FSDP2, _sequential
from tests.parity.test_pipeline import _batch as pipeline_batch
from tests.unit.test_moe import CASES, inputs, make
from tests.unit.test_moe_capacity import BASE as MAXTEXT_BASE
from tests.unit.test_moe_capacity import MIXTRAL, expert_weights, maxtext_dense, routing
from tests.unit.test_quant import LOW, _dot_operand_types

# the grouped and dense paths compute the same float32 products in another summation order; measured
# (float32, CPU, every case below): max |dy| <= 2.4e-7, loss + aux rel <= 8.8e-7 (EP mesh; 1.8e-7 without),
# input cotangent rel <= 2.2e-7, aggregate gradient rel <= 1.7e-7, worst leaf <= 2% of its bound
BOUNDS = dict(loss_rtol=1e-5, rel=1e-5, abs_frac=1e-6, aggregate_rel=1e-5)
STATE = dict(load_balance_loss_weight=0.01, routed_bias_update_rate=0.1)  # aux loss + counters in every case
CAPACITY = {"dropless": {}, "sequence": dict(capacity_factor=1.0, capacity_scope="sequence"), "call": dict(capacity_factor=0.75)}


PATHS = {  # the reference (ragged_dot) and the paths compared with it
    "grouped": dict(moe_compute="grouped", grouped_matmul="ragged_dot"),
    "dense": dict(moe_compute="dense"),
    "blocked": dict(moe_compute="grouped", grouped_matmul="blocked"),
}


def _pair(paths=("grouped", "dense"), **overrides) -> dict[str, tuple[MoE, object]]:
    """The same MoE (same seed, same router bias) on each path, and its config."""
    return {path: make(**PATHS[path], **overrides) for path in paths}


def _skew(moe: MoE) -> None:
    moe.router.kernel[...] = moe.router.kernel[...].at[:, 0].add(0.4)  # towards expert 0, so capacity overflows


def _compare(pair: dict, x: jax.Array, cot: jax.Array, mesh_name: str | None = None) -> dict:
    """Each other path (on ``mesh_name`` if given) vs grouped (ragged_dot) unsharded: y, loss + aux,
    every gradient, new state."""
    ref = _run(pair["grouped"][1], pair["grouped"][0], x, cot, None)
    errs = {}
    for path in sorted(set(pair) - {"grouped"}):
        got = _run(pair[path][1], pair[path][0], x, cot, _mesh(mesh_name) if mesh_name else None)
        np.testing.assert_allclose(np.asarray(got[0][1][0]), np.asarray(ref[0][1][0]), rtol=1e-5, atol=2e-6, err_msg=path)
        errs[path] = assert_grad_parity(_result(got), _result(ref), **BOUNDS)
        rest_got, rest_ref = got[0][1][2], ref[0][1][2]
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), rest_got, rest_ref)
    return {"errs": errs, "aux": ref[0][1][1], "rest": rest_ref}


@pytest.mark.parametrize(("case", "capacity"), [
    *((case, capacity) for case in ("mixtral", "deepseek3") for capacity in CAPACITY),
    ("deepseek4", "dropless"), ("llama4", "sequence"),
])  # fmt: skip
def test_dense_equals_grouped(case, capacity):
    overrides = {**CASES[case], **CAPACITY[capacity]}
    if overrides.get("routed_bias"):
        overrides.update(STATE)
    else:
        overrides["load_balance_loss_weight"] = 0.01
    pair = _pair(("grouped", "dense", "blocked"), **overrides)
    if capacity != "dropless":
        for moe, _ in pair.values():
            _skew(moe)
    x = inputs()
    cot = jax.random.normal(jax.random.key(3), x.shape)
    out = _compare(pair, x, cot)
    assert float(out["aux"]["moe_lb_loss"]) > 0
    if "expert_load" in out["rest"]:
        assert float(np.sum(out["rest"]["expert_load"])) == x.shape[0] * x.shape[1] * CASES[case].get("num_experts_per_tok", 2)
    assert all(errs["aggregate"] < 1e-5 for errs in out["errs"].values()), out["errs"]


@pytest.mark.parametrize("factor", [0.5, 1.25])
def test_dense_sequence_capacity_matches_maxtexts_dense_path(factor):
    moe, _ = make(capacity_factor=factor, capacity_scope="sequence", moe_compute="dense", **MIXTRAL)
    _skew(moe)
    x = inputs()
    weights, idx = routing(moe, x)
    ref, kept = maxtext_dense(np.asarray(x, np.float64), idx, weights, *expert_weights(moe), factor)
    assert not kept.all(), "the routing must overflow the capacity"
    y = jax.jit(lambda state, x: nnx.merge(nnx.graphdef(moe), state)(x)[0])(nnx.state(moe), x)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=2e-6)


def test_dense_under_expert_parallelism_equals_grouped_unsharded():
    """Dense on a mesh with 2 expert shards x 4 FSDP (XLA partitions the einsums; no shard_map), and
    blocked there (under shard_map: 4 local experts, the other shard's assignments in no group)."""
    overrides = dict(**CASES["deepseek3"], **STATE, capacity_factor=1.0, capacity_scope="sequence")
    overrides.update(ici_expert_parallelism=2, ici_fsdp_parallelism=4)
    pair = _pair(("grouped", "dense", "blocked"), **overrides)
    x = jax.random.normal(jax.random.key(1), (8, 4, 64))
    cot = jax.random.normal(jax.random.key(2), x.shape)
    _compare(pair, x, cot, "ep2_fsdp4")


def test_dense_under_llama4_needs_one_expert_per_token():
    from nnxtron.parallel.expert import dense_ffn

    x, idx = jnp.ones((1, 2, 4)), jnp.zeros((1, 2, 2), jnp.int32)
    with pytest.raises(ValueError, match="moe_compute=dense scales the expert input"):
        dense_ffn(x, idx, jnp.ones((1, 2, 2)), idx == 0, jnp.ones((1, 2, 2)), *(jnp.ones((2, 4, 4)),) * 3, glu=jnp.multiply)


# --- quantization: the dense expert einsums are quantized as the grouped ragged_dots are ------------
def _low_dots(found: dict, primitive: str) -> collections.Counter:
    """Matmuls of ``primitive`` with an 8-bit operand, by their (unordered) operand types."""
    low = collections.Counter()
    for (name, *types), n in found.items():
        if name == primitive and set(types) & LOW:
            low[tuple(sorted(types))] += n
    return low


@pytest.mark.parametrize(("mode", "name", "model"), [
    ("fp8_full", "mixtral-tiny", {}), ("int8", "mixtral-tiny", {}),
    # bfloat16 compute from float32 weights, embed == expert width (as deepseek3-tiny's 64 x 64), remat, MTP: a
    # weight is found by identity only when it is not cast (qwix's shape heuristic sees wi_0, wi_1, wo alike)
    ("fp8_full", "deepseek3-test", dict(dtype="bfloat16", base_moe_mlp_dim=64, remat_policy="full", mtp_num_layers=1)),
])  # fmt: skip
def test_dense_expert_matmuls_are_quantized_like_the_grouped_ones(mode, name, model):
    """The quantization pass finds the three expert einsums (ragged_dots on the grouped path), and
    in the training gradient's jaxpr the expert matmuls (3 forward, 3 input and 3 weight gradients,
    3 recomputed under remat) run on the same 8-bit operand types in both paths; every other matmul
    is the same."""
    overrides = dict(use_qwix_quantization=True, quantization=mode, scan_layers=True, remat_policy="none") | model
    cfgs = {c: tiny_config(name, moe_compute=c, **overrides) for c in ("grouped", "dense")}
    ops = {c: quant.quantized_structure(cfg).ops for c, cfg in cfgs.items()}
    moe_paths = [path for path in ops["grouped"] if path.endswith("/mlp")]
    assert moe_paths and all(ops["grouped"][p] == {"ragged_dot": 3} for p in moe_paths), ops["grouped"]
    assert all(ops["dense"][p] == {"einsum": 3} for p in moe_paths), ops["dense"]
    found = {c: _dot_operand_types(cfg) for c, cfg in cfgs.items()}
    ragged = _low_dots(found["grouped"], "ragged_dot_general")
    all_ragged = sum(n for key, n in found["grouped"].items() if key[0] == "ragged_dot_general")
    assert sum(ragged.values()) == all_ragged >= 9, found["grouped"]  # 3 forward + 6 gradient (+ 3 remat) per MoE stack
    assert not [key for key in found["dense"] if key[0] == "ragged_dot_general"]
    low = {c: _low_dots(found[c], "dot_general") for c in found}
    extra = {key: low["dense"][key] - low["grouped"].get(key, 0) for key in low["dense"]}
    # the same operand types per matmul as the ragged_dots (the weight gradient's operand order differs)
    assert {key: n for key, n in extra.items() if n} == ragged, (low, ragged)
    others = {c: {k: n for k, n in found[c].items() if not set(k[1:]) & LOW} for c in found}
    assert others["dense"] == others["grouped"], others  # combine einsum, attention...: no expert matmul left over


def _fake_quant(a: jax.Array, channelwise: tuple[int, ...], qtype=jnp.float8_e4m3fn) -> jax.Array:
    """qwix's absmax quantization of ``a`` (one scale per index of the ``channelwise`` axes), dequantized."""
    return qarray.dequantize(qarray.quantize(a, qarray.HowToQuantize(qtype=qtype, channelwise_axes=channelwise)))


def _quantized_reference(moe: MoE, x: jax.Array, expert_scales: bool) -> np.ndarray:
    """The routed experts with fp8 operands: activations scaled per token (per (token, expert) for
    ``wo``), expert weights per output channel — per expert too (qwix's einsum: every
    non-contracted axis is channelwise) or shared by all experts (qwix's ragged_dot: ``[G, K, N]``
    is scaled over N only)."""
    weights, idx, _ = moe.route(x)
    combine = jnp.sum(jnp.where(idx[..., None] == jnp.arange(moe.spec.num_experts), weights[..., None], 0.0), axis=-2)
    w_axes = (0, 2) if expert_scales else (2,)
    wi_0, wi_1, wo = (_fake_quant(w[...], w_axes) for w in (moe.wi_0, moe.wi_1, moe.wo))
    xq = _fake_quant(x, (0, 1))
    hidden = jax.nn.silu(jnp.einsum("bsd,edh->bseh", xq, wi_0)) * jnp.einsum("bsd,edh->bseh", xq, wi_1)
    out = jnp.einsum("bseh,ehd->bsed", _fake_quant(hidden, (0, 1, 2)), wo)
    return np.asarray(jnp.einsum("bsed,bse->bsd", out, combine))


def test_quantized_experts_match_qwix_scales_of_each_path():
    """fp8 forward of one MoE layer: dense == the reference with per-expert weight scales (qwix's
    einsum, as MaxText's dense path), grouped == the reference with scales shared by all experts
    (qwix's ragged_dot); each differs from the other's reference (measured max |dy|: own <= 5e-7, other ~0.1 for |y| ~1.3)."""
    rules = [qwix.QtRule(module_path="router"), qwix.QtRule(
        module_path=".*", op_names=("dot_general", "einsum", "ragged_dot"), weight_qtype=jnp.float8_e4m3fn,
        act_qtype=jnp.float8_e4m3fn, bwd_qtype=jnp.float8_e5m2,
    )]  # fmt: skip
    x = inputs()  # the config says quantized: the dense path keeps each expert weight its own einsum operand
    for compute, (moe, _) in _pair(**MIXTRAL, use_qwix_quantization=True, quantization="fp8_full").items():
        graphdef, state = nnx.split(qwix.quantize_model(moe, quant.WeightMatmulProvider(rules), x))
        y = np.asarray(jax.jit(lambda state, x, graphdef=graphdef: nnx.merge(graphdef, state)(x)[0])(state, x))
        own, other = (_quantized_reference(moe, x, scales) for scales in (compute == "dense", compute != "dense"))
        np.testing.assert_allclose(y, own, rtol=1e-5, atol=2e-6, err_msg=compute)
        assert np.abs(y - other).max() > 1e-2, compute  # the scale granularity is visible


# --- MaxText's sparse_matmul selects it -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "compute"), [([], "grouped"), (["sparse_matmul=true"], "grouped"), (["sparse_matmul=false"], "dense")]
)
def test_maxtext_sparse_matmul_selects_moe_compute(args, compute):
    cfg, report = load_config_report(MAXTEXT_BASE, ["model_name=mixtral-tiny", "megablox=false", *args])
    assert cfg.moe_compute == compute
    line = report.startup_lines(cfg)[-1]
    assert ("every expert on every token" in line) == (compute == "dense"), line
    assert load_config(None, ["model_name=mixtral-tiny"]).moe_compute == "grouped"


def test_dense_in_a_pipeline_equals_the_grouped_sequential_model():
    """2 pipeline stages x 2 FSDP, 4 microbatches, load-balance loss: dense == grouped without a pipeline
    (the reference of tests/parity/test_pipeline.py, its bounds); quantized, the pipelined dense
    experts are still found and quantized (einsum x3 in each MoE module)."""
    overrides = dict(base_num_decoder_layers=2, load_balance_loss_weight=0.01, remat_policy="none")
    cfg = tiny_config("mixtral-tiny", **overrides, **PP2_FSDP2, moe_compute="dense")
    reference = _sequential("mixtral-tiny", tuple(sorted(overrides.items())), pipeline_spec(cfg).microbatches, 4)
    result = loss_and_grads(build_model(cfg), pipeline_batch(cfg), mesh=make_mesh(cfg, jax.devices()[:4]))
    assert_grad_parity(result, reference, **PIPELINE_BOUNDS)
    ops = quant.quantized_structure(tiny_config("mixtral-tiny", **overrides, **PP2_FSDP2, moe_compute="dense",
                                                use_qwix_quantization=True, quantization="fp8_full")).ops  # fmt: skip
    moe_paths = [path for path in ops if path.endswith("/mlp")]
    assert moe_paths and all(ops[path] == {"einsum": 3} for path in moe_paths), ops


def test_expert_biases_are_added_alike_on_every_path():
    """GPT-OSS's expert biases (``mlp_bias``; made non-zero here), added after the grouped matmuls by each row's expert
    (``expert_ffn``) or per expert (``dense_ffn``): dense and blocked = grouped (ragged_dot), values and every
    gradient, the biases' own included."""
    pair = {}
    for path in ("grouped", "dense", "blocked"):
        cfg = tiny_config("gpt-oss-tiny", **PATHS[path], load_balance_loss_weight=0.01)
        with nnx.use_eager_sharding(False):
            moe = MoE(cfg, nnx.Rngs(0), trained_router_bias=True)
        for i, name in enumerate(("wi_0_bias", "wi_1_bias", "wo_bias")):
            param = getattr(moe, name)
            param[...] = 0.5 * jax.random.normal(jax.random.key(10 + i), param.shape)
        pair[path] = (moe, cfg)
    x = inputs(dim=pair["grouped"][1].base_emb_dim)
    out = _compare(pair, x, jax.random.normal(jax.random.key(3), x.shape))
    assert all(errs["aggregate"] < 1e-5 for errs in out["errs"].values()), out["errs"]
