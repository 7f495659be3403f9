"""Per-step metrics: JSON lines, TensorBoard and a live progress bar."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool):
        self.path = run_dir / "metrics.jsonl"
        self.file = self.path.open("a", encoding="utf-8")
        self.tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        if self.tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, step)

    def flush(self) -> None:
        self.file.flush()
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        self.flush()
        self.file.close()
        if self.tb is not None:
            self.tb.close()


class ProgressBar:
    """A rich progress bar showing step, loss, tokens/s, TFLOP/s and MFU (stderr)."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool | None = None):
        console = Console(file=sys.stderr)
        self.enabled = console.is_terminal if enabled is None else enabled
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
        if self.enabled:
            self.progress.console.print(message, highlight=False, markup=False)
        else:
            print(message, file=sys.stderr, flush=True)
