"""The decoding cache of an attention layer: a ring buffer of per-token entries.

A ``TokenCache`` holds ``size`` slots of named per-token entries (keys and values for
grouped-query attention; the compressed latent and the RoPE key for MLA) and the absolute
position stored in each slot (-1 = empty). A token at position ``p`` lives in slot
``p % size``, so one mechanism serves every attention kind:

* global attention: ``size`` = the maximum decoded length (slot = position);
* sliding window ``W``: ``size = W`` — a ring buffer holding the last W positions;
* chunked attention (Llama 4) of ``C``: ``size = C`` — a query only sees its own chunk;
* DeepSeek-V4 compressors: a buffer of the last ``m`` (CSA: ``2m``) tokens' projections and
  the pooled entries keyed by window index (``models/deepseek4/compressed.py``).

``extend`` returns the cached entries followed by the new tokens' entries, with their
positions, for the attention to mask by position; then it writes the new tokens (only the
last ``size`` positions of each row, and only valid tokens) into their slots. Prefill (a
whole prompt, longer than the window if need be) and decode (one token) are the same call.

Caches are non-parameter ``nnx.Variable``s attached to the attention modules by
``infer.cache.attach_caches``: scanned stacks get them stacked along the stack axis and
carry them through ``lax.scan`` like any other non-parameter state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

EMPTY = -1
CACHE_AXES = ("cache_batch", "cache_length")


class CacheEntry(nnx.Variable):
    """Decoding-cache contents: not a parameter, never saved in checkpoints."""


@dataclass(frozen=True)
class CacheSpec:
    """What an attention layer caches per token: slots and ``{name: (shape, logical axes)}``.

    ``slot_dim``: where the slot axis sits among each entry's dims in storage — 0 stores
    ``[batch, size, *dims]``; 1 with ``(heads, head_dim)`` entries stores ``[batch, heads, size,
    head_dim]``, the layout a one-token attention step reads without a transposed copy."""

    size: int
    entries: Mapping[str, tuple[tuple[int, ...], tuple[str | None, ...]]]
    dtype: jnp.dtype
    slot_dim: int = 0
    pageable: bool = True  # False: a recurrent state, not per-token entries (Qwen3-Next's DeltaNet): never paged


class TokenCache(nnx.Module):
    """Ring buffer of ``spec.size`` slots for ``batch`` rows; ``lead`` are stacked layer dims."""

    def __init__(self, batch: int, spec: CacheSpec, lead: tuple[int, ...] = (), lead_axes: tuple[str, ...] = ()):
        self.size = spec.size
        self.slot_dim = spec.slot_dim
        shape = (*lead, batch, spec.size)
        self.positions = CacheEntry(jnp.full(shape, EMPTY, jnp.int32), out_sharding=(*lead_axes, *CACHE_AXES))
        k = spec.slot_dim
        self.entries = nnx.Dict(
            {
                name: CacheEntry(
                    jnp.zeros((*lead, batch, *dims[:k], spec.size, *dims[k:]), spec.dtype),
                    out_sharding=(*lead_axes, CACHE_AXES[0], *axes[:k], CACHE_AXES[1], *axes[k:]),
                )
                for name, (dims, axes) in spec.entries.items()
            }
        )

    def _stored(self, name: str) -> jax.Array:
        """Entry ``name`` of every row in its storage layout (``[B, size, *dims]`` or with the
        slot axis inside); ``PagedCache`` gathers it from its block pool."""
        return self.entries[name][...]

    def _stored_positions(self) -> jax.Array:
        """``[B, size]``: the position held by each slot of each row (``EMPTY``: none)."""
        return self.positions[...]

    def _token_major(self, name: str) -> jax.Array:
        """Entry ``name`` as ``[B, size, *dims]`` (a transposed copy when stored slot-inside)."""
        entry = self._stored(name)
        return entry if self.slot_dim == 0 else jnp.moveaxis(entry, 1 + self.slot_dim, 1)

    def extend(
        self, new: Mapping[str, jax.Array], positions: jax.Array, valid: jax.Array
    ) -> tuple[dict[str, jax.Array], jax.Array]:
        """``new`` entries ``[B, S, ...]`` of tokens at ``positions [B, S]`` (``valid [B, S]``:
        padding is neither attended to nor written). Returns ``(entries [B, size + S, ...],
        key positions [B, size + S])`` — cache first, then the new tokens — and stores the
        new tokens."""
        new_positions = jnp.where(valid, positions, EMPTY)
        old = {name: self._token_major(name) for name in new}
        every = {name: jnp.concatenate([old[name], new[name].astype(old[name].dtype)], axis=1) for name in new}
        key_positions = jnp.concatenate([self._stored_positions(), new_positions], axis=1)
        self._write(new, positions, valid)
        return every, key_positions

    def attended(
        self, new: Mapping[str, jax.Array], positions: jax.Array, valid: jax.Array
    ) -> tuple[dict[str, jax.Array], jax.Array]:
        """What attention over this cache reads, as ``extend`` does, but for a one-token step
        (decode) without copying the cache: the token is written into its slot first and the
        cache itself is returned, in its storage layout (``[B, size, ...]``, or with the slot
        axis inside, see ``CacheSpec.slot_dim``). The entry it replaces, position ``p - size``,
        is outside query ``p``'s mask (the window or the chunk is at most ``size``; a global
        cache holds every position), so the result is the same."""
        if positions.shape[1] != 1:
            return self.extend(new, positions, valid)
        self._write(new, positions, valid)
        return {name: self._stored(name) for name in new}, self._stored_positions()

    def store(self, new: Mapping[str, jax.Array], positions: jax.Array, valid: jax.Array) -> None:
        """Store ``new`` entries ``[B, S, ...]`` without reading the cache (a recurrent state kept in one slot)."""
        self._write(new, positions, valid)

    def _write(self, new: Mapping[str, jax.Array], positions: jax.Array, valid: jax.Array) -> None:
        """Store the last ``size`` valid positions of each row in their slots (the rest are dropped)."""
        new_positions = jnp.where(valid, positions, EMPTY)
        latest = jnp.max(new_positions, axis=1, keepdims=True)
        keep = valid & (positions > latest - self.size)
        slots = jnp.where(keep, positions % self.size, self.size)
        self._scatter(slots, new, positions)

    def _scatter(self, slots: jax.Array, new: Mapping[str, jax.Array], positions: jax.Array) -> None:
        """Write each row's tokens into ``slots [B, S]`` (``size``: dropped)."""
        if slots.shape == (1, 1):
            self._update_one(slots[0, 0], new, positions)
        else:
            self._scatter_rows(slots, new, positions)

    def _scatter_rows(self, slots: jax.Array, new: Mapping[str, jax.Array], positions: jax.Array) -> None:
        """``_scatter`` as one scatter per entry (any number of rows and tokens)."""
        rows = jnp.arange(positions.shape[0])[:, None]
        # rows and slots around the leading dims: the updates are indexed [B, S, *dims] either way
        where = (rows, *(slice(None),) * self.slot_dim, slots)
        for name, value in new.items():
            entry = self.entries[name][...]
            self.entries[name][...] = entry.at[where].set(value.astype(entry.dtype), mode="drop")
        self.positions[...] = self.positions[...].at[rows, slots].set(positions, mode="drop")

    def _update_one(self, slot: jax.Array, new: Mapping[str, jax.Array], positions: jax.Array) -> None:
        """``_scatter`` of one token of one row (batch-1 decoding) as in-place slice updates. A TPU
        runs XLA's scatter as a loop of its own: in a bare decode loop of docs/tpu.md's 552M model
        (benchmarks/tpu_decode_floor.py) the scatters cost 1.512 -> 1.604 ms a token; in ``generate``
        this write took 1.5883 -> 1.5827 ms (84.9% -> 85.2% of the HBM bound, 2026-12-08).
        A dropped token (``slot == size``) writes back what the slot holds."""
        keep = slot < self.size
        slot = jnp.minimum(slot, self.size - 1)

        def update(entry: jax.Array, value: jax.Array, slot_axis: int) -> jax.Array:
            start = tuple(slot if axis == slot_axis else 0 for axis in range(entry.ndim))
            held = jax.lax.dynamic_slice(entry, start, value.shape)
            return jax.lax.dynamic_update_slice(entry, jnp.where(keep, value.astype(entry.dtype), held), start)

        slot_axis = 1 + self.slot_dim  # of the entries in their storage layout
        for name, value in new.items():  # [1, 1, *dims] -> the storage layout
            self.entries[name][...] = update(self.entries[name][...], jnp.moveaxis(value, 1, slot_axis), slot_axis)
        self.positions[...] = update(self.positions[...], positions, 1)


def cache_mask(q_positions: jax.Array, k_positions: jax.Array, sliding_window: int = 0, chunk_size: int = 0) -> jax.Array:
    """Boolean [B, S, T]: key ``t`` (position ``pk``, -1 = empty) is visible to query ``s``
    (position ``pq``) iff ``0 <= pk <= pq``, within the window (``pq - pk < W``) and the
    chunk (``pq // C == pk // C``) — the training mask on one document per row."""
    pq, pk = q_positions[:, :, None], k_positions[:, None, :]
    visible = (pk >= 0) & (pk <= pq)
    if sliding_window > 0:
        visible = visible & (pq - pk < sliding_window)
    if chunk_size > 0:
        visible = visible & (pq // chunk_size == pk // chunk_size)
    return visible


def cache_size(max_length: int, sliding_window: int = 0, chunk_size: int = 0) -> int:
    """Slots a layer needs to decode up to ``max_length`` tokens."""
    if chunk_size > 0:
        return min(chunk_size, max_length)
    if sliding_window > 0:
        return min(sliding_window, max_length)
    return max_length
