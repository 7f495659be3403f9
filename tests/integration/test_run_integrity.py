"""Run integrity: bounded input, a sandboxed run directory and one writer per run.

Each case was a traceback, a hang, a write outside ``base_output_directory`` or a silent
rewrite of a run's history before; now it is one ``error:`` line with exit status 2 and
nothing already written changes (or the documented behaviour).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from flax import nnx

from nnxtron.cli import main
from nnxtron.convert.runs import load_model
from nnxtron.params import flatten
from nnxtron.runtime.fake_devices import fake_device_env
from nnxtron.train.run_dir import LOCK_FILE, RunLock
from tests.integration.conftest import assert_user_error, metric_records, run_cli, train_overrides

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "golden"
ALIAS_BOMB = "a: &a [1,1,1,1,1,1,1,1,1,1]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdef", "bcdefg")
)  # 350 bytes, 10^7 values once expanded


def _files(tmp_path: Path) -> dict[str, str]:
    """Paths the table below refers to as {name}."""
    (tmp_path / "steps.yml").write_text("steps: 1.0e+23\n")
    (tmp_path / "length.yml").write_text("max_target_length: 1.0e+12\n")
    (tmp_path / "sample.yml").write_text("sample_after_training: 1.0e+9\n")
    (tmp_path / "bomb.yml").write_text(ALIAS_BOMB)
    (tmp_path / "evil.yml").write_text("base_emb_dim: 8\n")  # model_name=<tmp>/evil must not load it
    (tmp_path / "a_file").write_text("")
    fifo = tmp_path / "fifo.yml"
    if not fifo.exists():
        os.mkfifo(fifo)
    return {"tmp": str(tmp_path), "file": str(tmp_path / "a_file")}


@pytest.mark.parametrize(
    "args, fragment",
    [
        # numbers: finite and in range before anything is allocated
        (["train", "per_device_batch_size=.inf"], "config key 'per_device_batch_size': Input should be a finite number"),
        (["train", "learning_rate=1e39"], "config key 'learning_rate'"),
        (["train", "vocab_size=1099511627776"], "config key 'vocab_size'"),
        (["train", "init_weights_seed=1180591620717411303424"], "config key 'init_weights_seed'"),
        (["train", "{tmp}/steps.yml"], "config key 'steps'"),
        (["train", "{tmp}/length.yml"], "config key 'max_target_length'"),
        (["train", "{tmp}/sample.yml"], "config key 'sample_after_training'"),
        # the run directory is one name under base_output_directory
        (["train", "run_name=../../../x"], "must be one directory name under base_output_directory"),
        (["train", "run_name=/tmp/x"], "a path separator"),
        (["train", "run_name=."], "'.' or '..'"),
        (["train", "run_name=.."], "'.' or '..'"),
        (["train", "run_name=a\nb"], "a control character"),
        (["train", "run_name=" + "x" * 300], "more than 200 characters"),
        (["train", "base_output_directory={file}"], "is a file, not a directory"),
        (["train", "base_output_directory=/proc/nnxtron-runs"], "cannot create run directory"),
        (["train", "base_output_directory=/dev/null"], "'/dev/null' is a file, not a directory"),
        (["train", "base_output_directory={tmp}", "run_name=a_file"], "the run directory"),
        # presets are names; config files are regular files of bounded size
        (["train", "model_name={tmp}/evil"], "unknown model_name"),
        (["train", "{tmp}"], "is a directory"),
        (["train", "{tmp}/fifo.yml"], "is not a regular file"),
        (["config", "show", "{tmp}/bomb.yml"], "expands to more than 100000 values"),
        (["train", "sample_after_training=16000000"], "sample_after_training=16000000 leaves no room for the prompt"),
        (["plan", "devices=100000"], "plan over at most 2048 fake CPU devices"),
        # output directories that are files
        (["convert", "from-hf", str(GOLDEN / "llama2"), "{file}"], "is a file, not a directory"),
    ],
    ids=lambda value: value[-1][:40] if isinstance(value, list) else None,
)
def test_bad_input_is_one_line(tmp_path, capsys, args, fragment):
    paths = _files(tmp_path)
    args = [arg.format(**paths) for arg in args]
    code, _, err = run_cli(capsys, *args)
    assert_user_error(code, err, fragment)


def test_a_sample_with_no_room_for_its_prompt_is_refused_before_training(tmp_path, capsys):
    """prompt + sample_after_training beyond max_position_embeddings: one line before any
    step (it used to train, write the run, and fail only when sampling)."""
    args = ["max_target_length=16", "max_position_embeddings=16", "sample_after_training=14", "steps=2"]
    code, _, err = run_cli(capsys, "train", f"base_output_directory={tmp_path}", "run_name=r", *args)
    assert_user_error(code, err, "+ sample_after_training (14) exceed max_position_embeddings=16")
    assert not (tmp_path / "r").exists()


def test_hf_index_may_not_name_files_outside_the_model(tmp_path, capsys):
    model = tmp_path / "hf"
    shutil.copytree(GOLDEN / "llama2", model)
    (model / "model.safetensors").unlink()
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "../../../../etc/passwd"}}))
    code, _, err = run_cli(capsys, "convert", "from-hf", str(model), str(tmp_path / "run"))
    assert_user_error(code, err, "outside")
    assert not (tmp_path / "run").exists()


def _tiny(corpus: str, base: Path, run: str, **extra) -> list[str]:
    return [*train_overrides(corpus, str(base), run, eval_interval=-1, enable_tensorboard=False, **extra), "--no-progress"]


def _steps(run_dir: Path) -> list[int]:
    return [record["step"] for record in metric_records(run_dir) if "loss" in record]


def test_a_run_held_by_another_writer_is_refused_and_untouched(corpus, tmp_path, capsys):
    run_dir = tmp_path / "held"
    run_dir.mkdir()
    holder = RunLock(run_dir)
    holder.acquire()
    try:
        code, _, err = run_cli(capsys, "train", *_tiny(corpus, tmp_path, "held"))
        assert_user_error(code, err, f"is in use by pid {os.getpid()} on host")
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # nothing written
    finally:
        holder.release()
    assert run_cli(capsys, "train", *_tiny(corpus, tmp_path, "held"))[0] == 0  # free again
    assert _steps(run_dir) == list(range(1, 7))


def test_a_lock_left_by_a_dead_writer_is_taken_over(corpus, tmp_path, capsys):
    run_dir = tmp_path / "stale"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).write_text("pid 999999 on host elsewhere since 2026-01-01T00:00:00+00:00\n")
    code, out, err = run_cli(capsys, "train", *_tiny(corpus, tmp_path, "stale"))
    assert code == 0, err
    assert "run lock taken over from pid 999999 on host elsewhere" in out + err
    assert (run_dir / LOCK_FILE).read_text() == ""  # released at the end


def test_rerun_without_checkpoints_does_not_rewrite_history_unless_asked(corpus, tmp_path, capsys):
    """enable_checkpointing=false cannot resume: running the run again is refused, and
    --restart starts it again explicitly. (A run that died before its first checkpoint
    resumes from step 0: tests/integration/test_kill_resume.py.)"""
    args = _tiny(corpus, tmp_path, "nockpt", enable_checkpointing="false")
    assert run_cli(capsys, "train", *args)[0] == 0
    log = (tmp_path / "nockpt" / "metrics.jsonl").read_bytes()
    code, _, err = run_cli(capsys, "train", *args, "steps=4")
    assert_user_error(code, err, "already holds 6 logged records and enable_checkpointing=false cannot resume")
    assert "--restart" in err and (tmp_path / "nockpt" / "metrics.jsonl").read_bytes() == log
    assert run_cli(capsys, "train", *args, "steps=4", "--restart")[0] == 0
    assert _steps(tmp_path / "nockpt") == list(range(1, 5))


def _child(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, **fake_device_env(4)}
    return subprocess.Popen(
        [sys.executable, "-m", "nnxtron", "train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _final_params(run_dir: Path) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in flatten(nnx.state(load_model(run_dir), nnx.Param)).items()}


def test_two_writers_started_together_leave_one_exact_run(corpus, tmp_path):
    """Two ``nnxtron train`` of one run at once: one trains, the other is refused (or finds
    the run finished); the log counts each step once and the weights equal a lone run's."""
    procs = [_child(_tiny(corpus, tmp_path, "twice")) for _ in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes in ([0, 0], [0, 2]), results
    for code, _, err in results:
        if code == 2:
            assert_user_error(code, err, "is in use by pid")
    assert _steps(tmp_path / "twice") == list(range(1, 7))
    lone = _child(_tiny(corpus, tmp_path, "lone"))
    assert lone.wait(timeout=300) == 0, lone.communicate()
    ours, reference = _final_params(tmp_path / "twice"), _final_params(tmp_path / "lone")
    assert ours.keys() == reference.keys()
    for key, value in reference.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)


def test_a_run_never_takes_its_compilation_cache_from_its_config(corpus, tmp_path, capsys):
    """``generate`` of someone else's run: the run's config.yml cannot choose where compiled
    executables are loaded from (the cache is this machine's setting)."""
    run_dir, evil = tmp_path / "theirs", tmp_path / "their-cache"
    assert run_cli(capsys, "train", *_tiny(corpus, tmp_path, "theirs", steps=1, checkpoint_period=1))[0] == 0
    written = yaml.safe_load((run_dir / "config.yml").read_text())
    assert "compilation_cache_dir" not in written and "compilation_cache_min_compile_seconds" not in written
    (run_dir / "config.yml").write_text(yaml.safe_dump({**written, "compilation_cache_dir": str(evil)}))
    code, _, err = run_cli(capsys, "generate", str(run_dir), "--prompt", "ab", "max_new_tokens=2")
    assert code == 0, err
    assert not evil.exists()


# --- the model fingerprint -----------------------------------------------------------------


def test_model_keys_come_from_the_schema():
    from nnxtron.config.fingerprint import MODEL_KEYS

    issue_examples = {"rope_max_timescale", "mlp_activations", "normalization_layer_epsilon", "sliding_window_size", "dtype"}
    assert issue_examples <= set(MODEL_KEYS)
    assert {"decoder_block", "base_emb_dim", "vocab_size", "compress_ratios", "capacity_factor", "weight_dtype"} <= set(
        MODEL_KEYS
    )
    training = {"steps", "learning_rate", "scan_layers", "remat_policy", "ici_fsdp_parallelism", "attention", "run_name"}
    assert not training & set(MODEL_KEYS)


@pytest.fixture(scope="module")
def finished_run(corpus, tmp_path_factory):
    """A 6-step run (checkpoints at 3 and 6) and a snapshot of every file it wrote."""
    base = tmp_path_factory.mktemp("fingerprint")
    assert main(["train", *_tiny(corpus, base, "fp")]) == 0
    return base, base / "fp"


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "change",
    [
        "rope_max_timescale=500000.0",
        "mlp_activations=[gelu,linear]",
        "normalization_layer_epsilon=0.001",
        "sliding_window_size=8",
        "dtype=bfloat16",
    ],
)
def test_resume_with_another_model_is_refused(corpus, finished_run, capsys, change):
    base, run_dir = finished_run
    before = _snapshot(run_dir)
    code, _, err = run_cli(capsys, "train", *_tiny(corpus, base, "fp", steps=9), change)
    assert_user_error(code, err, f"was created with {change.split('=')[0]}=")
    assert _snapshot(run_dir) == before


def test_a_config_yml_edited_by_hand_is_caught_by_the_checkpoints(corpus, finished_run, tmp_path, capsys):
    """The checkpoints carry the fingerprint too: editing config.yml cannot make generate or
    a resume run another function on the same weights."""
    _, source = finished_run
    run_dir = tmp_path / "edited"
    shutil.copytree(source, run_dir)
    stored = yaml.safe_load((run_dir / "config.yml").read_text())
    (run_dir / "config.yml").write_text(
        yaml.safe_dump({**stored, "rope_max_timescale": 500000.0, "base_output_directory": str(tmp_path)})
    )
    code, _, err = run_cli(capsys, "generate", str(run_dir), "--prompt", "ab", "max_new_tokens=2")
    assert_user_error(code, err, "was created with rope_max_timescale=10000.0 but this config has rope_max_timescale=500000.0")
    code, _, err = run_cli(capsys, "train", *_tiny(corpus, tmp_path, "edited", steps=9, rope_max_timescale=500000.0))
    assert_user_error(code, err, "checkpoint")


def test_generate_and_load_parameters_refuse_another_model(corpus, finished_run, tmp_path, capsys):
    base, run_dir = finished_run
    code, _, err = run_cli(capsys, "generate", str(run_dir), "--prompt", "ab", "max_new_tokens=2", "rope_max_timescale=99.0")
    assert_user_error(code, err, "rope_max_timescale=99.0")
    args = _tiny(corpus, tmp_path, "finetune", load_parameters_path=str(run_dir), normalization_layer_epsilon=0.001)
    code, _, err = run_cli(capsys, "train", *args)
    assert_user_error(code, err, "normalization_layer_epsilon")


def test_a_resume_may_change_training_keys_and_says_which(corpus, finished_run, tmp_path, capsys):
    _, source = finished_run
    shutil.copytree(source, tmp_path / "more")
    code, out, err = run_cli(capsys, "train", *_tiny(corpus, tmp_path, "more", steps=9, learning_rate=0.005))
    assert code == 0, err
    assert "changed since the run's config.yml: " in out + err and "steps 6 -> 9" in out + err
    assert "learning_rate 0.01 -> 0.005" in out + err
    assert _steps(tmp_path / "more") == list(range(1, 10))


def test_hf_weights_must_be_finite_floats(tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    for name, damage in (("nan", lambda t: t * np.nan), ("int", lambda t: t.astype(np.int32))):
        model = tmp_path / name
        shutil.copytree(GOLDEN / "llama2", model)
        tensors = load_file(model / "model.safetensors")
        tensors["model.norm.weight"] = damage(tensors["model.norm.weight"])
        save_file(tensors, model / "model.safetensors")
        code, _, err = run_cli(capsys, "convert", "from-hf", str(model), str(tmp_path / f"run-{name}"))
        assert_user_error(code, err, "NaN/Inf values" if name == "nan" else "expected floating-point weights")


def test_more_bad_input_is_one_line(corpus, tmp_path, capsys):
    """A corpus whose every record is bad (skip_bad_records looped forever), a JSON line of
    100k nested '[', a prompt of undecodable bytes, an HF target that is a file, and the
    overwrite hint that names the command-line flag."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jsonl").write_text('{"text": 5}\n{"text": 7}\n')
    args = _tiny(corpus, tmp_path, "allbad", dataset_type="jsonl", dataset_path=str(bad / "a.jsonl"), skip_bad_records="true")
    code, _, err = run_cli(capsys, "train", *args, "eval_split_fraction=0")
    assert_user_error(code, err, "none of the 2 records of the train split is usable")
    (bad / "nested.jsonl").write_text('{"text": "fine"}\n' + "[" * 100_000 + "\n")
    args = _tiny(corpus, tmp_path, "nested", dataset_type="jsonl", dataset_path=str(bad / "nested.jsonl"))
    code, _, err = run_cli(capsys, "train", *args, "eval_split_fraction=0")
    assert_user_error(code, err, "nested too deeply to parse")
    run_dir = tmp_path / "src"
    assert run_cli(capsys, "convert", "from-hf", str(GOLDEN / "llama2"), str(run_dir))[0] == 0
    code, _, err = run_cli(capsys, "generate", str(run_dir), "--prompt", b"\xff\xfe".decode("utf-8", "surrogateescape"))
    assert_user_error(code, err, "config key 'prompt': is not valid UTF-8 text")
    (tmp_path / "a_file").write_text("")
    code, _, err = run_cli(capsys, "convert", "to-hf", str(run_dir), str(tmp_path / "a_file"))
    assert_user_error(code, err, "is a file, not a directory")
    assert run_cli(capsys, "convert", "to-hf", str(run_dir), str(tmp_path / "hf"))[0] == 0
    code, _, err = run_cli(capsys, "convert", "to-hf", str(run_dir), str(tmp_path / "hf"))
    assert_user_error(code, err, "pass --overwrite")
