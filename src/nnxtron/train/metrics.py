"""Per-step metrics: JSON lines, TensorBoard, Weights & Biases and a live progress bar (docs/logging.md)."""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.progress import Progress, Task
from rich.text import Text
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c

from nnxtron.config.schema import Config
from nnxtron.errors import UserError
from nnxtron.train.run_dir import disk_error
from nnxtron.train.wandb_logger import WandbLogger

FLUSH_BYTES = 1 << 16  # records kept in memory before they are written anyway
FLUSH_SECONDS = 30.0  # ... or this long after the last write


class LogWriteError(UserError):
    """The run's logs (``metrics.jsonl``, TensorBoard events) cannot be written: a full or read-only disk."""


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors its scalars to TensorBoard
    (``enable_tensorboard``) and Weights & Biases (``enable_wandb``; the same W&B run on resume).

    ``start_step``: the step a run resumes at. Records of later steps (written after that
    checkpoint by a run that then died) and a torn last line are dropped first, so the log
    of a resumed run reads exactly as if it had never stopped.

    Records are kept in memory and written by ``flush`` (every ``log_period`` steps, before each
    checkpoint, and once 64 KiB or 30 s have gathered) with plain ``os.write`` calls in the
    calling thread: a full disk fails that call, as one ``LogWriteError`` line. (tensorboardX's
    ``SummaryWriter`` writes from a thread that dies on ENOSPC, after which its queue fills and
    the training loop, and then a SIGTERM, waited forever.)"""

    def __init__(self, run_dir: Path, cfg: Config, start_step: int = 0):
        self.path = run_dir / "metrics.jsonl"
        self.lines: list[str] = []
        self.kept_bytes, self.last_flush = 0, time.monotonic()
        self.tb: _EventFile | None = None
        try:
            _truncate_after(self.path, start_step)
            self.file = _AppendFile(self.path)
            if cfg.enable_tensorboard:
                self.tb = _EventFile(run_dir / "tensorboard")
        except OSError as err:
            raise _log_error(err, self.path) from None
        self.wandb = WandbLogger(cfg, run_dir) if cfg.enable_wandb else None

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record) + "\n"
        self.lines.append(line)
        self.kept_bytes += len(line)
        step = record["step"]
        scalars = {key: value for key, value in record.items() if key != "step" and isinstance(value, (int, float))}
        if self.tb is not None and scalars:
            self.tb.add(scalars, step)
        if self.wandb is not None and scalars:
            self.wandb.log(scalars, step)
        if self.kept_bytes > FLUSH_BYTES or time.monotonic() - self.last_flush > FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Write the records kept since the last flush (a ``LogWriteError`` when the disk refuses)."""
        lines, self.lines = self.lines, []
        self.kept_bytes, self.last_flush = 0, time.monotonic()
        try:
            self.file.write("".join(lines).encode("utf-8"))
            if self.tb is not None:
                self.tb.flush()
        except OSError as err:
            raise _log_error(err, Path(err.filename) if err.filename else self.path) from None

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.file.close()
            if self.tb is not None:
                self.tb.file.close()
            if self.wandb is not None:
                self.wandb.close()


def _log_error(err: OSError, path: Path) -> LogWriteError:
    return LogWriteError(
        f"cannot write the run's log '{path}' ({disk_error(err)}); free space or fix the permissions of that disk, "
        "or choose another base_output_directory"
    )


class _AppendFile:
    """A file appended to with ``os.write``: nothing is buffered in Python, so a full disk fails
    the write that meets it (never a later flush, a close or the interpreter's exit). A write
    cut short leaves a torn last line, which a resume drops."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view and self.fd is not None:
            try:
                written = os.write(self.fd, view)
            except OSError as err:
                err.filename = str(self.path)
                raise
            view = view[written:]

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _EventFile:
    """A TensorBoard event file (``events.out.tfevents.<time>.<host>``, TFRecord framing), one
    event per step holding that step's scalars, written in the calling thread by ``flush``."""

    def __init__(self, directory: Path):
        directory.mkdir(exist_ok=True)
        self.file = _AppendFile(directory / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}")
        self.pending: list[bytes] = []
        self._append(Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()

    def add(self, scalars: dict[str, float], step: int) -> None:
        values = [Summary.Value(tag=key, simple_value=float(number)) for key, number in scalars.items()]
        self._append(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def flush(self) -> None:
        records, self.pending = self.pending, []
        self.file.write(b"".join(records))

    def _append(self, event: Event) -> None:
        data = event.SerializeToString()
        header = struct.pack("Q", len(data))
        self.pending.append(header + struct.pack("I", masked_crc32c(header)) + data + struct.pack("I", masked_crc32c(data)))


def _truncate_after(path: Path, step: int) -> None:
    """Keep the whole JSON records of ``path`` with ``step`` <= ``step`` (atomic rewrite)."""
    if not path.is_file():
        return
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)


# The live line's fields by priority (0 first): a terminal narrower than all of them drops
# whole fields from the end of this order, never cuts one (docs/logging.md).
STEP, LOSS, TOKENS, ETA, MFU, BAR, AUX, TFLOPS, ELAPSED, LABEL = range(10)
BAR_WIDTH = (10, 40)  # the bar's narrowest and widest: it takes the room the fields leave, within these
FIELD_GAP = "  "


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def line_fields(
    step: int, total: int, record: dict[str, Any] | None, elapsed: float | None, remaining: float | None
) -> list[tuple[int, str]]:
    """The live line's fields in display order, each ``(priority, text)`` (the bar is placed by
    ``fit_line``). Before the first record: the step and the ETA only."""
    fields = [(LABEL, "train"), (STEP, f"{step}/{total}")]
    if record is not None:
        fields.append((LOSS, f"loss {record['loss']:.4f}"))
        fields += [(AUX, f"{k[4:]} {v:.4f}") for k, v in record.items() if k.startswith("aux/")]
        fields += [
            (TOKENS, f"{record['tokens_per_s']:,.0f} tok/s"),
            (TFLOPS, f"{record['tflops']:.3f} TFLOP/s"),
            (MFU, f"MFU {100 * record['mfu']:.1f}%"),
        ]
    fields += [(ELAPSED, _clock(elapsed)), (ETA, f"ETA {_clock(remaining)}")]
    return fields


def fit_line(fields: list[tuple[int, str]], width: int, done: float) -> Text:
    """The fields taken by priority while they fit in ``width`` columns together (the first
    that does not fit ends the line, so the layout does not jump as values change length),
    shown in display order; the bar (``done``: 0..1, at least ``BAR_WIDTH[0]`` columns, then
    the room left) goes where the label is."""
    kept: set[int] = set()
    used, bar = 0, 0
    order = sorted(range(len(fields) + 1), key=lambda i: BAR if i == len(fields) else fields[i][0])
    for index in order:
        size = BAR_WIDTH[0] if index == len(fields) else len(fields[index][1])
        cost = size + (len(FIELD_GAP) if kept or bar else 0)
        if used + cost > width:
            break
        used += cost
        if index == len(fields):
            bar = size
        else:
            kept.add(index)
    if bar:
        bar = min(BAR_WIDTH[1], bar + width - used)
    line = Text(no_wrap=True, overflow="crop")
    for index, (priority, text) in enumerate(fields):
        if index in kept:
            if line:
                line.append(FIELD_GAP)
            line.append(text, style="bold" if priority == LABEL else "")
        if bar and priority == LABEL:
            if line:
                line.append(FIELD_GAP)
            filled = round(bar * min(max(done, 0.0), 1.0))
            line.append("━" * filled, style="bar.finished" if filled == bar else "bar.complete")
            line.append("━" * (bar - filled), style="bar.back")
    return line


class _Line:
    """One task's live line, fitted to the width the console gives it at each refresh."""

    def __init__(self, task: Task):
        self.task = task

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        task = self.task
        total = int(task.total or 0)
        fields = line_fields(int(task.completed), total, task.fields.get("record"), task.elapsed, task.time_remaining)
        yield fit_line(fields, options.max_width, task.completed / total if total else 0.0)


class _LineProgress(Progress):
    """rich's ``Progress`` (live refresh, speed and ETA estimates) drawing each task as one
    ``_Line`` instead of a table of fixed columns, which a narrow terminal cuts mid-field."""

    def get_renderables(self):
        for task in self.tasks:
            yield _Line(task)


class ProgressBar:
    """A live line on stderr: step/steps, loss, tokens/s, ETA, MFU, a bar, auxiliary losses,
    TFLOP/s and elapsed time — as many whole fields, in that priority, as the terminal's width
    holds (``line_fields``, ``fit_line``)."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool | None = None, silent: bool = False):
        console = Console(file=sys.stderr)
        self.silent = silent  # processes other than 0 of a multi-host run print nothing
        self.enabled = (console.is_terminal if enabled is None else enabled) and not silent
        self.progress = _LineProgress(console=console, disable=not self.enabled)
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, record=None)
        self.console = console

    def __enter__(self) -> "ProgressBar":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def update(self, step: int, record: dict[str, Any]) -> None:
        self.progress.update(self.task, completed=step, record=record)

    def log(self, message: str) -> None:
        """A line above the bar (or plain stderr when the bar is off)."""
        if self.silent:
            return
        if self.enabled:
            self.progress.console.print(message, highlight=False, markup=False)
        else:
            print(message, file=sys.stderr, flush=True)
