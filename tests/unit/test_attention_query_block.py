"""attention_query_block (docs/attention.md): attention over blocks of queries computes the
same values and gradients as the whole sequence at once, for every mask and both
implementations, for MLA (key and value head dims differ) and under a mesh with the sequence
sharded; one block's scores are alive at a time (XLA's memory analysis); the key is refused
where it cannot apply.

Measured on this CPU (jax 0.10.2, float32): blocked and whole attention agree to <= 3.6e-7
on outputs and q/k/v gradients (the same operations per query row; XLA's matmul tiling
differs); bound 2e-6. Memory: a 4-head, 512-token attention's forward + backward needs
16.3 MiB of temporaries whole and 2.9 MiB in 8 blocks. Mutations that turn these red: the
blocks taken contiguously while the output is put back strided (14 of the 20 equality
cases), the per-block ``jax.checkpoint`` removed (the memory test).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnxtron.config import load_config
from nnxtron.errors import ConfigError
from nnxtron.layers.attention import attend
from nnxtron.models.build import build_model
from nnxtron.parallel.mesh import make_mesh
from nnxtron.tools.parity import assert_grad_parity, loss_and_grads
from tests.conftest import random_batch, tiny_config

SEGMENTS = np.array([[1] * 5 + [2] * 6 + [3] * 3 + [0] * 2, [1] * 16], np.int32)
CASES = {  # name: (query heads, kv heads, key dim, value dim, sliding_window, chunk_size)
    "causal_packed": (4, 4, 8, 8, 0, 0),
    "gqa_sliding": (4, 2, 8, 8, 5, 0),
    "gqa_chunked": (4, 2, 8, 8, 0, 4),
    "mla_dims": (4, 4, 12, 8, 0, 0),  # MLA: key dim (nope + rope) != value dim
}
TOLERANCE = dict(rtol=0, atol=2e-6)
MODEL_BOUNDS = dict(loss_rtol=1e-6, rel=1e-5, abs_frac=1e-6, aggregate_rel=5e-6)


def _forward_backward(case: str, implementation: str, block: int):
    heads, kv_heads, dk, dv, window, chunk = CASES[case]
    keys = jax.random.split(jax.random.key(0), 4)
    batch, seq = SEGMENTS.shape
    q = jax.random.normal(keys[0], (batch, seq, heads, dk))
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, dk))
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, dv))
    cotangent = jax.random.normal(keys[3], (batch, seq, heads, dv))

    def f(q, k, v):
        return attend(
            q, k, v, SEGMENTS, scale=0.3, sliding_window=window, chunk_size=chunk, dtype=q.dtype,
            implementation=implementation, query_block=block,
        )  # fmt: skip

    out, vjp = jax.vjp(f, q, k, v)
    return out, *vjp(cotangent)


PAIRS = [(case, impl) for case, dims in CASES.items() for impl in ("xla", "dot_product") if impl == "xla" or dims[2] == dims[3]]
# dot_product needs equal key and value head dims (MLA runs xla)


@pytest.fixture(scope="module")
def computed():
    """Every case and implementation, whole and in blocks of 4 and 8 (one compile)."""
    return jax.jit(lambda: {(*pair, block): _forward_backward(*pair, block) for pair in PAIRS for block in (0, 4, 8)})()


@pytest.mark.parametrize("case, implementation", PAIRS)
@pytest.mark.parametrize("block", [4, 8])
def test_blocked_queries_equal_whole_attention(computed, case, implementation, block):
    reference = computed[case, implementation, 0]
    for name, got, ref in zip(("output", "d/dq", "d/dk", "d/dv"), computed[case, implementation, block], reference):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), err_msg=f"{case} {implementation} {name}", **TOLERANCE)


def _temporaries(block: int) -> int:
    q = jax.ShapeDtypeStruct((1, 512, 4, 16), jnp.float32)
    segments = jax.ShapeDtypeStruct((1, 512), jnp.int32)

    def loss(q, segments):
        out = attend(q, q, q, segments, scale=0.25, sliding_window=0, dtype=q.dtype, query_block=block)
        return jnp.sum(out**2)

    compiled = jax.jit(jax.grad(loss)).lower(q, segments).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_one_block_of_scores_is_alive_at_a_time():
    """XLA's memory analysis of forward + backward: 8 blocks need well under half the
    temporaries (whole: [4, 512, 512] float32 scores, probabilities and their gradients)."""
    whole, blocked = _temporaries(0), _temporaries(64)
    assert blocked < 0.4 * whole, (blocked, whole)


@pytest.mark.parametrize(
    "model, mesh",
    [
        ("llama3.1-tiny", {}),
        ("deepseek3-test", {}),  # MLA
        (
            "llama3.1-tiny",
            {
                "ici_context_parallelism": 2,
                "ici_tensor_parallelism": 2,
                "ici_fsdp_parallelism": 2,
                "context_parallel_strategy": "all_gather",
            },
        ),
    ],
)
def test_models_train_the_same_in_query_blocks(model, mesh):
    """Loss, input cotangent and every parameter gradient, packed documents; with the
    sequence sharded over the context axis (all_gather) the strided blocks stay sharded."""
    overrides = dict(base_num_decoder_layers=2, max_target_length=16, per_device_batch_size=1, **mesh)
    results = {}
    for block in (0, 4):
        cfg = tiny_config(model, attention_query_block=block, **overrides)
        devices = jax.devices()[: cfg.ici_context_parallelism * cfg.ici_tensor_parallelism * cfg.ici_fsdp_parallelism]
        batch = random_batch(
            cfg, batch=2 * len(devices) // cfg.ici_tensor_parallelism // cfg.ici_context_parallelism, seq=16, packed=True
        )
        results[block] = loss_and_grads(build_model(cfg), batch, mesh=make_mesh(cfg, devices) if mesh else None)
    assert_grad_parity(results[4], results[0], **MODEL_BOUNDS)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"attention_query_block": 5}, "does not divide max_target_length"),
        ({"attention_query_block": 4, "attention": "cudnn", "dtype": "bfloat16"}, "applies to attention=xla or dot_product"),
        (
            {"attention_query_block": 4, "ici_context_parallelism": 2, "context_parallel_strategy": "ring"},
            "does not apply to ring attention",
        ),
        (
            {"attention_query_block": 2, "ici_context_parallelism": 4, "context_parallel_strategy": "all_gather"},
            "not a multiple of ici_context_parallelism=4",
        ),
    ],
)
def test_config_refuses_what_query_blocks_cannot_do(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(values={"model_name": "llama3.1-tiny", "max_target_length": 16, **overrides})


def test_compressed_attention_refuses_query_blocks():
    with pytest.raises(ConfigError, match="attention_type=compressed"):
        load_config(values={"model_name": "deepseek4-test", "attention_query_block": 4})


def test_a_sequence_the_block_does_not_divide_is_refused():
    q = jnp.zeros((1, 12, 2, 4))
    with pytest.raises(ConfigError, match="does not divide the sequence length 12"):
        attend(q, q, q, jnp.ones((1, 12), jnp.int32), scale=1.0, sliding_window=0, dtype=q.dtype, query_block=8)
