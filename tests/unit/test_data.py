"""Tests for nnxtron.data: tokenizer, file discovery, packing and batch sources."""

from __future__ import annotations

import sysconfig

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nnxtron.data import (
    BATCH_KEYS,
    ByteTokenizer,
    SyntheticBatches,
    make_tokenizer,
    pack_documents,
    pack_documents_with_stats,
    resolve_paths,
)
from nnxtron.errors import DataError, UserError

TOK = ByteTokenizer()


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_ids_and_round_trip():
    assert (TOK.pad_id, TOK.bos_id, TOK.eos_id, TOK.vocab_size) == (0, 1, 2, 259)
    ids = TOK.encode("Az")
    assert ids.dtype == np.int32
    assert ids.tolist() == [ord("A") + 3, ord("z") + 3]
    text = "héllo wörld ✓ 😀 日本語\n\ttab"
    ids = TOK.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert ids.min() >= 3 and ids.max() < 259
    assert TOK.decode(ids) == text
    assert TOK.decode([]) == ""


def test_tokenizer_decode_drops_specials_and_replaces_bad_utf8():
    a = ord("a") + 3
    assert TOK.decode([1, a, 0, 2, 259, -5, 1000, a]) == "aa"
    assert TOK.decode(np.array([[1, a], [a, 2]])) == "aa"
    assert TOK.decode([0xFF + 3, a]) == "\ufffda"


def test_make_tokenizer():
    assert isinstance(make_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(DataError, match=r"'bpe'.*'byte'"):
        make_tokenizer("bpe")
    assert issubclass(DataError, UserError)


# ---------------------------------------------------------------- files


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_resolve_paths_file_dir_glob(tmp_path):
    a = _write(tmp_path / "a.txt", "a")
    b = _write(tmp_path / "sub" / "b.txt", "b")
    c = _write(tmp_path / "sub" / "deeper" / "c.md", "c")
    _write(tmp_path / "sub" / ".hidden", "h")
    assert resolve_paths([str(a)]) == [a.resolve()]
    assert resolve_paths(str(a)) == [a.resolve()]
    assert resolve_paths([str(tmp_path / "sub")]) == [b.resolve(), c.resolve()]
    assert resolve_paths([str(tmp_path / "*.txt")]) == [a.resolve()]
    assert resolve_paths([str(tmp_path / "**" / "*.txt")]) == [a.resolve(), b.resolve()]
    # overlapping patterns: sorted, each file once
    both = resolve_paths([str(tmp_path / "sub"), str(a), str(tmp_path / "**" / "*.txt")])
    assert both == [a.resolve(), b.resolve(), c.resolve()]
    assert both == sorted(both, key=str)
    odd = _write(tmp_path / "data[1]" / "x.txt", "x")  # a real name with glob characters
    assert resolve_paths([str(tmp_path / "data[1]")]) == [odd.resolve()]


def test_resolve_paths_python_stdlib():
    paths = resolve_paths(["{python_stdlib}/*.py"])
    names = {p.name for p in paths}
    assert {"os.py", "glob.py", "hashlib.py"} <= names
    stdlib = sysconfig.get_paths()["stdlib"]
    assert all(str(p.parent) == str(type(p)(stdlib).resolve()) for p in paths)


def test_resolve_paths_errors(tmp_path):
    missing = str(tmp_path / "nope" / "*.txt")
    with pytest.raises(DataError, match="matched no files") as info:
        resolve_paths([missing])
    assert missing in str(info.value)
    with pytest.raises(DataError, match="matched no files") as info:
        resolve_paths([str(tmp_path / "missing.txt")])
    assert "missing.txt" in str(info.value)
    with pytest.raises(DataError, match="dataset_path"):
        resolve_paths([])
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(DataError, match="emptydir"):
        resolve_paths([str(tmp_path / "emptydir")])


# ---------------------------------------------------------------- packing


def test_pack_exact_small_case():
    docs = [np.array([10, 11, 12]), np.array([20]), np.array([30, 31])]
    packed, stats = pack_documents_with_stats(docs, seq_len=5, bos_id=1, eos_id=2)
    # stream: 1 10 11 12 2 | 1 20 2 | 1 30 31 2 | pad...
    expected = {
        "inputs": [[1, 10, 11, 12, 2], [1, 20, 2, 1, 30], [31, 2, 0, 0, 0]],
        "targets": [[10, 11, 12, 2, 1], [20, 2, 1, 30, 31], [2, 0, 0, 0, 0]],
        "positions": [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1], [2, 3, 0, 0, 0]],
        "segment_ids": [[1, 1, 1, 1, 1], [1, 1, 1, 2, 2], [1, 1, 0, 0, 0]],
        "loss_mask": [[1, 1, 1, 1, 0], [1, 1, 0, 1, 1], [1, 0, 0, 0, 0]],
    }
    assert list(packed) == list(BATCH_KEYS)
    for key, want in expected.items():
        np.testing.assert_array_equal(packed[key], np.array(want), err_msg=key)
        want_dtype = np.float32 if key == "loss_mask" else np.int32
        assert packed[key].dtype == want_dtype, key
    assert (stats.documents, stats.tokens, stats.stream_tokens, stats.rows) == (3, 6, 12, 3)
    assert stats.real_targets == 11 and stats.loss_targets == 9
    assert stats.efficiency == pytest.approx(11 / 15)
    assert stats.as_dict()["packing_efficiency"] == pytest.approx(11 / 15)


def test_pack_document_continues_across_rows():
    docs = [np.array([10, 11, 12]), np.array([20])]
    p = pack_documents(docs, seq_len=4, bos_id=1, eos_id=2)
    # stream: 1 10 11 12 2 1 20 2 ; doc 0's eos starts row 1 at position 4, segment 1
    np.testing.assert_array_equal(p["inputs"], [[1, 10, 11, 12], [2, 1, 20, 2]])
    np.testing.assert_array_equal(p["targets"], [[10, 11, 12, 2], [1, 20, 2, 0]])
    np.testing.assert_array_equal(p["positions"], [[0, 1, 2, 3], [4, 0, 1, 2]])
    np.testing.assert_array_equal(p["segment_ids"], [[1, 1, 1, 1], [1, 2, 2, 2]])
    np.testing.assert_array_equal(p["loss_mask"], [[1, 1, 1, 1], [0, 1, 1, 0]])


def test_pack_without_specials_and_padding_row():
    docs = [np.array([10, 11]), np.array([20, 21])]
    p = pack_documents(docs, seq_len=3, bos_id=1, eos_id=2, add_bos=False, add_eos=False)
    np.testing.assert_array_equal(p["inputs"], [[10, 11, 20]])
    np.testing.assert_array_equal(p["targets"], [[11, 20, 21]])
    np.testing.assert_array_equal(p["positions"], [[0, 1, 0]])
    np.testing.assert_array_equal(p["segment_ids"], [[1, 1, 2]])
    np.testing.assert_array_equal(p["loss_mask"], [[1, 0, 1]])
    p = pack_documents([np.array([10, 11])], seq_len=6, bos_id=1, eos_id=2)
    np.testing.assert_array_equal(p["inputs"], [[1, 10, 11, 2, 0, 0]])
    np.testing.assert_array_equal(p["targets"], [[10, 11, 2, 0, 0, 0]])
    np.testing.assert_array_equal(p["segment_ids"], [[1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(p["loss_mask"], [[1, 1, 1, 0, 0, 0]])
    empty = pack_documents([], seq_len=4, bos_id=1, eos_id=2)
    assert all(v.shape == (0, 4) for v in empty.values())


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=8),
    seq_len=st.integers(1, 9),
    add_bos=st.booleans(),
    add_eos=st.booleans(),
)
def test_pack_no_token_lost(lengths, seq_len, add_bos, add_eos):
    rng = np.random.default_rng(len(lengths) * 100 + seq_len)
    docs = [rng.integers(3, 259, size=n) for n in lengths]
    p, stats = pack_documents_with_stats(docs, seq_len, 1, 2, add_bos, add_eos)
    parts = [np.concatenate([[1] * add_bos, d, [2] * add_eos]).astype(int) for d in docs]
    stream = np.concatenate(parts)
    doc_of = np.concatenate([[i] * len(x) for i, x in enumerate(parts)]).astype(int)
    pos_of = np.concatenate([np.arange(len(x)) for x in parts]).astype(int)
    n_rows = -(-(len(stream) - 1) // seq_len) if len(stream) > 1 else 0
    assert p["inputs"].shape == (n_rows, seq_len) == (stats.rows, seq_len)
    real = p["segment_ids"].ravel() > 0
    n_in = int(real.sum())
    # every stream token is an input exactly once, in order (except a final one with no target)
    assert n_in in (len(stream), len(stream) - 1) or n_rows == 0
    np.testing.assert_array_equal(p["inputs"].ravel()[real], stream[:n_in])
    np.testing.assert_array_equal(p["positions"].ravel()[real], pos_of[:n_in])
    np.testing.assert_array_equal(p["inputs"].ravel()[~real], 0)
    if n_rows:
        # every token but the first is a target exactly once; the rest is padding
        flat_t = p["targets"].ravel()
        np.testing.assert_array_equal(flat_t[: len(stream) - 1], stream[1:])
        np.testing.assert_array_equal(flat_t[len(stream) - 1 :], 0)
        same_doc = doc_of[:-1] == doc_of[1:]
        np.testing.assert_array_equal(p["loss_mask"].ravel()[: len(stream) - 1], same_doc)
        assert p["loss_mask"].ravel()[len(stream) - 1 :].sum() == 0
    # segment ids number the documents of each row 1, 2, ... in order; 0 for padding
    padded = np.full(n_rows * seq_len, -1)
    padded[: min(len(doc_of), padded.size)] = doc_of[: padded.size]
    for row_seg, row_doc in zip(p["segment_ids"], padded.reshape(n_rows, seq_len)):
        valid = row_doc >= 0
        want = np.zeros(seq_len, dtype=int)
        want[valid] = np.unique(row_doc[valid], return_inverse=True)[1] + 1
        np.testing.assert_array_equal(row_seg, want)


# text corpora: see test_data_stream.py


# ---------------------------------------------------------------- synthetic


def test_synthetic_batches():
    src = SyntheticBatches(vocab_size=50, seq_len=8, global_batch_size=4, seed=7)
    b = src.batch(3)
    tokens = np.random.default_rng([7, 3]).integers(3, 50, size=(4, 9))
    np.testing.assert_array_equal(b["inputs"], tokens[:, :-1])
    np.testing.assert_array_equal(b["targets"], tokens[:, 1:])
    np.testing.assert_array_equal(b["positions"], np.tile(np.arange(8), (4, 1)))
    np.testing.assert_array_equal(b["segment_ids"], 1)
    np.testing.assert_array_equal(b["loss_mask"], 1.0)
    assert {k: v.dtype for k, v in b.items()} == {
        "inputs": np.int32,
        "targets": np.int32,
        "positions": np.int32,
        "segment_ids": np.int32,
        "loss_mask": np.float32,
    }
    assert b["inputs"].min() >= 3 and b["inputs"].max() < 50
    again = SyntheticBatches(50, 8, 4, seed=7)
    for k in BATCH_KEYS:
        np.testing.assert_array_equal(again.batch(3)[k], b[k])
    assert not np.array_equal(src.batch(4)["inputs"], b["inputs"])
    assert not np.array_equal(SyntheticBatches(50, 8, 4, seed=8).batch(3)["inputs"], b["inputs"])
    assert "\n" not in src.describe()
    with pytest.raises(DataError, match="vocab_size"):
        SyntheticBatches(3, 8, 4)
