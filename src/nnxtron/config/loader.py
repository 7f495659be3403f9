"""Load a Config: base.yml < JAX environment < preset(model_name) < YAML file < key=value overrides."""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

import pydantic
import yaml

from nnxtron.config import maxtext
from nnxtron.config.families import rules_for
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError

PRESET_DIR = resources.files("nnxtron.config") / "presets"
# JAX's own environment variables for the compilation cache: when set, they replace the base.yml
# defaults (a user who exports them gets what they asked for), and any value given explicitly wins
ENVIRONMENT_DEFAULTS = {
    "compilation_cache_dir": "JAX_COMPILATION_CACHE_DIR",  # "" = off
    "compilation_cache_min_compile_seconds": "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
}
# settings of the machine a command runs on, not of a run: a run directory's config.yml never
# holds them and reading a run ignores them, so another person's run can never choose where
# compiled executables are loaded from
MACHINE_SETTINGS = tuple(ENVIRONMENT_DEFAULTS)
RUN_TOKENIZER_DIR = "tokenizer"  # a run's copy of its tokenizer files (data/tokenizer_files.py)
# model keys added after runs were written, with the value a stored config without the key computed
# with (from its other values): reading a run or checkpoint written before the key existed gives
# that value (``with_legacy_values``), never today's default, so the stored model stays the same
LEGACY_VALUES = {
    # before it, every tied head was HF's x @ E^T: MaxText's normalize=true for Gemma 3 only (families.py)
    "normalize_embedding_logits": lambda stored: rules_for(stored["decoder_block"]).legacy_normalize_embedding_logits,
}
MAX_YAML_BYTES = 1 << 20  # a config file or preset
MAX_YAML_VALUES = 100_000  # values after YAML aliases are expanded (an alias bomb stops here)


def base_values() -> dict[str, Any]:
    """Every key's default: ``presets/base.yml`` (a fresh copy)."""
    return _read_yaml((PRESET_DIR / "base.yml").read_text(), "base.yml")


def preset_names() -> list[str]:
    """Model presets selectable with model_name= (base is not a model preset)."""
    names = [p.name[:-4] for p in PRESET_DIR.iterdir() if p.name.endswith(".yml")]
    return sorted(n for n in names if n != "base")


def _read_yaml(text: str, origin: str) -> dict[str, Any]:
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(
            f"{origin} is {len(text)} characters long, more than a config can be ({MAX_YAML_BYTES}); check the file"
        )
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{origin} is not valid YAML{where}; fix the syntax") from None
    except RecursionError:
        raise ConfigError(f"{origin} nests too deeply to be a config; check the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{origin} must be a mapping of key: value, got {type(data).__name__}")
    _check_size(data, origin)
    return data


def _check_size(data: Any, origin: str) -> None:
    """At most ``MAX_YAML_VALUES`` values, counting an aliased value each time it is used."""
    pending, seen = [data], 0
    while pending:
        value = pending.pop()
        seen += 1
        if seen > MAX_YAML_VALUES:
            raise ConfigError(
                f"{origin} expands to more than {MAX_YAML_VALUES} values (YAML aliases?); a config is a few hundred keys"
            )
        if isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)


def read_config_file(file: str | Path) -> dict[str, Any]:
    """The key/values of a YAML config file: every key checked against the schema or, for a
    MaxText config (``config/maxtext.py``), its ``base_config:`` chain merged and every key
    checked against MaxText's table and the schema."""
    return _read_config(file)[0]


def is_maxtext_file(file: str | Path) -> bool:
    """Whether a config file is a MaxText config (``base_config:`` or MaxText-only keys: ``config/maxtext.py``)."""
    return maxtext.is_maxtext_config(_read_file(file))


def _read_config(file: str | Path) -> tuple[dict[str, Any], bool]:
    """(values, is a MaxText config)."""
    values = _read_file(file)
    if not maxtext.is_maxtext_config(values):
        _check_keys(values, f"config file '{file}'")
        return values, False
    values = maxtext.read_chain(Path(file), _read_file)
    for key in values:
        maxtext.check_key(key, f"config file '{file}'")
    return values, True


def _read_file(file: str | Path) -> dict[str, Any]:
    path = Path(file)
    shown = str(file)[:200]
    try:
        if not path.exists():
            raise ConfigError(f"config file {shown!r} does not exist; pass a YAML file or only key=value overrides")
        if path.is_dir():
            raise ConfigError(f"config file {shown!r} is a directory; pass a YAML file")
        if not path.is_file():
            raise ConfigError(f"config file {shown!r} is not a regular file (a FIFO or device?); pass a YAML file")
        with path.open("rb") as handle:
            text = handle.read(MAX_YAML_BYTES + 1).decode("utf-8", errors="replace")
    except OSError as err:  # a name too long, a directory without permission...
        raise ConfigError(
            f"cannot read config file {str(file)[:80]!r} ({err.strerror or err}); pass a readable YAML file"
        ) from None
    return _read_yaml(text, f"config file '{file}'")


def _check_keys(values: dict[str, Any], origin: str, maxtext_keys: bool = False) -> None:
    """Every key is nnxtron's (or, with ``maxtext_keys``, in MaxText's table: config/maxtext_keys.py)."""
    valid = list(Config.model_fields)
    for key in values:
        if key not in Config.model_fields and not (maxtext_keys and key in maxtext.KEYS):
            close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else "; `nnxtron config show` lists every key"
            raise ConfigError(f"unknown config key {str(key)!r} in {origin}{hint}")


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """Parse ``key=value`` strings; values are YAML scalars or flow lists (``[a, b]``)."""
    values: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        field = Config.model_fields.get(key)
        if field is not None and field.annotation is str:
            values[key] = raw  # strings stay verbatim (run_name=007 is "007", not 7)
            continue
        try:
            values[key] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            values[key] = raw
        if values[key] is None or (
            field is not None and "tuple[str" in str(field.annotation) and not isinstance(values[key], list)
        ):
            values[key] = raw
    _check_keys(values, "command-line overrides", maxtext_keys=True)
    return values


def _environment_defaults() -> dict[str, Any]:
    """The ``ENVIRONMENT_DEFAULTS`` keys whose environment variable is set."""
    values: dict[str, Any] = {}
    for key, variable in ENVIRONMENT_DEFAULTS.items():
        raw = os.environ.get(variable)
        if raw is None:
            continue
        if Config.model_fields[key].annotation is str:
            values[key] = raw
            continue
        try:
            values[key] = float(raw)
        except ValueError:
            raise ConfigError(
                f"environment variable {variable}={raw[:80]!r} (the default of {key}) is not a number; fix or unset it"
            ) from None
    return values


def _load_preset(name: str) -> dict[str, Any]:
    if name not in preset_names():  # a preset is a name, never a path
        close = difflib.get_close_matches(name, preset_names(), n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else f"; choose one of {', '.join(preset_names())}"
        raise ConfigError(f"unknown model_name {name!r}{hint}")
    values = _read_yaml((PRESET_DIR / f"{name}.yml").read_text(), f"preset {name}.yml")
    _check_keys(values, f"preset {name}.yml")
    return values


def _format_validation_error(err: pydantic.ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    got = first.get("input")
    shown = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    return f"config key '{loc.split('.')[0]}': {msg}{shown}"


def load_config(
    file: str | Path | None = None,
    overrides: Iterable[str] = (),
    values: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
) -> Config:
    """Resolve the configuration: base.yml < environment < preset(model_name) < defaults <
    file < values < overrides.

    ``values`` are typed key/values from code (e.g. a converted HF config.json);
    ``defaults`` too, but under the file (the model an ``init_from`` brings);
    ``overrides`` are ``key=value`` strings from the command line; the environment is
    JAX's compilation-cache variables (``ENVIRONMENT_DEFAULTS``). A MaxText config file
    resolves as ``config/maxtext.py`` says (``load_config_report`` also returns what it ignored).
    """
    return load_config_report(file, overrides, values, defaults)[0]


def load_config_report(
    file: str | Path | None = None,
    overrides: Iterable[str] = (),
    values: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
) -> tuple[Config, maxtext.Report]:
    """``load_config`` and the report of the MaxText keys it ignored (empty without any)."""
    file_values, is_maxtext = _read_config(file) if file is not None else ({}, False)
    code_values, under = dict(values or {}), dict(defaults or {})
    _check_keys({**code_values, **under}, "the values passed from code")
    cli_values = parse_overrides(overrides)
    report = maxtext.Report(maxtext_file=is_maxtext)
    resolved = base_values()
    resolved.update(_environment_defaults())
    if is_maxtext:
        file_values = {
            **maxtext.DEFAULTS,
            **maxtext.NNXTRON_KEYS_UNDER_MAXTEXT,
            **file_values,
        }  # MaxText's base.yml under the file
    merged = {**file_values, **code_values, **cli_values}
    model_name = str(merged.get("model_name", resolved["model_name"]))
    preset = _load_preset(model_name) if model_name != "default" else {}
    if is_maxtext:
        preset = maxtext.preset_under_maxtext(model_name, preset)
    if is_maxtext or cli_values.get("override_model_config") is False:
        maxtext.check_model_overrides(model_name, preset, cli_values, {**file_values, **cli_values}, is_maxtext)
    if is_maxtext:
        ctx = {**file_values, **preset, **under, **code_values, **cli_values}
        maxtext.check_refused({**file_values, **cli_values}, ctx)
        shadowed = {k: v for k, v in file_values.items() if k not in cli_values}  # the command line decides those
        resolved.update(maxtext.translate(shadowed, ctx, report, maxtext_meaning=True))
        resolved.update(preset)
        resolved.update(under)
        resolved.update(code_values)
    else:
        resolved.update(preset)
        resolved.update(under)
        resolved.update({**file_values, **code_values})
        ctx = {**maxtext.DEFAULTS, **resolved, **cli_values}
        maxtext.check_refused({k: v for k, v in cli_values.items() if k in maxtext.MAXTEXT_ONLY}, ctx)
    resolved.update(maxtext.translate(cli_values, ctx, report, maxtext_meaning=is_maxtext))
    try:
        return Config(**resolved), report
    except pydantic.ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def config_to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (lists rather than tuples), in schema order."""
    return _to_yaml(cfg.model_dump(mode="json"))


def _to_yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)


def run_config_to_yaml(cfg: Config) -> str:
    """A run directory's ``config.yml``: the resolved config without the ``MACHINE_SETTINGS``."""
    return _to_yaml({key: value for key, value in cfg.model_dump(mode="json").items() if key not in MACHINE_SETTINGS})


def is_hf_directory(path: str | Path) -> bool:
    """An HF model directory (``config.json``), not an nnxtron run (``config.yml``)."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / "config.yml").is_file()


def with_legacy_values(stored: dict[str, Any]) -> dict[str, Any]:
    """Stored model values (a run's ``config.yml``, a checkpoint's fingerprint) with each
    ``LEGACY_VALUES`` key they lack (written before it existed) at the value they were computed
    with; values without a ``decoder_block`` are not a model's and are returned as they are."""
    if "decoder_block" not in stored:
        return dict(stored)
    return {**{key: value(stored) for key, value in LEGACY_VALUES.items() if key not in stored}, **stored}


def run_values(run_dir: str | Path) -> dict[str, Any]:
    """The stored values of a run directory's ``config.yml`` without the ``MACHINE_SETTINGS``;
    a run that carries its tokenizer (``<run>/tokenizer/``) reads it from there, wherever
    the run has been moved."""
    run_dir = Path(run_dir)
    values = {k: v for k, v in read_config_file(run_dir / "config.yml").items() if k not in MACHINE_SETTINGS}
    values = with_legacy_values(values)
    if (run_dir / RUN_TOKENIZER_DIR).is_dir() and values.get("tokenizer_type", "byte") != "byte":
        values["tokenizer_path"] = str(run_dir / RUN_TOKENIZER_DIR)
    return values


def load_run_config(run_dir: str | Path, overrides: Iterable[str] = ()) -> Config:
    """The config a run directory was written with (``run_values``) plus ``overrides``; the
    ``MACHINE_SETTINGS`` come from this machine (base.yml, the environment, overrides), never
    from the run (an older run's ``config.yml`` may hold them: they are ignored)."""
    return load_config(None, overrides, values=run_values(run_dir))
