"""A model's weights from an nnxtron checkpoint: its parameters and its model state.

Model state is what a model computes with that is not a trained parameter: DeepSeek's
router correction biases (``RouterBias``) and DeepSeek-V4's token -> expert hash tables
(``HashTable``). It travels with the parameters: a training checkpoint holds it in its
``train`` item, a converted HF checkpoint (``convert from-hf``) holds only it there.
The expert-load counters (``ExpertLoad``) are statistics of a run and start at zero.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from flax import nnx

from nnxtron.config.fingerprint import check_same_model, of_stored
from nnxtron.config.loader import is_hf_directory
from nnxtron.config.schema import Config
from nnxtron.errors import CheckpointError
from nnxtron.layers.moe import ExpertLoad
from nnxtron.models.build import abstract_model
from nnxtron.params import flatten
from nnxtron.train.checkpoint import Checkpointer
from nnxtron.train.checksum import LORA_BASE_FILE, check_recorded
from nnxtron.train.state import init_frozen

# reads a new run's starting (params, model state) into the given abstract trees and shardings
# (``{"params": ..., "rest": ...}``): init_from, or a MaxText checkpoint (convert/runs.init_params)
ParamsLoader = Callable[[dict, dict], tuple[Any, Any]]


def checkpoint_model(meta: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint a checkpoint was written with (older ones: from its config; converted
    HF checkpoints of older versions have none, and nothing is compared)."""
    model = meta.get("model")
    if isinstance(model, dict):
        return of_stored(model)  # one written before a model key existed: the value it had then
    config = meta.get("config")
    return of_stored(config) if isinstance(config, dict) else {}


def _checkpoint(path: str | Path) -> tuple[Checkpointer, int]:
    """The checkpointer and step of a run directory, its checkpoints/ or one step."""
    directory = Path(path)
    if is_hf_directory(directory):
        raise CheckpointError(
            f"'{path}' is an HF model directory, not an nnxtron checkpoint; start from it with init_from={path} "
            "(it brings the model's config and tokenizer too)"
        )
    if (directory / "items").is_dir() or any(directory.glob("[0-9]*/items")):
        raise CheckpointError(
            f"'{path}' is a MaxText checkpoint: `nnxtron train load_parameters_path=...` converts it on load (in Python "
            "pass init_params=nnxtron.convert.runs.init_params(cfg)); or convert it once with `nnxtron convert from-maxtext`"
        )
    if (directory / "checkpoints").is_dir():
        directory = directory / "checkpoints"
    step = None
    if directory.name.isdigit() and (directory / "params").exists():
        step, directory = int(directory.name), directory.parent
    ckpt = Checkpointer(directory, max_to_keep=1_000_000, create=False)
    step = ckpt.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint found under '{path}'; point load_parameters_path at a run or checkpoint directory")
    return ckpt, step


def model_state_needed(cfg: Config) -> bool:
    """Whether the model has state a checkpoint must provide (router biases, hash tables)."""
    state = nnx.state(abstract_model(cfg), nnx.Not(nnx.Any(nnx.Param, ExpertLoad)))
    return bool(flatten(nnx.to_pure_dict(state)))


def load_weights(path: str | Path, cfg: Config, abstract: dict[str, Any], shardings: dict[str, Any]) -> tuple[Any, Any]:
    """``(params, model state)`` from a run directory, its checkpoints/ or one step.

    ``abstract`` / ``shardings``: ``{"params": ..., "rest": ...}`` of the model ``cfg``
    describes (``"rest"`` may be left out: then only the parameters are read and the model
    state is None). The checkpoint may be a full training one or a converted one, written
    with either ``scan_layers`` and on any mesh: it is converted to the layout asked for. It
    must have been written for the same model (``config.fingerprint``)."""
    ckpt, step = _checkpoint(path)
    meta = ckpt.read_meta(step)
    fix = f"start from it with init_from={path} to take its model, or use the model settings it was written with"
    check_same_model(checkpoint_model(meta), cfg, f"checkpoint '{ckpt.directory / str(step)}'", fix)
    wanted = {key: abstract[key] for key in ("params", "rest") if key in abstract}
    if "rest" in wanted and not flatten(wanted["rest"]):
        wanted.pop("rest")  # a model without state (no MoE router biases, no hash tables)
    if "rest" in wanted and "train" not in meta.get("items", []):
        if model_state_needed(cfg):
            raise CheckpointError(
                f"checkpoint '{ckpt.directory / str(step)}' holds no model state (router biases, hash tables): it was "
                "converted by an older nnxtron; convert the HF model again"
            )
        wanted.pop("rest")  # a converted checkpoint of a model with only counters: they start at zero
    restored, _ = ckpt.restore(step, wanted, {key: shardings[key] for key in wanted}, subset=True)
    return restored["params"], restored.get("rest")


def starting_weights(
    cfg: Config, loader: ParamsLoader | None, abstract: dict[str, Any], shardings: dict[str, Any]
) -> tuple[Any, Any] | None:
    """The ``(params, model state or None)`` a run starts from: read by ``loader`` (init_from, a
    MaxText checkpoint), else the nnxtron checkpoint at ``load_parameters_path``; None: a seeded init."""
    if loader is not None:
        return loader(abstract, shardings)
    if cfg.load_parameters_path:
        return load_weights(cfg.load_parameters_path, cfg, abstract, shardings)
    return None


def lora_base(
    cfg: Config,
    run_dir: str | Path,
    shardings: Any,
    weights: tuple[Any, Any] | None,
    what: str,
    *,
    record_step: int | None = None,
) -> Any:
    """A LoRA run's frozen base, placed in ``shardings``: the parameters of ``weights``
    (``starting_weights``), else the seeded init; checked against the checksum ``run_dir``
    recorded when it started (written now when ``record_step`` is given and there is none)."""
    base = init_frozen(cfg, shardings, weights[0] if weights else None)
    check_recorded(run_dir, LORA_BASE_FILE, base, what, record_step=record_step)
    return base
