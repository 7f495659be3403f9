"""Tokenizers: byte-level (no files), HuggingFace ``tokenizer.json``, SentencePiece ``.model`` and
tiktoken BPE files, all read from local paths."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from nnxtron.errors import DataError

__all__ = [
    "TOKENIZERS", "ByteTokenizer", "HFTokenizer", "SentencePieceTokenizer", "TiktokenTokenizer", "Tokenizer", "make_tokenizer",
    "read_tiktoken_ranks",
]  # fmt: skip


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

    def token_text(self, token_id: int) -> str: ...


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

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``encode(text)`` and each token's ``[start, end)`` character span in ``text``."""
        chars = [len(c.encode("utf-8")) for c in text]
        owner = np.repeat(np.arange(len(text), dtype=np.int32), chars)  # the character of each byte
        return self.encode(text), np.stack([owner, owner + 1], axis=1).reshape(-1, 2)

    def decode(self, ids: object) -> str:
        """Text of ``ids``; special and out-of-range ids are dropped, bad UTF-8 replaced."""
        arr = np.asarray(ids, dtype=np.int64).ravel()
        arr = arr[(arr >= self.offset) & (arr < self.vocab_size)]
        return (arr - self.offset).astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """The token's text form: ``<pad>``, ``<s>``, ``</s>``, else ``<0xNN>`` (its byte)."""
        specials = ("<pad>", "<s>", "</s>")
        return specials[token_id] if token_id < self.offset else f"<0x{token_id - self.offset:02X}>"

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

        file = _tokenizer_file(path, "tokenizer.json", "tokenizer.json")
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
        """Ids of ``text`` (no special tokens added: BOS/EOS are the caller's choice). ``encode_batch``
        gives the same ids as ``encode`` but releases the GIL, so a long text does not stop other
        threads (``serve``'s event loop)."""
        return np.asarray(self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids, dtype=np.int32)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``encode(text)`` and each token's ``[start, end)`` character span in ``text`` (special
        tokens written in the text, e.g. a chat template's, are matched as in HF)."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        offsets = np.asarray(encoding.offsets, dtype=np.int32).reshape(-1, 2)
        return np.asarray(encoding.ids, dtype=np.int32), offsets

    def decode(self, ids: object) -> str:
        """Text of ``ids``; special tokens are skipped."""
        return self._tokenizer.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """The token's string in the vocabulary ("" for an unknown id)."""
        return self._tokenizer.id_to_token(token_id) or ""

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


def _tokenizer_file(path: str | Path, default_name: str, kind: str) -> Path:
    """``path``, or ``path/default_name`` when it is a directory; DataError when missing."""
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / default_name
    if not file.is_file():
        raise DataError(f"tokenizer file '{file}' does not exist; set tokenizer_path to a {kind} file or its directory")
    return file


class SentencePieceTokenizer:
    """A SentencePiece model (``tokenizer.model`` of Llama 2, Mistral, Gemma). BOS / EOS / PAD
    are the model's own ids (-1 where it has none; PAD then falls back to 0)."""

    name = "sentencepiece"

    def __init__(self, path: str | Path):
        import sentencepiece

        file = _tokenizer_file(path, "tokenizer.model", "SentencePiece .model")
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(str(file))
        except (OSError, RuntimeError) as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise DataError(f"'{file}' is not a SentencePiece model ({first}); point tokenizer_path at a .model file") from None
        self.path = file
        self.vocab_size = self._sp.GetPieceSize()
        self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()
        self.pad_id = max(self._sp.pad_id(), 0)
        # the pieces HF's Llama tokenizer adds as special tokens (control symbols and <unk>): matched in the text
        self.specials = {
            self._sp.IdToPiece(i): i
            for i in range(self.vocab_size)
            if (self._sp.IsControl(i) or self._sp.IsUnknown(i)) and self._sp.IdToPiece(i)
        }
        names = sorted(self.specials, key=len, reverse=True)  # the longest first, as HF matches added tokens
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None
        settings = _read_json(file.parent / "tokenizer_config.json")
        # HF splits the text around special tokens as SentencePiece would encode each part alone only with
        # legacy=true, which transformers 5's Llama tokenizer no longer assumes when the setting is left out
        llama = str(settings.get("tokenizer_class", "")).startswith("Llama")
        self._legacy = settings.get("legacy", None if llama else True)

    def _chunks(self, text: str) -> list[tuple[int, str]]:
        """``(start character, text)`` of each plain chunk and special-token string of ``text``."""
        if self._split is None:
            return [(0, text)]
        chunks, start = [], 0
        for piece in self._split.split(text):
            if piece:
                chunks.append((start, piece))
            start += len(piece)
        if len(chunks) > 1 and self._legacy is not True:
            setting = "sets legacy=false" if self._legacy is False else "names a Llama tokenizer without legacy=true"
            raise DataError(
                f"'{self.path}': its tokenizer_config.json {setting}, and HF then encodes the text around special tokens "
                "(here a chat template's) in a way nnxtron's SentencePiece tokenizer does not reproduce; write the HF "
                'tokenizer.json next to it once with `python -c "from transformers import AutoTokenizer as T; '
                f"T.from_pretrained('{self.path.parent}').save_pretrained('{self.path.parent}')\"` and use it "
                "(tokenizer_type=hf)"
            )
        return chunks

    def encode(self, text: str) -> np.ndarray:
        """Ids of ``text`` (no BOS/EOS: the caller adds them). Control symbols written in the text
        (``<s>``, ``</s>``, ``<unk>``, e.g. by a chat template) are their ids and each text between
        them is encoded alone, as HF's Llama tokenizer (``legacy``) encodes added special tokens."""
        ids: list[int] = []
        for _, chunk in self._chunks(text):
            special = self.specials.get(chunk)
            ids.extend([special] if special is not None else self._sp.EncodeAsIds(chunk))
        return np.asarray(ids, dtype=np.int32)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``encode(text)`` and each token's ``[start, end)`` character span in ``text``, as HF's
        offsets: a piece without characters of its own (the word marker SentencePiece adds
        before a text) spans the character it stands before."""
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        for start, chunk in self._chunks(text):
            special = self.specials.get(chunk)
            if special is not None:
                ids.append(special)
                spans.append((start, start + len(chunk)))
                continue
            # byte offset -> character: the character holding each byte, and one past the last
            owner = np.repeat(np.arange(len(chunk) + 1), [len(c.encode("utf-8")) for c in chunk] + [1])
            for piece in self._sp.encode(chunk, out_type="proto").pieces:
                first = int(owner[piece.begin])
                spaces = len(piece.surface) - len(piece.surface.lstrip())
                first += max(spaces - (len(piece.piece) - len(piece.piece.lstrip("▁"))), 0)  # merged spaces: HF's is the last
                last = int(owner[piece.end - 1]) + 1 if piece.end > piece.begin else min(first + 1, len(chunk))
                ids.append(piece.id)
                spans.append((start + first, start + last))
        return np.asarray(ids, dtype=np.int32), np.asarray(spans, dtype=np.int32).reshape(-1, 2)

    def decode(self, ids: object) -> str:
        """Text of ``ids``; control ids (BOS/EOS/PAD) are dropped."""
        return self._sp.DecodeIds([int(i) for i in np.asarray(ids).ravel() if 0 <= int(i) < self.vocab_size])

    def token_text(self, token_id: int) -> str:
        """The piece of ``token_id`` (``<s>``, ``▁the`` ...)."""
        return self._sp.IdToPiece(token_id)

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer('{self.path}')"


#: The pre-tokenisation regex of Llama 3 (OpenAI's cl100k without possessive quantifiers).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def read_tiktoken_ranks(file: Path) -> dict[bytes, int]:
    """The ``token bytes -> rank`` table of a tiktoken BPE file (lines of ``base64(token) rank``)."""
    import base64
    import binascii

    ranks: dict[bytes, int] = {}
    number = 0
    try:
        for number, line in enumerate(file.read_bytes().splitlines(), 1):  # noqa: B007 - named in the error
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (ValueError, binascii.Error):
        raise DataError(
            f"'{file}' line {number} is not 'base64-token rank', so it is not a tiktoken BPE file; point tokenizer_path at one"
        ) from None
    except OSError as err:
        raise DataError(f"cannot read tokenizer file '{file}' ({err.strerror or err}); fix its permissions") from None
    n = len(ranks)
    if not n or sorted(ranks.values()) != list(range(n)):
        raise DataError(f"the ranks in '{file}' are not 0..{n - 1} without gaps, so it is not a tiktoken BPE file")
    return ranks


class TiktokenTokenizer:
    """A tiktoken BPE file (lines of ``base64(token) rank``, e.g. Llama 3's ``tokenizer.model``)
    split with the Llama 3 pattern. BOS and EOS are added after the ranks, as Llama 3 does:
    ``<|begin_of_text|>`` = number of ranks, ``<|end_of_text|>`` = that + 1; PAD is EOS."""

    name = "tiktoken"

    def __init__(self, path: str | Path):
        import tiktoken

        file = _tokenizer_file(path, "tokenizer.model", "tiktoken BPE")
        ranks = read_tiktoken_ranks(file)
        n = len(ranks)
        self.specials = {"<|begin_of_text|>": n, "<|end_of_text|>": n + 1}
        try:
            self._enc = tiktoken.Encoding(file.stem, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=self.specials)
        except ValueError as err:
            raise DataError(f"'{file}' is not a usable tiktoken BPE file ({err}); point tokenizer_path at one") from None
        self.path = file
        self.vocab_size = n + len(self.specials)
        self.bos_id, self.eos_id = n, n + 1
        self.pad_id = self.eos_id
        self._ranks = n

    def encode(self, text: str) -> np.ndarray:
        """Ids of ``text``; special-token strings in the text are ordinary text."""
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.int32)

    def decode(self, ids: object) -> str:
        """Text of ``ids``; BOS/EOS and out-of-range ids are dropped, bad UTF-8 replaced."""
        keep = [int(i) for i in np.asarray(ids).ravel() if 0 <= int(i) < self._ranks]
        return self._enc.decode(keep, errors="replace")

    def token_text(self, token_id: int) -> str:
        """A special token's name, else the token's bytes as text."""
        names = {i: name for name, i in self.specials.items()}
        return names.get(token_id) or self._enc.decode_single_token_bytes(token_id).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"TiktokenTokenizer('{self.path}')"


TOKENIZERS: dict[str, type] = {
    "byte": ByteTokenizer,
    "hf": HFTokenizer,
    "sentencepiece": SentencePieceTokenizer,
    "tiktoken": TiktokenTokenizer,
}


def make_tokenizer(name: str, path: str = "") -> Tokenizer:
    """The tokenizer called ``name``: ``"byte"``, or one read from ``path`` (hf, sentencepiece, tiktoken)."""
    cls = TOKENIZERS.get(name)
    if cls is None:
        choices = ", ".join(repr(k) for k in sorted(TOKENIZERS))
        raise DataError(f"unknown tokenizer {name!r}; set tokenizer_type to one of: {choices}")
    if cls is ByteTokenizer:
        return cls()
    if not path:
        raise DataError(f"tokenizer_type={name} needs tokenizer_path (the tokenizer file or the directory holding it)")
    return cls(path)
