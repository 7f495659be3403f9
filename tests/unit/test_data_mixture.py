"""Weighted mixtures of corpora (``dataset_weights``, MaxText's ``grain_train_files``): rows drawn
by weight, each source its own shuffle, epochs and eval split, exact resume, one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nnxtron.config import load_config
from nnxtron.data import BATCH_KEYS, ByteTokenizer, CorpusBatches, MixtureBatches, RowSchedule, RowSpec, open_corpus
from nnxtron.data.mixture import source_seed
from nnxtron.data.pipeline import split_documents
from nnxtron.data.sources import make_sources
from nnxtron.errors import ConfigError, DataError

TOK = ByteTokenizer()
SEQ = 16
LETTERS = "abc"  # source i's documents hold only the letter LETTERS[i]: a row's tokens name its source


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Three text corpora of 12, 20 and 9 documents of 1..40 repeated letters (a / b / c)."""
    root = tmp_path_factory.mktemp("mixture")
    rng = np.random.default_rng(0)
    for letter, count in zip(LETTERS, (12, 20, 9)):
        (root / letter).mkdir()
        for i in range(count):
            (root / letter / f"{i:02d}.txt").write_text(letter * int(rng.integers(1, 41)))
    return root


def _part(root, letter, *, seed=0, epochs=None, split="train", batch=8, **spec) -> CorpusBatches:
    corpus = open_corpus("text", [str(root / letter)])
    return CorpusBatches(corpus, np.arange(len(corpus)), TOK, RowSpec(SEQ, **spec), batch, split=split, seed=seed,
                         epochs=epochs, read_threads=0, prefetch=0)  # fmt: skip


def _mixture(root, weights, *, seed=0, letters=LETTERS, prefetch=0, **kw) -> MixtureBatches:
    parts = [_part(root, x, seed=source_seed(seed, i), **kw) for i, x in enumerate(letters)]
    return MixtureBatches(parts, weights, [x for x in letters], seed=seed, prefetch=prefetch)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _row_sources(batches) -> list[int]:
    """The source of every row: the one letter its tokens hold (byte id = ord + 3)."""
    out = []
    for batch in batches:
        for row in batch["inputs"]:
            found = {LETTERS.index(chr(t - 3)) for t in row.tolist() if chr(max(t - 3, 0)) in LETTERS}
            assert len(found) == 1, row  # a row never mixes sources
            out.append(found.pop())
    return out


def _assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_schedule_realises_the_weights_at_every_prefix():
    schedule = RowSchedule([3, 2, 1], seed=5)
    assert schedule.weights == pytest.approx((0.5, 1 / 3, 1 / 6))
    n = 30000
    picks = np.array([schedule.source(g) for g in range(n)])
    np.testing.assert_array_equal(np.bincount(picks, minlength=3), schedule.counts(n))
    drawn = np.cumsum(np.eye(3)[picks], axis=0)  # rows of each source among the first 1, 2, ..., n
    expected = np.arange(1, n + 1)[:, None] * np.array(schedule.weights)
    # measured (weights [3,2,1], [.7,.3], [1,1], [.9,.05,.05], ten equal; seeds 0, 5, 123): at most
    # 3.3 rows off n * weight at any n <= 30000 (a golden-ratio Weyl sequence's discrepancy)
    assert np.abs(drawn - expected).max() <= 4
    # far into a run the arithmetic is still exact integers: still the weights
    late = np.bincount([schedule.source(10**15 + g) for g in range(6000)], minlength=3)
    assert np.abs(late - 6000 * np.array(schedule.weights)).max() <= 4


def test_schedule_is_deterministic_per_seed():
    a, b, c = RowSchedule([1, 1], seed=0), RowSchedule([1, 1], seed=0), RowSchedule([1, 1], seed=1)
    first = [a.source(g) for g in range(64)]
    assert first == [b.source(g) for g in range(64)]
    assert first != [c.source(g) for g in range(64)]


def test_rows_are_drawn_in_proportion_to_the_weights(corpora):
    mix = _mixture(corpora, [6, 3, 1])
    it = mix.iterator()
    sources = _row_sources(_take(it, 50))  # 400 rows, several epochs of each source
    it.close()
    shares = np.bincount(sources, minlength=3) / len(sources)
    np.testing.assert_allclose(shares, [0.6, 0.3, 0.1], atol=0.01)
    # and exactly the schedule's choice for every row
    assert sources == [mix.schedule.source(g) for g in range(400)]


def test_each_source_keeps_its_own_stream(corpora):
    """The rows of source i inside the mixture are, in order, source i's own packed rows (its
    shuffle seed, its epochs, this process's share of its documents): the mixture only interleaves.
    Two processes: each row's source is the schedule's choice for its global row number."""
    mix = _mixture(corpora, [1, 2, 1], seed=7)
    for process in (0, 1):
        it = mix.iterator(process, 2)  # 4 rows of each global batch of 8
        batches = _take(it, 30)
        it.close()
        sources = _row_sources(batches)
        rows = [(b, r) for b in range(30) for r in range(4)]
        assert sources == [mix.schedule.source(b * 8 + process * 4 + r) for b, r in rows]
        tokens = np.concatenate([b["inputs"] for b in batches])
        for i, letter in enumerate(LETTERS):
            own = _part(corpora, letter, seed=source_seed(7, i)).packer(process, 2)
            expected = [next(own)[0][:-1] for _ in range(sources.count(i))]
            np.testing.assert_array_equal(tokens[np.array(sources) == i], np.stack(expected))
            own.documents.close()


def test_same_seed_same_batches_other_seed_other_batches(corpora):
    def first(seed):
        it = _mixture(corpora, [1, 1, 1], seed=seed).iterator()
        out = _take(it, 6)
        it.close()
        return out

    a = first(3)
    _assert_batches_equal(a, first(3))
    assert not all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, first(4)))


@pytest.mark.parametrize("options", [dict(), dict(prefetch=2, packing="pad"), dict(process=(1, 2), epochs=4)],
                         ids=["concat", "pad-prefetch", "process-1-of-2-finite"])  # fmt: skip
def test_resume_continues_at_the_exact_next_batch(corpora, options):
    options = dict(options)
    process = options.pop("process", (0, 1))
    mix = _mixture(corpora, [5, 3, 2], seed=2, **options)
    total = 14  # past every source's first epoch
    it = mix.iterator(*process)
    whole = _take(it, total)
    final = it.get_state()
    it.close()
    for k in (1, 5, 9):
        first = mix.iterator(*process)
        _take(first, k)
        state = json.loads(json.dumps(first.get_state()))  # what a checkpoint stores
        first.close()
        assert state["mixture_rows"] == k * mix.global_batch_size // process[1]
        resumed = mix.iterator(*process)
        resumed.set_state(state)
        _assert_batches_equal(_take(resumed, total - k), whole[k:])
        assert resumed.get_state() == final
        resumed.close()
    assert final["counts"]["rows"] == total * mix.global_batch_size // process[1]


def test_finite_epochs_end_when_the_first_source_runs_out(corpora):
    mix = _mixture(corpora, [1, 1, 8], epochs=2)  # c (9 short documents) is drawn most
    lasts, first_out = mix.lasts_batches()
    assert first_out == 2
    it = mix.iterator()
    n = 0
    with pytest.raises(StopIteration):
        while True:
            next(it)
            n += 1
    it.close()
    assert abs(n - lasts) <= 1, (n, lasts)
    assert f"enough for ~{lasts:,.0f} batches (source 3 runs out first)" in mix.describe()


def _cfg(root, *extra, eval_fraction=0.25):
    return load_config(overrides=[
        "model_name=llama2-tiny", "vocab_size=320", "max_target_length=16", f"eval_split_fraction={eval_fraction}", "eval_interval=5",
        "data_read_threads=0", "data_prefetch_batches=0", *extra,
    ])  # fmt: skip


def test_one_source_of_weight_1_is_todays_single_corpus(corpora):
    """dataset_weights=[1] and grain_train_files='glob' give today's pipeline: the same batches and
    the same iterator state format, so existing checkpoints' data_state resumes."""
    today, _ = make_sources(_cfg(corpora, f"dataset_path=[{corpora}/b]"), 8)
    it = today.iterator()
    first = _take(it, 4)
    saved = json.loads(json.dumps(it.get_state()))
    rest = _take(it, 3)
    it.close()
    assert set(saved) == {"documents", "offset", "counts", "first_problem"} and set(saved["documents"]) == {"next_index"}
    one = f"dataset_path=[{corpora}/b]"
    for overrides in ([one, "dataset_weights=[1]"], [one, "dataset_weights=[0.25]"], [f"grain_train_files={corpora}/b"]):
        source, _ = make_sources(_cfg(corpora, *overrides), 8)
        assert type(source) is CorpusBatches and source.describe() == today.describe()
        again = source.iterator()
        _assert_batches_equal(_take(again, 4), first)
        assert again.get_state() == saved
        again.close()
        restored = source.iterator()
        restored.set_state(saved)  # a checkpoint written before mixtures existed
        _assert_batches_equal(_take(restored, 3), rest)
        restored.close()


def test_config_forms_and_eval_split_per_source(corpora):
    """dataset_weights and grain_train_files give the same mixture; each source's eval split is its
    own stable split, whatever the other sources."""
    a, b = f"{corpora}/a", f"{corpora}/b"
    ours = _cfg(corpora, f"dataset_path=[{a},{b}]", "dataset_weights=[3,1]")
    maxtext = _cfg(corpora, f"grain_train_files={a}:0.75;{b}:0.25")
    (train, evaluation), (train2, evaluation2) = make_sources(ours, 8), make_sources(maxtext, 8)
    assert isinstance(train, MixtureBatches) and train.schedule.weights == (0.75, 0.25)
    assert train2.schedule.weights == (0.75, 0.25)
    for mix in (train, train2, evaluation, evaluation2):
        assert mix.seed == 0
    for i, path in enumerate((a, b)):
        train_docs, eval_docs = split_documents(open_corpus("text", [path]), 0.25)
        np.testing.assert_array_equal(train.parts[i].documents, train_docs)
        np.testing.assert_array_equal(evaluation.parts[i].documents, eval_docs)
        np.testing.assert_array_equal(train2.parts[i].documents, train_docs)
        assert train.parts[i].seed == source_seed(0, i) and evaluation.parts[i].split == "eval"
    it, it2 = train.iterator(), train2.iterator()
    _assert_batches_equal(_take(it, 3), _take(it2, 3))
    it.close(), it2.close()
    once, twice = evaluation.iterator(), evaluation.iterator()  # every evaluation reads the same batches
    _assert_batches_equal(_take(once, 3), _take(twice, 3))
    once.close(), twice.close()
    text = train.describe()
    lines = text.splitlines()
    assert len(lines) == 3 and lines[0].startswith("train data: a mixture of 2 sources")
    s = train.stats()["sources"]
    assert (
        s[0]["documents"] + s[1]["documents"]
        == train.stats()["documents"]
        == len(train.parts[0].documents) + len(train.parts[1].documents)
    )
    assert f"source 1 '{a}': {s[0]['documents']:,} of 12 text files, {s[0]['tokens']:,} tokens" in lines[1]
    assert "weight 0.75 -> 75.00% of rows" in lines[1] and "weight 0.25 -> 25.00% of rows" in lines[2]


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["dataset_path=[x,y]", "dataset_weights=[1]"], "dataset_weights has 1 weights for 2 dataset_path entries"),
        (["dataset_path=[x,y]", "dataset_weights=[1,0]"], "dataset_weights: the weight of 'y' is 0.0, not a positive"),
        (["dataset_path=[x,y]", "dataset_weights=[-1,1]"], "the weight of 'x' is -1.0"),
        (["dataset_path=[x,y]", "dataset_weights=[1,.inf]"], "dataset_weights"),
        (["dataset_path=[x,y]", "dataset_weights=[1,.nan]"], "dataset_weights"),
        (["grain_train_files=x:1;y"], "grain_train_files part 'y' is not 'glob:weight'"),
        (["grain_train_files=x:1;y:abc"], "grain_train_files part 'y:abc' is not 'glob:weight'"),
        (["grain_train_files=x:1;y:inf"], "grain_train_files: the weight of 'y:inf' is inf"),
        (["grain_train_files=x:1;y:1", "dataset_weights=[1]"], "not both"),
        (["grain_train_files=x:1;y:1", "dataset_path=z"], "grain_train_files replaces dataset_path"),
        (["dataset_type=synthetic", "dataset_weights=[1]"], "dataset_weights is not read with dataset_type=synthetic"),
        (["dataset_type=synthetic", "grain_train_files=x"], "grain_train_files is not read with dataset_type=synthetic"),
    ],
)
def test_bad_mixture_configs_are_one_line_errors(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert fragment in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_default_dataset_path_constant_is_base_yml():
    from nnxtron.config.checks import DEFAULT_DATASET_PATH

    assert load_config().dataset_path == DEFAULT_DATASET_PATH


def test_bad_sources_and_states_are_one_line_errors(corpora, tmp_path):
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    (tmp_path / "ok.jsonl").write_text('{"text": "hello"}\n' * 5)
    cases = [
        (["dataset_type=jsonl", f"dataset_path=[{tmp_path}/ok.jsonl,{tmp_path}/blank.jsonl]", "dataset_weights=[1,1]"],
         f"dataset source 2 of 2 '{tmp_path}/blank.jsonl': dataset file(s) '{tmp_path}/blank.jsonl' hold no lines"),
        ([f"dataset_path=[{corpora}/a,{corpora}/nothing*.txt]", "dataset_weights=[1,1]"],
         f"dataset source 2 of 2 '{corpora}/nothing*.txt': dataset_path"),
    ]  # fmt: skip
    for overrides, fragment in cases:
        with pytest.raises(DataError) as err:
            make_sources(_cfg(corpora, *overrides), 8)
        assert str(err.value).startswith(fragment) and "\n" not in str(err.value), str(err.value)
    mix = _mixture(corpora, [1, 1, 1])
    it = mix.iterator()
    _take(it, 2)
    state = it.get_state()
    it.close()
    single = _part(corpora, "a").iterator()
    with pytest.raises(DataError, match="does not fit this dataset"):
        single.set_state(state)  # a mixture's position into one corpus
    two = _mixture(corpora, [1, 1], letters="ab").iterator()
    for bad in (single.get_state(), state):  # one corpus's position; three sources' into two
        with pytest.raises(DataError, match="not one of a mixture of 2 sources; resume with the same dataset_path"):
            two.set_state(bad)
    single.close(), two.close()


def test_training_on_two_corpora_resumes_exactly(tmp_path):
    """A tiny run on a 3:1 mixture of two corpora, stopped after step 2 and resumed to step 4, has read
    exactly the first 4 batches of the uninterrupted stream: its final data state (positions in
    both sources, the mixture position, the counters) is that of a fresh iterator after 4 batches."""
    from nnxtron.train.checkpoint import Checkpointer
    from nnxtron.train.loop import Trainer
    from tests.integration.conftest import PARAGRAPH, train_overrides

    for name, text in (("en", PARAGRAPH), ("digits", "0123456789 " * 12 + "\n")):
        (tmp_path / name).mkdir()
        for i in range(6):
            (tmp_path / name / f"{i}.txt").write_text(text * (3 + i))
    values = dict(steps=4, eval_interval=-1, checkpoint_period=2, enable_tensorboard=False, base_num_decoder_layers=1)
    overrides = [o for o in train_overrides(str(tmp_path), str(tmp_path), "mix", **values) if not o.startswith("dataset_path=")]
    overrides += [f"dataset_path=[{tmp_path}/en,{tmp_path}/digits]", "dataset_weights=[3,1]"]
    cfg = load_config(overrides=overrides)
    first = Trainer(load_config(overrides=[*overrides, "steps=2"]), progress=False).run()
    second = Trainer(cfg, progress=False).run()
    assert (first.end_step, second.start_step, second.end_step) == (2, 2, 4)
    assert all(np.isfinite(first.losses + second.losses)) and second.losses[-1] < first.losses[0]
    checkpoints = Checkpointer(tmp_path / "mix" / "checkpoints", 3)
    at_2, at_4 = (checkpoints.read_meta(step)["data_state"][0] for step in (2, 4))
    assert (at_2["mixture_rows"], at_4["mixture_rows"]) == (16, 32)  # 8 rows per step (8 devices x 1)
    train, _ = make_sources(cfg, 8)
    uninterrupted = train.iterator()
    sources = _take(uninterrupted, 4)
    assert json.loads(json.dumps(uninterrupted.get_state())) == at_4
    uninterrupted.close()
    rows = [row for batch in sources for row in batch["inputs"]]
    digits = sum(bool(set(row.tolist()) & {ord(d) + 3 for d in "0123456789"}) for row in rows)
    assert digits == sum(train.schedule.source(g) for g in range(32)) == 8  # 1/4 of 32 rows from the digits
