"""The test processes stay under Linux's per-process mapping limit (tests/conftest.py)."""

import jax
import jax.numpy as jnp
import pytest

from tests.conftest import memory_mappings, release_compiled_programs


@pytest.mark.skipif(memory_mappings() == 0, reason="needs /proc/self/maps (Linux)")
def test_releasing_the_caches_frees_the_mappings_of_compiled_programs():
    before = memory_mappings()
    for width in range(1, 41):  # 40 distinct programs, each JIT-loaded into mappings of its own
        jax.jit(lambda x: jnp.tanh(x @ x.T).sum() + jnp.cumsum(x, axis=1).max())(jnp.ones((width, 7))).block_until_ready()
    compiled = memory_mappings()
    assert compiled > before
    assert not release_compiled_programs(limit=compiled + 1_000)
    assert release_compiled_programs(limit=0)
    assert memory_mappings() < compiled - (compiled - before) // 2
