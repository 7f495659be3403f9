"""Weighted mixtures of corpora: packed rows drawn from several sources by weight, resumable exactly.

Each source is a :class:`CorpusBatches` of its own — its files, its eval split by stable key,
its shuffle seed, its epochs, each process's share of its documents — packing its own rows.
A mixture takes every row of a batch from one source, chosen by :class:`RowSchedule` from the
row's number in the global stream of rows. Rows, not documents, are drawn: with
``packing=concat`` a row is ``seq_len`` stream tokens whatever the documents' lengths, so a
weight is the source's share of the trained tokens (drawing documents by weight would give a
corpus of long documents more tokens than its weight says), and no row mixes two sources.

The state is every source's packer state plus the number of rows this process has handed out;
the schedule is a pure function of the row number, so ``set_state`` continues exactly.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from nnxtron.data.packing import BATCH_KEYS, row_arrays
from nnxtron.data.pipeline import BatchSource, CorpusBatches, DataIterator, Prefetched, local_rows
from nnxtron.data.stream import COUNTERS, RowPacker
from nnxtron.errors import DataError

__all__ = ["MixtureBatches", "RowSchedule", "source_seed"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio (odd): the Weyl sequence's step
SOURCE_SEED_STRIDE = 1_000_003  # source i shuffles with data_shuffle_seed + i * this (mod 2**32)
SHARE_ROWS = 1 << 20  # rows of the schedule counted for the realised shares of the start-up line


def source_seed(seed: int, index: int) -> int:
    """The shuffle seed of source ``index`` (source 0 keeps ``seed``: one source = one corpus)."""
    return (operator.index(seed) + operator.index(index) * SOURCE_SEED_STRIDE) % 2**32


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class RowSchedule:
    """Which source global row ``g`` comes from.

    Row ``g`` gets the point ``x_g = (phase + g * 2**64 / golden ratio) mod 2**64`` (a Weyl
    sequence; ``phase`` from the seed) and the source whose slice of ``[0, 2**64)`` — slices
    sized by the normalised weights — holds it. The golden-ratio sequence is spread so evenly
    that among any first ``n`` rows a source of weight ``w`` has ``n * w`` rows give or take a
    few (a logarithmic discrepancy), and no state but ``g`` is needed."""

    def __init__(self, weights: Sequence[float], seed: int) -> None:
        weights = [float(w) for w in weights]
        if not weights or not all(math.isfinite(w) and w > 0 for w in weights):
            raise DataError(f"mixture weights must be positive finite numbers, got {weights}; fix dataset_weights")
        total = math.fsum(weights)
        self.weights = tuple(w / total for w in weights)
        edges = list(itertools.accumulate(self.weights))[:-1]
        self.thresholds = [min(round(e * 2.0**64), _MASK) for e in edges]
        self.phase = _splitmix64(operator.index(seed))

    def source(self, row: int) -> int:
        """The source of global row ``row``."""
        return bisect.bisect_right(self.thresholds, (self.phase + row * _GOLDEN) & _MASK)

    def counts(self, rows: int) -> np.ndarray:
        """Rows drawn from each source among global rows ``0 .. rows-1``."""
        with np.errstate(over="ignore"):
            points = np.uint64(self.phase) + np.arange(rows, dtype=np.uint64) * np.uint64(_GOLDEN)  # wraps mod 2**64
        which = np.searchsorted(np.asarray(self.thresholds, dtype=np.uint64), points, side="right")
        return np.bincount(which, minlength=len(self.weights))


class MixtureBatchIterator:
    """Batches whose rows come from several packers, row ``k`` of this process from the source
    the schedule gives its global row number (``rows`` per process, ``global_rows`` per batch)."""

    def __init__(
        self, packers: Sequence[RowPacker], schedule: RowSchedule, rows: int, global_rows: int, process_index: int
    ) -> None:
        self.packers, self.schedule, self.rows = list(packers), schedule, rows
        self.offset, self.global_rows = process_index * rows, global_rows
        self.done = 0  # rows handed out by this process

    def __iter__(self) -> MixtureBatchIterator:
        return self

    def global_row(self, k: int) -> int:
        """The global row number of this process's row ``k``: row ``k % rows`` of its slice of batch ``k // rows``."""
        return (k // self.rows) * self.global_rows + self.offset + k % self.rows

    def __next__(self) -> dict[str, np.ndarray]:
        parts = []
        for k in range(self.done, self.done + self.rows):
            parts.append(next(self.packers[self.schedule.source(self.global_row(k))]))  # StopIteration ends the data
        self.done += self.rows
        batch = row_arrays(*(np.stack(p) for p in zip(*parts)))  # each row is from one packer: its documents are numbered apart
        return {k: batch[k] for k in BATCH_KEYS}

    def get_state(self) -> dict[str, Any]:
        sources = [p.get_state() for p in self.packers]
        return {
            "mixture_rows": self.done,
            "sources": sources,
            "counts": {k: sum(s["counts"][k] for s in sources) for k in COUNTERS},  # read by the trainer's last line
            "first_problem": next((s["first_problem"] for s in sources if s["first_problem"]), ""),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        try:
            sources, done = state["sources"], operator.index(state["mixture_rows"])
            if not isinstance(sources, list) or len(sources) != len(self.packers) or done < 0:
                raise TypeError
        except (KeyError, TypeError):
            raise DataError(
                f"the saved data position is not one of a mixture of {len(self.packers)} sources; resume with the same "
                "dataset_path, dataset_weights and grain_train_files, or start a new run_name"
            ) from None
        for packer, saved in zip(self.packers, sources):
            packer.set_state(saved)
        self.done = done

    def close(self) -> None:
        """Stops every source's reader threads."""
        for packer in self.packers:
            packer.documents.close()


class MixtureBatches(BatchSource):
    """Batches of rows drawn from ``parts`` (one :class:`CorpusBatches` per source, same split,
    row and batch sizes) in proportion to ``weights``; the schedule's phase comes from ``seed``.
    ``labels`` name the sources in the start-up line; ``prefetch`` batches are prepared ahead."""

    def __init__(
        self,
        parts: Sequence[CorpusBatches],
        weights: Sequence[float],
        labels: Sequence[str],
        *,
        seed: int = 0,
        prefetch: int = 2,
    ) -> None:
        self.parts, self.labels = list(parts), list(labels)
        if len(self.parts) < 2 or len(weights) != len(self.parts) or len(labels) != len(self.parts):
            raise DataError(f"a mixture needs 2 or more sources with one weight each, got {len(self.parts)} and {len(weights)}")
        first = self.parts[0]
        for part in self.parts[1:]:
            if (part.seq_len, part.global_batch_size, part.split, part.spec) != (
                first.seq_len, first.global_batch_size, first.split, first.spec
            ):  # fmt: skip
                raise DataError("the sources of a mixture must share seq_len, the batch size, the split and the packing")
        self.seq_len, self.global_batch_size, self.split = first.seq_len, first.global_batch_size, first.split
        self.seed, self.prefetch = seed, max(int(prefetch), 0)
        self.schedule = RowSchedule(weights, seed)
        self._stats = self._measure()

    def iterator(self, process_index: int = 0, process_count: int = 1) -> DataIterator:
        rows = local_rows(self.global_batch_size, process_count)
        packers = [part.packer(process_index, process_count) for part in self.parts]
        batches = MixtureBatchIterator(packers, self.schedule, rows, self.global_batch_size, process_index)
        return Prefetched(batches, self.prefetch)

    def _measure(self) -> dict:
        parts = [part.stats() for part in self.parts]
        row_share = self.schedule.counts(SHARE_ROWS) / SHARE_ROWS
        per_row = np.array([s["loss_tokens_per_epoch"] / max(s["rows_per_epoch"], 1) for s in parts])
        token_share = row_share * per_row / max(float((row_share * per_row).sum()), 1e-30)
        sources = [
            {**s, "label": label, "weight": w, "row_share": float(r), "token_share": float(t)}
            for s, label, w, r, t in zip(parts, self.labels, self.schedule.weights, row_share, token_share)
        ]
        return {
            "split": self.split,
            "documents": sum(s["documents"] for s in parts),
            "tokens": sum(s["tokens"] for s in parts),
            "bad_records": sum(s["bad_records"] for s in parts),
            "packing_efficiency": float(sum(r * s["packing_efficiency"] for r, s in zip(row_share, parts))),
            "sources": sources,
        }

    def stats(self) -> dict:
        return {**self._stats, "sources": [dict(s) for s in self._stats["sources"]]}

    def lasts_batches(self) -> tuple[float, int] | None:
        """(about how many batches the data lasts, the source that runs out first), None when endless."""
        if self.split != "train" or self.parts[0].epochs is None:
            return None
        ends = [
            part.epochs * s["rows_per_epoch"] / max(s["row_share"], 1e-30) for part, s in zip(self.parts, self._stats["sources"])
        ]  # global rows until each source has no rows left
        first = int(np.argmin(ends))
        return ends[first] / self.global_batch_size, first

    def describe(self) -> str:
        head = (
            f"{self.split} data: a mixture of {len(self.parts)} sources, {self.global_batch_size} rows of {self.seq_len} "
            f"per batch, each row from one source by weight (seed {self.seed})"
        )
        first = self.parts[0]
        if self.split == "train":
            head += f"; each source shuffled with its own seed, {'endless' if first.epochs is None else f'{first.epochs} epochs'}"
            lasts = self.lasts_batches()
            if lasts is not None:
                head += f", enough for ~{lasts[0]:,.0f} batches (source {lasts[1] + 1} runs out first)"
        else:
            head += "; each source in order"
        lines = [head]
        for i, (part, s) in enumerate(zip(self.parts, self._stats["sources"])):
            exact = s["sampled_documents"] == s["documents"]
            approx = "" if exact else "~"
            bad = f", {approx}{s['bad_records']:,} bad records skipped" if s["bad_records"] else ""
            lines.append(
                f"  source {i + 1} {s['label']}: {s['documents']:,} of {part.corpus.describe()}, {approx}{s['tokens']:,} tokens, "
                f"{approx}{s['rows_per_epoch']:,} rows per epoch, {100 * s['packing_efficiency']:.1f}% full{bad}; "
                f"weight {s['weight']:.4g} -> {100 * s['row_share']:.2f}% of rows, {approx}{100 * s['token_share']:.1f}% "
                "of trained tokens"
            )
        return "\n".join(lines)
