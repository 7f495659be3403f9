"""Ring attention (context_parallel_strategy=ring, parallel/ring_attention.py) against one device.

Two levels, both on the mesh fsdp 2 x context 4 (8 fake devices), with and without causal
load balancing (the zig-zag order inside attention):

* the attention function: ``ring_attention`` against ``masked_attention`` with
  ``attention_mask`` on the same q, k, v (values and the q/k/v gradients), for causal
  attention over packed documents with padding, sliding windows narrower and wider than a
  device's chunk, Llama 4 chunks that straddle device boundaries, GQA and MLA-shaped heads
  (dk != dv). Measured in float32 on CPU (2026-12): relative errors <= 6e-7 (outputs) and
  <= 3e-7 (gradients); the bound 5e-6 leaves ~10x headroom, far below a real bug (a
  dropped mask or a lost running max is O(1));
* whole models: loss, input cotangent and every parameter gradient against one device
  (``tools.parity``, the strategy-matrix bounds) for GQA (llama3.1-tiny), a sliding window
  (mistral-tiny), chunks (llama4-tiny) and MLA (deepseek3-test), on packed batches. The
  strategy matrix's ``fsdp2_context4`` rows run the ring with load balancing (the default).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnxtron.config.derived import derive
from nnxtron.errors import ConfigError
from nnxtron.layers.attention import attention_mask, masked_attention
from nnxtron.models.build import build_model
from nnxtron.parallel.mesh import make_mesh
from nnxtron.parallel.ring_attention import ring_attention
from nnxtron.parallel.sharding import activate
from nnxtron.tools.parity import assert_grad_parity, loss_and_grads
from tests.conftest import random_batch, tiny_config
from tests.parity.test_matrix import BOUNDS

CONTEXT_MESH = dict(ici_fsdp_parallelism=2, ici_context_parallelism=4)
RTOL = 5e-6


@pytest.fixture(scope="module")
def mesh_and_rules():
    cfg = tiny_config("llama3.1-tiny", **CONTEXT_MESH)
    return make_mesh(cfg), cfg.logical_axis_rules


def _segments(batch: int, seq: int) -> np.ndarray:
    """Row 0 one document; row 1 three (boundaries off the device chunks); row 2 two and
    trailing padding (segment 0); row 3 a document per device chunk boundary shifted by one."""
    seg = np.ones((batch, seq), np.int32)
    seg[1, 5:] = 2
    seg[1, 19:] = 3
    seg[2, 13:] = 2
    seg[2, 27:] = 0
    seg[3, 9:] = 2
    seg[3, 17:] = 3
    return seg


# (sliding_window, chunk_size, dk, dv, kv_heads): causal GQA; windows inside one device chunk
# (5 < S/C = 8) and across chunks (12); chunks of 6 straddling the device chunks; MLA shapes
CASES = {
    "causal-gqa": (0, 0, 8, 8, 2),
    "window5": (5, 0, 8, 8, 2),
    "window12": (12, 0, 8, 8, 1),
    "chunk6": (0, 6, 8, 8, 2),
    "mla-dk12-dv6": (0, 0, 12, 6, 4),
}


@pytest.mark.parametrize("load_balance", [False, True], ids=["contiguous", "load-balanced"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_ring_attention_equals_masked_attention(case, load_balance, mesh_and_rules):
    window, chunk, dk, dv, kv_heads = CASES[case]
    batch, seq, heads, scale = 4, 32, 4, 0.37
    rng = np.random.default_rng(11)
    q = jnp.asarray(rng.normal(size=(batch, seq, heads, dk)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, dk)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(batch, seq, kv_heads, dv)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(batch, seq, heads, dv)), jnp.float32)
    segments = jnp.asarray(_segments(batch, seq))
    mask = attention_mask(segments, window, chunk)

    def reference(q, k, v):
        out = masked_attention(q, k, v, mask, scale=scale, dtype=jnp.float32)
        return jnp.sum(out * weights), out

    @jax.jit
    def ring(q, k, v):
        with activate(*mesh_and_rules):
            out = ring_attention(
                q, k, v, segments, scale=scale, dtype=jnp.float32, sliding_window=window, chunk_size=chunk,
                load_balance=load_balance,
            )  # fmt: skip
        return jnp.sum(out * weights), out

    (_, want), want_grads = jax.value_and_grad(reference, (0, 1, 2), has_aux=True)(q, k, v)
    (_, got), got_grads = jax.value_and_grad(ring, (0, 1, 2), has_aux=True)(q, k, v)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(jnp.abs(want).max()))
    for name, g, w in zip("qkv", got_grads, want_grads):
        err = float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
        assert err <= RTOL, f"d{name}: relative error {err:.2e}"
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * float(jnp.abs(w).max()), err_msg=f"d{name}")


def _ring_count(jaxpr) -> int:
    """ppermute equations in a jaxpr and every jaxpr nested in it (by primitive identity)."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive is jax.lax.ppermute_p
        for value in eqn.params.values():
            for item in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    count += _ring_count(inner)
    return count


@pytest.mark.parametrize("strategy, expected", [("ring", True), ("all_gather", False)])
def test_strategy_selects_the_ring(strategy, expected):
    """The model's attention runs the ring (ppermute around the context axis) only with
    context_parallel_strategy=ring; all_gather keeps the gathered keys and values."""
    cfg = tiny_config("llama3.1-tiny", context_parallel_strategy=strategy, **CONTEXT_MESH)
    model, batch = build_model(cfg), random_batch(cfg, batch=4, seq=16, packed=True)
    with activate(make_mesh(cfg), cfg.logical_axis_rules):
        jaxpr = jax.make_jaxpr(lambda x, p, s: model(x, p, s).logits)(batch["inputs"], batch["positions"], batch["segment_ids"])
    assert (_ring_count(jaxpr.jaxpr) > 0) == expected


# (model, overrides, load balance, sequence): each against the same model on one device
MODEL_ROWS = {
    "llama3.1-contiguous": ("llama3.1-tiny", dict(base_num_decoder_layers=2), False, 16),
    "mistral-window": ("mistral-tiny", dict(base_num_decoder_layers=2), True, 32),
    "llama4-chunks": ("llama4-tiny", {}, False, 32),
    "deepseek3-mla": ("deepseek3-test", {}, False, 16),
}


@pytest.mark.parametrize("row", MODEL_ROWS, ids=str)
def test_model_with_ring_matches_one_device(row):
    model, overrides, load_balance, seq = MODEL_ROWS[row]
    base = dict(scan_layers=True, remat_policy="full", **overrides)
    ring_cfg = tiny_config(model, context_parallel_load_balance=load_balance, **CONTEXT_MESH, **base)
    batch = random_batch(ring_cfg, batch=8, seq=seq, seed=13, packed=True)
    got = loss_and_grads(build_model(ring_cfg), batch, mesh=make_mesh(ring_cfg))
    want = loss_and_grads(build_model(tiny_config(model, **base)), batch)
    assert_grad_parity(got, want, **BOUNDS)


def test_ring_configuration_errors():
    with pytest.raises(ConfigError, match="attention=dot_product cannot run as ring attention"):
        tiny_config("llama3.1-tiny", attention="dot_product", **CONTEXT_MESH)
    tiny_config("llama3.1-tiny", attention="dot_product", context_parallel_strategy="all_gather", **CONTEXT_MESH)
    with pytest.raises(ConfigError, match="context_parallel_load_balance splits the sequence into 2 x"):
        derive(tiny_config("llama3.1-tiny", max_target_length=36, **CONTEXT_MESH), 8)
    derive(tiny_config("llama3.1-tiny", max_target_length=36, context_parallel_load_balance=False, **CONTEXT_MESH), 8)
    with pytest.raises(ConfigError, match="context_parallel_strategy"):
        tiny_config("llama3.1-tiny", context_parallel_strategy="ulysses")
