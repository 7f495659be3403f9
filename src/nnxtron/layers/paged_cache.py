"""A decoding cache in fixed-size blocks shared by every sequence (paged attention's KV cache).

``PagedCache`` is a ``TokenCache`` whose slots live in a pool of ``blocks`` blocks of
``block_size`` slots, shared by all sequences, instead of ``batch x size`` slots per row.
Each row of a step has a block table (``table [B, width]``: the pool block of each of its
logical blocks, ``width = size / block_size``) and a sequence id (``sequence [B]``, > 0).
A token at position ``p`` goes to logical slot ``p % size`` as in the ring buffer, i.e.
to block ``table[p % size // block_size]`` at offset ``p % block_size``; every attention
kind (global, window, chunk, MLA latents, DeepSeek-V4 compressor buffers and entries)
works unchanged because only where slots live changes.

Each stored slot also records the sequence that wrote it (``owners``): a block given to a
new sequence may still hold an earlier owner's positions, which are read as empty, so a
freed block never needs clearing. Block 0 is the null block: unassigned table entries
point to it, it is never written and its owner (0) matches no sequence. The host
(``infer.paging``) allocates blocks, fills the tables and sets them in the caches before
each step; the step's batch is only the rows it runs, independent of the pool.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from nnxtron.layers.kv_cache import EMPTY, CacheEntry, CacheSpec, TokenCache

NULL_BLOCK = 0
NO_SEQUENCE = 0


def paged_size(size: int, block_size: int) -> int:
    """A paged cache's ring size: ``size`` rounded up to whole blocks (a ring at least as long
    as the window or chunk holds the same tokens)."""
    return -(-size // block_size) * block_size


class PagedCache(TokenCache):
    """``spec``'s entries in a pool of ``blocks`` blocks of ``block_size`` slots, for steps of ``batch`` rows."""

    def __init__(self, batch: int, spec: CacheSpec, block_size: int, blocks: int):  # storage of its own: no super().__init__
        self.size = paged_size(spec.size, block_size)
        self.slot_dim = spec.slot_dim
        self.block_size = block_size
        k = spec.slot_dim
        self.positions = CacheEntry(jnp.full((blocks, block_size), EMPTY, jnp.int32))
        self.owners = CacheEntry(jnp.full((blocks, block_size), NO_SEQUENCE, jnp.int32))
        self.entries = nnx.Dict(
            {
                name: CacheEntry(jnp.zeros((blocks, *dims[:k], block_size, *dims[k:]), spec.dtype))
                for name, (dims, _) in spec.entries.items()
            }
        )
        self.table = CacheEntry(jnp.full((batch, self.size // block_size), NULL_BLOCK, jnp.int32))
        self.sequence = CacheEntry(jnp.full((batch,), NO_SEQUENCE, jnp.int32))

    def _stored(self, name: str) -> jax.Array:
        """Gather each row's blocks in table order: ``[B, size, *dims]`` (or slot axis inside)."""
        k = self.slot_dim
        blocks = self.entries[name][...][self.table[...]]  # [B, W, *dims[:k], block, *dims[k:]]
        blocks = jnp.moveaxis(blocks, 1, 1 + k)  # [B, *dims[:k], W, block, ...]
        shape = blocks.shape
        return blocks.reshape(*shape[: 1 + k], shape[1 + k] * shape[2 + k], *shape[3 + k :])

    def _stored_positions(self) -> jax.Array:
        table = self.table[...]
        mine = self.owners[...][table] == self.sequence[...][:, None, None]
        return jnp.where(mine, self.positions[...][table], EMPTY).reshape(table.shape[0], self.size)

    def _scatter(self, slots: jax.Array, new: Mapping[str, jax.Array], positions: jax.Array) -> None:
        table = self.table[...]
        width = table.shape[1]
        block = jnp.take_along_axis(table, jnp.minimum(slots // self.block_size, width - 1), axis=1)
        pool_blocks = self.positions.shape[0]
        # dropped slots (``size``) and the null block are out of range: never written
        block = jnp.where((slots < self.size) & (block != NULL_BLOCK), block, pool_blocks)
        offset = slots % self.block_size
        where = (block, *(slice(None),) * self.slot_dim, offset)
        for name, value in new.items():
            pool = self.entries[name][...]
            self.entries[name][...] = pool.at[where].set(value.astype(pool.dtype), mode="drop")
        self.positions[...] = self.positions[...].at[block, offset].set(positions, mode="drop")
        owner = jnp.broadcast_to(self.sequence[...][:, None], positions.shape)
        self.owners[...] = self.owners[...].at[block, offset].set(owner, mode="drop")
