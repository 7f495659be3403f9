"""The one registry of decoder families: decoder_block name -> Family."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from flax import nnx

from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.layers.norms import RMSNorm
from nnxtron.models.pattern import LayerKind


def rms_norm(cfg: Config, dim: int | None = None, zero_centered: bool = False) -> RMSNorm:
    """An RMSNorm over ``dim`` (default ``base_emb_dim``) with the config's eps and dtypes
    (``zero_centered``: Gemma's ``1 + w``)."""
    return RMSNorm(
        dim or cfg.base_emb_dim,
        eps=cfg.normalization_layer_epsilon,
        dtype=jnp.dtype(cfg.dtype),
        weight_dtype=jnp.dtype(cfg.weight_dtype),
        zero_centered=zero_centered,
    )


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

    Other layouts: ``conv1d`` marks a tensor with the nnxtron element order, only
    reshaped — HF ``Conv1D.weight`` ``[in, out]`` (GPT-2) is ``[prod(in dims), prod(out
    dims)]`` with ``linear_in_dims`` input dims, a fused bias is flat. ``split_parts`` > 1
    marks an HF tensor that concatenates that many variables along its last axis (Llama 4
    ``experts.gate_up_proj [E, D, 2F]``); this variable is chunk ``split_part``.
    """

    path: str
    hf_key: str
    linear_in_dims: int = 0
    fused_key: str = ""
    fused_part: int = 0
    fused_parts: int = 1
    conv1d: bool = False
    split_part: int = 0
    split_parts: int = 1

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.hf_key


@dataclass(frozen=True)
class Family:
    """A decoder family: its block (dense or MoE kind), weight maps and HF config maps.

    ``make_block(cfg, rngs, kind)`` and ``layer_weights(cfg, kind)`` take the layer's
    ``LayerKind`` (MoE or dense feed-forward, attention mask kind, RoPE or NoPE).
    ``hf_layer_prefix`` is the HF name prefix of layer ``{i}``; ``make_final_norm(cfg)``
    builds the norm before the output head; ``scale_embeddings`` multiplies the token
    embeddings by ``sqrt(emb_dim)`` (Gemma). ``hyper_connections``: the residual is
    ``mhc_expansion_rate`` streams, collapsed by a ``HyperHead`` before the final norm;
    ``block_takes_tokens``: blocks are called with the token ids as a fourth argument
    (DeepSeek-V4 hash routing).
    """

    name: str
    hf_model_type: str
    hf_architecture: str
    make_block: Callable[[Config, nnx.Rngs, LayerKind], nnx.Module]
    layer_weights: Callable[[Config, LayerKind], tuple[WeightMap, ...]]
    top_weights: Callable[[Config], tuple[WeightMap, ...]]
    config_from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    config_to_hf: Callable[[Config], dict[str, Any]]
    make_final_norm: Callable[[Config], nnx.Module] = rms_norm
    hf_layer_prefix: str = "model.layers.{i}."
    scale_embeddings: bool = False
    hyper_connections: bool = False
    block_takes_tokens: bool = False


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
        from nnxtron.models import deepseek, deepseek4, gemma3, gpt3, llama, llama4, mixtral, qwen3  # noqa: F401  (each registers itself)
