"""``PipelinedStack`` outside any mesh: explicit about it. By default (what the Decoder builds)
the blocks run in order, the same function; ``sequential_without_mesh=False`` refuses with a
``ConfigError`` naming the missing mesh with a ``stage`` axis. No compile: eager tiny blocks,
and the refusal comes before any computation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxtron.config.pipeline import PipelineSpec
from nnxtron.errors import ConfigError
from nnxtron.parallel.pipeline import PipelinedStack
from nnxtron.parallel.remat import RematSpec
from nnxtron.parallel.scan import LayerStack

SPEC = PipelineSpec("layers", 1, 2, 2, 1, 1)  # 2 stages, 2 microbatches, 1 repeat, 1 layer per stage


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.bias = nnx.Param(jax.random.normal(rngs.params(), (4,)), out_sharding=("embed",))

    def __call__(self, x):
        return jnp.tanh(x + self.bias[...])


def _stack(cls=PipelinedStack, **kwargs):
    with nnx.use_eager_sharding(False):
        if cls is LayerStack:
            return LayerStack(Block, SPEC.blocks, key=jax.random.key(0), scan=True, remat=RematSpec("full"), axis_name="layers")
        return PipelinedStack(
            Block, SPEC.blocks, key=jax.random.key(0), remat=RematSpec("full"), axis_name="layers", pipeline=SPEC, **kwargs
        )


X = jnp.ones((4, 3, 4))


def test_refuses_without_a_mesh_when_asked_to():
    stack = _stack(sequential_without_mesh=False)
    with pytest.raises(ConfigError) as err:
        stack(X)
    message = str(err.value)
    assert "'stage' axis of 2 devices" in message and "ici_pipeline_parallelism" in message and "no mesh is active" in message


def test_default_applies_the_blocks_in_order_without_a_mesh():
    """The documented default (the Decoder's): the plain scanned stack's function, on the same weights."""
    stack = _stack()
    assert stack.sequential_without_mesh is True
    np.testing.assert_array_equal(np.asarray(stack(X)[0]), np.asarray(_stack(LayerStack)(X)[0]))
