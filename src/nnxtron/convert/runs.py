"""Opening trained models: a run directory (config.yml + checkpoints) or an HF directory, to
sample from, export, or start a fine-tuning run from (``init_from``)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from flax import nnx

from nnxtron.config.finetune import finetune_defaults
from nnxtron.config.finetune import startup_lines as finetune_lines
from nnxtron.config.fingerprint import MODEL_KEYS, check_same_model, fingerprint
from nnxtron.config.loader import (
    is_hf_directory,
    is_maxtext_file,
    load_config_report,
    load_run_config,
    parse_overrides,
    run_values,
)
from nnxtron.config.schema import Config
from nnxtron.convert.hf import check_tokenizer, from_hf, hf_config, load_hf_weights
from nnxtron.convert.maxtext import is_maxtext_checkpoint, load_maxtext_model
from nnxtron.errors import CheckpointError, ConfigError
from nnxtron.layers.lora import base_config, merge_adapters, with_adapters
from nnxtron.models.build import abstract_model
from nnxtron.models.decoder import Decoder
from nnxtron.parallel.mesh import make_mesh
from nnxtron.train.run_dir import resolve_run_dir
from nnxtron.train.state import frozen_shardings, init_non_params, model_shardings
from nnxtron.train.weights import ParamsLoader, load_weights, lora_base, starting_weights

__all__ = [
    "check_output_directory",
    "is_hf_directory",
    "run_config",
    "load_model",
    "model_from_state",
    "init_config",
    "init_config_report",
    "init_params",
]

# HF weights are cast on reading: a fine-tuning run chooses its own precision
FREE_WITH_HF_SOURCE = ("dtype", "weight_dtype")


def check_output_directory(dest: str | Path) -> None:
    """Raise one line now, before a model is loaded, when an export could not be written to
    ``dest``: it, or the nearest folder above it that exists, must be a directory this process
    can create files in. Nothing is created."""
    path = Path(dest).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
    reason = None
    if not existing.is_dir():
        reason = f"'{existing}' is a file, not a directory"
    else:
        try:  # a read-only or full file system, missing permissions: the probe says which
            with tempfile.TemporaryFile(dir=existing, prefix=".nnxtron-probe-"):
                pass
        except OSError as err:
            reason = f"cannot write in '{existing}' ({err.strerror or err})"
    if reason is not None:
        raise CheckpointError(f"output directory '{dest}': {reason}; choose a writable directory")


def run_config(path: str | Path, overrides: Iterable[str] = ()) -> Config:
    """The config a run was created with (``<run>/config.yml``), plus overrides."""
    run_dir = Path(path)
    _check_run_dir(run_dir)
    return load_run_config(run_dir, overrides)


def _check_run_dir(run_dir: Path) -> None:
    if not (run_dir / "config.yml").is_file():
        raise CheckpointError(
            f"'{run_dir}' is not an nnxtron run directory (no config.yml); pass a directory written by "
            "`nnxtron train` or `nnxtron convert from-hf`, or an HF model directory"
        )


def check_text_tokenizer(path: str | Path, overrides: Iterable[str] = ()) -> None:
    """Before a command turns the model at ``path`` into text (generate, eval, serve): an HF
    directory without tokenizer files is refused unless ``overrides`` choose a tokenizer
    (``check_tokenizer``); so is a run made from such a directory on ids alone
    (``dataset_type=synthetic``), which records no tokenizer of that model either."""
    given = parse_overrides(list(overrides))
    if is_hf_directory(path):
        check_tokenizer(path, given)
        return
    cfg = run_config(Path(path), list(overrides))
    if cfg.init_from and not cfg.tokenizer_path and is_hf_directory(cfg.init_from):
        check_tokenizer(cfg.init_from, given)


def load_model(path: str | Path, overrides: Iterable[str] = ()) -> Decoder:
    """The trained model at ``path``: a run directory (latest checkpoint) or an HF directory.

    The model is built from the run's config plus ``overrides`` (e.g. ``scan_layers=false`` or
    another mesh); the checkpoint is converted to that layout whatever layout wrote it."""
    path = Path(path)
    if is_hf_directory(path):
        return from_hf(path, **parse_overrides(overrides))
    cfg = run_config(path, overrides)
    mesh = make_mesh(cfg)
    graphdef, abstract_params, abstract_rest, param_sh, rest_sh = model_shardings(cfg, mesh)
    params, rest = load_weights(
        path, cfg, {"params": abstract_params, "rest": abstract_rest}, {"params": param_sh, "rest": rest_sh}
    )
    rest = init_non_params(cfg, rest_sh) if rest is None else rest
    if not cfg.lora_rank:
        return nnx.merge(graphdef, params, rest)
    # a LoRA run's checkpoints hold the adapters: merged into the base it started from
    abstract_base, base_sh = frozen_shardings(cfg, mesh)
    weights = starting_weights(cfg, init_params(cfg), {"params": abstract_base}, {"params": base_sh})
    base = lora_base(cfg, path, base_sh, weights, f"LoRA run '{path}': the base weights")
    return model_from_state(cfg, params, rest, base)


def model_from_state(cfg: Config, params: Any, rest: Any, frozen: Any = None) -> Decoder:
    """The model of a training state's pure dicts: ``params`` and ``rest`` (other state); with
    ``lora_rank`` > 0 ``params`` are the adapters, merged into ``frozen`` (the base weights) as a
    plain model of the base config."""
    if not cfg.lora_rank:
        return nnx.merge(nnx.split(abstract_model(cfg))[0], params, rest)
    if frozen is None:
        raise ValueError("a LoRA state needs its frozen base weights to form a model")
    graphdef = nnx.split(abstract_model(base_config(cfg)))[0]
    return nnx.merge(graphdef, merge_adapters(with_adapters(frozen, params), cfg.lora_alpha / cfg.lora_rank), rest)


def _source_model(source: Path, given: dict[str, Any]) -> dict[str, Any]:
    """The model keys and tokenizer of ``init_from``: every model key's value (so no preset
    or default can change the model) and where its tokenizer is read from."""
    if is_hf_directory(source):
        cfg = hf_config(source, **{k: v for k, v in given.items() if k in ("tokenizer_type", "tokenizer_path")})
        values = {k: v for k, v in fingerprint(cfg).items() if k not in FREE_WITH_HF_SOURCE}
        return {**values, "tokenizer_path": cfg.tokenizer_path}
    if not source.is_dir():
        raise ConfigError(f"init_from='{source}' does not exist; pass an HF model directory or an nnxtron run directory")
    _check_run_dir(source)
    stored = run_values(source)
    _refuse_lora_source(source, stored)
    return {key: stored[key] for key in (*MODEL_KEYS, "tokenizer_path") if key in stored}


def _refuse_lora_source(source: Path, stored: dict[str, Any]) -> None:
    if stored.get("lora_rank"):
        raise ConfigError(
            f"init_from='{source}' is a LoRA run (its checkpoints hold adapters only); export the merged model with "
            f"`nnxtron convert to-hf {source} DIR` and start from DIR"
        )


def init_config(file: str | None, overrides: Iterable[str], given: dict[str, Any]) -> Config:
    """The config of a run that starts from ``init_from`` (``init_config_report`` without its start-up lines)."""
    return init_config_report(file, overrides, given)[0]


def init_config_report(file: str | None, overrides: Iterable[str], given: dict[str, Any]) -> tuple[Config, list[str]]:
    """The config of a run that starts from ``init_from`` (``given``: the file's and the
    command line's values) and its start-up lines: the source's model keys and tokenizer
    under the user's values. A model key the user sets to another value than the source's is
    refused (one line naming it); training keys (steps, learning rate, data, mesh...) are the
    user's, and those the user leaves unset take the fine-tuning defaults
    (``config/finetune.py``), or, when the run already exists (a resume), its recorded values."""
    source = Path(str(given["init_from"])).expanduser()
    values = _source_model(source, given)
    if "model_name" in given:
        raise ConfigError(
            f"model_name={given['model_name']} and init_from are both set; init_from brings the model "
            f"('{source}'): drop model_name"
        )
    maxtext_file = file is not None and is_maxtext_file(file)
    defaults = finetune_defaults(given, None, maxtext_file)
    cfg, report = load_config_report(file, overrides, defaults={**{d.key: d.value for d in defaults}, **values})
    recorded = _recorded_values(resolve_run_dir(cfg)) if cfg.run_name else None
    if recorded is not None:  # a resume: the keys the user leaves unset keep the run's values
        defaults = finetune_defaults(given, recorded, maxtext_file)
        cfg, report = load_config_report(file, overrides, defaults={**{d.key: d.value for d in defaults}, **values})
    if is_hf_directory(source) and cfg.dataset_type != "synthetic":  # its corpus is text
        check_tokenizer(source, given)
    fix = "the model comes from init_from: drop these keys, or start a new model without init_from"
    check_same_model({k: v for k, v in values.items() if k in MODEL_KEYS}, cfg, f"init_from '{source}'", fix)
    return cfg, [*report.startup_lines(cfg), *finetune_lines(defaults, cfg)]


def _recorded_values(run_dir: Path) -> dict[str, Any] | None:
    """The values of an existing run's ``config.yml`` (None: no run there yet, or a file the
    training loop will refuse with its own message)."""
    try:
        stored = yaml.safe_load((run_dir / "config.yml").read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    return stored if isinstance(stored, dict) else None


def init_params(cfg: Config) -> ParamsLoader | None:
    """How a new run reads its starting weights from ``cfg.init_from``, or from a MaxText
    checkpoint at ``cfg.load_parameters_path`` (converted on load); None: neither (an nnxtron
    checkpoint at ``load_parameters_path`` is read by the training loop itself)."""
    if cfg.load_parameters_path and is_maxtext_checkpoint(cfg.load_parameters_path):
        source_dir = Path(cfg.load_parameters_path).expanduser()

        def from_maxtext_checkpoint(abstract: dict, shardings: dict) -> tuple[Any, Any]:
            del abstract, shardings  # init_state places them
            _, params, rest = nnx.split(load_maxtext_model(source_dir, base_config(cfg)), nnx.Param, ...)
            return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

        return from_maxtext_checkpoint
    if not cfg.init_from:
        return None
    source = Path(cfg.init_from).expanduser()
    if is_hf_directory(source):

        def from_hf_directory(abstract: dict, shardings: dict) -> tuple[Any, Any]:
            del abstract, shardings  # init_state places them
            _, params, rest = nnx.split(load_hf_weights(source, base_config(cfg)), nnx.Param, ...)
            return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

        return from_hf_directory

    _check_run_dir(source)
    _refuse_lora_source(source, run_values(source))

    def from_run(abstract: dict, shardings: dict) -> tuple[Any, Any]:
        return load_weights(source, cfg, abstract, shardings)

    return from_run
