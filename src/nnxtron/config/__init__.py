"""Typed configuration: schema, presets and loading."""

from nnxtron.config import checks, schema
from nnxtron.config.derived import Derived, derive
from nnxtron.config.loader import config_to_yaml, load_config, preset_names
from nnxtron.config.schema import Config

# the schema sits at the bottom of config/ and imports no check (checks.py reads layout and
# pipeline, which read Config): the package wires them in, so every Config runs them
schema.register_cross_key_check(checks.check_combinations)

__all__ = ["Config", "Derived", "derive", "load_config", "config_to_yaml", "preset_names"]
