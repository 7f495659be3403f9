"""LoRA: a trainable low-rank update ``scale * x @ A @ B`` beside a frozen dense kernel.

With ``lora_rank`` r > 0 every ``Linear`` whose module path matches ``lora_target_modules``
holds two extra parameters of type ``nnx.LoRAParam``: ``lora_a`` ``[*in, r]`` (uniform in
``±1/sqrt(fan_in)``, as PEFT's Kaiming init) and ``lora_b`` ``[r, *out]`` (zeros), so the
model equals its base at the start. ``scale = lora_alpha / r`` (PEFT's default).

The adapters are made when the ``Linear`` is made, from its own kernel's key folded with a
constant: they are stacked, sharded (A like the kernel's input axes, B like its output
axes, the rank unsharded) and scanned exactly like the kernel, and every layout of the
layers (scanned, unrolled, pipelined) draws the same values. Every ``Linear`` gets them while
the model is built; ``select_targets`` then removes those whose path does not match. The
path is matched without layer indices (``layers/layers/attention/query`` for a scanned and
an unrolled stack alike), so the choice never depends on the layout.

Training then differentiates and updates only the ``nnx.LoRAParam``s (``train/state.py``).
``merge_adapters`` folds them into the kernels for export and inference.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnxtron.config.checks import LORA_DEFAULTS
from nnxtron.errors import ConfigError
from nnxtron.layers.dropout import dropout
from nnxtron.parallel.row_keys import current_layer_keys
from nnxtron.scoped import scoped

ADAPTERS = ("lora_a", "lora_b")
_A_KEY_SALT = 0x4C6F5241  # folded into the kernel's key for A's draw ("LoRA")
LORA_SITES = 1 << 20  # dropout site ids of the adapters, within a layer: this + a hash of the last two path parts


@dataclass(frozen=True)
class LoRASettings:
    rank: int
    alpha: float
    target_modules: str  # regex, searched in each Linear's module path without layer indices
    dropout: float = 0.0  # on the adapters' input, in training (per row, layer and adapted layer)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def settings_of(cfg: Any) -> LoRASettings | None:
    """The LoRA of a config (None: ``lora_rank`` = 0, no adapters)."""
    if not cfg.lora_rank:
        return None
    return LoRASettings(cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules, cfg.lora_dropout)


def base_config(cfg: Any) -> Any:
    """The config of the model without adapters (the frozen base a LoRA run starts from)."""
    return cfg.model_copy(update={"lora_rank": 0, **LORA_DEFAULTS}) if cfg.lora_rank else cfg


def trainable(cfg: Any) -> Any:
    """The parameters a run trains: the adapters with LoRA, else every ``nnx.Param``."""
    return nnx.LoRAParam if cfg.lora_rank else nnx.Param


FROZEN = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))  # with LoRA: the base model's parameters


_building: contextvars.ContextVar[LoRASettings | None] = contextvars.ContextVar("nnxtron_lora_building", default=None)


def building(settings: LoRASettings | None) -> contextlib.AbstractContextManager[None]:
    """While a model is built: every ``Linear`` made inside gets adapters of ``settings``."""
    return scoped(_building, settings)


def adapters_for(
    kernel_key: jax.Array, in_shape: Sequence[int], out_shape: Sequence[int], axes: Sequence[str | None], weight_dtype: Any
) -> tuple[nnx.LoRAParam, nnx.LoRAParam, float, float] | None:
    """``(A, B, scale, dropout)`` for a ``Linear`` being built now, or None when no LoRA is being built."""
    settings = _building.get()
    if settings is None:
        return None
    r, n_in = settings.rank, len(in_shape)
    bound = 1.0 / math.sqrt(math.prod(in_shape))
    a = jax.random.uniform(jax.random.fold_in(kernel_key, _A_KEY_SALT), (*in_shape, r), jnp.float32, -bound, bound)
    lora_a = nnx.LoRAParam(a.astype(weight_dtype), out_sharding=(*axes[:n_in], None))
    lora_b = nnx.LoRAParam(jnp.zeros((r, *out_shape), weight_dtype), out_sharding=(None, *axes[n_in:]))
    return lora_a, lora_b, settings.scale, settings.dropout


def layout_free_path(path: Sequence[Any]) -> str:
    """A module path with the layer indices of unrolled stacks left out."""
    return "/".join(str(part) for part in path if not isinstance(part, int) and not str(part).isdigit())


def select_targets(model: nnx.Module, settings: LoRASettings | None, layer_parts: tuple[str, ...] = ()) -> list[str]:
    """Keep the adapters of the ``Linear``s whose path matches ``settings.target_modules`` and
    remove the others; the matched paths (without layer indices). A regex that matches no
    ``Linear`` is a ``ConfigError`` naming the paths it could have matched. With dropout the
    adapted layers must lie under ``layer_parts`` (the decoder's layer stacks and MTP depths,
    where the per-row dropout keys are: ``parallel.row_keys.layer_keys``), and each gets its dropout site."""
    if settings is None:
        return []
    pattern = re.compile(settings.target_modules)
    kept, candidates = set(), set()
    for path, node in nnx.iter_graph(model):
        if not hasattr(node, "lora_a"):
            continue
        where = layout_free_path(path)
        candidates.add(where)
        if pattern.search(where):
            kept.add(where)
            node.lora_site = LORA_SITES + zlib.crc32("/".join(where.split("/")[-2:]).encode()) % (1 << 16)
        else:
            del node.lora_a, node.lora_b
            node.lora_scale = 0.0
    if not kept:
        shown = ", ".join(sorted(candidates)[:12])
        raise ConfigError(
            f"lora_target_modules={settings.target_modules!r} matches no dense layer of this model; the paths are: {shown}"
        )
    outside = sorted(where for where in kept if where.split("/")[0] not in layer_parts)
    if settings.dropout and outside:
        raise ConfigError(
            f"lora_dropout > 0 acts inside the decoder layers, but lora_target_modules also matches {outside[0]}; "
            "narrow lora_target_modules or set lora_dropout=0"
        )
    return sorted(kept)


def adapter_input(x: jax.Array, rate: float, site: int) -> jax.Array:
    """The adapters' input: ``x`` with dropout (one mask element per activation, PEFT's
    ``nn.Dropout``) when training with ``lora_dropout`` > 0, else ``x``."""
    return dropout(x, current_layer_keys(), rate, site, broadcast_dims=())


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, scale: float, n_in: int, product: Any) -> jax.Array:
    """``scale * (x @ A) @ B`` over the last ``n_in`` axes of ``x`` (``product``: ``contract_last``)."""
    return product(product(x, a.astype(x.dtype), n_in), b.astype(x.dtype), 1) * jnp.asarray(scale, x.dtype)


def with_adapters(base: dict, adapters: dict) -> dict:
    """The base model's pure parameter dict with the adapters of ``adapters`` added where they belong."""
    merged = dict(base)
    for key, value in adapters.items():
        merged[key] = with_adapters(base[key], value) if isinstance(value, dict) else value
    return merged


def merge_adapters(params: dict, scale: float) -> dict:
    """A pure parameter dict with every ``{kernel, lora_a, lora_b}`` replaced by the merged
    ``{kernel + scale * A @ B}`` (in float32, cast back to the kernel's dtype). Leading axes
    the kernel has beyond ``A``'s input axes and ``B``'s output axes (layer stacks) are kept."""

    def merge(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if "lora_a" not in node:
            return {key: merge(value) for key, value in node.items()}
        kernel, a, b = node["kernel"], node["lora_a"], node["lora_b"]
        lead = a.ndim + b.ndim - kernel.ndim - 2  # kernel [*lead, *in, *out], A [*lead, *in, r], B [*lead, r, *out]
        a32 = jnp.asarray(a, jnp.float32).reshape(*a.shape[:lead], math.prod(a.shape[lead:-1]), a.shape[-1])
        b32 = jnp.asarray(b, jnp.float32).reshape(*b.shape[: lead + 1], -1)
        delta = (jnp.matmul(a32, b32) * scale).reshape(kernel.shape)
        merged = (jnp.asarray(kernel, jnp.float32) + delta).astype(kernel.dtype)
        return {**{k: v for k, v in node.items() if k not in ADAPTERS}, "kernel": merged}

    return merge(params)
