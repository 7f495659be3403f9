"""The one registry of decoder families: decoder_block name -> Family."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flax import nnx

from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError


@dataclass(frozen=True)
class WeightMap:
    """One parameter's HF name and layout.

    ``path`` is the nnxtron path inside a block (or the model, for top-level weights),
    ``hf_key`` the HF name (per-layer keys are relative to ``model.layers.{i}.``) and
    ``linear_in_dims`` > 0 marks an HF ``nn.Linear.weight`` [out, in] whose nnxtron
    kernel is ``[*in, *out]`` with that many input dims; 0 means the same layout.
    """

    path: str
    hf_key: str
    linear_in_dims: int = 0


@dataclass(frozen=True)
class Family:
    name: str
    hf_model_type: str
    hf_architecture: str
    make_block: Callable[[Config, nnx.Rngs], nnx.Module]
    layer_weights: tuple[WeightMap, ...]
    top_weights: Callable[[Config], tuple[WeightMap, ...]]
    config_from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    config_to_hf: Callable[[Config], dict[str, Any]]


_FAMILIES: dict[str, Family] = {}


def register(block_names: tuple[str, ...], family: Family) -> None:
    for name in block_names:
        if name in _FAMILIES:
            raise ValueError(f"decoder_block '{name}' registered twice")
        _FAMILIES[name] = family


def family_for(decoder_block: str) -> Family:
    _load_builtin()
    if decoder_block not in _FAMILIES:
        raise ConfigError(f"decoder_block '{decoder_block}' is not registered; choose one of {sorted(_FAMILIES)}")
    return _FAMILIES[decoder_block]


def family_for_hf(model_type: str) -> tuple[str, Family]:
    """The decoder_block name and family for an HF ``model_type``."""
    _load_builtin()
    for name, family in _FAMILIES.items():
        if family.hf_model_type == model_type and family.name == name:
            return name, family
    supported = sorted({f.hf_model_type for f in _FAMILIES.values()})
    raise ConfigError(f"HF model_type '{model_type}' is not supported; supported: {', '.join(supported)}")


def _load_builtin() -> None:
    if not _FAMILIES:
        from nnxtron.models import llama  # noqa: F401  (registers itself)
