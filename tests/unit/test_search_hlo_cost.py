"""`search.hlo_cost.program_cost`: matmul FLOPs and memory traffic of compiled programs."""

import jax
import jax.numpy as jnp
from jax import lax

from nnxtron.tools.search.hlo_cost import program_cost


def _cost(fn, *args):
    return program_cost(jax.jit(fn).lower(*args).compile().as_text())


def test_a_matmul_counts_its_flops_and_its_operands_and_result():
    a, b = jnp.ones((64, 128)), jnp.ones((128, 32))
    cost = _cost(lambda a, b: a @ b, a, b)
    assert cost.dot_flops == 2 * 64 * 32 * 128
    assert cost.dot_bytes == a.nbytes + b.nbytes + 64 * 32 * 4
    assert cost.other_bytes == 0


def test_an_elementwise_fusion_reads_and_writes_its_array_once():
    x = jnp.ones((1024, 256))
    cost = _cost(lambda x: x * 2 + 1, x)
    assert cost.dot_flops == 0 and cost.dot_bytes == 0
    assert cost.other_bytes == 2 * x.nbytes


def test_a_scanned_layer_stack_counts_every_layer_as_the_unrolled_one_does():
    w, h = jnp.ones((6, 128, 128)), jnp.ones((64, 128))

    def scanned(h, w):
        return lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), h, w)[0]

    def unrolled(h, w):
        for i in range(6):
            h = jnp.tanh(h @ w[i])
        return h

    scan, loop = _cost(scanned, h, w), _cost(unrolled, h, w)
    assert scan.dot_flops == loop.dot_flops == 6 * 2 * 64 * 128 * 128  # XLA's cost_analysis counts the body once
    assert scan.dot_bytes == loop.dot_bytes
    assert abs(scan.other_bytes - loop.other_bytes) < 0.1 * loop.other_bytes


def test_an_in_place_update_in_a_loop_counts_the_rows_it_touches_not_the_buffer():
    buf = jnp.ones((32, 4096))
    row = 4096 * 4
    cost = _cost(lambda buf: lax.fori_loop(0, 32, lambda i, b: b.at[i].set(b[i] * 2 + 1), buf), buf)
    assert cost.other_bytes >= 32 * 2 * row  # each trip reads its row and writes it back
    assert cost.other_bytes < 5 * buf.nbytes  # the whole buffer per trip would be 64 x its size


def test_a_slice_of_a_stacked_weight_reads_the_slice():
    w = jnp.ones((6, 128, 128))
    cost = _cost(lambda w: lax.fori_loop(0, 6, lambda i, s: s + jnp.sum(w[i] * 2), 0.0), w)
    layer = w.nbytes // 6
    assert 6 * layer <= cost.other_bytes <= 6 * 3 * layer + 1024  # slice read + written + reduced, never all 6 layers a trip
