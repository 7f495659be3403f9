"""Weights & Biases: the scalars of ``metrics.jsonl`` mirrored to one W&B run per run directory.

An optional extra (``pip install 'nnxtron[wandb]'``), switched on by ``enable_wandb=true``.
The W&B run id is kept in ``<run>/wandb_id``: a resumed run logs into the same W&B run
(``resume="allow"``), so its curves continue. W&B's local files go under ``<run>/wandb/``
unless ``WANDB_DIR`` is set. Only process 0 logs (``MetricsWriter`` lives there).
"""

from __future__ import annotations

import os
import secrets
import string
from pathlib import Path
from types import ModuleType

from nnxtron.config.loader import MACHINE_SETTINGS
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError

ID_FILE = "wandb_id"
INSTALL = "pip install 'nnxtron[wandb]'"


def require_wandb() -> ModuleType:
    """The ``wandb`` module, or one line saying how to install it (called early, at ``Trainer``)."""
    try:
        import wandb
    except ImportError as err:
        raise ConfigError(
            f"enable_wandb=true needs the wandb package, which does not import ({err}); {INSTALL}, or set enable_wandb=false"
        ) from None
    return wandb


def run_id(run_dir: Path) -> str:
    """The W&B run id of ``run_dir``: the stored one, else a new one (8 characters from [a-z0-9]
    like W&B's own), stored (atomic write)."""
    path = run_dir / ID_FILE
    if path.is_file():
        stored = path.read_text(encoding="utf-8").strip()
        if stored:
            return stored
    new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    tmp = path.with_name(ID_FILE + ".tmp")
    tmp.write_text(new + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return new


class WandbLogger:
    """One W&B run: ``log`` sends scalars at a step; ``close`` finishes (and flushes) the run."""

    def __init__(self, cfg: Config, run_dir: Path):
        wandb = require_wandb()
        try:
            if cfg.wandb_mode:  # process-wide too: W&B's own usage analytics follow this, not the run's mode
                wandb.setup(settings=wandb.Settings(mode=cfg.wandb_mode))
            self.run = wandb.init(
                project=cfg.wandb_project or None,
                entity=cfg.wandb_entity or None,
                name=cfg.wandb_run_name or run_dir.name,
                id=run_id(run_dir),
                resume="allow",  # the stored id: a resumed run continues its W&B run
                mode=cfg.wandb_mode or None,
                dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
                config={key: value for key, value in cfg.model_dump(mode="json").items() if key not in MACHINE_SETTINGS},
                reinit="create_new",  # an independent run object: never logs into another Trainer's run
            )
        except wandb.Error as err:  # online mode without an API key or a connection ...
            reason = (str(err).strip() or type(err).__name__).splitlines()[0]
            raise ConfigError(
                f"Weights & Biases could not start a run ({reason}); run `wandb login`, or set wandb_mode=offline "
                "to log locally and `wandb sync` later"
            ) from None

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
