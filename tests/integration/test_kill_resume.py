"""SIGKILL `nnxtron train` at random points (mid-save included), resume, and get the
uninterrupted run's final parameters, optimizer state and loss log bit for bit."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from nnxtron.config import load_config
from nnxtron.params import flatten
from nnxtron.runtime.fake_devices import fake_device_env
from nnxtron.train.checkpoint import Checkpointer
from nnxtron.train.loop import Trainer
from tests.integration.conftest import train_overrides

STEPS = 16
KILLS = 5


def _args(corpus: str, base: str, run: str) -> list[str]:
    return train_overrides(
        corpus, base, run, steps=STEPS, checkpoint_period=1, max_num_checkpoints_to_keep=3, eval_interval=-1,
        enable_tensorboard=False, log_period=1, per_device_batch_size=1,
    )  # fmt: skip


def _env(cache: Path) -> dict[str, str]:
    """4 fake devices, and a compilation cache shared by every launch (restarts stay cheap)."""
    return {
        **os.environ,
        **fake_device_env(4),
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def _launch(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "nnxtron", "train", *args, "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def _committed(checkpoints: Path) -> set[int]:
    return {int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()} if checkpoints.is_dir() else set()


def _unfinished(checkpoints: Path) -> set[str]:
    """Orbax's temporary directories: saves in flight (or left by a killed one)."""
    return {p.name for p in checkpoints.iterdir() if "tmp" in p.name} if checkpoints.is_dir() else set()


def _kill_when(proc: subprocess.Popen, checkpoints: Path, mid_save: bool, delay: float, deadline: float) -> bool:
    """SIGKILL ``proc`` while a save is in flight (``mid_save``) or ``delay`` seconds after its
    next checkpoint commits. False if it finished first."""
    seen, stale = _committed(checkpoints), _unfinished(checkpoints)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if mid_save and _unfinished(checkpoints) - stale:  # a save of this launch is in flight
            break
        if not mid_save and _committed(checkpoints) - seen:
            time.sleep(delay)
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


def _losses(run: Path) -> list[tuple[int, float, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records]


def test_sigkill_at_random_points_then_resume_is_bit_exact(corpus, tmp_path):
    env = _env(tmp_path / "compilation-cache")
    base = str(tmp_path)
    straight = subprocess.run(
        [sys.executable, "-m", "nnxtron", "train", *_args(corpus, base, "straight"), "--no-progress"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert straight.returncode == 0, straight.stderr

    rng = random.Random(0)
    checkpoints = tmp_path / "killed" / "checkpoints"
    kills, mid_saves, launches = 0, 0, 0
    while kills < KILLS:
        launches += 1
        assert launches <= 3 * KILLS, f"only {kills} kills landed in {launches} launches"
        mid_save = kills % 2 == 0  # alternate: inside a save, and at a random time after one
        proc = _launch(_args(corpus, base, "killed"), env)
        if _kill_when(proc, checkpoints, mid_save, rng.uniform(0.0, 0.4), time.monotonic() + 240):
            kills += 1
            mid_saves += mid_save
        else:
            assert proc.returncode == 0, proc.stderr.read()
            break  # it finished before the kill: the run is complete
    assert kills == KILLS and mid_saves >= 2, (kills, mid_saves)
    final = _launch(_args(corpus, base, "killed"), env)
    _, err = final.communicate(timeout=300)
    assert final.returncode == 0, err
    assert max(_committed(checkpoints)) == STEPS

    assert _losses(tmp_path / "killed") == _losses(tmp_path / "straight")  # every step once, same floats
    trainer = Trainer(load_config(overrides=_args(corpus, base, "straight")), progress=False)
    states = []
    for run in ("straight", "killed"):
        ckpt = Checkpointer(tmp_path / run / "checkpoints", 100, create=False)
        state, meta = ckpt.restore(STEPS, trainer.setup.abstract_state, trainer.setup.state_shardings)
        states.append((flatten(state), meta["data_state"]))
    (a, data_a), (b, data_b) = states
    assert a.keys() == b.keys() and data_a == data_b
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)
