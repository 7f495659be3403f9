"""Sharding annotations and shardings survive forward+backward passes, for one stack and
for DeepSeek-V3 (two scanned stacks with their own axis names, MLA, MoE, an MTP depth),
and the unsharded-parameter check holds for the real deepseek3-tiny layout."""

import jax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from nnxtron.models.build import build_model
from nnxtron.models.loss import cross_entropy
from nnxtron.parallel.mesh import make_mesh
from nnxtron.parallel.sharding import (
    activate,
    check_unsharded,
    logical_to_spec,
    state_shardings,
    unsharded_report,
    variable_names,
)
from nnxtron.params import flatten
from nnxtron.train.state import model_shardings
from tests.conftest import random_batch, tiny_config


def _annotations(model) -> dict:
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return {jax.tree_util.keystr(path): variable_names(v) for path, v in leaves}


def test_deepseek3_tiny_with_mtp_leaves_under_two_percent_unsharded():
    """The acceptance layout: deepseek3-tiny + one MTP depth on 4 devices, ici_fsdp_parallelism=4."""
    cfg = tiny_config("deepseek3-tiny", mtp_num_layers=1, ici_fsdp_parallelism=4)
    mesh = make_mesh(cfg, jax.devices()[:4])
    _, params, _, param_shardings, _ = model_shardings(cfg, mesh)
    fraction, offenders = unsharded_report(params, param_shardings, mesh)
    assert fraction <= 0.02 and check_unsharded(params, param_shardings, mesh, cfg.sharding_tolerance) == fraction
    assert all("norm" in path for path, *_ in offenders), offenders[:3]  # only norm scales stay whole


@pytest.mark.parametrize("kind", ["single_stack", "deepseek_two_stacks"])
def test_annotations_and_shardings_unchanged_after_three_steps(kind):
    if kind == "single_stack":
        cfg = tiny_config("llama3.1-tiny", ici_fsdp_parallelism=4, ici_tensor_parallelism=2)
    else:
        cfg = tiny_config("deepseek3-test", mtp_num_layers=1, ici_fsdp_parallelism=4, ici_expert_parallelism=2)
    rules, mesh = cfg.logical_axis_rules, make_mesh(cfg)
    with nnx.use_eager_sharding(False):
        model = build_model(cfg)
    before = _annotations(model)
    if kind != "single_stack":
        names = {n for v in before.values() for n in v}
        assert {"dense_layers", "moe_layers", "exp"} <= names and "layers" not in names
    graphdef, params = nnx.split(model)
    shardings = nnx.to_pure_dict(state_shardings(params, mesh, rules))
    params = jax.device_put(nnx.to_pure_dict(params), shardings)
    expected = {k: s for k, s in flatten(shardings).items()}
    batch_sharding = NamedSharding(mesh, logical_to_spec(("activation_batch", "activation_length"), rules, mesh))
    batch = {k: jax.device_put(v, batch_sharding) for k, v in random_batch(cfg, batch=8, seq=16, packed=True).items()}

    @jax.jit  # no out_shardings: the propagated shardings are what is checked
    def step(params, batch):
        with activate(mesh, rules):

            def loss_fn(p):
                out = nnx.merge(graphdef, p)(
                    batch["inputs"], batch["positions"], batch["segment_ids"], batch["targets"], batch["loss_mask"]
                )
                return cross_entropy(out.logits, batch["targets"], batch["loss_mask"])[0] + sum(
                    out.aux.get("losses", {}).values()
                )

            grads = jax.grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    for _ in range(3):
        params = step(params, batch)
        model = nnx.merge(graphdef, params)
        assert _annotations(model) == before
        for path, array in flatten(params).items():
            assert array.sharding.is_equivalent_to(expected[path], array.ndim), (path, array.sharding, expected[path])
