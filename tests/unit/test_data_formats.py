"""Every corpus format x every tokenizer, and the one-line errors of bad input.

All files are made here: the same 12 documents as a directory of text files, JSON Lines,
Parquet (several row groups), ArrayRecord (text records, in two files) and ArrayRecord of JSON
objects; a byte-level BPE ``tokenizer.json``, a SentencePiece model trained in-process and a
tiktoken ranks file with a few merges.
"""

from __future__ import annotations

import json
import pathlib
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from nnxtron.config.loader import load_config
from nnxtron.data.pipeline import CorpusBatches
from nnxtron.data.records import BadRecord, open_corpus
from nnxtron.data.sources import make_sources, tokenizer_for
from nnxtron.data.stream import RowSpec
from nnxtron.data.tokenizer import ByteTokenizer, HFTokenizer, SentencePieceTokenizer, TiktokenTokenizer, make_tokenizer
from nnxtron.errors import ConfigError, DataError
from tests.tokenizer_files import write_bpe, write_sentencepiece, write_tiktoken

DOCS = [
    "the cat sat on the mat",
    "héllo ✓ wörld",
    "x",
    "Ünïcödé ß 日本語 — emoji 🙂",
    "line one\nline two\n",
    "  leading and   multiple spaces  ",
    "tab\tseparated\tvalues",
    "the theme of the thesis: then, there, these.",
    "a much longer document that spans several rows of sixteen tokens, " * 3 + "the end",
    "1234567890 + 42 = 1234567932",
    "quotes \"double\" and 'single' and \\backslash",
    "The end.",
]
N = len(DOCS)
SEQ = 16
SP_VOCAB = 360
GARBAGE = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes() + b"\xff\xfe\n\x00\x80"
FORMATS = ["text", "jsonl", "parquet", "arrayrecord", "arrayrecord-json"]
TOKENIZERS = ["byte", "hf", "sentencepiece", "tiktoken"]
EXACT = {"byte", "hf", "tiktoken"}  # decode(encode(text)) == text
TIKTOKEN_MERGES = [b"th", b"he", b"the", b" t"]  # ranks 256.. (a merge ranks after its parts)


def write_arrayrecord(path: pathlib.Path, records: list[bytes]) -> pathlib.Path:
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for record in records:
        writer.write(record)
    writer.close()
    return path


def write_jsonl(path: pathlib.Path, lines: list[str]) -> pathlib.Path:
    path.write_bytes("".join(line + "\n" for line in lines).encode("utf-8"))
    return path


def dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


# --- fixtures: the corpora --------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, dict]:
    """format -> {kind, path, field, order (DOCS index of each corpus document), where}."""
    root = tmp_path_factory.mktemp("corpora")
    out = {}

    # text: one document per file; names sort in an order other than DOCS', one file nested,
    # and a hidden file that must be skipped
    text_dir = root / "text"
    (text_dir / "sub").mkdir(parents=True)
    files = {}
    for i, doc in enumerate(DOCS):
        name = "sub/zz.txt" if i == 3 else f"{(5 * i) % N:02d}.txt"
        files[i] = text_dir / name
        files[i].write_bytes(doc.encode("utf-8"))
    (text_dir / ".hidden.txt").write_bytes(GARBAGE)
    order = sorted(range(N), key=lambda i: str(files[i]))
    out["text"] = dict(kind="text", path=text_dir, field="", order=order, where=[f"'{files[i]}'" for i in order])

    # JSON Lines with an "id" field and two blank lines (one " \r") after the sixth document
    jsonl = root / "docs.jsonl"
    lines = [dumps({"id": i, "text": doc}) for i, doc in enumerate(DOCS)]
    write_jsonl(jsonl, lines[:6] + ["", " \r"] + lines[6:])
    numbers = [i + 1 if i < 6 else i + 3 for i in range(N)]
    out["jsonl"] = dict(kind="jsonl", path=jsonl, field="", order=list(range(N)), where=[f"'{jsonl}' line {n}" for n in numbers])

    # Parquet: 3 row groups of 4 rows
    parquet = root / "docs.parquet"
    pq.write_table(pa.table({"id": list(range(N)), "text": DOCS}), parquet, row_group_size=4)
    assert pq.ParquetFile(parquet).num_row_groups == 3
    out["parquet"] = dict(
        kind="parquet", path=parquet, field="", order=list(range(N)), where=[f"'{parquet}' row {i}" for i in range(N)]
    )

    # ArrayRecord of UTF-8 text, split over two files (a directory of them)
    ar_dir = root / "arrayrecord"
    ar_dir.mkdir()
    part0 = write_arrayrecord(ar_dir / "part-0.arrayrecord", [d.encode() for d in DOCS[:5]])
    part1 = write_arrayrecord(ar_dir / "part-1.arrayrecord", [d.encode() for d in DOCS[5:]])
    where = [f"'{part0}' record {i}" for i in range(5)] + [f"'{part1}' record {i}" for i in range(N - 5)]
    out["arrayrecord"] = dict(kind="arrayrecord", path=ar_dir, field="", order=list(range(N)), where=where)

    # ArrayRecord of JSON objects, the text in "body"
    ar_json = write_arrayrecord(root / "docs.json.arrayrecord", [dumps({"body": d, "n": i}).encode() for i, d in enumerate(DOCS)])
    out["arrayrecord-json"] = dict(
        kind="arrayrecord", path=ar_json, field="body", order=list(range(N)), where=[f"'{ar_json}' record {i}" for i in range(N)]
    )
    return out


def open_format(info: dict):
    return open_corpus(info["kind"], info["path"], info["field"])


# --- fixtures: the tokenizers -----------------------------------------------------------------


def write_hf(directory: pathlib.Path) -> pathlib.Path:
    """A byte-level BPE with <pad>, <s>, </s> (ids 0-2), as in test_hf_tokenizer.py."""
    return write_bpe(directory, DOCS * 5) / "tokenizer.json"


@pytest.fixture(scope="module")
def tok_files(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "hf": write_hf(root / "hf"),
        "sentencepiece": write_sentencepiece(root / "tok.model", DOCS, SP_VOCAB),
        "tiktoken": write_tiktoken(root / "ranks.tiktoken", TIKTOKEN_MERGES),
    }


@pytest.fixture(scope="module")
def toks(tok_files) -> dict:
    return {"byte": make_tokenizer("byte"), **{name: make_tokenizer(name, str(path)) for name, path in tok_files.items()}}


# --- helpers ------------------------------------------------------------------------------------


def read_epoch(source: CorpusBatches, limit: int = 1000) -> tuple[list[dict], dict]:
    """All batches of one epoch and the iterator state after the last of them."""
    it = source.iterator()
    batches: list[dict] = []
    try:
        for _ in range(limit):
            try:
                batches.append(next(it))
            except StopIteration:
                break
        else:
            pytest.fail(f"the epoch did not end within {limit} batches")
        return batches, it.get_state()
    finally:
        it.close()


def stream_documents(batches: list[dict], bos_id: int, eos_id: int) -> list[tuple[int, ...]]:
    """The documents' token ids (BOS/EOS removed) of consecutive rows, in stream order, checking
    that each starts with BOS at position 0, its positions count up and it ends with EOS."""
    cat = {k: np.concatenate([b[k].reshape(-1) for b in batches]) for k in ("inputs", "positions", "segment_ids")}
    real = cat["segment_ids"] > 0
    ids, positions = cat["inputs"][real], cat["positions"][real]
    starts = np.flatnonzero(ids == bos_id)
    assert len(starts) and starts[0] == 0
    np.testing.assert_array_equal(starts, np.flatnonzero(positions == 0))
    docs = []
    for k, (piece, pos) in enumerate(zip(np.split(ids, starts[1:]), np.split(positions, starts[1:]))):
        np.testing.assert_array_equal(pos, np.arange(len(pos)))
        body = piece[1:]
        if k < len(starts) - 1:  # the stream's very last EOS is only a target when the last row is full
            assert body[-1] == eos_id
        if len(body) and body[-1] == eos_id:
            body = body[:-1]
        docs.append(tuple(int(t) for t in body))
    return docs


def batches_for(corpus, tok, spec=None, rows=1, **kw) -> CorpusBatches:
    kw = {"split": "train", "seed": 0, "epochs": 1, "read_threads": 2, "prefetch": 1, **kw}
    return CorpusBatches(corpus, np.arange(len(corpus)), tok, spec or RowSpec(seq_len=SEQ), rows, **kw)


def assert_one_line(err: BaseException, *fragments: str) -> str:
    message = str(err)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# --- tokenizers ---------------------------------------------------------------------------------


def test_tokenizer_special_ids_and_sizes(toks, tok_files):
    assert (toks["byte"].pad_id, toks["byte"].bos_id, toks["byte"].eos_id, toks["byte"].vocab_size) == (0, 1, 2, 259)
    hf_vocab = json.loads(tok_files["hf"].read_text())["model"]["vocab"]
    assert (toks["hf"].pad_id, toks["hf"].bos_id, toks["hf"].eos_id) == (0, 1, 2)
    assert toks["hf"].vocab_size == len(hf_vocab) and 256 + 3 < len(hf_vocab) <= 300
    assert (toks["sentencepiece"].pad_id, toks["sentencepiece"].bos_id, toks["sentencepiece"].eos_id) == (0, 1, 2)
    assert toks["sentencepiece"].vocab_size == SP_VOCAB
    ranks = 256 + len(TIKTOKEN_MERGES)
    tik = toks["tiktoken"]
    assert (tik.bos_id, tik.eos_id, tik.pad_id, tik.vocab_size) == (ranks, ranks + 1, ranks + 1, ranks + 2)
    assert [toks[name].name for name in TOKENIZERS] == TOKENIZERS
    assert isinstance(toks["hf"], HFTokenizer) and isinstance(toks["sentencepiece"], SentencePieceTokenizer)
    assert isinstance(toks["tiktoken"], TiktokenTokenizer) and isinstance(toks["byte"], ByteTokenizer)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_tokenizer_round_trip(toks, name):
    tok = toks[name]
    for doc in DOCS:
        ids = tok.encode(doc)
        assert ids.dtype == np.int32 and ids.ndim == 1 and len(ids)
        assert ((ids >= 0) & (ids < tok.vocab_size)).all()
        assert not np.isin(ids, [tok.bos_id, tok.eos_id]).any()  # no special tokens added
        # SentencePiece normalises whitespace (runs, tabs, newlines -> one space; no leading/trailing)
        expected = doc if name in EXACT else " ".join(doc.split())
        assert tok.decode(ids) == expected
        assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == expected  # special ids are dropped
    if name == "byte":
        np.testing.assert_array_equal(tok.encode("hé"), [ord("h") + 3, 0xC3 + 3, 0xA9 + 3])


def test_sentencepiece_byte_fallback_keeps_unseen_characters(toks):
    sp = toks["sentencepiece"]
    unseen = "Zebra qüïck ❄ 漢"
    ids = sp.encode(unseen)
    assert sp.decode(ids) == unseen and 3 not in ids  # no <unk>
    assert len(sp.encode("the cat sat on the mat")) < len("the cat sat on the mat")  # merges were learned


def test_tiktoken_merges_follow_the_ranks(toks):
    tik = toks["tiktoken"]
    assert tik.encode("the").tolist() == [258]  # t h e -> th e -> the
    assert tik.encode("he").tolist() == [257]
    assert tik.encode(" t").tolist() == [259]
    assert tik.encode(" the").tolist() == [32, 258]  # "th" (256) merges before " t" (259)
    assert tik.encode("at").tolist() == [ord("a"), ord("t")]
    assert tik.encode("é").tolist() == [0xC3, 0xA9]
    assert tik.decode([256, 101, 260, 261]) == "the"  # BOS/EOS dropped


@pytest.mark.parametrize("name", TOKENIZERS)
def test_tokenizer_for_checks_vocab_size(toks, tok_files, name):
    size = toks[name].vocab_size
    path = [f"tokenizer_path={tok_files[name]}"] if name != "byte" else []

    def config(vocab_size: int):
        return load_config(overrides=[f"tokenizer_type={name}", *path, f"vocab_size={vocab_size}"])

    with pytest.raises(ConfigError) as err:
        tokenizer_for(config(size - 1))
    assert_one_line(err.value, f"vocab_size={size - 1}", f"{name} tokenizer's {size} ids", f"vocab_size >= {size}")
    tok = tokenizer_for(config(size))
    assert tok.name == name and tok.vocab_size == size


# --- corpora ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_corpus_reads_every_document(corpora, fmt):
    info = corpora[fmt]
    corpus = open_format(info)
    assert len(corpus) == N
    assert [corpus.text(i) for i in range(N)] == [DOCS[j] for j in info["order"]]
    assert sorted(corpus.text(i) for i in range(N)) == sorted(DOCS)
    assert [corpus.where(i) for i in range(N)] == info["where"]
    keys = corpus.keys()
    assert keys.dtype == np.uint64 and len(set(keys.tolist())) == N
    np.testing.assert_array_equal(keys, open_format(info).keys())  # stable
    for bad in (-1, N):
        with pytest.raises(IndexError):
            corpus.text(bad)
    files = {"text": f"{N} text files", "arrayrecord": f"{N} arrayrecord records in 2 files"}
    expected = files.get(fmt, f"{N} {info['kind']} {corpus.unit}s in 1 file")
    assert corpus.describe() == expected


@pytest.mark.parametrize("tok_name", TOKENIZERS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_with_every_tokenizer(corpora, toks, fmt, tok_name):
    corpus, tok = open_format(corpora[fmt]), toks[tok_name]
    source = batches_for(corpus, tok)
    batches, state = read_epoch(source)
    assert all(b["inputs"].shape == (1, SEQ) for b in batches)
    docs = stream_documents(batches, tok.bos_id, tok.eos_id)
    encoded = [tuple(tok.encode(d).tolist()) for d in DOCS]
    assert Counter(docs) == Counter(encoded)  # every document exactly once
    if tok_name in EXACT:
        assert sorted(tok.decode(d) for d in docs) == sorted(DOCS)
    assert docs != encoded  # shuffled (12! orders; seed 0 is not the identity)

    stats = source.stats()
    tokens = sum(len(e) + 2 for e in encoded)
    assert stats["documents"] == N and stats["sampled_documents"] == N and stats["bad_records"] == 0
    assert stats["tokens"] == tokens
    assert stats["rows_per_epoch"] == len(batches) == -(-(tokens - 1) // SEQ)
    assert stats["loss_tokens_per_epoch"] == sum(int(b["loss_mask"].sum()) for b in batches) == tokens - N
    assert state["counts"]["documents"] == N and state["counts"]["bad_records"] == 0
    describe = assert_one_line(source.describe(), f"({tok_name} tokenizer)", f"{N} of {corpus.describe()}")
    assert f"{tokens:,} tokens" in describe and "bad records" not in describe


def test_batches_of_three_rows_are_consecutive_rows(corpora, toks):
    corpus, tok = open_format(corpora["jsonl"]), toks["byte"]
    rows, _ = read_epoch(batches_for(corpus, tok, rows=1))
    triples, _ = read_epoch(batches_for(corpus, tok, rows=3))
    assert len(rows) % 3 and len(triples) == len(rows) // 3  # the last, partial batch is dropped
    for k, batch in enumerate(triples):
        assert batch["inputs"].shape == (3, SEQ)
        for key in batch:
            for r in range(3):
                np.testing.assert_array_equal(batch[key][r], rows[3 * k + r][key][0])
    # concat packing: a row's targets are its inputs shifted by one, continuing in the next row
    for a, b in zip(rows, rows[1:]):
        np.testing.assert_array_equal(a["targets"][0, :-1], a["inputs"][0, 1:])
        assert a["targets"][0, -1] == b["inputs"][0, 0]


def test_seeds_change_the_order_not_the_documents(corpora, toks):
    corpus, tok = open_format(corpora["parquet"]), toks["tiktoken"]
    orders = [stream_documents(read_epoch(batches_for(corpus, tok, seed=s))[0], tok.bos_id, tok.eos_id) for s in (0, 0, 1)]
    assert orders[0] == orders[1] and orders[0] != orders[2]
    assert Counter(orders[0]) == Counter(orders[2])


def test_eval_split_reads_in_order_and_cycles(corpora, toks):
    corpus, tok = open_format(corpora["parquet"]), toks["byte"]
    source = batches_for(corpus, tok, split="eval")
    it = source.iterator()
    try:
        batches = [next(it) for _ in range(60)]  # more than one pass over the corpus
    finally:
        it.close()
    docs = [tok.decode(d) for d in stream_documents(batches, tok.bos_id, tok.eos_id)]
    assert len(docs) > N + 1
    assert docs[:N] == DOCS and docs[N : len(docs) - 1] == DOCS[: len(docs) - 1 - N]
    assert "in order" in source.describe()


def test_make_sources_from_a_config(corpora, tok_files):
    info = corpora["jsonl"]
    common = [
        "dataset_type=jsonl", f"dataset_path={info['path']}", "tokenizer_type=tiktoken",
        f"tokenizer_path={tok_files['tiktoken']}", f"max_target_length={SEQ}", "data_num_epochs=1",
    ]  # fmt: skip
    train, evaluation = make_sources(load_config(overrides=[*common, "eval_interval=-1"]), 1)
    assert evaluation is None and isinstance(train, CorpusBatches)
    tok = train.tokenizer
    docs = stream_documents(read_epoch(train)[0], tok.bos_id, tok.eos_id)
    assert sorted(tok.decode(d) for d in docs) == sorted(DOCS)
    assert train.stats()["documents"] == N and "(tiktoken tokenizer)" in train.describe()

    train, evaluation = make_sources(load_config(overrides=[*common, "eval_interval=5", "eval_split_fraction=0.5"]), 1)
    assert train.stats()["documents"] + evaluation.stats()["documents"] == N
    assert set(train.documents.tolist()).isdisjoint(evaluation.documents.tolist())
    assert evaluation.stats()["documents"] >= 1 and evaluation.split == "eval"


# --- bad input: whole files -> DataError at open -----------------------------------------------


@pytest.fixture
def bad_dir(tmp_path) -> pathlib.Path:
    return tmp_path


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet", "arrayrecord"])
def test_missing_dataset_file(bad_dir, kind):
    path = bad_dir / f"missing.{kind}"
    with pytest.raises(DataError) as err:
        open_corpus(kind, path)
    assert_one_line(err.value, f"'{path}'", "matched no files")


def test_unknown_dataset_type(corpora):
    with pytest.raises(DataError) as err:
        open_corpus("csv", corpora["jsonl"]["path"])
    assert_one_line(err.value, "unknown dataset_type 'csv'", "jsonl")
    with pytest.raises(DataError, match="dataset_text_field is not read"):
        open_corpus("text", corpora["text"]["path"], "text")


@pytest.mark.parametrize(
    "fmt, field, fragments",
    [
        ("jsonl", "body", ["first line of", "no 'body' field", "'id', 'text'", "dataset_text_field"]),
        ("parquet", "body", ["Parquet file", "no column 'body'", "'id', 'text'", "dataset_text_field"]),
        ("parquet", "id", ["column 'id'", "holds int64, not strings"]),
    ],
)
def test_wrong_field_or_column(corpora, fmt, field, fragments):
    path = corpora[fmt]["path"]
    with pytest.raises(DataError) as err:
        open_corpus(fmt, path, field)
    assert_one_line(err.value, f"'{path}'", *fragments)


@pytest.mark.parametrize("damage", ["truncated", "footer"])
def test_corrupted_parquet_fails_at_open(corpora, bad_dir, damage):
    data = corpora["parquet"]["path"].read_bytes()
    path = bad_dir / f"{damage}.parquet"
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # the footer's metadata overwritten, its length and magic kept
        path.write_bytes(data[:-40] + b"\x55" * 32 + data[-8:])
    with pytest.raises(DataError) as err:
        open_corpus("parquet", path)
    assert_one_line(err.value, f"'{path}'", "is not a readable Parquet file")


def test_damaged_row_group_is_a_bad_record(corpora, toks, bad_dir):
    src = corpora["parquet"]["path"]
    column = pq.ParquetFile(src).metadata.row_group(1).column(1)  # "text"
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(src.read_bytes())
    data[start : start + column.total_compressed_size] = b"\xff" * column.total_compressed_size
    path = bad_dir / "damaged.parquet"
    path.write_bytes(bytes(data))
    corpus = open_corpus("parquet", path)
    assert [corpus.text(i) for i in (0, 3, 8, 11)] == [DOCS[i] for i in (0, 3, 8, 11)]
    for i in range(4, 8):
        with pytest.raises(BadRecord) as err:
            corpus.text(i)
        assert_one_line(err.value, f"'{path}' row {i}", "row group 1 cannot be read")
    with pytest.raises(DataError) as err:
        batches_for(corpus, toks["byte"])
    assert_one_line(err.value, f"'{path}' row ", "skip_bad_records")
    source = batches_for(corpus, toks["byte"], RowSpec(seq_len=SEQ, skip_bad_records=True))
    batches, state = read_epoch(source)
    tok = toks["byte"]
    assert sorted(tok.decode(d) for d in stream_documents(batches, 1, 2)) == sorted(DOCS[:4] + DOCS[8:])
    assert (state["counts"]["documents"], state["counts"]["bad_records"]) == (8, 4)


def test_garbage_as_text_file(toks, bad_dir):
    path = bad_dir / "garbage.txt"
    path.write_bytes(GARBAGE)
    corpus = open_corpus("text", path)
    assert len(corpus) == 1
    with pytest.raises(BadRecord) as err:
        corpus.text(0)
    assert_one_line(err.value, f"'{path}'", "not valid UTF-8")
    with pytest.raises(DataError) as err:
        batches_for(corpus, toks["byte"])
    assert_one_line(err.value, "bad record", f"'{path}'", "skip_bad_records")


def test_garbage_as_jsonl(toks, bad_dir):
    path = bad_dir / "garbage.jsonl"
    path.write_bytes(GARBAGE)
    corpus = open_corpus("jsonl", path)  # a bad line is a bad record, found when read
    assert len(corpus) >= 1
    with pytest.raises(DataError) as err:
        batches_for(corpus, toks["byte"])
    assert_one_line(err.value, f"'{path}' line ", "skip_bad_records")


@pytest.mark.parametrize("kind, what", [("parquet", "Parquet"), ("arrayrecord", "ArrayRecord")])
def test_garbage_as_a_binary_format(bad_dir, kind, what):
    path = bad_dir / f"garbage.{kind}"
    path.write_bytes(GARBAGE)
    with pytest.raises(DataError) as err:
        open_corpus(kind, path)
    assert_one_line(err.value, f"'{path}'", f"is not a readable {what} file")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_unreadable_arrayrecord_next_to_a_good_one(bad_dir, damage):
    good = write_arrayrecord(bad_dir / "a-good.arrayrecord", [d.encode() for d in DOCS])
    bad = bad_dir / "b-bad.arrayrecord"
    bad.write_bytes(GARBAGE if damage == "garbage" else good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DataError) as err:
        open_corpus("arrayrecord", bad_dir)
    assert_one_line(err.value, f"'{bad}'", "not a readable ArrayRecord file")


def _empty_jsonl(path):
    path.write_bytes(b"")


def _blank_jsonl(path):
    path.write_bytes(b"\n\n \n\r\n\t\n")


def _empty_arrayrecord(path):
    write_arrayrecord(path, [])


def _empty_parquet(path):
    pq.write_table(pa.table({"text": pa.array([], pa.string()), "id": pa.array([], pa.int64())}), path)


@pytest.mark.parametrize(
    "kind, name, make, unit",
    [
        ("jsonl", "empty.jsonl", _empty_jsonl, "lines"),
        ("jsonl", "blank.jsonl", _blank_jsonl, "lines"),
        ("arrayrecord", "empty.arrayrecord", _empty_arrayrecord, "records"),
        ("parquet", "empty.parquet", _empty_parquet, "rows"),
    ],
)
def test_empty_datasets(bad_dir, kind, name, make, unit):
    path = bad_dir / name
    make(path)
    with pytest.raises(DataError) as err:
        open_corpus(kind, path)
    assert_one_line(err.value, f"'{path}'", f"hold no {unit} of text")


def test_jsonl_whitespace_lines_are_blank(bad_dir):
    path = bad_dir / "spaces.jsonl"
    path.write_bytes(b'{"text": "a"}\n    \n\t\t\t\n{"text": "b"}\n')
    corpus = open_corpus("jsonl", path)
    assert [corpus.text(i) for i in range(len(corpus))] == ["a", "b"]
    assert corpus.where(1) == f"'{path}' line 4"


# --- bad input: single records -> BadRecord ------------------------------------------------------

BAD_LINES = [
    ('{"text": null}', "field 'text' is a NoneType, not a string"),
    ('{"text": 42}', "field 'text' is a int, not a string"),
    ('{"id": 7}', "has no 'text' field (it has 'id')"),
    ('["text"]', "is a JSON list, not an object"),
    ('"just a string"', "is a JSON str, not an object"),
    ('{"text": "unterminated', "is not valid JSON"),
    ('{"text": "   "}', "the document is empty"),
]


def test_bad_json_lines_are_bad_records(bad_dir):
    path = bad_dir / "bad.jsonl"
    raw = [b'{"text": "fine"}'] + [line.encode() for line, _ in BAD_LINES] + [b'{"text": "\xff\xfe"}']
    path.write_bytes(b"\n".join(raw) + b"\n")
    corpus = open_corpus("jsonl", path)
    assert len(corpus) == len(raw) and corpus.text(0) == "fine"
    for i, fragment in enumerate([f for _, f in BAD_LINES] + ["the line is not valid UTF-8"], 1):
        with pytest.raises(BadRecord) as err:
            corpus.text(i)
        assert_one_line(err.value, f"'{path}' line {i + 1}: ", fragment)


def test_bad_arrayrecord_records(bad_dir):
    path = write_arrayrecord(bad_dir / "mixed.arrayrecord", [b"plain text", b"\xff\xfe\xfd", b'{"text": null}'])
    corpus = open_corpus("arrayrecord", path)
    assert corpus.text(0) == "plain text"
    with pytest.raises(BadRecord) as err:
        corpus.text(1)
    assert_one_line(err.value, f"'{path}' record 1", "not UTF-8 text", "tf.train.Example")
    as_json = open_corpus("arrayrecord", path, "text")
    with pytest.raises(BadRecord) as err:
        as_json.text(0)
    assert_one_line(err.value, f"'{path}' record 0", "is not a JSON object", "dataset_text_field is set")
    with pytest.raises(BadRecord) as err:
        as_json.text(2)
    assert_one_line(err.value, f"'{path}' record 2", "field 'text' is a NoneType")


def test_empty_text_file_is_a_bad_record(bad_dir):
    path = bad_dir / "empty.txt"
    path.write_bytes(b" \n\t")
    with pytest.raises(BadRecord) as err:
        open_corpus("text", path).text(0)
    assert_one_line(err.value, f"'{path}'", "the document is empty")


# --- bad tokenizer files -------------------------------------------------------------------------

CLASSES = {"hf": HFTokenizer, "sentencepiece": SentencePieceTokenizer, "tiktoken": TiktokenTokenizer}
WRONG = [
    (cls, f)
    for cls in CLASSES
    for f in [*CLASSES, "garbage", "gaps", "missing"]
    if f != cls and not (f == "gaps" and cls != "tiktoken")
]


@pytest.mark.parametrize("cls, given", WRONG, ids=[f"{c}-given-{f}" for c, f in WRONG])
def test_wrong_tokenizer_file(tok_files, bad_dir, cls, given):
    if given in tok_files:
        path = tok_files[given]
    else:
        path = bad_dir / f"{given}.tok"
        if given == "garbage":
            path.write_bytes(GARBAGE)
        elif given == "gaps":  # ranks 0, 1, 3
            path.write_bytes(b"YQ== 0\nYg== 1\nYw== 3\n")
    with pytest.raises(DataError) as err:
        CLASSES[cls](path)
    assert_one_line(err.value, f"'{path}'")
    with pytest.raises(DataError) as err:
        make_tokenizer(cls, str(path))
    assert_one_line(err.value, f"'{path}'", *(["does not exist"] if given == "missing" else []))


def test_unknown_tokenizer_and_missing_path():
    with pytest.raises(DataError) as err:
        make_tokenizer("gpt9")
    assert_one_line(err.value, "unknown tokenizer 'gpt9'", "'byte'", "'tiktoken'")
    for name in CLASSES:
        with pytest.raises(DataError) as err:
            make_tokenizer(name)
        assert_one_line(err.value, f"tokenizer_type={name} needs tokenizer_path")


# --- bad records in the pipeline: reported, or counted and skipped ---------------------------------

GOOD_AND_BAD = [dumps({"text": d}) for d in DOCS[:4]] + ['{"text": "oops'] + [dumps({"text": d}) for d in DOCS[4:8]]
GOOD_AND_BAD += ['{"text": null}', dumps({"text": DOCS[8]}), '{"id": 3}', dumps({"text": DOCS[9]})]
BAD_LINE_NUMBERS = {5, 10, 12}


@pytest.fixture
def mixed_jsonl(bad_dir) -> pathlib.Path:
    return write_jsonl(bad_dir / "mixed.jsonl", GOOD_AND_BAD)


def test_skip_bad_records_counts_and_skips(mixed_jsonl, toks):
    tok = toks["byte"]
    corpus = open_corpus("jsonl", mixed_jsonl)
    assert len(corpus) == 13
    source = batches_for(corpus, tok, RowSpec(seq_len=SEQ, skip_bad_records=True))
    stats = source.stats()
    assert (stats["documents"], stats["bad_records"]) == (13, 3)
    assert stats["tokens"] == sum(len(d.encode()) + 2 for d in DOCS[:10])
    assert_one_line(source.describe(), "3 bad records will be skipped", f"'{mixed_jsonl}' line ")
    batches, state = read_epoch(source)
    docs = stream_documents(batches, tok.bos_id, tok.eos_id)
    assert sorted(tok.decode(d) for d in docs) == sorted(DOCS[:10])
    assert (state["counts"]["documents"], state["counts"]["bad_records"]) == (10, 3)
    problem = state["first_problem"]
    assert problem.startswith(f"'{mixed_jsonl}' line ")
    assert int(problem.split(" line ")[1].split(":")[0]) in BAD_LINE_NUMBERS


def test_bad_records_without_skip_stop_at_start_up(mixed_jsonl, toks):
    corpus = open_corpus("jsonl", mixed_jsonl)
    with pytest.raises(DataError) as err:
        batches_for(corpus, toks["byte"])
    assert_one_line(err.value, "bad record", f"'{mixed_jsonl}' line 5", "is not valid JSON", "skip_bad_records=true")


def test_bad_record_past_the_start_up_sample_is_raised_by_next(mixed_jsonl, toks):
    corpus = open_corpus("jsonl", mixed_jsonl)
    source = batches_for(corpus, toks["byte"], stats_documents=1)  # samples line 1 only: looks clean
    assert source.stats()["bad_records"] == 0 and source.stats()["sampled_documents"] == 1
    it = source.iterator()
    try:
        with pytest.raises(DataError) as err:
            for _ in range(1000):
                next(it)
    finally:
        it.close()
    message = assert_one_line(err.value, "bad record", f"'{mixed_jsonl}' line ", "skip_bad_records")
    assert int(message.split(" line ")[1].split(":")[0]) in BAD_LINE_NUMBERS
