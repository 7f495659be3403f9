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

    Routed experts: an ``hf_key`` containing ``{e}`` names one tensor per expert (the hub
    layout ``save_pretrained`` writes); the nnxtron variable stacks the experts on its
    leading axis and ``linear_in_dims`` describes one expert. ``fused_key`` is the
    transformers>=5 in-memory layout holding all experts in one tensor
    ``[E, fused_parts * out, in]``; this weight is chunk ``fused_part`` along dim 1.
    """

    path: str
    hf_key: str
    linear_in_dims: int = 0
    fused_key: str = ""
    fused_part: int = 0
    fused_parts: int = 1

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.hf_key


@dataclass(frozen=True)
class Family:
    """A decoder family: its block (dense or MoE kind), weight maps and HF config maps.

    ``make_block(cfg, rngs, moe)`` and ``layer_weights(cfg, moe)`` take the layer kind:
    ``moe=True`` for layers whose feed-forward is the routed MoE.
    """

    name: str
    hf_model_type: str
    hf_architecture: str
    make_block: Callable[[Config, nnx.Rngs, bool], nnx.Module]
    layer_weights: Callable[[Config, bool], tuple[WeightMap, ...]]
    top_weights: Callable[[Config], tuple[WeightMap, ...]]
    config_from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    config_to_hf: Callable[[Config], dict[str, Any]]


@dataclass(frozen=True)
class StackLayout:
    """One scanned stack of identical layers: the Decoder attribute (also the stack axis
    name), the HF index of its first layer, its layer count and its layer kind."""

    name: str
    first_layer: int
    num_layers: int
    moe: bool


def layer_stacks(cfg: Config) -> tuple[StackLayout, ...]:
    """The decoder's layer stacks, in order: one ``layers`` stack, or with MoE and
    ``first_num_dense_layers`` > 0 a ``dense_layers`` prefix then ``moe_layers``."""
    moe = cfg.num_experts > 1
    dense = cfg.first_num_dense_layers if moe else 0
    total = cfg.base_num_decoder_layers
    if not dense:
        return (StackLayout("layers", 0, total, moe),)
    return (StackLayout("dense_layers", 0, dense, False), StackLayout("moe_layers", dense, total - dense, True))


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


def layer_counts(cfg: Config) -> dict[str, int]:
    """Layer count of each stack, by stack name (what ``params`` layout conversions take)."""
    return {stack.name: stack.num_layers for stack in layer_stacks(cfg)}


def _load_builtin() -> None:
    if not _FAMILIES:
        from nnxtron.models import deepseek, llama, mixtral, qwen3  # noqa: F401  (each registers itself)
