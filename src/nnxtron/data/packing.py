"""Greedy packing of tokenized documents into fixed-length training rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from nnxtron.errors import DataError

__all__ = ["BATCH_KEYS", "PackStats", "pack_documents", "pack_documents_with_stats", "row_arrays"]

#: Keys of every packed-rows / batch dict, in this order.
BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


@dataclasses.dataclass(frozen=True)
class PackStats:
    """Counts from one packing: documents, their tokens, the rows made and how full they are."""

    documents: int
    tokens: int  # document tokens, without bos/eos
    stream_tokens: int  # tokens in the packed stream, bos/eos included
    rows: int
    seq_len: int
    real_targets: int  # target slots holding a real (non-padding) token
    loss_targets: int  # target slots with loss_mask 1

    @property
    def efficiency(self) -> float:
        """Fraction of target slots that hold a real token (1.0 = no padding)."""
        slots = self.rows * self.seq_len
        return self.real_targets / slots if slots else 0.0

    def as_dict(self) -> dict[str, float | int]:
        """The counts plus ``packing_efficiency``."""
        return {**dataclasses.asdict(self), "packing_efficiency": self.efficiency}


def row_arrays(
    tokens: np.ndarray, doc_of: np.ndarray, pos_of: np.ndarray, trainable: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """The batch arrays of rows of ``seq_len + 1`` stream tokens ``[rows, seq_len + 1]``.

    ``doc_of`` numbers the document each token belongs to (-1 = padding), ``pos_of`` is its
    position in that document, ``trainable`` (None = all) whether the loss may train on
    predicting it (instruction data: the answers only). Inputs are ``tokens[:, :-1]``, targets
    ``tokens[:, 1:]``; segment ids number the documents of each row 1, 2, ... (0 = padding)
    and the loss mask is 1 where the target is the next token of the same document and trainable."""
    doc_in, doc_tgt = doc_of[:, :-1], doc_of[:, 1:]
    starts_seg = np.ones(doc_in.shape, dtype=bool)
    starts_seg[:, 1:] = doc_in[:, 1:] != doc_in[:, :-1]
    segment_ids = np.cumsum(starts_seg, axis=1, dtype=np.int32)
    segment_ids[doc_in < 0] = 0
    return {
        "inputs": np.ascontiguousarray(tokens[:, :-1], dtype=np.int32),
        "targets": np.ascontiguousarray(tokens[:, 1:], dtype=np.int32),
        "positions": np.ascontiguousarray(pos_of[:, :-1], dtype=np.int32),
        "segment_ids": segment_ids,
        "loss_mask": ((doc_in == doc_tgt) & (doc_tgt >= 0) & (True if trainable is None else trainable[:, 1:])).astype(
            np.float32
        ),
    }


def pack_documents_with_stats(
    docs: Sequence[np.ndarray],
    seq_len: int,
    bos_id: int,
    eos_id: int,
    add_bos: bool = True,
    add_eos: bool = True,
    pad_id: int = 0,
) -> tuple[dict[str, np.ndarray], PackStats]:
    """Like :func:`pack_documents`, also returning the :class:`PackStats`."""
    if int(seq_len) < 1:
        raise DataError(f"seq_len must be at least 1, got {seq_len}; set a positive seq_len")
    seq_len = int(seq_len)
    docs = [np.asarray(d).ravel() for d in docs]
    n_docs = len(docs)
    extra = int(add_bos) + int(add_eos)
    doc_lens = np.array([d.size for d in docs], dtype=np.int64)
    lengths = doc_lens + extra  # stream tokens per document
    total = int(lengths.sum())
    n_rows = -(-(total - 1) // seq_len) if total > 1 else 0
    size = n_rows * seq_len + 1  # every row needs seq_len + 1 stream tokens

    stream = np.full(size, pad_id, dtype=np.int32)
    doc_of = np.full(size, -1, dtype=np.int32)
    pos_of = np.zeros(size, dtype=np.int32)
    if total:
        starts = np.cumsum(lengths) - lengths
        ids = np.repeat(np.arange(n_docs, dtype=np.int32), lengths)
        pos = np.arange(total) - np.repeat(starts, lengths)
        content = (pos >= int(add_bos)) & (pos < np.repeat(lengths, lengths) - int(add_eos))
        body = stream[:total]
        if doc_lens.sum():
            body[content] = np.concatenate(docs).astype(np.int32, copy=False)
        if add_bos:
            body[starts] = bos_id
        if add_eos:
            body[starts + lengths - 1] = eos_id
        doc_of[:total] = ids  # size >= total always holds
        pos_of[:total] = pos

    # row r reads stream[r*S : r*S + S + 1]: its inputs and, shifted by one, its targets
    window = np.arange(n_rows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    packed = row_arrays(stream[window], doc_of[window], pos_of[window])
    loss_mask = packed["loss_mask"]
    stats = PackStats(
        documents=n_docs,
        tokens=int(doc_lens.sum()),
        stream_tokens=total,
        rows=n_rows,
        seq_len=seq_len,
        real_targets=max(total - 1, 0) if n_rows else 0,
        loss_targets=int(loss_mask.sum()),
    )
    return packed, stats


def pack_documents(
    docs: Sequence[np.ndarray],
    seq_len: int,
    bos_id: int,
    eos_id: int,
    add_bos: bool = True,
    add_eos: bool = True,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """Pack ``[bos] + doc + [eos]`` of every document, in order, into rows of ``seq_len``.

    The documents form one token stream; row ``r`` has ``inputs = stream[r*S : r*S+S]`` and
    ``targets = stream[r*S+1 : r*S+S+1]``. The last row is padded with ``pad_id`` (segment 0,
    loss_mask 0). ``positions`` restart at 0 at each document start and continue across rows;
    ``segment_ids`` number the documents of each row 1, 2, ...; ``loss_mask`` is 1 where the
    target is the next token of the same document. Arrays are [rows, seq_len], int32 except
    ``loss_mask`` (float32). Every stream token except the first is a target exactly once.
    """
    return pack_documents_with_stats(docs, seq_len, bos_id, eos_id, add_bos, add_eos, pad_id)[0]
