"""Deterministic, resumable batch sources: batch ``index`` depends only on ``index``."""

from __future__ import annotations

import abc
import hashlib
import operator
import os
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from nnxtron.data.packing import BATCH_KEYS, PackStats, pack_documents_with_stats
from nnxtron.data.text import load_documents, resolve_paths
from nnxtron.data.tokenizer import Tokenizer, make_tokenizer
from nnxtron.errors import DataError

__all__ = ["BatchSource", "SyntheticBatches", "TextBatches", "eval_bucket"]

Batch = dict[str, np.ndarray]


def _positive(name: str, value: int) -> int:
    value = operator.index(value)
    if value < 1:
        raise DataError(f"{name} must be a positive integer, got {value}; set {name} >= 1")
    return value


def _seed(seed: int) -> int:
    seed = operator.index(seed)
    if seed < 0:
        raise DataError(f"seed must be a non-negative integer, got {seed}; set seed >= 0")
    return seed


def eval_bucket(path: str | os.PathLike) -> int:
    """Stable bucket in [0, 10000) of a path string (sha256, independent of PYTHONHASHSEED)."""
    digest = hashlib.sha256(os.fspath(path).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 10000


class BatchSource(abc.ABC):
    """Batches of rows ``[index*B, (index+1)*B)`` of a deterministic stream of rows."""

    global_batch_size: int
    seq_len: int

    def batch(self, index: int, process_index: int = 0, process_count: int = 1) -> Batch:
        """This process's rows of global batch ``index``: an equal, in-order slice per process."""
        index = operator.index(index)
        process_index = operator.index(process_index)
        process_count = operator.index(process_count)
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"bad process_index {process_index} for process_count {process_count}")
        size = self.global_batch_size
        if size % process_count:
            raise DataError(
                f"global_batch_size {size} is not divisible by the {process_count} processes; "
                f"set global_batch_size to a multiple of {process_count}"
            )
        local = size // process_count
        return self._batch(index, process_index * local, local)

    @abc.abstractmethod
    def _batch(self, index: int, offset: int, count: int) -> Batch:
        """Rows ``offset .. offset+count`` of global batch ``index``, as fresh arrays."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """documents, tokens, rows_per_epoch, packing_efficiency (None where not applicable)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the start-up print."""


class TextBatches(BatchSource):
    """Packed rows of text files, one document per file.

    Files go to the eval split by a stable hash of their path relative to the corpus root
    (the deepest common directory): ``eval_bucket(relpath) < eval_fraction * 10000``, so the
    split is the same wherever the corpus lives. Train epoch ``e`` shuffles the train
    documents with ``np.random.default_rng([seed, e])`` and packs them; batches read an endless
    run of epochs (a batch may straddle epochs). Eval packs documents in sorted order once and
    batches cycle over its rows.
    """

    def __init__(
        self,
        paths_or_patterns: Sequence[str | os.PathLike] | str | os.PathLike,
        tokenizer: Tokenizer | str,
        seq_len: int,
        global_batch_size: int,
        seed: int = 0,
        split: str = "train",
        eval_fraction: float = 0.0,
        add_bos: bool = True,
        add_eos: bool = True,
    ) -> None:
        if split not in ("train", "eval"):
            raise DataError(f"unknown split {split!r}; use 'train' or 'eval'")
        eval_fraction = float(eval_fraction)
        if not 0.0 <= eval_fraction <= 1.0:
            raise DataError(f"eval_fraction must be in [0, 1], got {eval_fraction}; set it between 0 and 1")
        if split == "eval" and eval_fraction == 0.0:
            raise DataError("the eval split is empty because eval_fraction is 0; set eval_fraction > 0")
        self.tokenizer = make_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.seq_len = _positive("seq_len", seq_len)
        self.global_batch_size = _positive("global_batch_size", global_batch_size)
        self.seed = _seed(seed)
        self.split = split
        self.eval_fraction = eval_fraction
        self.add_bos, self.add_eos = bool(add_bos), bool(add_eos)
        if isinstance(paths_or_patterns, (str, os.PathLike)):
            paths_or_patterns = [paths_or_patterns]
        self.patterns = [os.fspath(p) for p in paths_or_patterns]

        all_paths = resolve_paths(self.patterns)
        threshold = eval_fraction * 10000
        # hash paths relative to the corpus root, so the split is the same on every machine
        root = os.path.commonpath([str(p.parent) for p in all_paths])
        is_eval = [eval_bucket(os.path.relpath(p, root)) < threshold for p in all_paths]
        if eval_fraction > 0 and not any(is_eval):
            is_eval[-1] = True  # never an empty eval split: the last file (sorted) goes there
        train = [p for p, e in zip(all_paths, is_eval) if not e]
        if split == "train" and not train:
            raise DataError(
                f"all {len(all_paths)} dataset files went to the eval split (eval_fraction "
                f"{eval_fraction}); add more files to dataset_path or lower eval_fraction"
            )
        self.paths = train if split == "train" else [p for p, e in zip(all_paths, is_eval) if e]
        encode = self.tokenizer.encode
        self._docs = [encode(text) for text in load_documents(self.paths)]
        self._cache: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()
        packed, self._stats = self._pack_epoch(0)
        self.rows_per_epoch = self._stats.rows
        if self.rows_per_epoch == 0:
            raise DataError(
                f"the {split} split of dataset_path {self.patterns} has too few tokens to fill "
                "one row; add text or enable add_bos/add_eos"
            )
        # Row count does not depend on document order, so every epoch has rows_per_epoch rows.
        self._cache_epochs = max(2, -(-self.global_batch_size // self.rows_per_epoch) + 1)
        self._cache[0] = packed

    def _pack_epoch(self, epoch: int) -> tuple[dict[str, np.ndarray], PackStats]:
        docs = self._docs
        if self.split == "train":
            order = np.random.default_rng([self.seed, epoch]).permutation(len(docs))
            docs = [docs[i] for i in order]
        tok = self.tokenizer
        return pack_documents_with_stats(docs, self.seq_len, tok.bos_id, tok.eos_id, self.add_bos, self.add_eos, tok.pad_id)

    def epoch_rows(self, epoch: int) -> dict[str, np.ndarray]:
        """The packed rows of ``epoch`` (cached; treat as read-only). Eval has one fixed epoch."""
        if self.split == "eval":
            epoch = 0
        rows = self._cache.get(epoch)
        if rows is None:
            rows = self._pack_epoch(epoch)[0]
            self._cache[epoch] = rows
            while len(self._cache) > self._cache_epochs:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(epoch)
        return rows

    def _batch(self, index: int, offset: int, count: int) -> Batch:
        row = index * self.global_batch_size + offset
        parts: dict[str, list[np.ndarray]] = {k: [] for k in BATCH_KEYS}
        while count > 0:
            epoch, start = divmod(row, self.rows_per_epoch)
            take = min(count, self.rows_per_epoch - start)
            rows = self.epoch_rows(epoch)
            for k in BATCH_KEYS:
                parts[k].append(rows[k][start : start + take])
            row += take
            count -= take
        return {k: np.concatenate(v, axis=0) for k, v in parts.items()}

    def stats(self) -> dict:
        """Per-epoch counts of this split, plus ``batches_per_epoch`` (may be fractional)."""
        out = self._stats.as_dict()
        return {
            "split": self.split,
            "documents": out["documents"],
            "tokens": out["tokens"],
            "stream_tokens": out["stream_tokens"],
            "rows_per_epoch": out["rows"],
            "packing_efficiency": out["packing_efficiency"],
            "loss_tokens_per_epoch": out["loss_targets"],
            "batches_per_epoch": out["rows"] / self.global_batch_size,
        }

    def describe(self) -> str:
        s = self.stats()
        patterns = ", ".join(self.patterns)
        return (
            f"{self.split} data: {s['documents']:,} files, {s['tokens']:,} tokens "
            f"({self.tokenizer.name} tokenizer) -> {s['rows_per_epoch']:,} rows of {self.seq_len} "
            f"per epoch, packing {100 * s['packing_efficiency']:.1f}%, "
            f"{s['batches_per_epoch']:.1f} batches of {self.global_batch_size} per epoch; "
            f"from {patterns}"
        )


class SyntheticBatches(BatchSource):
    """Uniform random tokens in [3, vocab_size); batch ``i`` uses ``default_rng([seed, i])``."""

    def __init__(self, vocab_size: int, seq_len: int, global_batch_size: int, seed: int = 0) -> None:
        self.vocab_size = _positive("vocab_size", vocab_size)
        if self.vocab_size <= 3:
            raise DataError(f"vocab_size {vocab_size} leaves no room for tokens after the 3 special ids; set vocab_size > 3")
        self.seq_len = _positive("seq_len", seq_len)
        self.global_batch_size = _positive("global_batch_size", global_batch_size)
        self.seed = _seed(seed)

    def _batch(self, index: int, offset: int, count: int) -> Batch:
        rng = np.random.default_rng([self.seed, index])
        shape = (self.global_batch_size, self.seq_len + 1)
        tokens = rng.integers(3, self.vocab_size, size=shape, dtype=np.int64)
        tokens = tokens[offset : offset + count].astype(np.int32)
        rows = (count, self.seq_len)
        return {
            "inputs": np.ascontiguousarray(tokens[:, :-1]),
            "targets": np.ascontiguousarray(tokens[:, 1:]),
            "positions": np.broadcast_to(np.arange(self.seq_len, dtype=np.int32), rows).copy(),
            "segment_ids": np.ones(rows, dtype=np.int32),
            "loss_mask": np.ones(rows, dtype=np.float32),
        }

    def stats(self) -> dict:
        """An endless stream: documents, tokens and rows_per_epoch are None."""
        return {
            "split": "synthetic",
            "documents": None,
            "tokens": None,
            "stream_tokens": None,
            "rows_per_epoch": None,
            "packing_efficiency": 1.0,
            "loss_tokens_per_epoch": None,
            "batches_per_epoch": None,
        }

    def describe(self) -> str:
        return (
            f"synthetic data: uniform random tokens in [3, {self.vocab_size}), "
            f"{self.global_batch_size} rows of {self.seq_len} per batch, seed {self.seed}"
        )
