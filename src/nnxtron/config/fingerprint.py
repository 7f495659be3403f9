"""A model's fingerprint: the values of every key that changes the function the model computes.

Those keys are the ones the schema marks ``Model[...]`` (architecture, RoPE, attention and
routing settings, the dtypes), so the set is read from the schema, never kept by hand.
A run records its fingerprint in ``config.yml`` and in every checkpoint's meta; resuming,
``load_parameters_path``, ``generate`` and ``convert`` compare it with the config they
run and refuse a difference with one line naming the keys. Every other key (steps,
learning rate, mesh, remat, ``scan_layers``...) may change between invocations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nnxtron.config.loader import MACHINE_SETTINGS, with_legacy_values
from nnxtron.config.schema import MODEL_KEY, Config
from nnxtron.errors import ConfigError

MODEL_KEYS: tuple[str, ...] = tuple(name for name, field in Config.model_fields.items() if MODEL_KEY in field.metadata)


def fingerprint(cfg: Config) -> dict[str, Any]:
    """``{key: value}`` of the model keys (JSON values, as ``config.yml`` and checkpoints hold them)."""
    values = cfg.model_dump(mode="json", include=set(MODEL_KEYS))
    return {key: values[key] for key in MODEL_KEYS}


def of_stored(values: Mapping[str, Any]) -> dict[str, Any]:
    """The fingerprint inside stored config values (a ``config.yml`` or a checkpoint's config or
    fingerprint); keys it lacks (written before the key existed) are left out and not compared,
    except ``LEGACY_VALUES`` keys (``config/loader.py``), which take the value the model had then."""
    values = with_legacy_values(dict(values))
    return {key: values[key] for key in MODEL_KEYS if key in values}


def changed_keys(stored: Mapping[str, Any], cfg: Config) -> list[str]:
    """The model keys whose stored value differs from ``cfg``'s."""
    current = fingerprint(cfg)
    return [key for key in MODEL_KEYS if key in stored and _normal(stored[key]) != current[key]]


def other_changes(stored: Mapping[str, Any], cfg: Config) -> list[str]:
    """``key old -> new`` for every other key whose stored value differs (what a resume changed;
    this machine's settings are not the run's and are left out)."""
    current = cfg.model_dump(mode="json")
    ignored = {*MODEL_KEYS, *MACHINE_SETTINGS}
    keys = [key for key in current if key in stored and key not in ignored and _normal(stored[key]) != current[key]]
    return [f"{key} {_normal(stored[key])!r} -> {current[key]!r}" for key in keys]


def check_same_model(stored: Mapping[str, Any], cfg: Config, origin: str, fix: str) -> None:
    """Raise one line when ``cfg`` computes another model than the one ``origin`` was created with."""
    keys = changed_keys(stored, cfg)
    if keys:
        current = fingerprint(cfg)
        was = ", ".join(f"{key}={_normal(stored[key])!r}" for key in keys)
        now = ", ".join(f"{key}={current[key]!r}" for key in keys)
        raise ConfigError(f"{origin} was created with {was} but this config has {now}; {fix}")


def _normal(value: Any) -> Any:
    """Stored YAML/JSON values as ``model_dump(mode="json")`` gives them (tuples are lists)."""
    return list(value) if isinstance(value, tuple) else value
