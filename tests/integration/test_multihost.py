"""Two `nnxtron train` processes on localhost (2 fake CPU devices each, collectives over gloo)
train with fsdp over all 4 devices, checkpoint, resume, and match one 4-device process."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from nnxtron.config import load_config
from nnxtron.params import flatten
from nnxtron.runtime.fake_devices import fake_device_env
from nnxtron.train.checkpoint import Checkpointer
from nnxtron.train.loop import Trainer
from tests.integration.conftest import train_overrides

STEPS = 6


def _args(corpus: str, base: str, run: str, steps: int) -> list[str]:
    return train_overrides(
        corpus, base, run, steps=steps, checkpoint_period=3, eval_interval=-1, enable_tensorboard=False,
        dataset_type="synthetic", dataset_path="[]", eval_split_fraction=0.0, ici_fsdp_parallelism=-1,
        per_device_batch_size=1, log_period=1, learning_rate_schedule_steps=STEPS,
    )  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "nnxtron", "train", *args, "--no-progress"]


def _two_processes(args: list[str]) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    env = {**os.environ, **fake_device_env(2)}
    procs = [
        subprocess.Popen(
            _command(args) + ["--coordinator-address", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for i in range(2)
    ]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=400)
        out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    for result in out:
        assert result.returncode == 0, result.stdout + result.stderr
    return out


# gloo's C++ connection messages; several of its threads write them at once, piece by piece
# ("[Gloo] Rank ", the rank, " is connected to ", the count, " peer ranks. ... is : ", the count),
# so a message can be cut at any of those joints, with other lines in between (seen in CI:
# "[Gloo] Rank " / "2 is connected to ..." and "1 is connected to 1" / " peer ranks. ...")
GLOO_PIECES = re.compile(
    r"\[Gloo\] Rank \d*|\d* ?is connected to \d*| ?peer ranks\. Expected number of connected peer ranks is : \d*"
)


def _ours(text: str) -> str:
    """Output without gloo's own connection messages, whole or in pieces, and the blank or
    bare-number lines their pieces leave."""
    lines = GLOO_PIECES.sub("", text).splitlines(keepends=True)
    return "".join(line for line in lines if line.strip() and not line.strip().isdigit())


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_train_checkpoint_resume_and_match_one(corpus, tmp_path):
    base = str(tmp_path)
    first = _two_processes(_args(corpus, base, "multi", 3))
    assert "trained steps 0..3" in first[0].stdout and _ours(first[1].stdout) == ""  # process 0 reports
    assert "run " in first[0].stderr and "run " not in _ours(first[1].stderr)  # ... and only process 0 logs
    second = _two_processes(_args(corpus, base, "multi", STEPS))
    assert "resumed at step 3" in second[0].stderr and "trained steps 3..6" in second[0].stdout
    meta = json.loads((tmp_path / "multi" / "checkpoints" / str(STEPS) / "meta" / "metadata").read_text())
    assert meta["data_state"] == [{"index": STEPS}, {"index": STEPS}]  # one data state per process
    assert meta["layout"]["num_devices"] == 4

    straight = _two_processes(_args(corpus, base, "multi-straight", STEPS))  # the same two processes, never stopped
    assert "trained steps 0..6" in straight[0].stdout

    def losses(run):
        return [(r["step"], r["loss"], r["grad_norm"]) for r in _records(tmp_path / run)]

    assert losses("multi-straight") == losses("multi")  # bit for bit across the resume

    single = subprocess.run(
        _command(_args(corpus, base, "single", STEPS)), capture_output=True, text=True, timeout=400, check=False,
        env={**os.environ, **fake_device_env(4)},
    )  # fmt: skip
    assert single.returncode == 0, single.stderr

    multi, one = _records(tmp_path / "multi"), _records(tmp_path / "single")
    assert [r["step"] for r in multi] == [r["step"] for r in one] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in multi], [r["loss"] for r in one], rtol=1e-6, atol=0)
    np.testing.assert_allclose([r["grad_norm"] for r in multi], [r["grad_norm"] for r in one], rtol=1e-5, atol=0)

    cfg = load_config(overrides=_args(corpus, base, "single", STEPS))
    trainer = Trainer(cfg, progress=False)  # 8 devices here: restored onto this process's mesh
    states = {}
    for run in ("multi", "multi-straight", "single"):
        ckpt = Checkpointer(tmp_path / run / "checkpoints", 100, create=False)
        states[run] = flatten(ckpt.restore(STEPS, trainer.setup.abstract_state, trainer.setup.state_shardings)[0])
    assert states["multi"].keys() == states["single"].keys() == states["multi-straight"].keys()
    for key, value in states["multi-straight"].items():  # the resume is exact
        np.testing.assert_array_equal(np.asarray(states["multi"][key]), np.asarray(value), err_msg=key)
    # one process and two sum gradients in another order (1e-7 apart); Adam can turn that into a
    # visible step on an entry whose gradient is ~0, so the bound is per parameter, relative
    for key, value in states["single"].items():
        want, got = np.asarray(value, np.float64), np.asarray(states["multi"][key], np.float64)
        assert np.linalg.norm(got - want) <= 1e-5 * max(np.linalg.norm(want), 1e-6), key
