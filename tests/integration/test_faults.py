"""Faults of issue 48 (round 2), each one line instead of a hang, an abort, a swallowed Ctrl-C,
a write outside ``base_output_directory`` or a meaningless sample:

- a run directory (or an entry in it) that is a symbolic link is refused, nothing written;
- a Ctrl-C during start-up whose ``KeyboardInterrupt`` a library swallows (JAX's gc callback)
  still stops the run: status 130, one line, the new run directory removed;
- a coordinator nobody answers (or a peer never started) ends ``nnxtron train`` with one
  line and status 2 after ``--init-timeout`` (JAX aborted with SIGABRT after 307 s);
- weights so large that the activations overflow make ``generate`` say so (it printed token
  0 over and over).
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from flax import nnx

from nnxtron.config import load_config
from nnxtron.config.fingerprint import fingerprint
from nnxtron.config.loader import run_config_to_yaml
from nnxtron.models.build import build_model
from nnxtron.runtime.fake_devices import fake_device_env
from nnxtron.train import loop
from nnxtron.train.checkpoint import Checkpointer
from tests.integration.conftest import assert_user_error, run_cli

TINY = ["model_name=llama2-tiny", "vocab_size=320", "base_num_decoder_layers=2", "max_target_length=16"]
SYNTHETIC = ["dataset_type=synthetic", "dataset_path=[]", "eval_split_fraction=0.0", "eval_interval=-1",
             "enable_tensorboard=false", "sample_after_training=0", "per_device_batch_size=1", "steps=1"]  # fmt: skip


def _train_args(base: Path, run: str) -> list[str]:
    return ["train", *TINY, *SYNTHETIC, f"base_output_directory={base}", f"run_name={run}", "--no-progress"]


@pytest.mark.parametrize("linked", ["run", "checkpoints", "metrics.jsonl"])
def test_a_symbolic_link_in_a_run_is_refused(tmp_path, capsys, linked):
    """A link would carry the run's writes outside base_output_directory (they used to land there)."""
    base, outside = tmp_path / "runs", tmp_path / "elsewhere"
    outside.mkdir()
    base.mkdir()
    if linked == "run":
        (base / "r").symlink_to(outside, target_is_directory=True)
    else:
        (base / "r").mkdir()
        target = outside / linked
        target.mkdir() if linked == "checkpoints" else target.write_text("")
        (base / "r" / linked).symlink_to(target)
    code, _, err = run_cli(capsys, *_train_args(base, "r"))
    assert_user_error(code, err, "is a symbolic link")
    assert sorted(p.name for p in outside.rglob("*")) == ([] if linked == "run" else [linked])
    assert not (outside / linked).is_file() or (outside / linked).read_text() == ""


def test_a_ctrl_c_a_library_swallows_still_stops_the_start_up(tmp_path, capsys, monkeypatch):
    """SIGINT lands in JAX's gc callback, which drops the ``KeyboardInterrupt`` ("Exception
    ignored"): the run used to go on and exit 0. Reproduced exactly: a gc callback raises the
    signal while the run directory is being made."""
    armed: list[bool] = []

    def swallowing_callback(phase: str, info: dict) -> None:  # as jax's _xla_gc_callback: its exceptions are dropped
        if armed:
            armed.clear()
            signal.raise_signal(signal.SIGINT)

    def make_run_dir(path: Path) -> None:
        make(path)
        armed.append(True)
        gc.collect()

    make = loop.make_run_dir
    monkeypatch.setattr(loop, "make_run_dir", make_run_dir)
    gc.callbacks.append(swallowing_callback)
    try:
        code, out, err = run_cli(capsys, *_train_args(tmp_path, "cut"))
    finally:
        gc.callbacks.remove(swallowing_callback)
    assert code == 130, err
    assert err.strip().splitlines()[-1] == "SIGINT: stopped before the first step (nothing was trained or saved)", err
    assert "trained steps" not in out and "Exception ignored" not in err and "Traceback" not in err
    assert not (tmp_path / "cut").exists()  # the directory this start made is removed: nothing half-written
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored after the command


NNXTRON = Path(sys.executable).parent / "nnxtron"  # the console script `pip install` wrote (pyproject.toml)


def _interrupt_while_loading(command: list[str], library: str) -> tuple[subprocess.Popen, str]:
    """``command`` started, then SIGINT the moment the process maps ``library`` (a shared object of
    an extension module being imported); the process (ended) and its stderr."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    try:
        while library not in Path(f"/proc/{proc.pid}/maps").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, f"{library} was never loaded: {proc.stderr.read()}"
            time.sleep(0.0005)
        proc.send_signal(signal.SIGINT)
        return proc, proc.communicate(timeout=60)[1]
    finally:
        proc.kill()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps (Linux)")
@pytest.mark.parametrize("library", ["_multiarray_umath", "jaxlib/_jax", "jaxlib/_xla"])
@pytest.mark.parametrize("entry", ["config", "train", "python -m"])
def test_a_ctrl_c_while_the_start_up_imports_is_one_line(tmp_path, entry, library):
    """SIGINT while NumPy's or JAX's extension modules load (the first ~0.2 s of any command): the
    ``KeyboardInterrupt`` cut their initialisation short: an ImportError traceback, a segmentation
    fault (-11) or SIGABRT (-6). Now, from the console script or ``python -m nnxtron``: status
    130, one line, nothing written."""
    if entry == "train":
        command = [str(NNXTRON), *_train_args(tmp_path, "cut")]
    else:
        command = [str(NNXTRON)] if entry == "config" else [sys.executable, "-m", "nnxtron"]
        command += ["config", "show"]
    proc, err = _interrupt_while_loading(command, library)
    assert proc.returncode == 130, err
    assert [line for line in err.splitlines() if line.strip()] == ["interrupted"], err
    assert not (tmp_path / "cut").exists()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("process_id, fragment", [(1, "does not answer"), (0, "not all 2 processes joined")],
                         ids=["no-coordinator", "peer-never-started"])  # fmt: skip
def test_a_run_that_cannot_be_joined_is_one_line(tmp_path, process_id, fragment):
    """Process 1 with nobody at the address; process 0 whose peer never starts. JAX's own
    deadline aborts the process from C++ (SIGABRT, a stack dump, 307 s with the defaults)."""
    args = [*_train_args(tmp_path, "join")[1:], "--coordinator-address", f"127.0.0.1:{_free_port()}",
            "--num-processes", "2", "--process-id", str(process_id), "--init-timeout", "2"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "nnxtron", "train", *args], capture_output=True, text=True,
                          env={**os.environ, **fake_device_env(1)}, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: could not join the distributed run within 2 s"), proc.stderr
    assert fragment in lines[0], lines[0]
    assert not (tmp_path / "join").exists()


def _run_with_weights_times(tmp_path: Path, scale: float) -> Path:
    """A run whose one checkpoint holds a seeded tiny model's weights times ``scale`` (finite)."""
    cfg = load_config(None, TINY)
    _, params, _ = nnx.split(build_model(cfg), nnx.Param, ...)
    run = tmp_path / "huge"
    run.mkdir()
    (run / "config.yml").write_text(run_config_to_yaml(cfg))
    ckpt = Checkpointer(run / "checkpoints", max_to_keep=1)
    ckpt.save(0, {"params": jax.tree.map(lambda x: x * scale, nnx.to_pure_dict(params))}, {"model": fingerprint(cfg)})
    ckpt.wait()
    return run


@pytest.mark.parametrize("scale, fragment", [(1e6, "are all equal"), (1e18, "are not finite")], ids=["flat", "nan"])
def test_generate_says_when_the_logits_cannot_be_sampled(tmp_path, capsys, scale, fragment):
    """Weights 1e6 times too large: the norms scale the overflowing activations to 0 (every
    logit 0.0); 1e18: to NaN. Either way argmax is token 0, which ``generate`` printed as
    the sample, every time."""
    run = _run_with_weights_times(tmp_path, scale)
    code, out, err = run_cli(capsys, "generate", str(run), "max_new_tokens=4", "--prompt", "hi")
    assert_user_error(code, err, fragment)
    assert "logits for new token 1" in err
