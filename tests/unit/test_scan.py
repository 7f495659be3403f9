"""The scan primitive: stacking-axis metadata and remat, checked structurally."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax._src import ad_checkpoint

from nnxtron.config.options import REMAT_POLICIES
from nnxtron.models.build import build_model
from nnxtron.parallel.scan import add_stack_axis, remove_stack_axis
from nnxtron.parallel.sharding import variable_names
from tests.conftest import random_batch, tiny_config


def _param(shape, names):
    return nnx.Param(jnp.zeros(shape), out_sharding=names, eager_sharding=False)


def test_add_and_remove_stack_axis_round_trip():
    state = {"w": _param((3, 4, 5), ("embed", "mlp"))}
    stacked = add_stack_axis(state, "layers")
    assert variable_names(stacked["w"]) == ("layers", "embed", "mlp")
    assert variable_names(state["w"]) == ("embed", "mlp")  # input untouched
    sliced = {"w": stacked["w"].replace(stacked["w"][...][0])}
    assert variable_names(remove_stack_axis(sliced, "layers")["w"]) == ("embed", "mlp")


def test_stack_axis_functions_raise_on_rank_mismatch():
    with pytest.raises(ValueError, match="rank 2 but sharding names"):
        add_stack_axis({"w": _param((4, 5), ("embed", "mlp"))})  # values not stacked
    with pytest.raises(ValueError, match="rank 3 but sharding names"):
        remove_stack_axis({"w": _param((3, 4, 5), ("layers", "embed", "mlp"))})  # values still stacked
    with pytest.raises(ValueError, match="no 'layers' at axis 0"):
        remove_stack_axis({"w": _param((5,), ("embed", "mlp"))})


def test_scanned_params_record_the_layers_axis():
    model = build_model(tiny_config("llama2-tiny"))
    kernel = model.layers.layers.attention.query.kernel
    assert kernel.shape == (3, 64, 4, 16)
    assert variable_names(kernel) == ("layers", "embed", "q_heads", "head_dim")


def _count_remat(jaxpr) -> int:
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive is ad_checkpoint.remat_p:
            count += 1
        for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else _subjaxprs(eqn):
            count += _count_remat(sub)
    return count


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
                yield item.jaxpr
            elif hasattr(item, "eqns"):
                yield item


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("policy", REMAT_POLICIES)
def test_remat_applied_by_identity(scan, policy):
    """Every policy but none puts a checkpoint around each layer (one inside the scan body)."""
    expected = 0 if policy == "none" else "per_layer"
    cfg = tiny_config("llama2-tiny", scan_layers=scan, remat_policy=policy)
    model = build_model(cfg)
    graphdef, state = nnx.split(model)
    batch = random_batch(cfg, batch=2, seq=8)

    def loss(state):
        return nnx.merge(graphdef, state)(batch["inputs"]).logits.sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss))(state).jaxpr
    count = _count_remat(jaxpr)
    if expected == 0:
        assert count == 0
    else:  # one checkpoint inside the scan body, or one per unrolled layer
        assert count == (1 if scan else cfg.base_num_decoder_layers)
