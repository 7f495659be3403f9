"""Tokenizers: byte-level (no vocabulary files) and HuggingFace ``tokenizer.json`` files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from nnxtron.errors import DataError

__all__ = ["TOKENIZERS", "ByteTokenizer", "HFTokenizer", "Tokenizer", "make_tokenizer"]


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


class HFTokenizer:
    """A HuggingFace ``tokenizer.json`` (the ``tokenizers`` library), read from a local file or
    a directory holding one. BOS / EOS / PAD come from ``tokenizer_config.json`` (their token
    strings) or ``config.json`` (their ids) next to it; a missing one is -1 (not added, never
    stops generation); PAD falls back to 0."""

    name = "hf"

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tokenizer

        file = Path(path).expanduser()
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise DataError(f"tokenizer file '{file}' does not exist; set tokenizer_path to a tokenizer.json or its directory")
        try:
            self._tokenizer = _Tokenizer.from_file(str(file))
        except Exception as err:  # noqa: BLE001 - the library raises plain Exceptions for bad files
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise DataError(f"'{file}' is not a HuggingFace tokenizer.json ({first}); point tokenizer_path at one") from None
        self.path = file
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        special = self._special_ids(file.parent)
        self.bos_id, self.eos_id = special.get("bos", -1), special.get("eos", -1)
        self.pad_id = max(special.get("pad", 0), 0)

    def _special_ids(self, directory: Path) -> dict[str, int]:
        ids: dict[str, int] = {}
        config = _read_json(directory / "config.json")
        for kind in ("bos", "eos", "pad"):
            value = config.get(f"{kind}_token_id")
            if isinstance(value, list):
                value = value[0] if value else None
            if isinstance(value, int) and 0 <= value < self.vocab_size:
                ids[kind] = value
        settings = _read_json(directory / "tokenizer_config.json")
        for kind in ("bos", "eos", "pad"):
            token = settings.get(f"{kind}_token")
            token = token.get("content") if isinstance(token, dict) else token
            token_id = self._tokenizer.token_to_id(token) if isinstance(token, str) else None
            if token_id is not None:
                ids[kind] = token_id
        return ids

    def encode(self, text: str) -> np.ndarray:
        """Ids of ``text`` (no special tokens added: BOS/EOS are the caller's choice)."""
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids: object) -> str:
        """Text of ``ids``; special tokens are skipped."""
        return self._tokenizer.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer('{self.path}')"


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"'{path}' is not readable JSON ({err}); repair or remove it") from None
    return value if isinstance(value, dict) else {}


TOKENIZERS: dict[str, type] = {"byte": ByteTokenizer, "hf": HFTokenizer}


def make_tokenizer(name: str, path: str = "") -> Tokenizer:
    """The tokenizer called ``name``: ``"byte"``, or ``"hf"`` read from ``path``."""
    cls = TOKENIZERS.get(name)
    if cls is None:
        choices = ", ".join(repr(k) for k in sorted(TOKENIZERS))
        raise DataError(f"unknown tokenizer {name!r}; set tokenizer to one of: {choices}")
    if cls is HFTokenizer:
        if not path:
            raise DataError("tokenizer_type=hf needs tokenizer_path (a tokenizer.json or the directory holding one)")
        return HFTokenizer(path)
    return cls()
