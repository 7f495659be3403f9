"""A full or read-only disk: one line naming the path and the reason, the older checkpoints
kept, a prompt exit (no orbax thread left waiting), and a resume elsewhere that ends bit for
bit where an uninterrupted run ends. The faults are real file systems: a small tmpfs and a
read-only bind mount (these tests need the right to mount, which CI's root has)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from nnxtron.runtime.fake_devices import fake_device_env
from tests.integration.conftest import train_overrides
from tests.integration.test_preemption import _assert_same_params

STEPS = 6


@contextlib.contextmanager
def _mounted(target: Path, *options: str) -> Iterator[Path]:
    target.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", *options, str(target)], capture_output=True, text=True, check=False)
    if proc.returncode:
        pytest.skip(f"cannot mount file systems here ({proc.stderr.strip()}): the disk-fault tests need root")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def _train(base: Path, run: str, steps: int = STEPS) -> subprocess.CompletedProcess:
    args = train_overrides("", str(base), run, steps=steps, checkpoint_period=1, eval_interval=-1, enable_tensorboard=False,
                           dataset_type="synthetic", dataset_path="[]", eval_split_fraction=0.0, sample_after_training=0,
                           learning_rate_schedule_steps=STEPS)  # fmt: skip
    env = {**os.environ, **fake_device_env(1)}
    command = [sys.executable, "-m", "nnxtron", "train", *args, "--no-progress"]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, check=False)


def _one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and proc.stderr.rstrip().endswith(errors[0]), proc.stderr  # the start-up lines, then one error
    assert not any(word in proc.stderr for word in ("Traceback", "ERROR", "Exception", "Event loop")), proc.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def _steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def test_a_full_disk_keeps_the_older_checkpoints(tmp_path):
    reference = _train(tmp_path / "normal", "straight")
    assert reference.returncode == 0, reference.stderr
    with _mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=2500k", "tmpfs") as small:
        started = time.monotonic()
        proc = _train(small, "full")
        assert time.monotonic() - started < 120
        _one_error_line(proc, f"cannot write checkpoints in '{small / 'full' / 'checkpoints'}'", "ENOSPC")
        kept = _steps(small / "full")
        assert kept and kept[-1] < STEPS
        shutil.copytree(small / "full", tmp_path / "normal" / "moved")  # room again: resume there
    resumed = _train(tmp_path / "normal", "moved")
    assert resumed.returncode == 0 and f"resumed at step {kept[-1]}" in resumed.stderr, resumed.stderr
    _assert_same_params(tmp_path / "normal" / "moved", tmp_path / "normal" / "straight")


def test_a_read_only_checkpoint_directory_is_one_line_and_kept(tmp_path):
    first = _train(tmp_path, "ro", steps=2)
    assert first.returncode == 0, first.stderr
    checkpoints = tmp_path / "ro" / "checkpoints"
    before = sorted(str(p.relative_to(checkpoints)) for p in checkpoints.rglob("*"))
    with _mounted(checkpoints, "--bind", str(checkpoints)):
        subprocess.run(["mount", "-o", "remount,bind,ro", str(checkpoints)], check=True)
        started = time.monotonic()
        proc = _train(tmp_path, "ro")
        assert time.monotonic() - started < 120  # it used to hang at exit with orbax threads waiting
        _one_error_line(proc, f"cannot write checkpoints in '{checkpoints}'", "Read-only file system")
        assert sorted(str(p.relative_to(checkpoints)) for p in checkpoints.rglob("*")) == before
    assert np.array_equal(_steps(tmp_path / "ro"), [1, 2])


def test_a_resume_past_a_truncated_checkpoint_prints_no_orbax_dump(tmp_path):
    """The fallback line is the whole report: orbax's coroutines of the failed read, which
    Python collects at exit, used to print "Exception ignored in: <coroutine ...>" dumps."""
    assert _train(tmp_path, "cut", steps=4).returncode == 0
    biggest = max((p for p in (tmp_path / "cut" / "checkpoints" / "4" / "params").rglob("*") if p.is_file()),
                  key=lambda p: p.stat().st_size)  # fmt: skip
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    proc = _train(tmp_path, "cut")
    assert proc.returncode == 0 and "skipped checkpoint 4:" in proc.stderr, proc.stderr
    assert not any(word in proc.stderr for word in ("Exception ignored", "Traceback")), proc.stderr
