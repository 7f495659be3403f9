"""The host side of the paged KV cache: block pools, free lists and block tables.

A model's paged caches (``layers/paged_cache.py``) fall into groups by their table width
(``size / block_size``): the global caches of a model share one group, each window, chunk
or compressor size another. Every cache of a group has its own pool array with the same
number of blocks, and a sequence holds the same block ids in all of them, so one table
per group serves every layer of the group.

* A global cache (ring size >= the longest sequence) grows with its sequence: it holds
  ``ceil(tokens / block_size)`` blocks, taken from the group's free list as the sequence
  grows — the memory follows the live tokens.
* A window, chunk or compressor cache is a ring of a few blocks: a sequence takes all of
  them when it starts.

``PagedLayout.reserve`` is all-or-nothing over the groups; ``release`` gives a sequence's
blocks back. ``with_tables`` writes the step's tables and sequence ids into the caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from nnxtron.layers.paged_cache import NULL_BLOCK, paged_size


@dataclass(frozen=True)
class Paging:
    """A paged cache's shape: ``block_size`` slots per block, at most ``max_sequences`` live
    sequences, and ``global_blocks`` blocks for the global caches (default: every sequence
    at ``max_length`` tokens; fewer makes sequences wait or be preempted when it is full)."""

    block_size: int = 16
    max_sequences: int = 16
    global_blocks: int | None = None

    def pool_blocks(self, size: int, max_length: int) -> int:
        """Blocks in the pool of a cache of ``size`` slots (the null block included)."""
        width = paged_size(size, self.block_size) // self.block_size
        if grows(size, max_length, self.block_size) and self.global_blocks is not None:
            return self.global_blocks + 1
        return self.max_sequences * width + 1


def grows(size: int, max_length: int, block_size: int) -> bool:
    """A cache whose ring holds the whole sequence takes blocks as the sequence grows."""
    return paged_size(size, block_size) >= paged_size(max_length, block_size)


class BlockGroup:
    """One group's free list and each sequence's blocks."""

    def __init__(self, width: int, blocks: int, block_size: int, growing: bool):
        self.width, self.block_size, self.growing = width, block_size, growing
        self.capacity = blocks - 1  # the null block is never handed out
        self.free: list[int] = list(range(blocks - 1, 0, -1))  # a stack: the last block given back is reused first
        self.held: dict[int, list[int]] = {}

    def needed(self, tokens: int) -> int:
        """Blocks a sequence of ``tokens`` tokens holds."""
        return min(self.width, -(-tokens // self.block_size)) if self.growing else self.width

    def shortfall(self, sequence: int, tokens: int) -> int:
        return max(0, self.needed(tokens) - len(self.held.get(sequence, ())) - len(self.free))

    def take(self, sequence: int, tokens: int) -> None:
        held = self.held.setdefault(sequence, [])
        while len(held) < self.needed(tokens):
            held.append(self.free.pop())

    def give_back(self, sequence: int) -> None:
        self.free.extend(self.held.pop(sequence, ()))

    def table(self, sequence: int) -> list[int]:
        held = self.held.get(sequence, [])
        return held + [NULL_BLOCK] * (self.width - len(held))


class PagedLayout:
    """The block groups of a model's paged caches (from the caches' pure dict)."""

    def __init__(self, caches: dict, paging: Paging, max_length: int):
        self.paging = paging
        self.widths: set[int] = set()
        for path, leaf in jax.tree_util.tree_leaves_with_path(caches):
            if path[-1].key == "table":
                self.widths.add(leaf.shape[1])
        if not self.widths:
            raise ValueError("the caches are not paged (no block tables)")
        bs = paging.block_size
        self.groups = {
            width: BlockGroup(width, paging.pool_blocks(width * bs, max_length), bs, grows(width * bs, max_length, bs))
            for width in sorted(self.widths)
        }

    def reserve(self, sequence: int, tokens: int) -> bool:
        """Give ``sequence`` the blocks for ``tokens`` tokens in every group, or nothing (False)."""
        if any(group.shortfall(sequence, tokens) for group in self.groups.values()):
            return False
        for group in self.groups.values():
            group.take(sequence, tokens)
        return True

    def release(self, sequence: int) -> None:
        for group in self.groups.values():
            group.give_back(sequence)

    def blocks_in_use(self) -> int:
        return sum(group.capacity - len(group.free) for group in self.groups.values())

    def growing_blocks(self) -> tuple[int, int]:
        """(in use, capacity) of the groups that grow with their sequences."""
        growing = [g for g in self.groups.values() if g.growing]
        return sum(g.capacity - len(g.free) for g in growing), sum(g.capacity for g in growing)

    def with_tables(self, caches: dict, sequences: list[int]) -> dict:
        """``caches`` with the tables and sequence ids of a step over ``sequences`` (one row
        each; ``NO_SEQUENCE`` for a padding row)."""
        # host arrays: each leaf is transferred on its own (one device buffer donated twice is refused)
        tables = {
            width: np.array([group.table(s) for s in sequences], np.int32).reshape(len(sequences), width)
            for width, group in self.groups.items()
        }
        ids = np.array(sequences, np.int32)

        def put(path, leaf):
            if path[-1].key == "table":
                return tables[leaf.shape[1]]
            if path[-1].key == "sequence":
                return ids
            return leaf

        return jax.tree_util.tree_map_with_path(put, caches)
