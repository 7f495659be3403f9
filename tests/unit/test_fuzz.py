"""Property-based input hardening: random config overrides, command lines and data files give
either a result or one clear error line (exit status 2) -- never a traceback. And no loading
path unpickles or executes anything."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nnxtron
from nnxtron.cli import main
from nnxtron.config import derive, load_config
from nnxtron.config.schema import Config
from nnxtron.data import ByteTokenizer, CorpusBatches, RowSpec, open_corpus
from nnxtron.errors import DataError, UserError
from tests.integration.conftest import assert_clean_exit

KEYS = sorted(Config.model_fields)
ODD_VALUES = [
    "", "0", "-1", "1e999", "nan", "inf", "-0.5", "true", "null", "~", "[", "]", "{", "{a: b}", "[1, 2]", "[[a, [b]]]",
    "'", '"', "a=b", "=", "9" * 40, "ü", "\x00", "!!python/object:os.system", "&a", "*a", "%", "@", "1:2", "0x10",
]  # fmt: skip
values = st.one_of(
    st.sampled_from(ODD_VALUES),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=12),
)
keys = st.one_of(st.sampled_from(KEYS), st.text(min_size=1, max_size=10))
overrides = st.lists(st.tuples(keys, values).map(lambda kv: f"{kv[0]}={kv[1]}"), min_size=1, max_size=4)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overrides)
def test_random_config_overrides_load_or_raise_one_user_error(items):
    try:
        cfg = load_config(overrides=items)
        derive(cfg, 8)
    except UserError as err:
        assert "\n" not in str(err).strip(), str(err)


WORDS = [
    "train", "generate", "convert", "config", "show", "bench", "plan", "from-hf", "to-hf", "--json", "--prompt",
    "--steps", "--no-progress", "--overwrite", "--decode", "--coordinator-address", "--num-processes", "--process-id",
    "--distributed", "--help-me", "-x", "steps=3", "steps=x", "model_name=nope", "devices=0", "a.yml", "/nonexistent",
    "k=v", "=", "--", "-", "ü", "x" * 300,
]  # fmt: skip
argvs = st.lists(st.one_of(st.sampled_from(WORDS), st.text(max_size=8)), max_size=6)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(argv=argvs)
def test_random_command_lines_exit_0_or_2_with_one_error_line(argv, monkeypatch, capsys):
    import jax

    import nnxtron.train.loop as loop

    def no_join(*args, **kwargs):  # never wait for a coordinator that does not exist
        raise RuntimeError("no coordinator in this test")

    monkeypatch.setattr(jax.distributed, "initialize", no_join)
    monkeypatch.setattr(loop, "train", lambda cfg, **kw: (_ for _ in ()).throw(UserError("training is not run here")))
    if any(a in ("bench", "plan") for a in argv[:1]) or argv[:2] in (["convert", "from-hf"], ["convert", "to-hf"]):
        argv = ["config", "show", *argv[1:]]  # heavy commands: their argument handling is the same parser
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse --help prints usage and exits 0
        code = exit_.code
    assert_clean_exit(argv, code, *capsys.readouterr())


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzzed-files")


SUFFIX = {"text": ".txt", "jsonl": ".jsonl", "parquet": ".parquet", "arrayrecord": ".arrayrecord"}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(sorted(SUFFIX)), payload=st.binary(max_size=300), skip=st.booleans())
def test_random_bytes_as_any_format_read_or_raise_one_data_error(scratch, kind, payload, skip):
    path = scratch / f"fuzz{SUFFIX[kind]}"
    path.write_bytes(payload)
    try:
        corpus = open_corpus(kind, path)
        source = CorpusBatches(corpus, np.arange(len(corpus)), ByteTokenizer(), RowSpec(8, skip_bad_records=skip), 1, epochs=1)
        it = source.iterator()
        try:
            for _ in range(3):
                batch = next(it)
                assert batch["inputs"].shape == (1, 8)
        except StopIteration:
            pass
        finally:
            it.close()
    except DataError as err:
        message = str(err)
        assert "\n" not in message and "fuzz" in message, message  # one line naming the file


YAML_PIECES = [
    "steps: 3", "run_name: ok", "model_name: llama2-tiny", "a: &a [1, 2, 3]", "b: &b [*a, *a, *a, *a]", "c: [*b, *b, *b]",
    "dataset_path: *a", "steps: *a", "logical_axis_rules: [[a, [b]]]", "? complex key", "!!python/object/apply:os.system [ls]",
    "steps: !!binary aGVsbG8=", "vocab_size: 1.0e+40", "learning_rate: .nan", "per_device_batch_size: -.inf", "- a list",
    "steps: " + "[" * 200, "%YAML 1.1", "---", "...", "run_name: \"\\x00\"", "base_emb_dim: 0x10", "\t", "  indented: 1",
    "key with spaces: 1", "mlp_activations: {a: b}", "compress_ratios: [1, [2]]", "prompt: &p 'x'", "decode_sampling_seed: 1e30",
]  # fmt: skip
yaml_texts = st.one_of(
    st.lists(st.one_of(st.sampled_from(YAML_PIECES), st.text(max_size=20)), max_size=8).map("\n".join),
    st.binary(max_size=200).map(lambda b: b.decode("utf-8", "replace")),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=yaml_texts)
def test_random_yaml_config_files_load_or_raise_one_user_error(scratch, text):
    path = scratch / "fuzz.yml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    try:
        cfg = load_config(path)
        derive(cfg, 8)
    except UserError as err:
        assert "\n" not in str(err).strip(), str(err)


HF_VALUES = st.one_of(
    st.sampled_from([None, True, -1, 0, 2**40, 1e300, "", "llama", "gpt2", [], {}, [1, "x"], {"rope_type": "nope"}]),
    st.integers(-(2**20), 2**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    family=st.sampled_from(["llama2", "mixtral", "gpt2"]),
    edits=st.dictionaries(st.text(min_size=1, max_size=24), HF_VALUES, max_size=3),
    real_keys=st.lists(st.integers(0, 60), max_size=3),
    weights=st.sampled_from(["keep", "random-bytes", "truncated", "index-outside", "index-garbage"]),
    payload=st.binary(max_size=64),
)
def test_random_hf_directories_load_or_raise_one_user_error(scratch, family, edits, real_keys, weights, payload):
    """An HF directory with fuzzed config.json values (real keys and unknown ones) and damaged
    weight files: ``from_hf`` gives a model or one ``UserError`` line, never a traceback."""
    import json
    import shutil

    golden = Path(__file__).resolve().parents[1] / "assets" / "golden" / family
    model = scratch / "hf-fuzz"
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(golden, model, ignore=shutil.ignore_patterns("golden.safetensors", "fused.safetensors", "generate*"))
    config = json.loads((model / "config.json").read_text())
    keys = sorted(config)
    for i, value in zip(real_keys, edits.values()):
        config[keys[i % len(keys)]] = value
    config.update(edits)
    (model / "config.json").write_text(json.dumps(config))
    weights_file = model / "model.safetensors"
    if weights == "random-bytes":
        weights_file.write_bytes(payload)
    elif weights == "truncated":
        weights_file.write_bytes(weights_file.read_bytes()[: len(payload) * 1000])
    elif weights.startswith("index"):
        weights_file.unlink()
        target = "../../../etc/passwd" if weights == "index-outside" else payload.decode("latin-1")
        (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": target}}))
    try:
        nnxtron.from_hf(model)
    except UserError as err:
        assert "\n" not in str(err).strip(), str(err)


@pytest.mark.parametrize(
    "family, heads_key", [("llama2", "num_attention_heads"), ("mixtral", "num_attention_heads"), ("gpt2", "n_head")]
)
def test_a_zero_head_count_is_one_line(tmp_path, family, heads_key):
    """The fuzzer's find (a ZeroDivisionError traceback for gpt2's ``n_head: 0``), for each family."""
    import json
    import shutil

    model = tmp_path / "hf"
    shutil.copytree(
        Path(__file__).resolve().parents[1] / "assets" / "golden" / family,
        model,
        ignore=shutil.ignore_patterns("golden*", "fused*", "generate*"),
    )
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, heads_key: 0}))
    with pytest.raises(UserError, match="0 for a size or count|invalid value|heads") as err:
        nnxtron.from_hf(model)
    assert "\n" not in str(err.value)


def test_a_huge_line_and_an_empty_file(tmp_path):
    huge = tmp_path / "huge.jsonl"
    huge.write_text('{"text": "' + "a" * 5_000_000 + '"}\n{"text": "short"}\n')
    corpus = open_corpus("jsonl", huge)
    assert len(corpus) == 2 and len(corpus.text(0)) == 5_000_000
    source = CorpusBatches(corpus, np.arange(2), ByteTokenizer(), RowSpec(64), 2, epochs=1, stats_documents=2)
    assert source.stats()["tokens"] == 5_000_000 + 5 + 4  # text + BOS/EOS of both
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="empty.txt"):
        CorpusBatches(open_corpus("text", tmp_path / "empty.txt"), np.arange(1), ByteTokenizer(), RowSpec(8), 1)


def test_no_loading_path_unpickles_or_executes():
    """Checkpoints are orbax arrays + JSON, HF weights safetensors, configs YAML/JSON as data."""
    src = Path(nnxtron.__file__).parent
    banned = re.compile(
        r"\b(pickle|cloudpickle|dill|joblib|marshal)\b|torch\.load|allow_pickle\s*=\s*True|trust_remote_code|yaml\.load\(|yaml\.unsafe_load|\beval\(|\bexec\("
    )
    hits = [
        f"{path.relative_to(src)}:{number}: {line.strip()}"
        for path in src.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if banned.search(line.split("#")[0]) and not line.strip().startswith(('"""', "``"))
    ]
    assert hits == [], hits
