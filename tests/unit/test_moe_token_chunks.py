"""moe_token_chunks (docs/moe.md): the routed experts over pieces of each device's tokens
compute the same values and gradients as all tokens at once — dropless, with capacity, with
the router scaling the expert input, and under expert parallelism — with one piece's grouped
rows alive at a time (XLA's memory analysis); the key is refused where it cannot apply.

Bounds (float32): outputs within 2e-6, gradients within the strategy bounds (the same
operations per token; the weight gradients summed piece by piece). Memory: a 16-expert layer's forward + backward on
4096 tokens needs 45.5 MiB of temporaries whole and 11.8 MiB in 8 pieces.
Mutations that turn these red: the routing of each piece shifted to the next piece (7 of 7
equality tests), the per-piece ``jax.checkpoint`` removed (the memory test).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxtron.config import load_config
from nnxtron.errors import ConfigError
from nnxtron.layers.moe import MoE
from nnxtron.models.build import build_model
from nnxtron.parallel.mesh import make_mesh
from nnxtron.tools.parity import assert_grad_parity, loss_and_grads
from tests.conftest import random_batch, tiny_config
from tests.unit.test_moe import CASES, _grads, forward, inputs, make

BOUNDS = dict(loss_rtol=1e-6, rel=1e-5, abs_frac=1e-6, aggregate_rel=5e-6)
LAYER_CASES = {
    "dropless": CASES["deepseek3"],
    "capacity": dict(CASES["mixtral"], capacity_factor=0.5),
    "scaled_input": CASES["llama4"],
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
@pytest.mark.parametrize("chunks", [2, 4])
def test_chunked_experts_equal_all_tokens_at_once(case, chunks):
    x = inputs()
    cot = jax.random.normal(jax.random.key(3), x.shape)
    results = {}
    for n in (1, chunks):
        moe, _ = make(**LAYER_CASES[case], moe_token_chunks=n)
        assert moe.token_chunks == n  # the key is read
        results[n] = (np.asarray(forward(moe, x)[0]), _grads(lambda m, x: m(x)[0], moe, x, cot))
    np.testing.assert_allclose(results[chunks][0], results[1][0], rtol=0, atol=2e-6)
    assert_grad_parity(results[chunks][1], results[1][1], **BOUNDS)


def test_chunked_experts_under_expert_parallelism():
    """Whole mixtral-tiny model, experts over 2 devices x fsdp 4: loss, input cotangent and
    every parameter gradient."""
    results = {}
    for chunks in (1, 2):
        cfg = tiny_config(
            "mixtral-tiny", moe_token_chunks=chunks, ici_expert_parallelism=2, ici_fsdp_parallelism=4,
            base_num_decoder_layers=2, max_target_length=16, per_device_batch_size=1,
        )  # fmt: skip
        results[chunks] = loss_and_grads(
            build_model(cfg), random_batch(cfg, batch=8, seq=16), mesh=make_mesh(cfg, jax.devices()[:8])
        )
    assert_grad_parity(results[2], results[1], **BOUNDS)


def _temporaries(chunks: int) -> int:
    cfg = tiny_config("llama2-tiny", num_experts=16, num_experts_per_tok=4, base_moe_mlp_dim=64, moe_token_chunks=chunks)
    with nnx.use_eager_sharding(False):
        moe = MoE(cfg, nnx.Rngs(0))
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params, rest)(x)[0] ** 2)

    x = jax.ShapeDtypeStruct((2, 2048, cfg.base_emb_dim), jnp.float32)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_one_piece_of_grouped_rows_is_alive_at_a_time():
    whole, chunked = _temporaries(1), _temporaries(8)
    assert chunked < 0.5 * whole, (chunked, whole)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model_name": "llama2-tiny", "moe_token_chunks": 2}, "this model is dense"),
        ({"model_name": "mixtral-tiny", "moe_token_chunks": 2, "moe_compute": "dense"}, "applies to moe_compute=grouped"),
    ],
)
def test_config_refuses_what_token_chunks_cannot_do(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(values=overrides)


def test_a_token_count_the_chunks_do_not_divide_is_refused():
    moe, _ = make(moe_token_chunks=3)
    with pytest.raises(ConfigError, match="moe_token_chunks=3 does not divide the 16 tokens"):
        forward(moe, inputs())
