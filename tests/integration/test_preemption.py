"""Preemption: SIGTERM / SIGINT finish the step, save a checkpoint and exit 128 + signal;
resuming gives bit for bit the run that was never stopped (one process, and two processes
over gloo, where both stop after the same step). A second signal stops at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from nnxtron.convert.runs import load_model
from nnxtron.params import flatten
from nnxtron.runtime.fake_devices import fake_device_env
from tests.integration.conftest import train_overrides
from tests.integration.test_multihost import _free_port

STEPS = 24


def _args(corpus: str, base: Path, run: str, **extra) -> list[str]:
    values = dict(steps=STEPS, checkpoint_period=1000, eval_interval=-1, enable_tensorboard=False, log_period=1,
                  learning_rate_schedule_steps=STEPS, sample_after_training=0)  # fmt: skip
    return [*train_overrides(corpus, str(base), run, **{**values, **extra}), "--no-progress"]


def _start(args: list[str], devices: int = 4, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {**os.environ, **fake_device_env(devices)}
    command = [sys.executable, "-m", "nnxtron", "train", *args, *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _logged(run_dir: Path) -> list[int]:
    log = run_dir / "metrics.jsonl"
    lines = log.read_text().splitlines() if log.is_file() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("}")]


def _wait_for_steps(run_dir: Path, count: int, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 300
    while len(_logged(run_dir)) < count:
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)


def _params(run_dir: Path) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in flatten(nnx.state(load_model(run_dir), nnx.Param)).items()}


def _assert_same_params(run_dir: Path, reference: Path) -> None:
    ours, theirs = _params(run_dir), _params(reference)
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    base = tmp_path_factory.mktemp("preemption")
    proc = _start(_args(corpus, base, "straight"))
    assert proc.wait(timeout=300) == 0, proc.communicate()
    return base / "straight"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_and_the_resume_is_exact(corpus, tmp_path, uninterrupted, signum):
    run_dir = tmp_path / "stopped"
    proc = _start(_args(corpus, tmp_path, "stopped"))
    _wait_for_steps(run_dir, 3, [proc])
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=300)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, err
    assert f"{name}: finishing this step, saving a checkpoint, then stopping" in err
    stopped = _logged(run_dir)[-1]
    assert 3 <= stopped < STEPS and f"{name}: stopped after step {stopped} and saved checkpoint {stopped}" in err
    assert (run_dir / "checkpoints" / str(stopped)).is_dir() and "Traceback" not in err
    resumed = _start(_args(corpus, tmp_path, "stopped"))
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and f"resumed at step {stopped}" in err, err
    assert _logged(run_dir) == list(range(1, STEPS + 1))
    _assert_same_params(run_dir, uninterrupted)


def test_a_second_signal_stops_at_once(corpus, tmp_path):
    run_dir = tmp_path / "twice"
    proc = _start(_args(corpus, tmp_path, "twice"))
    _wait_for_steps(run_dir, 2, [proc])
    proc.send_signal(signal.SIGINT)
    seen = []
    while not seen or "finishing this step" not in seen[-1]:  # the first one is being handled
        seen.append(proc.stderr.readline())
        assert seen[-1], "".join(seen)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    err = "".join(seen) + err
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "SIGINT again: stopping now, without a checkpoint" in err and "Traceback" not in err


SYNTHETIC = dict(
    dataset_type="synthetic", dataset_path="[]", eval_split_fraction=0.0, ici_fsdp_parallelism=-1, per_device_batch_size=1
)


def test_two_processes_stop_after_the_same_step(corpus, tmp_path):
    """SIGTERM to one of two processes: both stop after the same step (JAX's preemption
    service agrees on it), the checkpoint is complete and the resume equals the same two
    processes never stopped, bit for bit."""

    def pair(run: str) -> list[subprocess.Popen]:
        port = _free_port()
        return [
            _start(_args(corpus, tmp_path, run, **SYNTHETIC), devices=2,
                   extra=("--coordinator-address", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)))
            for i in range(2)
        ]  # fmt: skip

    def finish(procs: list[subprocess.Popen]) -> list[tuple[str, str]]:
        return [p.communicate(timeout=300) for p in procs]

    straight = pair("straight")
    assert [p.wait(timeout=300) for p in straight] == [0, 0], finish(straight)
    run_dir = tmp_path / "pair"
    procs = pair("pair")
    _wait_for_steps(run_dir, 3, procs)
    procs[1].send_signal(signal.SIGTERM)
    results = finish(procs)
    assert [p.returncode for p in procs] == [143, 143], results
    stopped = _logged(run_dir)[-1]
    assert f"SIGTERM: stopped after step {stopped} and saved checkpoint {stopped}" in results[0][1]
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [stopped]
    procs = pair("pair")
    results = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], results
    assert f"resumed at step {stopped}" in results[0][1]
    assert _logged(run_dir) == list(range(1, STEPS + 1))
    _assert_same_params(run_dir, tmp_path / "straight")


@pytest.mark.parametrize(
    "how, within, reasons",
    [
        # its connections close: noticed at the next collective, or by the heartbeat when the
        # survivor is between collectives longer than --peer-timeout (a loaded machine: seen in CI)
        ("SIGKILL", 25, ("a collective with another process failed", "process 1 of 2 has not been heard from for 10 s")),
        ("SIGSTOP", 25, ("process 1 of 2 has not been heard from for 10 s (--peer-timeout)",)),  # silent: the heartbeat
    ],
)
def test_a_dead_or_silent_peer_stops_the_others_with_one_line(corpus, tmp_path, how, within, reasons):
    """One of two processes is killed, or stopped (a hung process or a host gone without a
    word): the other exits with one error line and status 3 within --peer-timeout (it used to
    print a traceback, wait for JAX's heartbeat timeout, then abort with a C++ stack dump)."""
    port = _free_port()
    procs = [
        _start(_args(corpus, tmp_path, "dead", **SYNTHETIC), devices=2,
               extra=("--coordinator-address", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i),
                      "--peer-timeout", "10"))
        for i in range(2)
    ]  # fmt: skip
    _wait_for_steps(tmp_path / "dead", 3, procs)
    procs[1].send_signal(getattr(signal, how))
    started = time.monotonic()
    try:
        _, err = procs[0].communicate(timeout=120)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 3, err
    assert time.monotonic() - started < within
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and any(r in errors[0] for r in reasons) and "a peer process died or was stopped" in errors[0], err
    assert "Traceback" not in err and "Check failure" not in err
