"""Tokenizer files made in-process (nothing downloaded): a byte-level BPE ``tokenizer.json``
(GPT-2 / Llama 3 style, spaces as ``Ġ``), a SentencePiece BPE model with byte fallback
(Llama 2 style, ``▁`` word marker) and a tiktoken ranks file."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Sequence
from pathlib import Path

import sentencepiece
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2


def write_bpe(directory: Path, texts: Sequence[str], vocab_size: int = 300) -> Path:
    """A byte-level BPE trained on ``texts`` with <pad>, <s>, </s> and its tokenizer_config.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(list(texts), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))
    return directory


def write_sentencepiece(path: Path, texts: Sequence[str], vocab_size: int = 360) -> Path:
    """A SentencePiece BPE with byte fallback trained on the lines of ``texts``: pad 0, bos 1, eos 2, unk 3."""
    lines = [line for text in texts for line in text.splitlines() if line.strip()]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines * 5), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, byte_fallback=True, pad_id=0, bos_id=1, eos_id=2, unk_id=3, minloglevel=2,
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.getvalue())
    return path


def write_tiktoken(path: Path, merges: Sequence[bytes]) -> Path:
    """All 256 single bytes (rank = byte value), then ``merges`` ranked 256, 257, ... (a merge ranks after its parts)."""
    tokens = [bytes([b]) for b in range(256)] + list(merges)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(base64.b64encode(t) + f" {rank}\n".encode() for rank, t in enumerate(tokens)))
    return path
