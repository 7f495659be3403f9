"""The grain pipeline from a corpus to packed rows and batches, with exact, resumable state.

``documents`` is a grain ``MapDataset`` over document numbers: shuffled with the seed (a new
order each epoch), repeated, sliced ``[process_index::process_count]`` for this host, and
mapped to token ids in reader threads. :class:`RowPacker` turns that stream into rows and
:class:`BatchIterator` into batches. Their state is the documents iterator's state before the
document now being packed, plus how many of its tokens are used, so ``set_state`` continues at
exactly the next token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grain
import numpy as np

from nnxtron.config.options import PACKING_MODES
from nnxtron.data.file_tokens import STREAM_BYTES, FileTokens, TextFileCheck
from nnxtron.data.packing import BATCH_KEYS, row_arrays
from nnxtron.data.preference import format_pair
from nnxtron.data.records import BadRecord, Corpus
from nnxtron.data.sft import SFTFormat, format_record
from nnxtron.data.tokenizer import ByteTokenizer, Tokenizer
from nnxtron.errors import DataError

__all__ = ["BatchIterator", "Document", "PairPacker", "RowPacker", "RowSpec", "document_iterator", "make_packer"]


@dataclasses.dataclass(frozen=True)
class Document:
    """One tokenized document (BOS/EOS included; a large text file's are a :class:`FileTokens`,
    read as they are sliced), or why it is unusable; ``trainable`` marks
    the tokens the loss may train on predicting (None: all; instruction data: the answers).
    A preference pair holds its chosen side in ``tokens``/``trainable`` and its rejected
    side in ``rejected``/``rejected_trainable``."""

    index: int
    tokens: np.ndarray | FileTokens | None
    problem: str = ""
    trainable: np.ndarray | None = None
    rejected: np.ndarray | None = None
    rejected_trainable: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """How documents become rows.

    ``packing="concat"`` joins documents into one stream cut into rows (a document may
    continue in the next row, its positions continuing); ``"pad"`` starts every row with a
    new document (or the rest of a long one) and pads the rest of the row. With
    ``truncate_documents`` a document keeps only the tokens that fit one row (``seq_len + 1``
    with BOS/EOS). ``skip_bad_records`` counts and skips unusable documents instead of raising.
    ``sft``: the documents are instruction records (``data.sft``), trained on their answers.
    ``preference``: they are preference pairs (``data.preference``, rendered with this format's
    template), each made into two rows, its chosen then its rejected side (:class:`PairPacker`).
    """

    seq_len: int
    packing: str = "concat"
    truncate_documents: bool = False
    add_bos: bool = True
    add_eos: bool = True
    skip_bad_records: bool = False
    sft: SFTFormat | None = None
    preference: SFTFormat | None = None

    def __post_init__(self) -> None:
        if self.packing not in PACKING_MODES:
            raise DataError(f"unknown packing {self.packing!r}; set packing to one of: {', '.join(PACKING_MODES)}")
        if self.seq_len < 1:
            raise DataError(f"seq_len must be at least 1, got {self.seq_len}")


class _Tokenize:
    """grain map: document number -> :class:`Document` (runs in the reader threads). A text file
    over ``STREAM_BYTES`` read with the byte tokenizer is not tokenized here: its document's
    tokens are a :class:`FileTokens`, read from the file as they are packed (``data/file_tokens.py``)."""

    def __init__(self, corpus: Corpus, tokenizer: Tokenizer, spec: RowSpec) -> None:
        self.corpus, self.tokenizer, self.spec = corpus, tokenizer, spec
        self.head = np.asarray([tokenizer.bos_id] if spec.add_bos and tokenizer.bos_id >= 0 else [], np.int32)
        self.tail = np.asarray([tokenizer.eos_id] if spec.add_eos and tokenizer.eos_id >= 0 else [], np.int32)
        self.streams = isinstance(tokenizer, ByteTokenizer)  # its ids are the bytes: exact in any piece
        self.checked = TextFileCheck()

    def __call__(self, index: Any) -> Document:
        index = int(index)
        if self.spec.sft is not None or self.spec.preference is not None:
            return self._instruction(index)
        path = self.corpus.whole_file(index) if self.streams else None
        if path is not None and _size(path) > STREAM_BYTES:
            problem = self.checked.problem(path)
            if problem:
                return Document(index, None, f"{self.corpus.where(index)}: {problem}")
            return Document(index, FileTokens(path, ByteTokenizer.offset, self.head, self.tail))
        try:
            text = self.corpus.text(index)
        except BadRecord as err:
            return Document(index, None, str(err))
        ids = self.tokenizer.encode(text)
        return Document(index, np.concatenate([self.head, ids, self.tail]).astype(np.int32, copy=False))

    def _instruction(self, index: int) -> Document:
        try:
            record = self.corpus.record(index)
            bos_eos = (self.spec.add_bos, self.spec.add_eos)
            try:
                if self.spec.preference is not None:
                    pair = format_pair(record, self.tokenizer, self.spec.preference, *bos_eos)
                    _check_answers_fit(pair.chosen_scored, pair.rejected_scored, self.spec.seq_len)
                    return Document(index, pair.chosen, "", pair.chosen_scored, pair.rejected, pair.rejected_scored)
                ids, trainable = format_record(record, self.tokenizer, self.spec.sft, *bos_eos)
            except BadRecord as err:
                raise BadRecord(f"{self.corpus.where(index)}: {err}") from None
        except BadRecord as err:
            return Document(index, None, str(err))
        return Document(index, ids, trainable=trainable)


def _size(path: Any) -> int:
    """Bytes of a file (-1 when it cannot be read: reading it whole reports why)."""
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _check_answers_fit(chosen_scored: np.ndarray, rejected_scored: np.ndarray, seq_len: int) -> None:
    """A preference row is scored on the answer tokens within its first ``seq_len + 1``."""
    for name, scored in (("chosen", chosen_scored), ("rejected", rejected_scored)):
        if not scored[1 : seq_len + 1].any():
            raise BadRecord(
                f"its prompt fills the row: no {name!r} answer token within max_target_length={seq_len}; shorten the "
                "prompt or raise max_target_length"
            )


def document_iterator(
    corpus: Corpus,
    indices: np.ndarray,
    tokenizer: Tokenizer,
    spec: RowSpec,
    *,
    seed: int | None,
    epochs: int | None,
    process_index: int = 0,
    process_count: int = 1,
    read_threads: int = 2,
    read_buffer: int = 64,
) -> grain.DatasetIterator:
    """Tokenized documents ``indices`` (corpus numbers), shuffled per epoch with ``seed``
    (None: in order), ``epochs`` times (None: endless), this process's share only."""
    if not len(indices):
        raise DataError("the data split is empty; add documents or change eval_split_fraction")
    ds = grain.MapDataset.source(np.asarray(indices, dtype=np.int64))
    if seed is not None:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(epochs)[process_index::process_count]
    ds = ds.map(_Tokenize(corpus, tokenizer, spec))
    options = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=read_buffer if read_threads else 0)
    return ds.to_iter_dataset(options).__iter__()


COUNTERS = ("documents", "tokens", "bad_records", "truncated_tokens", "rows", "real_targets", "loss_targets")


class RowPacker:
    """Rows of ``seq_len + 1`` stream tokens from a documents iterator (see :class:`RowSpec`).

    ``pass_size``: documents in one pass of the stream; that many bad records in a row
    (skipped with ``skip_bad_records``) mean the data has no usable record at all, an
    error rather than an endless search."""

    def __init__(self, documents: grain.DatasetIterator, spec: RowSpec, pad_id: int, pass_size: int | None = None) -> None:
        self.documents, self.spec, self.pad_id, self.pass_size = documents, spec, pad_id, pass_size
        self._bad_in_a_row = 0
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.first_problem = ""
        self._before = documents.get_state()  # the documents state before self._doc
        self._doc: np.ndarray | None = None
        self._trainable: np.ndarray | None = None  # of self._doc (None: every token)
        self._offset = 0  # tokens of self._doc already packed (the next row starts there)
        self._serial = 0  # a number per document pulled, to tell documents apart inside a row

    def _pull(self, count: bool = True) -> bool:
        """Make the next usable document current; False when the stream has ended."""
        while True:
            before = self.documents.get_state()
            try:
                doc: Document = next(self.documents)
            except StopIteration:
                self._before, self._doc = before, None
                return False
            if doc.tokens is None or doc.tokens.size == 0:
                problem = doc.problem or "the document has no tokens"
                if not self.spec.skip_bad_records:
                    raise DataError(f"bad record: {problem}; fix or remove it, or set skip_bad_records=true to skip such records")
                if count:
                    self.counts["bad_records"] += 1
                    self.first_problem = self.first_problem or problem
                self._bad_in_a_row += 1
                if self.pass_size and self._bad_in_a_row >= self.pass_size:
                    raise DataError(
                        f"none of the {self.pass_size} records of a full pass over the data is usable (all skipped as bad; "
                        f"the first: {self.first_problem or problem}); fix the data or its settings (dataset_text_field, "
                        "tokenizer)"
                    )
                continue
            self._bad_in_a_row = 0
            tokens, trainable = doc.tokens, doc.trainable
            limit = self.spec.seq_len + 1
            if (self.spec.truncate_documents or self.spec.preference is not None) and tokens.size > limit:
                if count:
                    self.counts["truncated_tokens"] += int(tokens.size - limit)
                tokens, trainable = tokens[:limit], None if trainable is None else trainable[:limit]
            if count:
                self.counts["documents"] += 1
                self.counts["tokens"] += int(tokens.size)
            self._before, self._doc, self._trainable, self._offset = before, tokens, trainable, 0
            self._document = doc
            self._serial += 1
            return True

    def _exhausted(self) -> bool:
        return self._doc is None or self._offset >= self._doc.size

    def __iter__(self) -> RowPacker:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, document number or -1 for padding, position, trainable), each ``[seq_len + 1]``."""
        width = self.spec.seq_len + 1
        tokens = np.full(width, self.pad_id, np.int32)
        doc_of = np.full(width, -1, np.int32)
        pos_of = np.zeros(width, np.int32)
        trainable = np.ones(width, bool)
        filled = 0
        concat = self.spec.packing == "concat"
        while filled < width:
            if self._exhausted() and not self._pull():
                break
            take = min(width - filled, self._doc.size - self._offset)
            tokens[filled : filled + take] = self._doc[self._offset : self._offset + take]
            doc_of[filled : filled + take] = self._serial
            pos_of[filled : filled + take] = np.arange(self._offset, self._offset + take)
            if self._trainable is not None:
                trainable[filled : filled + take] = self._trainable[self._offset : self._offset + take]
            filled += take
            self._offset += take
            if not concat:
                break
        if filled < 2:  # no (input, target) pair left: the stream has ended
            raise StopIteration
        if concat:
            if filled == width:
                self._offset -= 1  # a row's last token is the next row's first input
        elif self._offset < self._doc.size:
            self._offset -= 1  # the rest of a long document starts the next row
        self._count_row(doc_of, trainable, filled)
        return tokens, doc_of, pos_of, trainable

    def _count_row(self, doc_of: np.ndarray, trainable: np.ndarray, filled: int) -> None:
        self.counts["rows"] += 1
        self.counts["real_targets"] += filled - 1
        self.counts["loss_targets"] += int(((doc_of[1:filled] == doc_of[: filled - 1]) & trainable[1:filled]).sum())

    def get_state(self) -> dict[str, Any]:
        return {
            "documents": self._before,
            "offset": None if self._doc is None else self._offset,
            "counts": dict(self.counts),
            "first_problem": self.first_problem,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        try:
            self.documents.set_state(state["documents"])
            self.counts = {k: int(state["counts"][k]) for k in COUNTERS}
            self.first_problem = str(state.get("first_problem", ""))
            self._doc, self._offset = None, 0
            if state["offset"] is not None:
                if not self._pull(count=False):
                    raise ValueError("the documents ended before the saved position")
                self._offset = int(state["offset"])
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(
                f"the saved data position does not fit this dataset ({err}); resume with the same data settings or a new run_name"
            ) from None


class PairPacker(RowPacker):
    """Rows of preference pairs (``RowSpec.preference``): each pair gives two rows, its chosen
    side then its rejected side, each starting at position 0 and padded. A side longer than
    a row keeps its first ``seq_len + 1`` tokens (the rest counted as ``truncated_tokens``)."""

    def __init__(self, documents: grain.DatasetIterator, spec: RowSpec, pad_id: int, pass_size: int | None = None) -> None:
        super().__init__(documents, spec, pad_id, pass_size)
        self._rejected_row: tuple[np.ndarray, ...] | None = None

    def __next__(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if self._rejected_row is not None:
            row, self._rejected_row = self._rejected_row, None
            return row
        if not self._pull():
            raise StopIteration
        limit = self.spec.seq_len + 1
        rejected, rejected_trainable = self._document.rejected, self._document.rejected_trainable
        self.counts["truncated_tokens"] += max(int(rejected.size) - limit, 0)
        self.counts["tokens"] += min(int(rejected.size), limit)
        chosen = self._row(self._doc, self._trainable)
        self._rejected_row = self._row(rejected[:limit], rejected_trainable[:limit])
        self._offset = self._doc.size  # the pair is used up
        return chosen

    def _row(self, tokens: np.ndarray, trainable: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        width, size = self.spec.seq_len + 1, tokens.size
        row = np.full(width, self.pad_id, np.int32)
        doc_of = np.full(width, -1, np.int32)
        pos_of = np.zeros(width, np.int32)
        scored = np.zeros(width, bool)
        row[:size], doc_of[:size], pos_of[:size], scored[:size] = tokens, 0, np.arange(size), trainable
        self._count_row(doc_of, scored, size)
        return row, doc_of, pos_of, scored

    def get_state(self) -> dict[str, Any]:
        if self._rejected_row is not None:
            raise RuntimeError("a preference pair's rejected row is still to come: batches hold whole pairs")
        return super().get_state()


def make_packer(documents: grain.DatasetIterator, spec: RowSpec, pad_id: int, pass_size: int | None = None) -> RowPacker:
    """The packer of ``spec``'s documents: :class:`PairPacker` for preference pairs, else :class:`RowPacker`."""
    return (PairPacker if spec.preference is not None else RowPacker)(documents, spec, pad_id, pass_size)


class BatchIterator:
    """Batches of ``rows`` packed rows: the ``BATCH_KEYS`` arrays, ``[rows, seq_len]``.

    Preference pairs (a :class:`PairPacker`) come as the chosen sides of ``rows / 2`` pairs
    followed by their rejected sides in the same order (``train.dpo.pair_halves``)."""

    def __init__(self, packer: RowPacker, rows: int) -> None:
        self.packer, self.rows = packer, rows
        self.pairs = isinstance(packer, PairPacker)
        if self.pairs and rows % 2:
            raise DataError(
                f"use_dpo=true puts each preference pair in two rows, but this process has {rows} rows per batch; "
                "set the batch size to an even number of rows per process"
            )

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        parts = [next(self.packer) for _ in range(self.rows)]  # StopIteration ends the batches
        if self.pairs:
            parts = parts[0::2] + parts[1::2]
        batch = row_arrays(*(np.stack(p) for p in zip(*parts)))
        return {k: batch[k] for k in BATCH_KEYS}

    def get_state(self) -> dict[str, Any]:
        return self.packer.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self.packer.set_state(state)

    def close(self) -> None:
        """Stops the documents iterator's reader threads."""
        self.packer.documents.close()
