"""The grain pipeline: packing equals the in-memory packer, epochs, exact resume, per-process
shards, the eval split and errors raised by reader threads."""

from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import pytest

from nnxtron.data import BATCH_KEYS, ByteTokenizer, CorpusBatches, RowSpec, SyntheticBatches, open_corpus, pack_documents
from nnxtron.data.packing import row_arrays
from nnxtron.data.pipeline import split_documents
from nnxtron.data.stream import RowPacker, document_iterator
from nnxtron.errors import DataError

TOK = ByteTokenizer()
SEQ = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """14 text documents of 3..60 bytes (several longer than a row), plus two that are bad."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for i in range(14):
        words = " ".join(f"w{i}.{j}" for j in range(int(rng.integers(1, 12))))
        (root / f"doc{i:02d}.txt").write_text(f"d{i} {words}")
    bad = root / "bad"
    bad.mkdir()
    (bad / "empty.txt").write_text("  \n")
    (bad / "latin1.txt").write_bytes(b"caf\xe9")
    return root


def _open(corpus, bad: bool = False):
    return open_corpus("text", [str(corpus / "*.txt")] + ([str(corpus / "bad")] if bad else []))


def _source(corpus_obj, *, batch: int = 4, docs=None, **kw) -> CorpusBatches:
    spec_keys = {"packing", "truncate_documents", "add_bos", "add_eos", "skip_bad_records"}
    spec = RowSpec(seq_len=SEQ, **{k: v for k, v in kw.items() if k in spec_keys})
    rest = {k: v for k, v in kw.items() if k not in spec_keys}
    docs = np.arange(len(corpus_obj)) if docs is None else docs
    return CorpusBatches(corpus_obj, docs, TOK, spec, batch, **rest)


def _order(corpus_obj, docs, *, seed, epochs, index: int = 0, count: int = 1, skip: bool = False) -> list[int]:
    """Document numbers in stream order (bad ones included)."""
    it = document_iterator(
        corpus_obj, docs, TOK, RowSpec(SEQ, skip_bad_records=skip), seed=seed, epochs=epochs,
        process_index=index, process_count=count, read_threads=0,
    )  # fmt: skip
    return [d.index for d in it]


def _take(it, n: int) -> list[dict]:
    return [next(it) for _ in range(n)]


def _assert_batches_equal(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.mark.parametrize("add_bos, add_eos", [(True, True), (False, True), (True, False)])
def test_concat_rows_equal_in_memory_packing(corpus, add_bos, add_eos):
    """One epoch of streamed rows == pack_documents of the same documents in the same order."""
    c = _open(corpus)
    docs = np.arange(len(c))
    order = _order(c, docs, seed=5, epochs=1)
    assert sorted(order) == list(docs) and order != list(docs)
    want = pack_documents([TOK.encode(c.text(i)) for i in order], SEQ, TOK.bos_id, TOK.eos_id, add_bos, add_eos)
    spec = RowSpec(SEQ, add_bos=add_bos, add_eos=add_eos)
    packer = RowPacker(document_iterator(c, docs, TOK, spec, seed=5, epochs=1, read_threads=2), spec, TOK.pad_id)
    rows = list(packer)
    got = row_arrays(*(np.stack(x) for x in zip(*rows)))
    for k in BATCH_KEYS:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert packer.counts["rows"] == len(rows) == len(want["inputs"])
    assert packer.counts["loss_targets"] == int(want["loss_mask"].sum())
    assert packer.counts["documents"] == len(c)


def test_pad_mode_starts_every_row_with_a_document(corpus):
    c = _open(corpus)
    src = _source(c, batch=1, packing="pad", epochs=1, seed=2)
    rows = list(src.iterator())
    order = _order(c, np.arange(len(c)), seed=2, epochs=1)
    streams = [np.concatenate([[TOK.bos_id], TOK.encode(c.text(i)), [TOK.eos_id]]) for i in order]
    at = 0
    for stream in streams:  # a document fills one or more rows, continuing with overlap
        pieces = -(-(len(stream) - 1) // SEQ)
        for part in range(pieces):
            row = rows[at]
            n = min(SEQ, len(stream) - 1 - part * SEQ)
            np.testing.assert_array_equal(row["inputs"][0, :n], stream[part * SEQ : part * SEQ + n])
            np.testing.assert_array_equal(row["targets"][0, :n], stream[part * SEQ + 1 : part * SEQ + n + 1])
            np.testing.assert_array_equal(row["positions"][0, :n], np.arange(part * SEQ, part * SEQ + n))
            real = min(n + 1, SEQ)  # a document's last token is an input too (with no target)
            np.testing.assert_array_equal(row["segment_ids"][0], [1] * real + [0] * (SEQ - real))
            np.testing.assert_array_equal(row["loss_mask"][0], [1] * n + [0] * (SEQ - n))
            at += 1
    assert at == len(rows)
    assert src.stats()["packing_efficiency"] < 0.9  # pad mode pays for its padding


def test_truncate_documents_keeps_one_row_each(corpus):
    c = _open(corpus)
    lengths = [len(TOK.encode(c.text(i))) + 2 for i in range(len(c))]
    assert max(lengths) > SEQ + 1
    for packing in ("pad", "concat"):
        spec = RowSpec(SEQ, packing=packing, truncate_documents=True)
        packer = RowPacker(document_iterator(c, np.arange(len(c)), TOK, spec, seed=1, epochs=1), spec, TOK.pad_id)
        rows = list(packer)
        assert packer.counts["truncated_tokens"] == sum(max(n - SEQ - 1, 0) for n in lengths)
        assert packer.counts["tokens"] == sum(min(n, SEQ + 1) for n in lengths)
        if packing == "pad":
            assert len(rows) == len(c)
            assert all(r[0][0] == TOK.bos_id and r[2][0] == 0 for r in rows)


def test_epochs_shuffle_differently_and_deterministically(corpus):
    c = _open(corpus)
    docs = np.arange(len(c))
    two = _order(c, docs, seed=0, epochs=2)
    first, second = two[: len(c)], two[len(c) :]
    assert sorted(first) == sorted(second) == list(docs) and first != second
    assert two == _order(c, docs, seed=0, epochs=2)
    assert first != _order(c, docs, seed=1, epochs=1)
    assert _order(c, docs, seed=None, epochs=1) == list(docs)  # eval: in order


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(read_threads=0, prefetch=0),
        dict(packing="pad"),
        dict(packing="pad", truncate_documents=True),
        dict(bad=True, skip_bad_records=True),
    ],
    ids=["concat", "no-threads", "pad", "pad-truncate", "skip-bad"],
)
def test_resume_continues_at_the_exact_next_batch(corpus, options):
    """Batches after set_state(get_state() after k batches) == batches k.. of one uninterrupted run,
    for k before, inside and past the first epoch boundary."""
    options = dict(options)
    c = _open(corpus, bad=options.pop("bad", False))
    src = _source(c, seed=3, **options)
    rows_per_epoch = src.stats()["rows_per_epoch"]
    total = 3 * rows_per_epoch // 4 + 2  # into the third epoch
    it = src.iterator()
    whole = _take(it, total)
    final = it.get_state()
    it.close()
    for k in (1, rows_per_epoch // 4, rows_per_epoch // 4 + 1, total - 1):
        first = src.iterator()
        _take(first, k)
        state = json.loads(json.dumps(first.get_state()))  # what a checkpoint stores
        first.close()
        resumed = src.iterator()
        resumed.set_state(state)
        _assert_batches_equal(_take(resumed, total - k), whole[k:])
        assert resumed.get_state() == final  # the counters (bad records included) continue too
        resumed.close()
    if options.get("skip_bad_records"):
        assert final["counts"]["bad_records"] >= 4


def test_skipped_bad_records_are_counted(corpus):
    c = _open(corpus, bad=True)
    assert len(c) == 16
    src = _source(c, batch=1, skip_bad_records=True, epochs=2, seed=0)
    it = src.iterator()
    rows = list(it)
    state = it.get_state()
    assert state["counts"]["bad_records"] == 4 and state["counts"]["documents"] == 28
    assert "empty" in state["first_problem"] or "UTF-8" in state["first_problem"]
    assert src.stats()["bad_records"] == 2 and "bad records will be skipped" in src.describe()
    good = [i for i in range(len(c)) if "bad" not in str(c.paths[i])]
    targets = sum(len(TOK.encode(c.text(i))) + 1 for i in good)  # bos + text + eos: all but bos are targets
    assert sum(int(r["loss_mask"].sum()) for r in rows) == 2 * targets
    with pytest.raises(DataError, match="skip_bad_records") as err:
        _source(c)  # the start-up statistics find them
    assert "bad" in str(err.value) and "\n" not in str(err.value)


def test_bad_record_met_while_training_is_an_error(corpus):
    c = _open(corpus, bad=True)
    bad = [i for i in range(len(c)) if "bad" in str(c.paths[i])]
    docs = np.array([i for i in range(len(c)) if i not in bad] + bad)
    src = _source(c, batch=1, docs=docs, stats_documents=1)  # the statistics sample misses the bad files
    with pytest.raises(DataError, match="skip_bad_records") as err:
        list(src.iterator())
    assert ".txt" in str(err.value)


def test_a_split_of_only_bad_records_stops_instead_of_searching_forever(corpus):
    """skip_bad_records on data with no usable record: the start-up statistics stop it when
    they see the whole split; otherwise the packer stops after one full pass of bad ones."""
    c = _open(corpus, bad=True)
    bad = np.array([i for i in range(len(c)) if "bad" in str(c.paths[i])])
    with pytest.raises(DataError, match="none of the 2 records of the train split is usable"):
        _source(c, docs=bad, skip_bad_records=True)
    spec = RowSpec(seq_len=SEQ, skip_bad_records=True)
    endless = document_iterator(c, bad, TOK, spec, seed=0, epochs=None, read_threads=0)
    with pytest.raises(DataError, match="none of the 2 records of a full pass over the data is usable"):
        next(RowPacker(endless, spec, TOK.pad_id, pass_size=len(bad)))


def test_process_shards_are_disjoint_and_complete(corpus):
    c = _open(corpus)
    docs = np.arange(len(c))
    for count in (2, 3, 5):
        shares = [_order(c, docs, seed=4, epochs=1, index=p, count=count) for p in range(count)]
        seen = [i for share in shares for i in share]
        assert sorted(seen) == list(docs), count  # every document once, in exactly one process
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    src = _source(c, batch=4)
    part = next(src.iterator(1, 2))
    assert part["inputs"].shape == (2, SEQ)
    with pytest.raises(DataError, match="multiple of 3"):
        src.iterator(0, 3)


def test_split_documents(corpus, tmp_path):
    c = _open(corpus)
    train, evaluation = split_documents(c, 0.3)
    assert sorted([*train, *evaluation]) == list(range(len(c))) and 0 < len(evaluation) < len(c)
    assert len(split_documents(c, 0.0)[1]) == 0
    assert len(split_documents(c, 1e-9)[1]) == 1  # a positive fraction never gives an empty eval split
    with pytest.raises(DataError, match="eval_split_fraction"):
        split_documents(c, 1.0)
    # the split hashes paths relative to the corpus root: a moved corpus splits the same
    for root in ("a", "b/deeper"):
        for i in range(30):
            path = tmp_path / root / "sub" / f"doc{i}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"document {i}")
    moved = [open_corpus("text", str(tmp_path / root / "**" / "*.txt")) for root in ("a", "b/deeper")]
    names = [[m.paths[i].name for i in split_documents(m, 0.3)[1]] for m in moved]
    assert names[0] == names[1] and 0 < len(names[0]) < 30


def test_eval_iterator_is_the_same_every_time(corpus):
    c = _open(corpus)
    _, evaluation = split_documents(c, 0.5)
    src = _source(c, docs=evaluation, split="eval", seed=9)
    a, b = src.iterator(), src.iterator()
    _assert_batches_equal(_take(a, 5), _take(b, 5))  # cycles over its documents, in order
    a.close()
    b.close()


def test_error_in_a_reader_thread_is_raised_not_hung(corpus):
    class Broken(ByteTokenizer):
        def encode(self, text):
            if text.startswith("d7 "):
                raise RuntimeError("tokenizer exploded on d7")
            return super().encode(text)

    c = _open(corpus)
    spec = RowSpec(SEQ)
    src = CorpusBatches(c, np.arange(len(c)), ByteTokenizer(), spec, 2, read_threads=2, prefetch=2)
    src.tokenizer = Broken()  # after the start-up statistics, as if a worker failed mid-run
    it = src.iterator()

    def drain():
        for _ in range(1000):
            next(it)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with pytest.raises(RuntimeError, match="exploded on d7"):
            pool.submit(drain).result(timeout=60)
    it.close()


def test_finite_epochs_end(corpus):
    c = _open(corpus)
    src = _source(c, batch=2, epochs=1)
    batches = list(src.iterator())
    assert len(batches) == src.stats()["rows_per_epoch"] // 2


def test_foreign_state_is_a_clear_error(corpus):
    it = _source(_open(corpus)).iterator()
    with pytest.raises(DataError, match="saved data position"):
        it.set_state({"index": 3})
    it.close()
    synthetic = SyntheticBatches(50, 8, 4).iterator()
    with pytest.raises(DataError, match="synthetic"):
        synthetic.set_state({"documents": {}})


def test_synthetic_iterator_resumes():
    src = SyntheticBatches(50, 8, 4, seed=7)
    it = src.iterator(1, 2)
    first = _take(it, 3)
    _assert_batches_equal(first, [src.batch(i, 1, 2) for i in range(3)])
    again = src.iterator(1, 2)
    again.set_state(it.get_state())
    _assert_batches_equal(_take(again, 2), [src.batch(i, 1, 2) for i in (3, 4)])


def test_checkpointed_states_must_match_the_process_count(tmp_path):
    from nnxtron.errors import CheckpointError
    from nnxtron.train.loop import _process_data_state, all_process_states

    state = {"index": 4}
    assert all_process_states(state) == [state]
    assert _process_data_state({"data_state": [state]}, tmp_path) == state
    with pytest.raises(CheckpointError, match="written by 2 processes but this run has 1"):
        _process_data_state({"data_state": [state, state]}, tmp_path)
    with pytest.raises(CheckpointError, match="no data-iterator state"):
        _process_data_state({}, tmp_path)


# ---- a large text file is read in pieces (data/file_tokens.py) -------------------------------


@pytest.mark.parametrize(
    "options",
    [dict(), dict(packing="pad"), dict(packing="pad", truncate_documents=True), dict(bad=True, skip_bad_records=True)],
    ids=["concat", "pad", "pad-truncate", "skip-bad"],
)
def test_text_files_read_in_pieces_give_the_rows_of_reading_them_whole(corpus, monkeypatch, options):
    """Every file streamed (``STREAM_BYTES`` 0) through a 7-byte window: the batches, the statistics,
    the bad records' messages and a resume inside a document are those of reading each file whole."""
    import nnxtron.data.file_tokens as file_tokens
    import nnxtron.data.stream as stream

    options = dict(options)
    c = _open(corpus, bad=options.pop("bad", False))

    def run() -> tuple:
        src = _source(c, seed=3, **options)
        total = src.stats()["rows_per_epoch"] + 3  # into the second epoch
        it = src.iterator()
        whole = _take(it, total)
        state, final = None, it.get_state()
        it.close()
        first = src.iterator()
        _take(first, total // 2)
        state = json.loads(json.dumps(first.get_state()))
        first.close()
        resumed = src.iterator()
        resumed.set_state(state)
        _assert_batches_equal(_take(resumed, total - total // 2), whole[total // 2 :])
        resumed.close()
        return whole, src.describe(), final

    whole, described, final = run()
    monkeypatch.setattr(stream, "STREAM_BYTES", 0)
    monkeypatch.setattr(file_tokens, "WINDOW_BYTES", 7)
    streamed, streamed_described, streamed_final = run()
    _assert_batches_equal(streamed, whole)
    assert (streamed_described, streamed_final) == (described, final)


@pytest.mark.parametrize(
    "raw",
    [b"ab\xe9cd", b"abc\xc3", b"abcdef\xff", b"abcd\xe2\x82", "a\u00e9\u20ac\U0001f600 z".encode(), b"  \n\t\r  ", b"\xc3\xa9"],
)
def test_a_file_read_in_pieces_has_the_problems_of_reading_it_whole(tmp_path, monkeypatch, raw):
    """Bad UTF-8 before, across and at the end of a 4-byte piece; only whitespace; valid text: the
    same message (the same offset) as decoding the whole file."""
    import nnxtron.data.file_tokens as file_tokens
    from nnxtron.data.records import BadRecord

    monkeypatch.setattr(file_tokens, "WINDOW_BYTES", 4)
    (tmp_path / "f.txt").write_bytes(raw)
    c = open_corpus("text", [str(tmp_path / "f.txt")])
    try:
        c.text(0)
        whole = ""
    except BadRecord as err:
        whole = str(err).split(": ", 1)[1]
    assert file_tokens.TextFileCheck().problem(tmp_path / "f.txt") == whole


def test_a_large_text_file_is_read_in_bounded_memory(tmp_path):
    """One text file of 2 and of 8 MiB (the byte tokenizer; 100 MB was 5.6 GB of RSS in `nnxtron train`):
    the memory the pipeline allocates (statistics pass, reader threads, prefetch, 8 batches) does not
    grow with the file; read whole, the 8 MiB file took hundreds of MiB."""
    import tracemalloc

    peaks = {}
    for mib in (2, 8):
        path = tmp_path / f"{mib}.txt"
        path.write_bytes(b"the quick brown fox jumps over the lazy dog\n" * ((mib << 20) // 44))
        tracemalloc.start()
        try:
            src = CorpusBatches(open_corpus("text", [str(path)]), np.arange(1), TOK, RowSpec(seq_len=1024), 4)
            it = src.iterator()
            rows = _take(it, 8)
            peaks[mib] = tracemalloc.get_traced_memory()[1]
            it.close()
        finally:
            tracemalloc.stop()
        assert (rows[0]["inputs"][0, 1:6] - TOK.offset).astype(np.uint8).tobytes() == b"the q"
    assert peaks[8] < 32 << 20 and peaks[8] < 1.5 * peaks[2] + (4 << 20), {k: v >> 20 for k, v in peaks.items()}
