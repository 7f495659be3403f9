"""Checkpoint checksums: the NumPy sum a CPU process computes equals the jitted one an accelerator
computes (a checkpoint saved on one verifies on the other), and both see a flipped bit, swapped
elements and a NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from nnxtron.train import checksum
from nnxtron.train.checksum import _one, _one_on_host, checksums


def arrays() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    values = {
        "float32": rng.standard_normal((16, 24)).astype(np.float32),
        "bfloat16": rng.standard_normal((7, 5, 3)).astype(jnp.bfloat16),
        "float8": rng.standard_normal((33,)).astype(jnp.float8_e4m3fn),
        "int32": rng.integers(-(2**31), 2**31 - 1, size=(9, 4), dtype=np.int32),
        "scalar": np.float32(3.5),
    }
    placed = {key: jnp.asarray(value) for key, value in values.items()}
    placed["sharded"] = jax.device_put(values["float32"], NamedSharding(mesh, PartitionSpec("a", "b")))
    placed["replicated"] = jax.device_put(values["bfloat16"], NamedSharding(mesh, PartitionSpec()))
    return placed


def test_the_host_sum_equals_the_jitted_one_bit_for_bit(monkeypatch):
    values = arrays()
    monkeypatch.setattr(checksum, "HOST_CHUNK", 7)  # several chunks: positions carried across them
    for key, value in values.items():
        jitted = tuple(jax.device_get(_one(value)))
        assert _one_on_host(np.asarray(value)) == (int(jitted[0]), bool(jitted[1])), key
    host, _ = checksums(values)
    monkeypatch.setattr(checksum, "_on_cpu_here", lambda value: False)  # as on an accelerator
    assert checksums(values)[0] == host


@pytest.mark.parametrize("on_host", [True, False])
def test_a_flipped_bit_swapped_elements_and_a_nan_are_seen(monkeypatch, on_host):
    monkeypatch.setattr(checksum, "_on_cpu_here", lambda value: on_host)
    base = np.arange(1, 13, dtype=np.float32).reshape(3, 4)
    flipped = base.copy()
    flipped.view(np.uint32)[1, 2] ^= 1 << 7
    swapped = base.copy()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    nan = base.astype(jnp.bfloat16)
    nan[2, 3] = np.nan
    sums, not_finite = checksums(
        {k: jnp.asarray(v) for k, v in dict(base=base, flipped=flipped, swapped=swapped, nan=nan).items()}
    )
    assert len({sums["base"], sums["flipped"], sums["swapped"]}) == 3
    assert not_finite == ["nan"]
