"""Expert parallelism == no expert parallelism: MoE output, d/dx and every parameter
gradient, jitted on meshes of the 8 fake CPU devices with parameters placed by their
logical sharding; and the EP program really communicates (collectives in the HLO)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding

from nnxtron.layers.moe import MoE
from nnxtron.parallel.sharding import activate, logical_to_spec, state_shardings
from nnxtron.tools.parity import GradResult, assert_grad_parity
from tests.conftest import tiny_config

AXES = ("data", "fsdp", "context", "expert", "tensor")
MESHES = {  # sizes in AXES order
    "ep2_fsdp4": (1, 4, 1, 2, 1),
    "ep4_data2": (2, 1, 1, 4, 1),
    "ep2_fsdp2_tp2": (1, 2, 1, 2, 2),
    "fsdp8_no_ep": (1, 8, 1, 1, 1),
}
BASE = dict(num_experts=8, num_experts_per_tok=2, base_moe_mlp_dim=32)
CASES = {
    "deepseek": dict(
        routed_score_func="sigmoid", routed_bias=True, routed_scaling_factor=2.5, n_routing_groups=4,
        topk_routing_group=2, shared_experts=1, load_balance_loss_weight=0.01, routed_bias_update_rate=0.1,
    ),
    "capacity": dict(routed_score_func="softmax", norm_topk_prob=True, capacity_factor=0.75),
    "llama4": dict(num_experts_per_tok=1, routed_score_func="sigmoid", router_scales_expert_input=True, shared_experts=1),
}  # fmt: skip
RUNS = [
    ("deepseek", "ep2_fsdp4"),
    ("deepseek", "ep4_data2"),
    ("deepseek", "ep2_fsdp2_tp2"),
    ("deepseek", "fsdp8_no_ep"),
    ("capacity", "ep4_data2"),
    ("llama4", "ep2_fsdp4"),
]


def _mesh(name: str) -> Mesh:
    return Mesh(np.asarray(jax.devices()).reshape(MESHES[name]), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def _setup(case: str, mesh_name: str | None):
    sizes = dict(zip(AXES, MESHES[mesh_name])) if mesh_name else {}
    ici = {f"ici_{a}_parallelism": s for a, s in sizes.items()}
    cfg = tiny_config("llama2-tiny", **{**BASE, **CASES[case], **ici})
    with nnx.use_eager_sharding(False):
        moe = MoE(cfg, nnx.Rngs(0))
    if cfg.routed_bias:
        moe.router_bias[...] = 0.2 * jax.random.normal(jax.random.key(7), (cfg.num_experts,))
    x = jax.random.normal(jax.random.key(1), (8, 4, cfg.base_emb_dim), jnp.float32)
    cot = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    return cfg, moe, x, cot


def _run(cfg, moe, x, cot, mesh: Mesh | None):
    """(objective, y, dx, param grads, aux, rest) jitted; with ``mesh``, sharded by the config's rules."""
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    rules = cfg.logical_axis_rules
    if mesh is not None:
        params = jax.device_put(params, state_shardings(params, mesh, rules))
        rest = jax.device_put(rest, state_shardings(rest, mesh, rules))
        token = NamedSharding(mesh, logical_to_spec(("activation_batch", "activation_length", None), rules, mesh))
        x, cot = jax.device_put(x, token), jax.device_put(cot, token)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

    def objective(params, x, rest):
        model = nnx.merge(graphdef, params, rest)
        y, aux = model(x)
        new_rest = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
        return jnp.sum(y * cot) + sum(aux.values(), jnp.float32(0)), (y, aux, new_rest)

    fn = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))
    if mesh is None:
        return fn(params, x, rest)
    with activate(mesh, rules):
        return fn(params, x, rest)


def _result(out) -> GradResult:
    (value, (_, aux, _)), (g_params, g_x) = out
    flat = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(g_params)}
    return GradResult(float(value), np.asarray(g_x), flat, {k: float(v) for k, v in aux.items()})


@pytest.mark.parametrize("case,mesh_name", RUNS)
def test_expert_parallel_matches_unsharded(case, mesh_name):
    cfg, moe, x, cot = _setup(case, mesh_name)
    if cfg.capacity_factor > 0:  # the routing must overflow, or capacity under EP is untested
        counts = np.bincount(np.asarray(moe.route(x)[1]).ravel(), minlength=cfg.num_experts)
        assert counts.max() > np.ceil(cfg.capacity_factor * counts.sum() / cfg.num_experts), counts
    ref = _run(cfg, moe, x, cot, None)
    got = _run(cfg, moe, x, cot, _mesh(mesh_name))
    y_ref, y_got = np.asarray(ref[0][1][0]), np.asarray(got[0][1][0])
    # measured: max |dy| <= 6e-7 (sharded contractions re-associate float32 sums); loss rel <= 8e-7
    np.testing.assert_allclose(y_got, y_ref, rtol=1e-5, atol=5e-6)
    errs = assert_grad_parity(_result(got), _result(ref), loss_rtol=1e-5, rel=1e-5, abs_frac=1e-6, aggregate_rel=1e-5)
    assert errs["aggregate"] < 1e-5, errs  # measured <= 1.4e-7 (input cotangent <= 1.7e-7)
    rest_ref, rest_got = ref[0][1][2], got[0][1][2]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), rest_got, rest_ref)
    if "expert_load" in rest_ref:
        assert float(np.sum(rest_ref["expert_load"])) == x.shape[0] * x.shape[1] * cfg.num_experts_per_tok


def _compiled_forward_hlo(mesh_name: str) -> str:
    cfg, moe, x, _ = _setup("deepseek", mesh_name)
    mesh, rules = _mesh(mesh_name), cfg.logical_axis_rules
    graphdef, state = nnx.split(moe)
    state = jax.device_put(state, state_shardings(state, mesh, rules))
    x = jax.device_put(x, NamedSharding(mesh, logical_to_spec(("activation_batch", "activation_length", None), rules, mesh)))
    fwd = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x)[0])
    with activate(mesh, rules):
        return fwd.lower(state, x).compile().as_text()


def _gathers(hlo: str) -> list[str]:
    return [line.split("=")[1].split()[0].split("{")[0] for line in hlo.splitlines() if "all-gather(" in line]


@pytest.mark.parametrize("mesh_name", ["ep2_fsdp4", "ep4_data2"])
def test_expert_parallel_program_communicates(mesh_name):
    """The EP forward reduce-scatters the partial expert outputs over the expert axis and
    each device holds only its E / ep experts (no full [E, D, F] weight is ever formed);
    the FSDP-only forward gathers all 8 experts and has no reduce-scatter. Routing stays
    sharded by token: the [T, E] router scores (T = 32) are never gathered."""
    ep = dict(zip(AXES, MESHES[mesh_name]))["expert"]
    hlo = _compiled_forward_hlo(mesh_name)
    assert "reduce-scatter(" in hlo, "EP forward has no reduce-scatter"
    assert any(shape.startswith("f32[") and shape.endswith(",64]") for shape in _gathers(hlo)), "tokens not gathered"
    assert f"f32[{8 // ep},64,32]" in hlo and "f32[8,64,32]" not in hlo
    assert not any(shape.startswith("f32[32,8]") for shape in _gathers(hlo)), _gathers(hlo)
    dense = _compiled_forward_hlo("fsdp8_no_ep")
    assert "reduce-scatter(" not in dense and "f32[8,64,32]" in dense


def test_capacity_and_bias_state_under_ep_with_layer_stack_remat():
    """MoE under LayerStack (scanned, remat) on an EP mesh == unsharded, including the carried load."""
    from nnxtron.parallel.remat import RematSpec
    from nnxtron.parallel.scan import LayerStack

    class Block(nnx.Module):
        def __init__(self, cfg, rngs):
            self.moe = MoE(cfg, rngs)

        def __call__(self, x):
            y, aux = self.moe(x)
            return x + y, aux

    cfg = tiny_config(
        "llama2-tiny", **BASE, **CASES["deepseek"], capacity_factor=1.0, ici_expert_parallelism=2, ici_fsdp_parallelism=4
    )
    with nnx.use_eager_sharding(False):
        stack = LayerStack(lambda r: Block(cfg, r), 2, key=jax.random.key(0), scan=True, remat=RematSpec("save_dot_except_mlp"))
    x = jax.random.normal(jax.random.key(1), (8, 4, 64))
    cot = jax.random.normal(jax.random.key(2), x.shape)
    ref = _run(cfg, stack, x, cot, None)
    got = _run(cfg, stack, x, cot, _mesh("ep2_fsdp4"))
    # the objective sum(y * cot) cancels to ~2.4 from terms of size ~1: its sharded reduction
    # order moves it by ~5e-5 absolute (2e-5 relative); gradients agree to ~1e-7
    assert_grad_parity(_result(got), _result(ref), loss_rtol=1e-4, rel=1e-5, abs_frac=1e-6, aggregate_rel=1e-5)
    load_got, load_ref = (np.asarray(out[0][1][2]["layers"]["moe"]["expert_load"]) for out in (got, ref))
    np.testing.assert_array_equal(load_got, load_ref)
    np.testing.assert_array_equal(load_ref.sum(-1), [64, 64])
