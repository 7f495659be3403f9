"""Layer patterns: which kind each layer is, and how the layers are grouped for scanning.

Pure arithmetic on the config (no JAX): ``models/stack.py`` builds the blocks,
``config/pipeline.py`` schedules the main stack over pipeline stages and
``config/stacks.py`` gives the stacks a decoder builds.

A decoder whose layers are not all alike (Gemma 3's five sliding-window layers per
global one, Llama 4's NoPE and MoE layers every few layers, DeepSeek's dense prefix) is
described by one ``LayerKind`` per layer. ``layer_stacks`` groups the layers into
scanned stacks of identical *blocks*: a block is one layer, or — for a repeating pattern —
one cycle of ``inhomogeneous_layer_cycle_interval`` layers (a ``CycleBlock``) so that every
block in a stack has the same structure and one compiled body scans them all. Layers
left over after the last full cycle form a ``remainder_layers`` stack holding one
shorter block; no layer is ever dropped. A pipeline that whole cycles cannot fill may instead
run a sliding/global pattern as one-layer blocks of kind ``selected`` whose kind is data
(``selected_stacks``, ``config/pipeline.decoder_stacks``).

Layer ``i`` (0-based) of a config:

* MoE iff ``num_experts > 1``, ``i >= first_num_dense_layers``, ``i`` not in ``dense_layers``
  and ``(i + 1) % interleave_moe_layer_step == 0`` (HF Qwen3-MoE's rule, with ``dense_layers`` its
  ``mlp_only_layers`` and the step its ``decoder_sparse_step``);
* no RoPE (NoPE) iff ``nope_layer_interval > 0`` and ``(i + 1) % nope_layer_interval == 0``;
* attention: a family that fixes its pattern (``FamilyRules.layer_attention``; Qwen3-Next: ``global`` iff
  ``(i + 1) % inhomogeneous_layer_cycle_interval == 0``, else ``linear``, Gated DeltaNet); DeepSeek-V4 (``compress_ratios``): ``sliding`` (0), ``csa`` or ``hca`` by the
  layer's ratio, and hash-routed MoE iff ``i < first_num_hash_layers``; with ``sliding_window_pattern`` P > 0, ``global`` iff ``(i + 1) % P == 0``
  else ``sliding``; with ``chunk_attn_window_size`` > 0, ``chunked`` on RoPE layers and
  ``global`` on NoPE layers; otherwise ``sliding`` when ``sliding_window_size`` > 0
  (Mistral: every layer) else ``global``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from nnxtron.config import deepseek4
from nnxtron.config.families import rules_for
from nnxtron.errors import ConfigError

if TYPE_CHECKING:
    from nnxtron.config.schema import Config


@dataclass(frozen=True)
class LayerKind:
    """What distinguishes one layer from another in a patterned decoder."""

    moe: bool = False
    attention: Literal["global", "sliding", "chunked", "csa", "hca", "linear", "selected"] = "global"
    rope: bool = True
    hash: bool = False  # DeepSeek-V4: MoE routed by the token -> expert table

    @property
    def label(self) -> str:
        return f"{self.attention}{'' if self.rope else '+nope'}{'+moe' if self.moe else ''}{'+hash' if self.hash else ''}"


PLAIN = LayerKind()  # dense feed-forward, global attention, RoPE


def is_moe_layer(cfg: Config, i: int) -> bool:
    """Whether layer ``i`` (0-based) has the routed MoE feed-forward; see the module docstring."""
    return (
        cfg.num_experts > 1
        and i >= cfg.first_num_dense_layers
        and i not in cfg.dense_layers
        and (i + 1) % cfg.interleave_moe_layer_step == 0
    )


def layer_kind(cfg: Config, i: int) -> LayerKind:
    """The kind of layer ``i`` (0-based); see the module docstring."""
    moe = is_moe_layer(cfg, i)
    rope = not (cfg.nope_layer_interval and (i + 1) % cfg.nope_layer_interval == 0)
    if cfg.compress_ratios:  # DeepSeek-V4
        return LayerKind(moe=moe, attention=deepseek4.attention_kind(cfg, i), hash=deepseek4.hash_routed(cfg, i))
    fixed = rules_for(cfg.decoder_block).layer_attention  # the family's own pattern (Qwen3-Next: linear / global)
    if fixed is not None:
        attention = fixed(cfg, i)
    elif cfg.sliding_window_pattern:
        attention = "global" if (i + 1) % cfg.sliding_window_pattern == 0 else "sliding"
    elif cfg.chunk_attn_window_size:
        attention = "chunked" if rope else "global"
    else:
        attention = "sliding" if cfg.sliding_window_size else "global"
    return LayerKind(moe=moe, attention=attention, rope=rope)


def attention_shape(cfg: Config, kind: LayerKind) -> tuple[int, int, bool]:
    """(key/value heads, head width, whether the values are the key projection) of a layer of ``kind``: a
    global layer takes ``global_num_kv_heads`` / ``global_head_dim`` where set and shares its key projection
    with ``share_kv_projections`` (Gemma 4); every other layer has the base shape."""
    kv_heads, head_dim = cfg.base_num_kv_heads, cfg.resolved_head_dim
    if kind.attention != "global":
        return kv_heads, head_dim, False
    return cfg.global_num_kv_heads or kv_heads, cfg.global_head_dim or head_dim, cfg.share_kv_projections


def layer_kinds(cfg: Config) -> tuple[LayerKind, ...]:
    return tuple(layer_kind(cfg, i) for i in range(cfg.base_num_decoder_layers))


def layer_pattern_period(cfg: Config) -> int:
    """The smallest number of layers after which the layer kinds repeat (1: all alike)."""
    periods = [cfg.sliding_window_pattern or 1, cfg.nope_layer_interval or 1]
    family_period = rules_for(cfg.decoder_block).layer_period
    if family_period is not None:
        periods.append(family_period(cfg))
    if cfg.num_experts > 1:
        periods.append(cfg.interleave_moe_layer_step)
        if cfg.dense_layers:  # any set of layers: no shorter period in general
            periods.append(cfg.base_num_decoder_layers)
    if cfg.compress_ratios:
        periods.append(deepseek4.period(cfg))
    return math.lcm(*periods)


def cycle_length(cfg: Config) -> int:
    """Layers per scanned block: ``inhomogeneous_layer_cycle_interval``, or the pattern period
    (the config validates that the interval is a multiple of the period)."""
    return cfg.inhomogeneous_layer_cycle_interval or layer_pattern_period(cfg)


@dataclass(frozen=True)
class StackLayout:
    """One scanned stack of identical blocks.

    ``name`` is the Decoder attribute and the stack axis name, ``first_layer`` the HF index
    of its first layer, ``num_layers`` the number of blocks (the scan length) and
    ``kinds`` the kinds of the layers in one block (one entry: a block is one layer).
    ``global_layers`` (a stack of ``selected`` one-layer blocks, ``selected_stacks``): whether
    block ``b`` of the stack is a global-attention layer (else sliding), by block index in the
    unsplit stack; empty when every block's kind is fixed by its structure.
    """

    name: str
    first_layer: int
    num_layers: int
    kinds: tuple[LayerKind, ...]
    global_layers: tuple[bool, ...] = ()

    @property
    def layers_per_block(self) -> int:
        return len(self.kinds)

    @property
    def total_layers(self) -> int:
        return self.num_layers * len(self.kinds)

    def hf_layer(self, block: int, position: int) -> int:
        """The 0-based model layer of ``position`` in ``block``."""
        return self.first_layer + block * len(self.kinds) + position

    def sub_path(self, position: int) -> tuple[Any, ...]:
        """Path of the layer at ``position`` inside a block (empty for one-layer blocks)."""
        return ("cycle", position) if len(self.kinds) > 1 else ()


@functools.cache
def pattern_stacks(cfg: Config) -> tuple[StackLayout, ...]:
    """The stacks of the layer pattern, in layer order (before any pipeline split:
    ``config/stacks.layer_stacks`` gives the stacks a decoder builds).

    * identical layers: one ``layers`` stack;
    * a dense prefix (``first_num_dense_layers``): ``dense_layers`` then ``moe_layers``;
    * a hash-routed prefix (DeepSeek-V4 ``first_num_hash_layers``): ``hash_layers`` (one
      block holding the prefix, i.e. applied unrolled), then the patterned stacks;
    * a pattern with period > 1: ``layers`` of whole cycles, then ``remainder_layers``
      (one block of the leftover layers) when the layer count is not a multiple of the cycle.
    """
    kinds = layer_kinds(cfg)
    total = len(kinds)
    stacks: list[StackLayout] = []
    start = 0
    if cfg.num_experts > 1 and cfg.first_num_dense_layers:
        start = cfg.first_num_dense_layers
        if len(set(kinds[:start])) != 1:
            raise ConfigError("first_num_dense_layers cannot be combined with a layer pattern inside the dense prefix")
        stacks.append(StackLayout("dense_layers", 0, start, (kinds[0],)))
    elif cfg.first_num_hash_layers:
        start = cfg.first_num_hash_layers
        stacks.append(StackLayout("hash_layers", 0, 1, kinds[:start]))
    cycle = cycle_length(cfg)
    blocks, leftover = divmod(total - start, cycle)
    name = "moe_layers" if stacks and stacks[0].name == "dense_layers" else "layers"
    if blocks:
        block_kinds = kinds[start : start + cycle]
        for b in range(blocks):  # the pattern must repeat (guaranteed by cycle_length; checked, never assumed)
            if kinds[start + b * cycle : start + (b + 1) * cycle] != block_kinds:
                raise ConfigError(f"layer pattern does not repeat every {cycle} layers; set inhomogeneous_layer_cycle_interval")
        stacks.append(StackLayout(name, start, blocks, block_kinds))
    if leftover:
        first = start + blocks * cycle
        stacks.append(StackLayout("remainder_layers", first, 1, kinds[first:]))
    return tuple(stacks)


SELECTABLE = frozenset({"sliding", "global"})  # attention kinds one layer structure can compute, chosen at run time


def selectable_reason(cfg: Config) -> str | None:
    """Why the layers of ``cfg``'s pattern cannot be one-layer blocks whose attention kind is
    data (``selected_stacks``), or None when they can: every layer must be ``sliding`` or
    ``global`` with the same feed-forward (MoE or dense), RoPE and routing, and no prefix stack.
    Such layers have the same parameters (a family's block builds the same weights for both
    kinds; ``models/stack.py`` checks it when it builds one) and differ only in the attention
    mask's window and the RoPE table."""
    kinds = set(layer_kinds(cfg))
    attention = {kind.attention for kind in kinds}
    differ = []
    if len({kind.moe for kind in kinds}) > 1:
        differ.append("MoE and dense feed-forward layers")
    if len({kind.hash for kind in kinds}) > 1:
        differ.append("hash-routed and learned-router MoE layers")
    if attention - SELECTABLE:
        differ.append(f"{'/'.join(sorted(attention - SELECTABLE))} attention with weights or code of its own")
    if len({kind.rope for kind in kinds}) > 1:
        differ.append("RoPE and NoPE layers")
    shapes = {attention_shape(cfg, kind) for kind in kinds if kind.attention in SELECTABLE}
    if len(shapes) > 1:
        differ.append(
            "global layers with attention weights of their own shape (global_head_dim, global_num_kv_heads, share_kv_projections)"
        )
    if differ:
        labels = ", ".join(sorted({kind.label for kind in kinds}))
        return f"its layers' parameters or code differ ({'; '.join(differ)}: {labels})"
    if (cfg.num_experts > 1 and cfg.first_num_dense_layers) or cfg.first_num_hash_layers:
        return "it has a prefix stack (first_num_dense_layers / first_num_hash_layers)"
    return None


def selected_stacks(cfg: Config) -> tuple[StackLayout, ...]:
    """The layers of a sliding/global pattern as one ``layers`` stack of one-layer blocks of kind
    ``selected`` (see ``selectable_reason``): every block has one structure, and block ``b``'s
    ``global_layers[b]`` selects its attention window and RoPE table at run time. What a
    pipeline uses when whole cycles do not divide into its stages (``config/pipeline.py``)."""
    kinds = layer_kinds(cfg)
    kind = LayerKind(moe=kinds[0].moe, attention="selected", rope=kinds[0].rope)
    return (StackLayout("layers", 0, len(kinds), (kind,), tuple(k.attention == "global" for k in kinds)),)
