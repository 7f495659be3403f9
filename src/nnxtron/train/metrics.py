"""Per-step metrics: JSON lines, TensorBoard, Weights & Biases and a live progress bar (docs/logging.md)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from nnxtron.config.schema import Config
from nnxtron.train.wandb_logger import WandbLogger


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors its scalars to TensorBoard
    (``enable_tensorboard``) and Weights & Biases (``enable_wandb``; the same W&B run on resume).

    ``start_step``: the step a run resumes at. Records of later steps (written after that
    checkpoint by a run that then died) and a torn last line are dropped first, so the log
    of a resumed run reads exactly as if it had never stopped."""

    def __init__(self, run_dir: Path, cfg: Config, start_step: int = 0):
        self.path = run_dir / "metrics.jsonl"
        _truncate_after(self.path, start_step)
        self.file = self.path.open("a", encoding="utf-8")
        self.tb = None
        if cfg.enable_tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        self.wandb = WandbLogger(cfg, run_dir) if cfg.enable_wandb else None

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        step = record["step"]
        scalars = {key: value for key, value in record.items() if key != "step" and isinstance(value, (int, float))}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None and scalars:
            self.wandb.log(scalars, step)

    def flush(self) -> None:
        self.file.flush()
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        self.flush()
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()


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


class ProgressBar:
    """A rich progress bar showing step, loss, tokens/s, TFLOP/s and MFU (stderr)."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool | None = None, silent: bool = False):
        console = Console(file=sys.stderr)
        self.silent = silent  # processes other than 0 of a multi-host run print nothing
        self.enabled = (console.is_terminal if enabled is None else enabled) and not silent
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            disable=not self.enabled,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, stats="")
        self.console = console

    def __enter__(self) -> "ProgressBar":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def update(self, step: int, record: dict[str, Any]) -> None:
        aux = "".join(f"{k[4:]} {v:.4f}  " for k, v in record.items() if k.startswith("aux/"))
        stats = (
            f"loss {record['loss']:.4f}  {aux}{record['tokens_per_s']:,.0f} tok/s  "
            f"{record['tflops']:.3f} TFLOP/s  MFU {100 * record['mfu']:.1f}%"
        )
        self.progress.update(self.task, completed=step, stats=stats)

    def log(self, message: str) -> None:
        """A line above the bar (or plain stderr when the bar is off)."""
        if self.silent:
            return
        if self.enabled:
            self.progress.console.print(message, highlight=False, markup=False)
        else:
            print(message, file=sys.stderr, flush=True)
