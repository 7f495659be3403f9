"""HuggingFace tokenizer.json files (a tiny BPE trained here, nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nnxtron.config import load_config
from nnxtron.data.sources import tokenizer_for
from nnxtron.data.tokenizer import HFTokenizer, make_tokenizer
from nnxtron.errors import ConfigError, DataError
from tests import tokenizer_files

TEXT = "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. Ünïcödé too.\n"


def write_bpe(directory: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE with <pad>, <s>, </s> (ids 0-2) and its tokenizer_config.json."""
    return tokenizer_files.write_bpe(directory, [TEXT] * 20, vocab_size)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    return write_bpe(tmp_path_factory.mktemp("bpe"))


def test_reads_a_directory_or_its_file_with_special_tokens(bpe_dir):
    for path in (bpe_dir, bpe_dir / "tokenizer.json"):
        tok = make_tokenizer("hf", str(path))
        assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
        assert 259 <= tok.vocab_size <= 300
        ids = tok.encode(TEXT)
        assert ids.dtype == np.int32 and len(ids) < len(TEXT.encode())  # merges were learned
        assert tok.decode(ids) == TEXT
        assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == TEXT  # special tokens are skipped


def test_special_ids_from_config_json_when_no_tokenizer_config(bpe_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": [1, 5]}))
    tok = HFTokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 1, 0)
    (tmp_path / "config.json").unlink()
    assert (HFTokenizer(tmp_path).bos_id, HFTokenizer(tmp_path).eos_id) == (-1, -1)


@pytest.mark.parametrize(
    "content, fragment",
    [(None, "does not exist"), ("not json at all", "is not a HuggingFace tokenizer.json"), ('{"a": 1}', "is not a HuggingFace")],
)
def test_bad_tokenizer_files_are_one_clear_error(tmp_path, content, fragment):
    if content is not None:
        (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(DataError, match=fragment):
        make_tokenizer("hf", str(tmp_path))


def test_hf_needs_a_path_and_a_path_needs_hf(bpe_dir):
    with pytest.raises(DataError, match="needs tokenizer_path"):
        make_tokenizer("hf")
    with pytest.raises(ConfigError, match="tokenizer_path is not read by tokenizer_type=byte"):
        load_config(values={"tokenizer_path": str(bpe_dir)})


def test_vocab_size_is_checked_against_the_tokenizer(tmp_path):
    directory = write_bpe(tmp_path, vocab_size=400)
    with pytest.raises(ConfigError, match="vocab_size=320 is smaller than the hf tokenizer's"):
        tokenizer_for(load_config(values={"tokenizer_type": "hf", "tokenizer_path": str(directory)}))
