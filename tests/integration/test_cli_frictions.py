"""Small frictions of the command line (issue 47, point 8), each through the command a user runs:
a closed pipe, `--help` texts, the live progress line in an 80-column terminal, the MaxText keys
listed at start-up, and the MFU's peak when the cached probe value is too low."""

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from nnxtron.runtime.fake_devices import fake_device_env
from tests.integration.conftest import train_overrides

NNXTRON = Path(sys.executable).parent / "nnxtron"  # the console script of this environment
COMMAND = [str(NNXTRON)] if NNXTRON.is_file() else [sys.executable, "-m", "nnxtron"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **fake_device_env(1), **extra}


def _run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, env=_env(), timeout=120, **kwargs)


def test_config_show_into_a_closed_pipe_stops_quietly():
    """`nnxtron config show | head`: the reader has left before the output is written. Exit 141
    (as a process that SIGPIPE ends), nothing on stderr, no BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone: every write gets EPIPE (Python ignores SIGPIPE)
    try:
        proc = subprocess.run(
            [*COMMAND, "config", "show"], stdout=write_end, stderr=subprocess.PIPE, text=True, env=_env(), timeout=120
        )
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (141, ""), proc.stderr


def test_positional_overrides_are_optional():
    """`generate` and `serve` need only the path: the usage and the error say so."""
    proc = _run("generate")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: nnxtron generate: the following arguments are required: path (see `nnxtron generate --help`)"
    )
    assert _run("serve").stderr.strip().endswith("the following arguments are required: path (see `nnxtron serve --help`)")
    usage = " ".join(_run("generate", "--help").stdout.split("\n\n")[0].split())
    assert usage.endswith(" path [key=value ...]"), usage


def test_train_help_names_the_keys_and_where_all_are():
    """`nnxtron train --help` lists the common keys and points to `config show` and the docs,
    without importing JAX (-X importtime lists every module imported)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "nnxtron", "train", "--help"],
        capture_output=True, text=True, env=_env(COLUMNS="80"), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for key in ("model_name=", "steps=", "per_device_batch_size=", "max_target_length=", "learning_rate=",
                "dataset_type=", "dataset_path=", "run_name=", "init_from=", "tokenizer_type="):  # fmt: skip
        assert key in proc.stdout, key
    assert "nnxtron config show" in proc.stdout and "docs/config.md" in proc.stdout and "base.yml" in proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) <= 80
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "nnxtron.cli" in imported and "jax" not in imported


def _read_pty(master: int, proc: subprocess.Popen, timeout: float) -> str:
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    return b"".join(chunks).decode("utf-8", "replace")


def test_train_in_an_80_column_terminal(corpus, tmp_path):
    """`nnxtron train` in an 80-column terminal (a pty), with MaxText keys at their defaults and
    a cached probe value far below any CPU's (as a probe under load leaves):

    - every live progress line fits in 80 columns and the last one shows step/steps, loss,
      tok/s and the ETA whole (rich's column layout cut it mid-field);
    - the start-up lists the ignored MaxText keys by name (it gave their count only);
    - the peak MFU divides by is measured again and the stale low value does not win."""
    cache = tmp_path / "xdg" / "nnxtron" / "peak_flops.json"
    cache.parent.mkdir(parents=True)
    stale = 1e6  # FLOP/s: 10^5 times below this CPU's matmuls
    cache.write_text(json.dumps({f"cpu:cpu:{dtype}:{n}:f32-accumulation": stale for dtype in ("float32", "bfloat16")
                                 for n in (1, 2, 4, 8)}))  # fmt: skip
    args = train_overrides(corpus, str(tmp_path), "pty", steps=4, eval_interval=-1, enable_checkpointing=False,
                           enable_tensorboard=False)  # fmt: skip
    maxtext_at_default = ["gcs_metrics=false", "dump_hlo=false", "grain_worker_count=1"]
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = _env(COLUMNS="80", LINES="24", TERM="xterm-256color", XDG_CACHE_HOME=str(tmp_path / "xdg"))
    proc = subprocess.Popen(
        [*COMMAND, "train", *args, *maxtext_at_default], stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env
    )
    os.close(slave)
    try:
        raw = _read_pty(master, proc, timeout=240)
        code = proc.wait(timeout=60)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    text = ANSI.sub("", raw)
    lines = [line.rstrip() for line in re.split(r"\r\n|\r|\n", text)]
    assert code == 0, text[-3000:]

    progress = [line for line in lines if "━" in line or "tok/s" in line or "ETA" in line]  # the live line's frames
    assert progress, text[-3000:]
    assert all(len(line) <= 80 for line in progress), [line for line in progress if len(line) > 80]
    end = next(i for i, line in enumerate(lines) if line.startswith("trained steps 0..4"))
    last = [line for line in lines[:end] if line.strip()][-1]  # the frame left on the screen
    assert re.search(r"\b4/4  loss \d+\.\d{4}  [\d,]+ tok/s  .*ETA \d:\d\d:\d\d$", last), last

    assert "MaxText keys ignored (3;" in text and "3 at MaxText's default values" in text
    named = " ".join(line for line in lines if line not in progress)  # the log without the live line's frames
    assert re.search(r"metrics upload, logging and monitoring services \(1\):\s+gcs_metrics\b", named), named[:3000]
    assert re.search(r"profilers and compiler dumps nnxtron does not have in training \(1\):\s+dump_hlo\b", named)
    assert re.search(r"data-loader performance and order of MaxText's Grain pipeline \(1\):\s+grain_worker_count\b", named)

    peak = re.search(r"peak (\d+\.\d+) TFLOP/s from matmul probe", text)
    assert peak and float(peak.group(1)) * 1e12 > 1000 * stale, text[-3000:]
    assert all(value > 1000 * stale for key, value in json.loads(cache.read_text()).items() if ":float32:1:" in key)
