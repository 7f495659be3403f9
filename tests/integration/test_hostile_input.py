"""Hostile input, round 2 (issue 48): bad input that gave a traceback or was silently accepted is
one error line (exit 2). Each check runs in this process and stops before a model is compiled."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from nnxtron.cli import MAX_SEARCH_WORKERS
from nnxtron.errors import CheckpointError, reason
from tests.integration.conftest import assert_user_error, run_cli

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "golden"


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["eval", "/nonexistent", "--tasks", "arc_easy", "--limit", "-1"], "argument --limit: must be an integer >= 1, got '-1'"),
        (["eval", "/nonexistent", "--tasks", "arc_easy", "--num-fewshot", "-3"], "--num-fewshot: must be an integer >= 0"),
        (["eval", "/nonexistent", "--batch-rows", "0"], "--batch-rows: must be an integer >= 1"),
        (["plan", "--search", "devices=8", "--time-budget", "nan"], "--time-budget: must be a number > 0, got 'nan'"),
        (["plan", "--search", "devices=8", "--time-budget=-inf"], "--time-budget: must be a number > 0"),
        (["plan", "model_name=llama2-tiny", "--device-memory-gib", "nan"], "--device-memory-gib: must be a number > 0"),
        (["plan", "model_name=llama2-tiny", "--device-memory-gib", "inf"], "--device-memory-gib: must be a number > 0"),
        (["plan", "--search", "devices=8", "--workers", "100000"], f"<= {MAX_SEARCH_WORKERS} (one compile process per CPU core)"),
        (["plan", "--search", "devices=8", "--top", "0"], "--top: must be an integer >= 1, got '0'"),
        (["train", "--peer-timeout=-1"], "argument --peer-timeout: must be an integer >= 1, got '-1'"),
        (["bench", "--steps", "0"], "argument --steps: must be an integer >= 1"),
    ],
)
def test_numeric_options_out_of_range_are_one_line(capsys, args, fragment):
    """Negative counts, nan/inf and an unbounded worker count: refused while the arguments are
    parsed (before: accepted, a `plan` traceback for nan, a search whose nan budget never expired)."""
    code, _, err = run_cli(capsys, *args)
    assert_user_error(code, err, fragment)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--peer-timeout", "30"], "--peer-timeout is read only by a multi-host run"),
        (["--init-timeout=5"], "--init-timeout is read only by a multi-host run"),
        (["--peer-timeout", "30", "--init-timeout", "5"], "--peer-timeout and --init-timeout are read only by a multi-host"),
    ],
)
def test_multi_host_timeouts_of_a_single_process_run_are_refused(capsys, args, fragment):
    """A single-process run has no peers to time out: the flag was accepted and never read."""
    code, _, err = run_cli(capsys, "train", "steps=1", *args)
    assert_user_error(code, err, fragment)
    assert "this run is single-process: drop it" in err


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("learning_rate=1e-300", "config key 'learning_rate': is smaller than float32 can hold"),
        ("adam_eps=1e-45", "config key 'adam_eps': is smaller than float32 can hold"),
        ("rope_max_timescale=1e39", "config key 'rope_max_timescale': is beyond float32's range"),
        ("steps=true", "config key 'steps': must be a number, not true/false"),
        ("learning_rate=false", "config key 'learning_rate': must be a number, not true/false"),
        ("dataset_weights=[1, true]", "config key 'dataset_weights': must be a number, not true/false"),
        ("base_output_directory=", "config key 'base_output_directory': is empty"),
        ("base_output_directory= ", "config key 'base_output_directory': is empty"),
        ("run_name=a\u0085b", "a control character (U+0085); choose a name of at most 200 printable characters"),
        ("run_name=a\u202eb", "a non-printable character (U+202E)"),
        ("run_name=a\tb", "a control character (U+0009)"),
    ],
)
def test_config_values_that_were_silently_accepted(capsys, override, fragment):
    code, _, err = run_cli(capsys, "config", "show", override)
    assert_user_error(code, err, fragment)


def test_dataset_path_is_refused_with_synthetic_data(capsys):
    """A key set where the chosen dataset_type does not read it is refused, as packing and the
    other corpus keys are; dataset_path=[] (what tests use to clear it) stays accepted."""
    code, _, err = run_cli(capsys, "config", "show", "dataset_type=synthetic", "dataset_path=5")
    assert_user_error(code, err, "dataset_path is not read with dataset_type=synthetic; unset it or train on a corpus")
    assert run_cli(capsys, "config", "show", "dataset_type=synthetic", "dataset_path=[]")[0] == 0


def test_printable_run_names_are_accepted():
    from nnxtron.config import load_config

    assert load_config(overrides=["run_name=Lauf 7 (été)-ü_x.y"]).run_name == "Lauf 7 (été)-ü_x.y"


@pytest.fixture(scope="module")
def converted_run(tmp_path_factory):
    """An nnxtron run converted from the Mistral golden checkpoint (no training, no compile)."""
    from nnxtron.cli import main

    run = tmp_path_factory.mktemp("hostile") / "run"
    assert main(["convert", "from-hf", str(GOLDEN / "mistral"), str(run)]) == 0
    return run


@pytest.mark.parametrize("direction", ["to-hf", "to-maxtext"])
def test_convert_into_a_directory_that_cannot_be_made(converted_run, tmp_path, capsys, direction):
    """Before: a NotADirectoryError traceback (after loading the whole model)."""
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(capsys, "convert", direction, str(converted_run), str(tmp_path / "file" / "out"))
    assert_user_error(code, err, f"'{tmp_path / 'file'}' is a file, not a directory; choose a writable directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_convert_into_a_read_only_directory(converted_run, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        code, _, err = run_cli(capsys, "convert", "to-hf", str(converted_run), str(locked / "out"))
    finally:
        locked.chmod(0o700)
    assert_user_error(code, err, f"cannot write in '{locked}' (Permission denied)")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["to-hf", "--scanned"], "--scanned is read by `convert to-maxtext`, not by to-hf; drop it"),
        (["from-hf", "--unscanned"], "--unscanned is read by `convert to-maxtext`, not by from-hf"),
        (["from-hf", "--overwrite"], "--overwrite is read by `convert to-hf`, not by from-hf"),
    ],
)
def test_convert_flags_of_another_direction_are_refused(tmp_path, capsys, args, fragment):
    code, _, err = run_cli(capsys, "convert", args[0], str(GOLDEN / "mistral"), str(tmp_path / "out"), *args[1:])
    assert_user_error(code, err, fragment)


@pytest.mark.parametrize("value, shown", [(4.5, "num_attention_heads=4.5 where a whole number"),
                                          (True, "num_attention_heads=true where a number belongs"),
                                          ("4", 'num_attention_heads="4" is a string where a number or true/false '
                                                "belongs; write it without quotes: 4")])  # fmt: skip
def test_hf_counts_are_not_truncated(tmp_path, capsys, value, shown):
    """``num_attention_heads: 4.5`` was read as 4 heads (``true`` as 1, the string ``"4"`` as 4)."""
    model = tmp_path / "hf"
    shutil.copytree(GOLDEN / "llama2", model, ignore=shutil.ignore_patterns("golden*", "generate*"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_attention_heads": value}))
    code, _, err = run_cli(capsys, "convert", "from-hf", str(model), str(tmp_path / "run"))
    assert_user_error(code, err, shown)


@pytest.fixture(scope="module")
def hf_without_tokenizer(tmp_path_factory):
    """An HF directory of a 300-id model (within the byte tokenizer's range) and no tokenizer file."""
    from nnxtron.config import load_config
    from nnxtron.convert.hf import to_hf
    from nnxtron.models.build import build_model

    cfg = load_config(overrides=["model_name=llama2-tiny", "vocab_size=300", "base_num_decoder_layers=1"])
    model = to_hf(build_model(cfg), tmp_path_factory.mktemp("hf") / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink(missing_ok=True)
    return model


@pytest.mark.parametrize(
    "args", [["generate", "{dir}", "--prompt", "hi"], ["eval", "{dir}", "dataset_type=text", "dataset_path=x.txt"]]
)
def test_hf_directory_without_tokenizer_is_refused_for_text(hf_without_tokenizer, capsys, args):
    """Before: the byte tokenizer read and wrote its text without a word."""
    code, _, err = run_cli(capsys, *[a.format(dir=hf_without_tokenizer) for a in args])
    assert_user_error(code, err, "holds no tokenizer file (tokenizer.json, tokenizer.model, *.tiktoken)")
    assert "tokenizer_type=byte for a byte-level model" in err


def test_synthetic_training_from_an_hf_directory_without_tokenizer_samples_no_text(
    hf_without_tokenizer, tmp_path, capsys, monkeypatch
):
    """Synthetic data needs no tokenizer, so such a run trains; but its sample after training was
    decoded with the byte tokenizer without a word. Now: one start-up note says why there is no
    sample (the run stops here, before the model is built)."""
    import nnxtron.cli as cli

    seen = {}

    def train_and_report(cfg, ns, init_params, sample, quiet=False, notes=()):
        seen.update(sample=sample, notes=list(notes))
        return 0

    monkeypatch.setattr(cli, "_train_and_report", train_and_report)
    args = [f"init_from={hf_without_tokenizer}", "dataset_type=synthetic", "dataset_path=[]", "steps=1",
            "sample_after_training=8", f"base_output_directory={tmp_path}", "run_name=r"]  # fmt: skip
    code, _, err = run_cli(capsys, "train", *args)
    assert code == 0, err
    assert seen["sample"] == 0
    (note,) = [n for n in seen["notes"] if n.startswith("no sample after training:")]
    assert "holds no tokenizer file" in note and "tokenizer_type=byte for a byte-level model" in note
    code, _, err = run_cli(capsys, "train", *args, "tokenizer_type=byte")  # said so: the byte tokenizer samples
    assert code == 0 and seen["sample"] == 8, err


def test_generate_from_a_run_trained_on_a_tokenizerless_hf_directory_is_refused(hf_without_tokenizer, tmp_path, capsys):
    """The run trained on ids (synthetic data) records no tokenizer of its model: ``generate`` on it
    refuses as on the HF directory itself, unless told which tokenizer to use."""
    args = [f"init_from={hf_without_tokenizer}", "dataset_type=synthetic", "dataset_path=[]", "steps=1",
            "sample_after_training=0", f"base_output_directory={tmp_path}", "run_name=r", "--no-progress"]  # fmt: skip
    code, _, err = run_cli(capsys, "train", *args)
    assert code == 0, err
    code, _, err = run_cli(capsys, "generate", str(tmp_path / "r"), "--prompt", "a", "max_new_tokens=2")
    assert code == 2 and "holds no tokenizer file" in err and "Traceback" not in err, err
    code, _, err = run_cli(capsys, "generate", str(tmp_path / "r"), "--prompt", "a", "max_new_tokens=2", "tokenizer_type=byte")
    assert code == 0, err
    from nnxtron.serve.server import load  # serve opens it the same way

    with pytest.raises(CheckpointError, match="holds no tokenizer file"):
        load(tmp_path / "r")


def test_unreadable_checkpoint_names_the_whole_reason(converted_run, tmp_path, capsys):
    """A data file of the checkpoint emptied: the line quotes TensorStore's reason, not orbax's
    wrapper cut mid-word ("See full TensorStore details: <bound method pybind11_detail_fun...")."""
    run = tmp_path / "run"
    shutil.copytree(converted_run, run)
    for data in (run / "checkpoints" / "0" / "params" / "ocdbt.process_0" / "d").iterdir():
        data.write_bytes(b"")
    code, _, err = run_cli(capsys, "generate", str(run), "max_new_tokens=2")
    assert_user_error(code, err, "is unreadable (ValueError: OUT_OF_RANGE: Error reading")
    assert "is not valid for value of size 0); it may be corrupted" in err and "TensorStore details" not in err


def test_reason_is_the_cause_without_tensorstore_dumps():
    try:
        try:
            raise ValueError('NOT_FOUND: Error opening "zarr" driver: gone [tensorstore_spec=\'{"context": 1}\']')
        except ValueError as inner:
            raise Exception("Encountered error while reading array index. See full TensorStore details: <bound") from inner
    except Exception as err:
        assert reason(err) == 'ValueError: NOT_FOUND: Error opening "zarr" driver: gone'
    assert reason(RuntimeError("word " * 200)).endswith("word …") and len(reason(RuntimeError("w " * 900))) < 520
