"""Sharding annotations and shardings survive forward+backward passes, for one stack and
for a model with two scanned stacks of different axis names (the DeepSeek-style layout)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from nnxtron.decoder import build_model
from nnxtron.layers.embed import Embed
from nnxtron.layers.norms import RMSNorm
from nnxtron.models.llama import LlamaBlock
from nnxtron.parallel.mesh import make_mesh
from nnxtron.parallel.remat import RematSpec
from nnxtron.parallel.scan import LayerStack
from nnxtron.parallel.sharding import activate, logical_to_spec, state_shardings, variable_names
from nnxtron.params import flatten
from nnxtron.train.loss import cross_entropy
from tests.conftest import random_batch, tiny_config


class TwoStacks(nnx.Module):
    """embed -> 1 'dense_layers' block -> 2 'moe_layers' blocks -> norm -> tied head."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        k1, k2, k3 = jax.random.split(rngs.params(), 3)
        kw = dict(dtype=jnp.float32, weight_dtype=jnp.float32)
        self.embed = Embed(cfg.vocab_size, cfg.base_emb_dim, rngs=nnx.Rngs(k1), **kw)
        block = lambda r: LlamaBlock(cfg, r)  # noqa: E731
        remat = RematSpec("full")
        self.dense = LayerStack(block, 1, key=k2, scan=True, remat=remat, axis_name="dense_layers")
        self.moe = LayerStack(block, 2, key=k3, scan=True, remat=remat, axis_name="moe_layers")
        self.norm = RMSNorm(cfg.base_emb_dim, eps=1e-5, **kw)

    def __call__(self, tokens, positions, segment_ids):
        x = self.dense(self.embed(tokens), positions, segment_ids)
        return self.embed.attend(self.norm(self.moe(x, positions, segment_ids)))


def _annotations(model) -> dict:
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return {jax.tree_util.keystr(path): variable_names(v) for path, v in leaves}


@pytest.mark.parametrize("kind", ["single_stack", "two_stacks"])
def test_annotations_and_shardings_unchanged_after_three_steps(kind):
    cfg = tiny_config(
        "llama3.1-tiny",
        ici_fsdp_parallelism=4,
        ici_tensor_parallelism=2,
        logical_axis_rules=[
            *[[n, list(a)] for n, a in tiny_config().logical_axis_rules],
            ["dense_layers", []],
            ["moe_layers", []],
        ],
    )
    rules, mesh = cfg.logical_axis_rules, make_mesh(cfg)
    with nnx.use_eager_sharding(False):
        model = build_model(cfg) if kind == "single_stack" else TwoStacks(cfg, nnx.Rngs(0))
    before = _annotations(model)
    if kind == "two_stacks":
        names = {n for v in before.values() for n in v}
        assert {"dense_layers", "moe_layers"} <= names and "layers" not in names
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
                logits = nnx.merge(graphdef, p)(batch["inputs"], batch["positions"], batch["segment_ids"])
                logits = getattr(logits, "logits", logits)
                return cross_entropy(logits, batch["targets"], batch["loss_mask"])[0]

            grads = jax.grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    for _ in range(3):
        params = step(params, batch)
        model = nnx.merge(graphdef, params)
        assert _annotations(model) == before
        for path, array in flatten(params).items():
            assert array.sharding.is_equivalent_to(expected[path], array.ndim), (path, array.sharding, expected[path])
