"""Opening trained models: a run directory (config.yml + checkpoints) or an HF directory."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from flax import nnx

from nnxtron.config.loader import load_run_config, parse_overrides
from nnxtron.config.schema import Config
from nnxtron.convert.hf import from_hf
from nnxtron.errors import CheckpointError
from nnxtron.models.decoder import Decoder
from nnxtron.parallel.mesh import make_mesh
from nnxtron.train.loop import load_parameters
from nnxtron.train.state import init_non_params, model_shardings


def is_hf_directory(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / "config.yml").is_file()


def run_config(path: str | Path, overrides: Iterable[str] = ()) -> Config:
    """The config a run was created with (``<run>/config.yml``), plus overrides."""
    run_dir = Path(path)
    if not (run_dir / "config.yml").is_file():
        raise CheckpointError(
            f"'{path}' is not an nnxtron run directory (no config.yml); pass a directory written by "
            "`nnxtron train` or `nnxtron convert from-hf`, or an HF model directory"
        )
    return load_run_config(run_dir, overrides)


def load_model(path: str | Path, overrides: Iterable[str] = ()) -> Decoder:
    """The trained model at ``path``: a run directory (latest checkpoint) or an HF directory.

    The model is built from the run's config plus ``overrides`` (e.g. ``scan_layers=false`` or
    another mesh); the checkpoint is converted to that layout whatever layout wrote it."""
    path = Path(path)
    if is_hf_directory(path):
        return from_hf(path, **parse_overrides(overrides))
    cfg = run_config(path, overrides)
    graphdef, abstract_params, _, param_sh, rest_sh = model_shardings(cfg, make_mesh(cfg))
    params = load_parameters(path, cfg, abstract_params, param_sh)
    return nnx.merge(graphdef, params, init_non_params(cfg, rest_sh))
