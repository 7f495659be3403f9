"""Typed configuration: schema, presets and loading."""

from nnxtron.config.derived import Derived, derive
from nnxtron.config.loader import config_to_yaml, load_config, preset_names
from nnxtron.config.schema import Config

__all__ = ["Config", "Derived", "derive", "load_config", "config_to_yaml", "preset_names"]
