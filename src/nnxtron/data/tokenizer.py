"""Tokenizers: a byte-level tokenizer that needs no vocabulary files."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from nnxtron.errors import DataError

__all__ = ["TOKENIZERS", "ByteTokenizer", "Tokenizer", "make_tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: object) -> str: ...


class ByteTokenizer:
    """UTF-8 byte tokenizer: ``pad=0, bos=1, eos=2``, byte ``b`` -> id ``b + 3``."""

    name = "byte"
    pad_id = 0
    bos_id = 1
    eos_id = 2
    offset = 3
    vocab_size = 256 + 3

    def encode(self, text: str) -> np.ndarray:
        """UTF-8 bytes of ``text`` as int32 ids (no special tokens added)."""
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return raw.astype(np.int32) + self.offset

    def decode(self, ids: object) -> str:
        """Text of ``ids``; special and out-of-range ids are dropped, bad UTF-8 replaced."""
        arr = np.asarray(ids, dtype=np.int64).ravel()
        arr = arr[(arr >= self.offset) & (arr < self.vocab_size)]
        return (arr - self.offset).astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


TOKENIZERS: dict[str, type] = {"byte": ByteTokenizer}


def make_tokenizer(name: str) -> Tokenizer:
    """The tokenizer called ``name`` (only ``"byte"`` for now)."""
    cls = TOKENIZERS.get(name)
    if cls is None:
        choices = ", ".join(repr(k) for k in sorted(TOKENIZERS))
        raise DataError(f"unknown tokenizer {name!r}; set tokenizer to one of: {choices}")
    return cls()
