import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nnxtron.cli import main
from nnxtron.runtime.fake_devices import fake_device_env

PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
    "All that glitters is not gold. Where there is a will there is a way.\n"
)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A tiny fixed corpus of repetitive English text (three files)."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(3):
        (root / f"doc{i}.txt").write_text(PARAGRAPH * (20 + 5 * i))
    return str(root)


def train_overrides(corpus: str, base: str, run: str, **extra) -> list[str]:
    values = {
        "model_name": "llama2-tiny",
        "vocab_size": 320,
        "base_num_decoder_layers": 2,
        "dataset_path": f"{corpus}/*.txt",
        "eval_split_fraction": 0.3,
        "per_device_batch_size": 1,
        "max_target_length": 32,
        "steps": 6,
        "eval_interval": 3,
        "eval_steps": 1,
        "checkpoint_period": 3,
        "learning_rate": 0.01,
        "warmup_steps_fraction": 0.0,
        "base_output_directory": base,
        "run_name": run,
        "sample_after_training": 0,
        "enable_tensorboard": True,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def cli_train(corpus: str, base: str, run: str, timeout: int = 300, **extra) -> subprocess.CompletedProcess:
    """`nnxtron train` in a child process on 4 fake CPU devices (the test process has 8)."""
    args = train_overrides(corpus, base, run, eval_interval=-1, enable_tensorboard=False, log_period=1, **extra)
    env = {**os.environ, **fake_device_env(4)}
    proc = subprocess.run(
        [sys.executable, "-m", "nnxtron", "train", *args, "--no-progress"],
        capture_output=True, text=True, env=env, timeout=timeout, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def metric_records(run_dir: Path) -> list[dict]:
    """The lines of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_cli(capsys, *args):
    """``nnxtron ARGS`` in this process: (exit status, stdout, stderr)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean_exit(argv, code, out, err):
    """Any input: exit status 0, or 2 with one ``error:`` line; never a traceback."""
    assert code in (0, 2), (argv, code, err)
    assert "Traceback" not in out + err
    if code == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err)


def assert_user_error(code, err, fragment):
    """Bad input: exit status 2, one ``error:`` line holding ``fragment``, no traceback."""
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("WARNING:absl")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert fragment in lines[0], lines[0]
