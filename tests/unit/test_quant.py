"""Quantized training (nnxtron/quant.py): which matmuls are quantized, in which types, and
that quantization changes nothing but the matmuls (state, shardings, checks).

Numerics against float32 and across strategies are in tests/parity/test_quantization.py.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxtron.config.options import QUANTIZATION_OPTIONS_OFF
from nnxtron.errors import ConfigError
from nnxtron.models import quant
from nnxtron.models.build import abstract_model, build_model
from nnxtron.parallel.mesh import make_mesh
from nnxtron.train.state import setup
from nnxtron.train.step import compute_gradients
from tests.conftest import lower_train_step, random_batch, tiny_config
from tests.helpers import is_quantized

E4M3, E5M2, INT8 = "float8_e4m3fn", "float8_e5m2", "int8"
LLAMA_MODULES = [f"layers/layers/attention/{p}" for p in ("key", "out", "query", "value")] + [
    f"layers/layers/mlp/{p}" for p in ("wi_0", "wi_1", "wo")
]


def quantized(model: str = "llama3.1-tiny", mode: str = "fp8_full", **overrides):
    return tiny_config(model, use_qwix_quantization=True, quantization=mode, **overrides)


def test_modes_map_to_forward_and_backward_types():
    expected = {
        "int8": (jnp.int8, jnp.int8),
        "fp8": (jnp.float8_e4m3fn, jnp.float8_e4m3fn),
        "fp8_e4m3": (jnp.float8_e4m3fn, jnp.float8_e4m3fn),
        "fp8_e5m2": (jnp.float8_e5m2, jnp.float8_e5m2),
        "fp8_full": (jnp.float8_e4m3fn, jnp.float8_e5m2),
    }
    for mode, (forward, backward) in expected.items():
        exclude, rule = quant.rules(quantized(mode=mode))
        assert exclude.weight_qtype is None and exclude.act_qtype is None and exclude.module_path == ".*/(router|.*_hc)"
        assert (rule.weight_qtype, rule.act_qtype, rule.bwd_qtype) == (forward, forward, backward), mode
        assert set(rule.op_names) == {"dot_general", "einsum", "ragged_dot"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_quantizes_exactly_the_layer_projections(dtype):
    """With bfloat16 compute the weight operand is a cast of the parameter: still found."""
    ops = quant.quantized_structure(quantized(dtype=dtype)).ops
    assert sorted(ops) == sorted(LLAMA_MODULES)
    assert all(counts == {"dot_general": 1} for counts in ops.values())


def test_deepseek3_quantizes_mla_experts_and_mtp_but_not_router_embedding_or_head():
    """The quantization pass runs the real forward with targets: the MTP depth is traced
    (and quantized) — the reference system's pass crashed here for want of targets."""
    ops = quant.quantized_structure(quantized("deepseek3-test", mtp_num_layers=1)).ops
    assert ops["moe_layers/layers/mlp"] == {"ragged_dot": 3}  # the grouped expert matmuls
    assert {"mtp/depths/0/projection", "mtp/depths/0/block/mlp", "mtp/depths/0/block/attention/wq_a"} <= set(ops)
    assert {"dense_layers/layers/attention/wkv_b", "moe_layers/layers/mlp/shared/wo"} <= set(ops)
    for path in ops:
        assert re.fullmatch(r"(.*layers|mtp)/.*", path) and not re.search(r"router|embed|logits|_hc", path), path


def test_deepseek4_keeps_hyper_connections_and_routers_unquantized():
    ops = quant.quantized_structure(quantized("deepseek4-test")).ops
    assert "layers/layers/cycle/1/attention/indexer/wq_b" in ops and "layers/layers/cycle/0/attention" in ops  # wo_a einsum
    assert not [path for path in ops if re.search(r"_hc|router|hyper_head", path)]


@pytest.mark.parametrize(
    "model, projections",
    [
        ("qwen3-next-tiny", ("in_proj_qkvz", "in_proj_ba")),
        ("qwen3.5-tiny", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
    ],
)
def test_qwen3_next_quantizes_its_projections_not_its_recurrence(model, projections):
    """Every weight matmul of the Gated DeltaNet (Qwen3-Next's fused input projections or Qwen3.5's split ones, out),
    the gated attention and the MoE (grouped experts, shared expert and its gate) is quantized; the delta rule's
    products of activations (state, keys, queries, the chunk's triangular system) and the elementwise conv are not:
    no op at the mixer's own path."""
    ops = quant.quantized_structure(quantized(model)).ops
    deltanet = {f"attention/{p}" for p in (*projections, "out")}
    attention = {f"attention/{p}" for p in ("query", "key", "value", "out")}
    moe = {"mlp", *(f"mlp/shared/{p}" for p in ("wi_0", "wi_1", "wo")), "mlp/shared_gate"}
    expected = {f"layers/layers/cycle/0/{p}" for p in deltanet | moe} | {f"layers/layers/cycle/1/{p}" for p in attention | moe}
    expected |= {f"remainder_layers/layers/{p}" for p in deltanet | moe}  # the 3-layer preset: DeltaNet, full, DeltaNet
    assert set(ops) == expected
    assert all(counts == ({"ragged_dot": 3} if path.endswith("/mlp") else {"dot_general": 1}) for path, counts in ops.items())


def test_gpt_oss_quantizes_its_expert_kernels_not_their_biases():
    """GPT-OSS's expert biases (mlp_bias) are added after the grouped matmuls, so qwix quantizes the three expert
    kernels (the parameters themselves) and nothing else of the MoE: three ragged_dots, no bias matmul."""
    ops = quant.quantized_structure(quantized("gpt-oss-tiny")).ops
    assert {path: counts for path, counts in ops.items() if path.endswith("/mlp")} == {
        f"layers/layers/cycle/{i}/mlp": {"ragged_dot": 3} for i in range(2)
    }
    assert all(re.search(r"/attention/(query|key|value|out)$", path) for path in ops if not path.endswith("/mlp")), ops


def test_module_path_options_select_what_is_quantized():
    only_mlp = quant.quantized_structure(quantized(qwix_module_path=".*/mlp/.*")).ops
    assert sorted(only_mlp) == [p for p in LLAMA_MODULES if "/mlp/" in p]
    no_out = quant.quantized_structure(quantized(qwix_exclude_module_path=".*/(out|wo)")).ops
    assert sorted(no_out) == [p for p in LLAMA_MODULES if not p.endswith(("/out", "/wo"))]
    with pytest.raises(ConfigError, match="quantizes no matmul"):
        quant.quantized_structure(quantized(qwix_module_path="nothing/.*"))


def _dot_operand_types(cfg) -> collections.Counter:
    """(primitive, lhs dtype, rhs dtype) of every matmul in the training gradient's jaxpr."""
    graphdef, params, rest = nnx.split(build_model(cfg), nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    batch = {k: jnp.asarray(v) for k, v in random_batch(cfg, batch=2, seq=16).items()}
    jaxpr = jax.make_jaxpr(lambda p, r, b: compute_gradients(graphdef, p, r, b).grads)(params, rest, batch)
    found: collections.Counter = collections.Counter()

    def walk(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
                found[(eqn.primitive.name, *(str(v.aval.dtype) for v in eqn.invars[:2]))] += 1
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jaxpr.jaxpr)
    return found


LOW = {E4M3, E5M2, INT8}


@pytest.mark.parametrize(
    "mode, forward, backward",
    [("fp8_full", (E4M3, E4M3), (E5M2, E4M3)), ("int8", (INT8, INT8), (INT8, INT8)), ("fp8_e5m2", (E5M2, E5M2), (E5M2, E5M2))],
)
def test_quantized_matmuls_are_visible_in_the_gradient_jaxpr(mode, forward, backward):
    """Scanned llama, no remat: the 7 weight matmuls of the layer body run on 8-bit operands
    forward, and their 14 gradient matmuls (input and weight) take the backward type;
    attention scores and the output head stay float32."""
    overrides = dict(base_num_decoder_layers=2, scan_layers=True, remat_policy="none")
    plain = _dot_operand_types(tiny_config("llama3.1-tiny", **overrides))
    assert not [key for key in plain if set(key[1:]) & LOW]
    found = _dot_operand_types(quantized(mode=mode, **overrides))
    low = {key: n for key, n in found.items() if set(key[1:]) & LOW}
    if forward == backward:
        assert low == {("dot_general", *forward): 7 + 14}, found
    else:
        assert low == {("dot_general", *forward): 7, ("dot_general", *backward): 14}, found
    assert sum(found.values()) == sum(plain.values())  # same matmuls, only their operand types differ
    assert found[("dot_general", "float32", "float32")] == plain[("dot_general", "float32", "float32")] - 21


def test_moe_grouped_matmuls_are_quantized_both_ways():
    found = _dot_operand_types(quantized("mixtral-tiny", scan_layers=True, remat_policy="none"))
    ragged = {key: n for key, n in found.items() if key[0] == "ragged_dot_general"}
    assert ragged == {
        ("ragged_dot_general", E4M3, E4M3): 3,
        ("ragged_dot_general", E5M2, E4M3): 3,  # input gradient
        ("ragged_dot_general", E4M3, E5M2): 3,  # expert-weight gradient
    }, ragged


def test_quantization_leaves_state_and_values_untouched():
    """The pass runs a real forward (MoE expert-load counting included) on an abstract copy:
    the quantized model holds exactly the values of the model it was given."""
    overrides = dict(routed_bias_update_rate=0.01, mtp_num_layers=1)
    plain = build_model(tiny_config("deepseek3-test", **overrides))
    model = build_model(quantized("deepseek3-test", **overrides))
    assert is_quantized(model) and not is_quantized(plain)
    a, b = nnx.to_flat_state(nnx.state(plain)), nnx.to_flat_state(nnx.state(model))
    assert [path for path, _ in a] == [path for path, _ in b]
    for (path, x), (_, y) in zip(a, b):
        assert type(x) is type(y), path
        assert x.get_metadata() == y.get_metadata(), path
        np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]), err_msg=str(path))


def _sharding_annotations(text: str) -> collections.Counter:
    return collections.Counter(re.findall(r'mhlo\.sharding = "([^"]*)"', text))


def test_shardings_identical_with_and_without_quantization():
    """deepseek3-tiny with MTP on 4 fake devices: the parameter and optimizer-state
    shardings, the unsharded-parameter check and every sharding annotation of the lowered
    train step are the same with quantization as without."""
    results = []
    for q in (False, True):
        values = dict(mtp_num_layers=1, max_target_length=16, per_device_batch_size=1)
        cfg = quantized("deepseek3-tiny", **values) if q else tiny_config("deepseek3-tiny", **values)
        model_setup, lowered = lower_train_step(cfg, 4)
        results.append((model_setup, _sharding_annotations(lowered.as_text())))
    (plain, plain_hlo), (q, q_hlo) = results
    assert is_quantized(nnx.merge(q.graphdef, q.abstract_state["params"], q.abstract_state["rest"]))
    assert jax.tree.leaves(plain.state_shardings) == jax.tree.leaves(q.state_shardings)
    assert jax.tree.structure(plain.state_shardings) == jax.tree.structure(q.state_shardings)
    assert plain.unsharded_fraction == q.unsharded_fraction <= 0.02
    assert plain_hlo == q_hlo


def test_quantized_structure_is_built_once_per_config():
    cfg = quantized()
    assert quant.quantized_structure(cfg) is quant.quantized_structure(cfg)
    assert nnx.graphdef(abstract_model(cfg)) == nnx.graphdef(build_model(cfg))


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (dict(use_qwix_quantization=True, quantization="int4"), "config key 'quantization'"),
        (dict(quantization="fp8"), "needs use_qwix_quantization=true"),
        (dict(use_qwix_quantization=True), "needs quantization="),
        (dict(quantization_tile_size=32), "quantization_tile_size is set but quantization is off"),
        (dict(use_qwix_quantization=True, quantization="fp8", qwix_module_path="(layers"), "not a valid regular expression"),
        (
            dict(use_qwix_quantization=True, quantization="int8", act_quantization_calibration_method="mean"),
            "unknown calibration",
        ),
        (dict(use_qwix_quantization=True, quantization="int8", bwd_quantization_calibration_method="rms"), "rms takes 1 number"),
        (
            dict(use_qwix_quantization=True, quantization="int8", weight_quantization_calibration_method="absmax,x"),
            "'x' is not a number",
        ),
        (
            dict(model_name="mixtral-tiny", use_qwix_quantization=True, quantization="fp8", quantization_tile_size=16),
            "MoE grouped",
        ),
        (
            dict(use_qwix_quantization=True, quantization="int8", weight_quantization_calibration_method="minmax"),
            "minmax calibration adds a zero point",
        ),
        (
            dict(use_qwix_quantization=True, quantization="int8", act_quantization_calibration_method="minmax,0.9"),
            "minmax calibration adds a zero point",
        ),
    ],
)
def test_bad_quantization_options_fail_at_load(overrides, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        tiny_config(**overrides)


def test_options_off_values_are_the_base_defaults():
    cfg = tiny_config()
    assert {key: getattr(cfg, key) for key in QUANTIZATION_OPTIONS_OFF} == QUANTIZATION_OPTIONS_OFF


def test_tile_size_that_does_not_divide_fails_at_setup():
    with pytest.raises(ConfigError, match="qwix cannot quantize this model"):
        build_model(quantized(quantization_tile_size=7))


def test_a_backend_that_cannot_run_the_mode_is_one_clear_error(monkeypatch):
    def unsupported(*args, **kwargs):
        raise RuntimeError("UNIMPLEMENTED: float8_e5m2 dot is not supported on this backend\nmore detail")

    quant._probe.cache_clear()
    monkeypatch.setattr(quant.qwix, "quantize_model", unsupported)
    try:
        with pytest.raises(ConfigError, match=r"the cpu backend cannot run float8_e4m3fn/float8_e5m2 matmuls \(UNIMPLEMENTED"):
            setup(quantized(), make_mesh(tiny_config()), optax.sgd(0.1))
    finally:
        monkeypatch.undo()
        quant._probe.cache_clear()
    quant.check_backend(quantized())  # the real probe passes on this backend


def test_configs_in_one_process_never_share_a_quantized_trace():
    """JAX caches remat/scan body traces by the layers' graphdef: two quantization modes
    (and an unquantized model) traced one after the other must each get their own types."""
    overrides = dict(base_num_decoder_layers=2, scan_layers=True, remat_policy="full")
    for mode, types in (("fp8_e4m3", {E4M3}), ("int8", {INT8}), (None, set())):
        cfg = quantized(mode=mode, **overrides) if mode else tiny_config("llama3.1-tiny", **overrides)
        found = {t for key in _dot_operand_types(cfg) for t in key[1:]} & LOW
        assert found == types, (mode, found)
