"""Batch sources: synthetic tokens and corpora (grain pipelines), each a resumable iterator."""

from __future__ import annotations

import abc
import operator
from typing import Any, Protocol

import numpy as np
from grain.experimental import ThreadPrefetchDatasetIterator

from nnxtron.data.records import Corpus
from nnxtron.data.stream import BatchIterator, RowPacker, RowSpec, document_iterator, make_packer
from nnxtron.data.tokenizer import Tokenizer
from nnxtron.errors import DataError

__all__ = ["BatchSource", "CorpusBatches", "DataIterator", "Prefetched", "SyntheticBatches", "local_rows", "split_documents"]

Batch = dict[str, np.ndarray]
EVAL_BUCKETS = 10000


class DataIterator(Protocol):
    """What the trainer reads batches from: ``next``, ``get_state``/``set_state``, ``close``."""

    def __next__(self) -> Batch: ...

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _positive(name: str, value: int) -> int:
    value = operator.index(value)
    if value < 1:
        raise DataError(f"{name} must be a positive integer, got {value}; set {name} >= 1")
    return value


def _seed(seed: int) -> int:
    seed = operator.index(seed)
    if not 0 <= seed < 2**32:
        raise DataError(f"the shuffle seed must be in [0, 2**32), got {seed}; set data_shuffle_seed in that range")
    return seed


def local_rows(global_batch_size: int, process_count: int) -> int:
    """Rows of each process's share of a global batch."""
    if global_batch_size % process_count:
        raise DataError(
            f"global_batch_size {global_batch_size} is not divisible by the {process_count} processes; "
            f"set global_batch_size to a multiple of {process_count}"
        )
    return global_batch_size // process_count


class BatchSource(abc.ABC):
    """A stream of global batches of ``global_batch_size`` rows of ``seq_len`` tokens."""

    global_batch_size: int
    seq_len: int

    @abc.abstractmethod
    def iterator(self, process_index: int = 0, process_count: int = 1) -> DataIterator:
        """This process's share of each batch, from the first batch on (``set_state`` to resume)."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """documents, tokens, packing_efficiency... (None where not applicable)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the start-up print."""


class _IndexIterator:
    """Batches ``batch(i)`` for i = 0, 1, ...; the state is the next ``i``."""

    def __init__(self, source: SyntheticBatches, process_index: int, process_count: int) -> None:
        self.source, self.where, self.index = source, (process_index, process_count), 0

    def __iter__(self) -> _IndexIterator:
        return self

    def __next__(self) -> Batch:
        batch = self.source.batch(self.index, *self.where)
        self.index += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"index": self.index}

    def set_state(self, state: dict[str, Any]) -> None:
        try:
            self.index = operator.index(state["index"])
        except (KeyError, TypeError):
            raise DataError("the saved data position is not one of synthetic data; resume with the same dataset_type") from None

    def close(self) -> None:
        pass


class SyntheticBatches(BatchSource):
    """Uniform random tokens in [3, vocab_size); batch ``i`` uses ``default_rng([seed, i])``,
    and each process takes its equal, in-order slice of the global batch."""

    def __init__(self, vocab_size: int, seq_len: int, global_batch_size: int, seed: int = 0) -> None:
        self.vocab_size = _positive("vocab_size", vocab_size)
        if self.vocab_size <= 3:
            raise DataError(f"vocab_size {vocab_size} leaves no room for tokens after the 3 special ids; set vocab_size > 3")
        self.seq_len = _positive("seq_len", seq_len)
        self.global_batch_size = _positive("global_batch_size", global_batch_size)
        self.seed = _seed(seed)

    def batch(self, index: int, process_index: int = 0, process_count: int = 1) -> Batch:
        """This process's rows of global batch ``index``, as fresh arrays."""
        index, process_index, process_count = map(operator.index, (index, process_index, process_count))
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"bad process_index {process_index} for process_count {process_count}")
        count = local_rows(self.global_batch_size, process_count)
        offset = process_index * count
        rng = np.random.default_rng([self.seed, index])
        tokens = rng.integers(3, self.vocab_size, size=(self.global_batch_size, self.seq_len + 1), dtype=np.int64)
        tokens = tokens[offset : offset + count].astype(np.int32)
        rows = (count, self.seq_len)
        return {
            "inputs": np.ascontiguousarray(tokens[:, :-1]),
            "targets": np.ascontiguousarray(tokens[:, 1:]),
            "positions": np.broadcast_to(np.arange(self.seq_len, dtype=np.int32), rows).copy(),
            "segment_ids": np.ones(rows, dtype=np.int32),
            "loss_mask": np.ones(rows, dtype=np.float32),
        }

    def iterator(self, process_index: int = 0, process_count: int = 1) -> DataIterator:
        local_rows(self.global_batch_size, process_count)
        return _IndexIterator(self, process_index, process_count)

    def stats(self) -> dict:
        """An endless stream: document and token counts are None."""
        return {"split": "synthetic", "documents": None, "tokens": None, "packing_efficiency": 1.0}

    def describe(self) -> str:
        return (
            f"synthetic data: uniform random tokens in [3, {self.vocab_size}), "
            f"{self.global_batch_size} rows of {self.seq_len} per batch, seed {self.seed}"
        )


def split_documents(corpus: Corpus, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) document numbers: a document is eval when its stable key falls in the
    first ``eval_fraction`` of the buckets. A positive fraction never gives an empty eval
    split (the last document goes there); an empty train split is an error."""
    eval_fraction = float(eval_fraction)
    if not 0.0 <= eval_fraction <= 1.0:
        raise DataError(f"eval_fraction must be in [0, 1], got {eval_fraction}; set it between 0 and 1")
    is_eval = (corpus.keys() % np.uint64(EVAL_BUCKETS)) < eval_fraction * EVAL_BUCKETS
    if eval_fraction > 0 and not is_eval.any():
        is_eval[-1] = True
    numbers = np.arange(len(corpus), dtype=np.int64)
    train, evaluation = numbers[~is_eval], numbers[is_eval]
    if not len(train):
        raise DataError(
            f"all {len(corpus)} documents went to the eval split (eval_split_fraction {eval_fraction}); "
            "add documents to dataset_path or lower eval_split_fraction"
        )
    return train, evaluation


class CorpusBatches(BatchSource):
    """Batches of packed rows of a corpus split, read by a grain pipeline.

    Train shuffles its documents with ``seed`` (a new order each epoch) for ``epochs`` epochs
    (None = endless); eval reads its documents in order, cycling. Each process packs its own
    share (``[process_index::process_count]``) of the document stream into its rows.
    ``read_threads`` threads read and tokenize documents; ``prefetch`` batches are prepared
    ahead in a background thread (0 = none). An error in any of them is raised by ``next``.
    """

    def __init__(
        self,
        corpus: Corpus,
        documents: np.ndarray,
        tokenizer: Tokenizer,
        spec: RowSpec,
        global_batch_size: int,
        *,
        split: str = "train",
        seed: int = 0,
        epochs: int | None = None,
        read_threads: int = 2,
        prefetch: int = 2,
        stats_documents: int = 1000,
    ) -> None:
        if split not in ("train", "eval"):
            raise DataError(f"unknown split {split!r}; use 'train' or 'eval'")
        self.corpus, self.documents, self.tokenizer, self.spec = corpus, np.asarray(documents), tokenizer, spec
        self.seq_len = spec.seq_len
        self.global_batch_size = _positive("global_batch_size", global_batch_size)
        self.split, self.seed = split, _seed(seed)
        self.epochs = None if epochs is None else _positive("data_num_epochs", epochs)
        self.read_threads, self.prefetch = max(int(read_threads), 0), max(int(prefetch), 0)
        if not len(self.documents):
            raise DataError(f"the {split} split of the dataset has no documents; add documents or change eval_split_fraction")
        self._stats = self._measure(max(int(stats_documents), 1))
        if self._stats["bad_records"] and not spec.skip_bad_records:
            raise DataError(
                f"bad record: {self._stats['first_problem']}; fix or remove it, or set skip_bad_records=true to skip such records"
            )
        if self._stats["sampled_documents"] == len(self.documents) and self._stats["bad_records"] == len(self.documents):
            raise DataError(  # (a larger split is caught by the packer after one full pass)
                f"none of the {len(self.documents)} records of the {split} split is usable (all bad; the first: "
                f"{self._stats['first_problem']}); fix the data or its settings (dataset_text_field, tokenizer)"
            )

    def _documents(self, process_index: int, process_count: int, **kw: Any):
        train = self.split == "train"
        return document_iterator(
            self.corpus, self.documents, self.tokenizer, self.spec,
            seed=self.seed if train else None, epochs=self.epochs if train else None,
            process_index=process_index, process_count=process_count, **kw,
        )  # fmt: skip

    def iterator(self, process_index: int = 0, process_count: int = 1) -> DataIterator:
        rows = local_rows(self.global_batch_size, process_count)
        return Prefetched(BatchIterator(self.packer(process_index, process_count), rows), self.prefetch)

    def packer(self, process_index: int = 0, process_count: int = 1) -> RowPacker:
        """This process's packed rows, one at a time (a mixture draws rows from several)."""
        docs = self._documents(process_index, process_count, read_threads=self.read_threads)
        pass_size = max(1, len(self.documents) // process_count)  # this process's documents per epoch
        return make_packer(docs, self.spec, self.tokenizer.pad_id, pass_size)

    def _measure(self, limit: int) -> dict:
        """Counts from packing up to ``limit`` documents spread evenly over the split."""
        total = len(self.documents)
        pick = self.documents[np.linspace(0, total - 1, min(limit, total)).round().astype(np.int64)]
        sample = CorpusSample(self.corpus, np.unique(pick), self.tokenizer, self.spec)
        counts = sample.counts
        seen = counts["documents"] + counts["bad_records"]
        scale = total / max(seen, 1)
        slots = counts["rows"] * self.seq_len
        return {
            "split": self.split,
            "documents": total,
            "sampled_documents": seen,
            "tokens": round(counts["tokens"] * scale),
            "bad_records": round(counts["bad_records"] * scale),
            "first_problem": sample.first_problem,
            "rows_per_epoch": round(counts["rows"] * scale),
            "packing_efficiency": counts["real_targets"] / slots if slots else 0.0,
            "loss_tokens_per_epoch": round(counts["loss_targets"] * scale),
        }

    def stats(self) -> dict:
        return dict(self._stats)

    def describe(self) -> str:
        s = self._stats
        exact = s["sampled_documents"] == s["documents"]
        measured = "" if exact else f", estimated from {s['sampled_documents']:,} of them"
        bad = ""
        if s["bad_records"]:
            bad = f"; {'' if exact else '~'}{s['bad_records']:,} bad records will be skipped (first: {s['first_problem']})"
        order = f"shuffled with seed {self.seed}, {'endless' if self.epochs is None else f'{self.epochs} epochs'}"
        if self.spec.sft is not None:  # what the loss trains on, so a template that marks nothing shows at once
            trained = "the answers" if self.spec.sft.completion_only else "every token"
            bad = f"; instruction records, trained on {trained}: {'' if exact else '~'}{s['loss_tokens_per_epoch']:,} targets per epoch{bad}"
        if self.spec.preference is not None:
            pairs = f"{'' if exact else '~'}{s['documents'] - s['bad_records']:,}"
            bad = f"; preference pairs ({pairs}), two rows each, scored on the answers: {'' if exact else '~'}{s['loss_tokens_per_epoch']:,} targets per epoch{bad}"
        return (
            f"{self.split} data: {s['documents']:,} of {self.corpus.describe()}, "
            f"{'' if exact else '~'}{s['tokens']:,} tokens ({self.tokenizer.name} tokenizer{measured}) -> "
            f"{'' if exact else '~'}{s['rows_per_epoch']:,} rows of {self.seq_len} per epoch, "
            f"{self.spec.packing} packing {100 * s['packing_efficiency']:.1f}% full; "
            f"{self.global_batch_size} rows per batch, {order if self.split == 'train' else 'in order'}{bad}"
        )


class Prefetched:
    """``batches`` prepared ``size`` ahead in a background thread (grain keeps the state of the
    batch last handed out); ``close`` stops that thread and the reader threads. ``batches`` is
    any iterator with ``get_state`` / ``set_state`` / ``close`` (a :class:`BatchIterator`, a mixture's)."""

    def __init__(self, batches: Any, size: int) -> None:
        self.batches, self.ahead = batches, ThreadPrefetchDatasetIterator(batches, size)

    def __iter__(self) -> Prefetched:
        return self

    def __next__(self) -> Batch:
        return next(self.ahead)

    def get_state(self) -> dict[str, Any]:
        return self.ahead.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self.ahead.set_state(state)

    def close(self) -> None:
        self.ahead.close()
        self.batches.close()
        self.ahead = ThreadPrefetchDatasetIterator(self.batches, 0)  # drop the closed one now, not at exit


class CorpusSample:
    """Packs some documents once, in order, to count them (the start-up statistics)."""

    def __init__(self, corpus: Corpus, documents: np.ndarray, tokenizer: Tokenizer, spec: RowSpec) -> None:
        skip = RowSpec(**{**spec.__dict__, "skip_bad_records": True})  # count bad records here; training decides
        docs = document_iterator(corpus, documents, tokenizer, skip, seed=None, epochs=1, read_threads=2)
        packer = make_packer(docs, skip, tokenizer.pad_id)
        try:
            for _ in packer:
                pass
        finally:
            docs.close()
        self.counts, self.first_problem = packer.counts, packer.first_problem
