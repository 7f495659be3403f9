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
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from nnxtron.runtime.fake_devices import fake_device_env
from tests.integration.conftest import assert_user_error, run_cli, train_overrides
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


def _fill(directory: Path) -> None:
    """Take every free byte of the file system holding ``directory``."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (1 << 16, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)


def test_a_disk_that_fills_between_checkpoints_with_tensorboard_is_one_line(tmp_path):
    """The TensorBoard writer thread died on ENOSPC, its queue filled, and the run (and then a
    SIGTERM) waited forever; a flush on the main thread gave a traceback instead. The logs'
    disk fills after checkpoint 4 (the checkpoints have a disk of their own, mounted inside
    the run, so that the logs meet the full disk first)."""
    with _mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=1m", "tmpfs") as small:
        with _mounted(small / "tb" / "checkpoints", "-t", "tmpfs", "-o", "size=20m", "tmpfs") as checkpoints:
            args = train_overrides("", str(small), "tb", steps=100_000, checkpoint_period=4, eval_interval=-1, log_period=10,
                                   enable_tensorboard=True, dataset_type="synthetic", dataset_path="[]",
                                   eval_split_fraction=0.0, sample_after_training=0, max_num_checkpoints_to_keep=2)  # fmt: skip
            command = [sys.executable, "-m", "nnxtron", "train", *args, "--no-progress"]
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, **fake_device_env(1)})  # fmt: skip
            try:
                while not (checkpoints / "4").is_dir():
                    assert proc.poll() is None, proc.communicate()
                    time.sleep(0.05)
                _fill(small)
                out, err = proc.communicate(timeout=120)  # it used to wait here forever
            finally:
                proc.kill()
            kept = _steps(small / "tb")
            _one_error_line(subprocess.CompletedProcess(command, proc.returncode, out, err), "cannot write the run's log",
                            "(no space left on device: ENOSPC)", f"(checkpoints up to step {kept[-1]} are kept)")  # fmt: skip
            assert kept[-1] >= 4


def test_a_full_disk_at_start_is_one_line(tmp_path, capsys):
    """Writing the run lock's pid on a full disk was an OSError traceback."""
    with _mounted(tmp_path / "full", "-t", "tmpfs", "-o", "size=256k", "tmpfs") as full:
        _fill(full)
        args = train_overrides("", str(full), "r", steps=1, eval_interval=-1, enable_tensorboard=True, dataset_type="synthetic",
                               dataset_path="[]", eval_split_fraction=0.0)  # fmt: skip
        code, _, err = run_cli(capsys, "train", *args, "--no-progress")
        assert_user_error(code, err, "(no space left on device: ENOSPC)")
        assert sorted(p.name for p in full.iterdir()) == ["filler"]  # the run directory this start made is removed


def test_the_metrics_writer_meets_a_full_disk_in_the_caller(tmp_path):
    """Steps logged between flushes on a full disk: tensorboardX's writer thread died on
    ENOSPC and the next ``add_scalar`` waited forever on its full queue (the reported hang;
    here in a thread, so that the test fails instead of hanging). Now the flush says it."""
    from nnxtron.config import load_config
    from nnxtron.train.metrics import LogWriteError, MetricsWriter

    with _mounted(tmp_path / "full", "-t", "tmpfs", "-o", "size=256k", "tmpfs") as full:
        writer = MetricsWriter(full, load_config(None, ["enable_tensorboard=true"]))
        _fill(full)
        raised: list[BaseException] = []

        def log() -> None:
            try:
                for step in range(1, 2001):
                    writer.write({"step": step, "loss": 1.0 / step, "grad_norm": 0.5, "tokens_per_s": 1e4})
                writer.flush()
            except BaseException as err:  # noqa: BLE001 - handed to the test thread
                raised.append(err)

        thread = threading.Thread(target=log, daemon=True)
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), "logging on a full disk hangs"
        assert len(raised) == 1 and isinstance(raised[0], LogWriteError), raised
        assert "(no space left on device: ENOSPC)" in str(raised[0]) and str(full) in str(raised[0])
        writer.file.close()
        writer.tb.file.close()
