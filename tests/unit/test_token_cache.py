"""TokenCache's one-token write (batch-1 decoding: in-place slice updates) stores what the
scatter of every other write stores: new slots, ring-buffer wrap-around, a dropped padding token,
both storage layouts."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxtron.layers.kv_cache import EMPTY, CacheSpec, TokenCache

ENTRIES = {0: {"key": (2, 3), "latent": (5,)}, 1: {"key": (2, 3)}}  # slot_dim 1: (heads, head_dim) entries only
WRITES = [(0, True), (1, True), (2, False), (2, True), (3, True), (4, True), (7, True)]  # (position, valid)


def contents(c: TokenCache) -> dict[str, np.ndarray]:
    return {"positions": np.asarray(c.positions[...]), **{k: np.asarray(v[...]) for k, v in c.entries.items()}}


@pytest.mark.parametrize("slot_dim", [0, 1])
def test_one_token_writes_equal_the_scatter(slot_dim):
    spec = CacheSpec(4, {name: (dims, (None,) * len(dims)) for name, dims in ENTRIES[slot_dim].items()}, jnp.float32, slot_dim)
    with nnx.use_eager_sharding(False):  # as infer.cache.attach_caches makes them
        one, scattered = TokenCache(1, spec), TokenCache(1, spec)
    rng = np.random.default_rng(0)
    for step, (position, valid) in enumerate(WRITES):
        new = {name: jnp.asarray(rng.standard_normal((1, 1, *dims)), jnp.float32) for name, dims in ENTRIES[slot_dim].items()}
        positions, valid = jnp.array([[position]]), jnp.array([[valid]])
        one._write(new, positions, valid)  # one row, one token: the slice updates
        slots = jnp.where(valid, positions % 4, 4)  # the slots _write computes for one token (4: dropped)
        scattered._scatter_rows(slots, new, jnp.where(valid, positions, EMPTY))
        for name, value in contents(one).items():
            np.testing.assert_array_equal(value, contents(scattered)[name], err_msg=f"write {step}: {name}")
    assert contents(one)["positions"].tolist() == [[4, 1, 2, 7]]  # 4 and 7 wrapped around; the dropped token wrote nothing
