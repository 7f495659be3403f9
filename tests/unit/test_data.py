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
    TextBatches,
    load_documents,
    make_tokenizer,
    pack_documents,
    pack_documents_with_stats,
    resolve_paths,
)
from nnxtron.data import pipeline as pipeline_mod
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


def test_load_documents(tmp_path):
    a = _write(tmp_path / "a.txt", "héllo\n")
    b = _write(tmp_path / "b.txt", "second")
    assert load_documents([a, b]) == ["héllo\n", "second"]


def test_load_documents_not_utf8(tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"abc\xffdef")
    with pytest.raises(DataError) as info:
        load_documents([bad])
    msg = str(info.value)
    assert "bad.bin" in msg and "offset 3" in msg and "re-encode" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("content", ["", "  \n\t\n"])
def test_load_documents_empty(tmp_path, content):
    empty = tmp_path / "empty.txt"
    empty.write_text(content)
    with pytest.raises(DataError, match="empty") as info:
        load_documents([_write(tmp_path / "ok.txt", "x"), empty])
    assert "empty.txt" in str(info.value)


def test_python_stdlib_corpus_loads():
    docs = load_documents(resolve_paths(["{python_stdlib}/*.py"]))
    assert len(docs) > 50 and all(d.strip() for d in docs)


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


# ---------------------------------------------------------------- text batches


@pytest.fixture
def corpus(tmp_path):
    """20 small documents of varied length with distinct content."""
    rng = np.random.default_rng(0)
    for i in range(20):
        words = " ".join(f"w{i}_{j}" for j in range(int(rng.integers(3, 40))))
        _write(tmp_path / "docs" / f"doc{i:02d}.txt", f"document {i}: {words}\n")
    return str(tmp_path / "docs" / "*.txt")


def _text(corpus, **kw):
    args = {"tokenizer": TOK, "seq_len": 16, "global_batch_size": 4, "seed": 0}
    args.update(kw)
    return TextBatches([corpus], **args)


def _concat(batches):
    return {k: np.concatenate([b[k] for b in batches]) for k in BATCH_KEYS}


def test_text_batch_layout(corpus):
    src = _text(corpus)
    b = src.batch(0)
    assert list(b) == list(BATCH_KEYS)
    for k in BATCH_KEYS:
        assert b[k].shape == (4, 16), k
    assert b["inputs"].dtype == np.int32 and b["loss_mask"].dtype == np.float32
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    s = src.stats()
    assert s["documents"] == 20 and s["rows_per_epoch"] == src.rows_per_epoch > 4
    assert 0.9 < s["packing_efficiency"] <= 1.0
    line = src.describe()
    assert "\n" not in line and "20 files" in line


def test_text_epoch_covers_every_token_once(corpus):
    src = _text(corpus)
    rows = src.rows_per_epoch
    n = -(-rows // 4)
    epoch0 = {k: v[:rows] for k, v in _concat([src.batch(i) for i in range(n)]).items()}
    docs = [TOK.encode(t) for t in load_documents(resolve_paths([corpus]))]
    # inputs of epoch 0, split at bos, are exactly the documents (in shuffled order)
    flat = epoch0["inputs"].ravel()[epoch0["segment_ids"].ravel() > 0]
    chunks = np.split(flat, np.flatnonzero(flat == 1))[1:]  # each starts with bos
    # drop the eos (the last one may be missing: the final stream token has no target)
    found = sorted(tuple(x[1:][x[1:] != 2].tolist()) for x in chunks)
    assert found == sorted(tuple(d.tolist()) for d in docs)
    # epoch 1 is another shuffle of the same documents
    assert np.array_equal(src.epoch_rows(0)["inputs"], epoch0["inputs"])
    assert not np.array_equal(src.epoch_rows(1)["inputs"], src.epoch_rows(0)["inputs"])
    e0, e1 = (np.sort(src.epoch_rows(e)["inputs"].ravel()) for e in (0, 1))
    np.testing.assert_array_equal(e0, e1)


def test_text_deterministic_and_seeded(corpus):
    a, b, c = _text(corpus), _text(corpus), _text(corpus, seed=1)
    for i in range(6):
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(a.batch(i)[k], b.batch(i)[k])
    assert any(not np.array_equal(a.batch(i)["inputs"], c.batch(i)["inputs"]) for i in range(6))


def test_text_resumable(corpus):
    seq = _text(corpus)
    rows = seq.rows_per_epoch
    last = 2 * rows // 4 + 3  # well into epoch 2, past batches straddling epochs
    history = [seq.batch(i) for i in range(last + 1)]
    fresh = _text(corpus)
    for i in (last, 0, rows // 4, last - 1):
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(fresh.batch(i)[k], history[i][k])
    # batches are the global rows of consecutive epochs, straddling included
    all_rows = _concat(history)
    want = _concat([seq.epoch_rows(e) for e in range(3)])
    n = min(len(all_rows["inputs"]), len(want["inputs"]))
    for k in BATCH_KEYS:
        np.testing.assert_array_equal(all_rows[k][:n], want[k][:n])


def test_text_batch_larger_than_epoch(tmp_path):
    _write(tmp_path / "one.txt", "tiny")  # 6 stream tokens -> 2 rows of 4
    src = TextBatches([str(tmp_path / "one.txt")], TOK, seq_len=4, global_batch_size=5, seed=3)
    assert src.rows_per_epoch == 2
    b = src.batch(1)  # global rows 5..9 = epoch rows 1, 0, 1, 0, 1
    epoch = src.epoch_rows(0)
    np.testing.assert_array_equal(b["inputs"], epoch["inputs"][[1, 0, 1, 0, 1]])
    np.testing.assert_array_equal(b["inputs"][1], [1, *TOK.encode("tin")])


def test_text_returns_fresh_arrays(corpus):
    src = _text(corpus)
    b = src.batch(0)
    before = b["inputs"].copy()
    b["inputs"][:] = -1
    np.testing.assert_array_equal(src.batch(0)["inputs"], before)


@pytest.mark.parametrize("count", [1, 2, 4])
def test_process_slices(corpus, count):
    sources = [_text(corpus), SyntheticBatches(50, 8, 4, seed=0)]
    for src in sources:
        for i in (0, 5):
            full = src.batch(i)
            parts = [src.batch(i, p, count) for p in range(count)]
            for p, part in enumerate(parts):
                assert part["inputs"].shape[0] == 4 // count
                for k in BATCH_KEYS:
                    want = full[k][p * 4 // count : (p + 1) * 4 // count]
                    np.testing.assert_array_equal(part[k], want)
            for k in BATCH_KEYS:
                np.testing.assert_array_equal(_concat(parts)[k], full[k])


def test_process_count_must_divide_batch(corpus):
    with pytest.raises(DataError, match="global_batch_size 4 .* 3 processes"):
        _text(corpus).batch(0, 0, 3)
    with pytest.raises(DataError, match="multiple of 3"):
        SyntheticBatches(50, 8, 4).batch(0, 1, 3)


def test_eval_train_split(corpus):
    all_paths = resolve_paths([corpus])
    train = _text(corpus, eval_fraction=0.3)
    ev = _text(corpus, eval_fraction=0.3, split="eval")
    assert set(train.paths).isdisjoint(ev.paths)
    assert sorted(train.paths + ev.paths) == all_paths
    assert 0 < len(ev.paths) < 20
    assert _text(corpus).paths == all_paths
    # eval: fixed order, independent of seed, cycles over its rows
    ev2 = _text(corpus, eval_fraction=0.3, split="eval", seed=9)
    rows = ev.epoch_rows(0)
    r = ev.rows_per_epoch
    for i in range(r // 4 + 2):
        np.testing.assert_array_equal(ev.batch(i)["inputs"], ev2.batch(i)["inputs"])
        want = rows["inputs"][[(i * 4 + j) % r for j in range(4)]]
        np.testing.assert_array_equal(ev.batch(i)["inputs"], want)


def test_eval_split_never_empty(corpus, monkeypatch):
    monkeypatch.setattr(pipeline_mod, "eval_bucket", lambda path: 9999)
    all_paths = resolve_paths([corpus])
    ev = _text(corpus, eval_fraction=0.01, split="eval")
    assert ev.paths == [all_paths[-1]]
    assert _text(corpus, eval_fraction=0.01).paths == all_paths[:-1]


def test_split_errors(corpus, tmp_path):
    with pytest.raises(DataError, match="eval_fraction"):
        _text(corpus, eval_fraction=1.0)
    with pytest.raises(DataError, match="eval_fraction"):
        _text(str(tmp_path / "docs" / "doc00.txt"), eval_fraction=0.1)
    with pytest.raises(DataError, match="eval_fraction is 0"):
        _text(corpus, split="eval")
    with pytest.raises(DataError, match="split"):
        _text(corpus, split="test")
    assert _text(corpus, eval_fraction=1.0, split="eval").stats()["documents"] == 20


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


def test_eval_split_does_not_depend_on_where_the_corpus_lives(tmp_path):
    """The split hashes paths relative to the corpus root: a moved corpus splits the same."""
    for root in ("a", "b/deeper"):
        for i in range(30):
            path = tmp_path / root / "sub" / f"doc{i}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"document number {i} " * 20)
    kwargs = dict(tokenizer="byte", seq_len=16, global_batch_size=2, split="eval", eval_fraction=0.3)
    a = TextBatches([str(tmp_path / "a" / "**" / "*.txt")], **kwargs)
    b = TextBatches([str(tmp_path / "b" / "deeper" / "**" / "*.txt")], **kwargs)
    assert [p.name for p in a.paths] == [p.name for p in b.paths]
    assert 0 < len(a.paths) < 30
