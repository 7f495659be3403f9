"""A model's tokenizer files: found in a directory, carried into a run, written for HF.

A model directory (an HF checkpoint, or a run's ``tokenizer/`` folder) holds its tokenizer
as ``tokenizer.json`` (HF ``tokenizers``), ``tokenizer.model`` (a SentencePiece model, or
a tiktoken ranks file as Llama 3 ships it: told apart by content) or one ``*.tiktoken``
file. ``detect_tokenizer`` finds it, ``copy_tokenizer`` carries it into a run (so a run
directory decodes its own ids wherever it is moved) and ``write_hf_tokenizer`` writes what
``transformers.AutoTokenizer`` loads: the files themselves, or for the byte and tiktoken
tokenizers a ``tokenizer.json`` built to give the same ids.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nnxtron.data.chat_template import TEMPLATE_FILE
from nnxtron.data.tokenizer import (
    LLAMA3_PATTERN,
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    read_tiktoken_ranks,
)
from nnxtron.errors import DataError

HF_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)  # copied with an HF tokenizer
MODEL_FILE = "tokenizer.model"  # SentencePiece model or tiktoken ranks
GENERATION_FILE = "generation_config.json"  # the model's generation settings: they travel with its tokenizer
CARRIED = (*HF_FILES[1:], GENERATION_FILE)  # copied from beside any tokenizer file
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=* \d+\r?$")


def sniff_model_file(file: Path) -> str:
    """``"tiktoken"`` when ``file`` starts with a ``base64 rank`` line, else ``"sentencepiece"``."""
    with file.open("rb") as handle:
        first = handle.read(512).split(b"\n", 1)[0]
    return "tiktoken" if _TIKTOKEN_LINE.match(first) else "sentencepiece"


def detect_tokenizer(directory: str | Path) -> tuple[str, str] | None:
    """``(tokenizer_type, tokenizer_path)`` of the tokenizer ``directory`` holds, or None.

    ``tokenizer.json`` wins (an HF directory's fast tokenizer is the reference), then
    ``tokenizer.model`` (SentencePiece or tiktoken), then a single ``*.tiktoken`` file."""
    root = Path(directory)
    if (root / "tokenizer.json").is_file():
        return "hf", str(root)
    if (root / MODEL_FILE).is_file():
        return sniff_model_file(root / MODEL_FILE), str(root / MODEL_FILE)
    ranks = sorted(root.glob("*.tiktoken"))
    if len(ranks) == 1:
        return "tiktoken", str(ranks[0])
    return None


def tokenizer_values(directory: str | Path, given: Mapping[str, Any]) -> dict[str, str]:
    """``tokenizer_type`` / ``tokenizer_path`` of the tokenizer a model directory holds,
    unless ``given`` (the user's values) chose one: a given ``tokenizer_path`` wins; a
    given ``tokenizer_type`` of another kind reads that kind from the directory."""
    if "tokenizer_path" in given:
        return {}
    found = detect_tokenizer(directory)
    if found is None:
        return {}
    kind, path = found
    chosen = given.get("tokenizer_type", kind)
    if chosen == kind:
        return {"tokenizer_type": kind, "tokenizer_path": path}
    return {} if chosen == "byte" else {"tokenizer_path": str(directory)}


def copy_tokenizer(tokenizer: Tokenizer, dest: Path) -> str:
    """Copy ``tokenizer``'s files into ``dest`` (created); the path to read it back from.
    The byte tokenizer has no files: nothing is written and ``""`` is returned."""
    if isinstance(tokenizer, ByteTokenizer):
        return ""
    dest.mkdir(parents=True, exist_ok=True)
    source = Path(tokenizer.path)
    shutil.copyfile(source, dest / ("tokenizer.json" if isinstance(tokenizer, HFTokenizer) else MODEL_FILE))
    for name in CARRIED:  # HF settings (added tokens, BOS handling, chat template) and generation settings
        if (source.parent / name).is_file() and (source.parent / name).resolve() != (dest / name).resolve():
            shutil.copyfile(source.parent / name, dest / name)
    if isinstance(tokenizer, HFTokenizer):
        if not (dest / "tokenizer_config.json").is_file():  # ids from config.json: name them by their tokens
            _write_json(dest / "tokenizer_config.json", _special_tokens(tokenizer))
        return str(dest)
    return str(dest / MODEL_FILE)


def write_chat_template(tokenizer: Tokenizer, dest: Path, text: str) -> None:
    """Keep the chat template ``text`` in the tokenizer directory ``dest`` where HF's
    ``AutoTokenizer`` and ``ChatTemplate.from_directory`` read it: ``chat_template.jinja`` and
    tokenizer_config.json's ``chat_template`` (with the special tokens the template sees)."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / TEMPLATE_FILE).write_text(text, encoding="utf-8")
    config = dest / "tokenizer_config.json"
    settings = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
    _write_json(config, {**_special_tokens(tokenizer), **settings, "chat_template": text})


def write_hf_tokenizer(tokenizer: Tokenizer, dest: Path) -> list[str]:
    """Write what ``AutoTokenizer.from_pretrained(dest)`` needs to give ``tokenizer``'s ids
    and text; the names of the files written."""
    dest.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, HFTokenizer | SentencePieceTokenizer):
        copy_tokenizer(tokenizer, dest)
        written = [name for name in (*HF_FILES, MODEL_FILE) if (dest / name).is_file()]
        if isinstance(tokenizer, SentencePieceTokenizer) and "tokenizer_config.json" not in written:
            _write_json(dest / "tokenizer_config.json", _special_tokens(tokenizer))
            written.append("tokenizer_config.json")
        return written
    built = _byte_tokenizer_json() if isinstance(tokenizer, ByteTokenizer) else _tiktoken_tokenizer_json(tokenizer)
    built.save(str(dest / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", **_special_tokens(tokenizer)}
    _write_json(dest / "tokenizer_config.json", settings)
    return ["tokenizer.json", "tokenizer_config.json"]


def _special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """``{"bos_token": "<s>", ...}`` for the special ids the tokenizer has."""
    ids = {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id, "pad": tokenizer.pad_id}
    texts = {kind: tokenizer.token_text(i) for kind, i in ids.items() if i >= 0}
    return {f"{kind}_token": text for kind, text in texts.items() if text}


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _byte_tokenizer_json():
    """The byte tokenizer as a ``tokenizers`` BPE without merges: every UTF-8 byte falls
    back to its ``<0xNN>`` token (id byte + 3); pad, BOS and EOS are special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {name: i for i, name in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": b + ByteTokenizer.offset for b in range(256)})
    built = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    built.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    built.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    return built


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the ByteLevel alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _merge_of(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes] | None:
    """The pair tiktoken's BPE joins last to build ``token`` (only merges ranked below it)."""
    parts = [bytes([b]) for b in token]
    limit = ranks[token]
    while len(parts) > 2:
        pairs = [(ranks.get(parts[i] + parts[i + 1], limit), i) for i in range(len(parts) - 1)]
        rank, i = min(pairs)
        if rank >= limit:
            return None
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def _tiktoken_tokenizer_json(tokenizer: TiktokenTokenizer):
    """A tiktoken ranks file as a ``tokenizers`` byte-level BPE (as Llama 3's
    ``tokenizer.json``): the ranks as vocabulary, each token's last merge, the Llama 3
    split pattern, whole words looked up first (``ignore_merges``)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks = read_tiktoken_ranks(tokenizer.path)
    char = _bytes_to_unicode()
    text = {token: "".join(char[b] for b in token) for token in ranks}
    merges = []
    for token in sorted(ranks, key=ranks.get):
        if len(token) > 1:
            pair = _merge_of(ranks, token)
            if pair is None:
                raise DataError(f"'{tokenizer.path}': token {token!r} cannot be built from lower-ranked merges")
            merges.append((text[pair[0]], text[pair[1]]))
    vocab = {text[token]: rank for token, rank in ranks.items()}
    built = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    built.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    built.decoder = decoders.ByteLevel()
    specials = [tokenizer.token_text(tokenizer.bos_id), tokenizer.token_text(tokenizer.eos_id)]
    built.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    return built
