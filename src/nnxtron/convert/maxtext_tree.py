"""MaxText parameter names and layouts <-> nnxtron's, per family.

MaxText (0.2.5, NNX) writes its parameters in the layout of its former Linen decoders
(``train_state_nnx.to_checkpoint_dict``: "so NNX and Linen checkpoints stay interchangeable"),
and Linen's ``nn.scan(variable_axes={"params": param_scan_axis})`` and ``name=f"layers_{i}"``
gave the same names. Below the params root a tree is:

* top level: ``token_embedder/embedding`` [V, D], ``decoder/decoder_norm/scale``,
  ``decoder/logits_dense/kernel`` [D, V] (absent with ``logits_via_embedding``);
* unscanned layers: ``decoder/layers_{i}/...`` (DeepSeek: ``dense_layers_{i}``,
  ``moe_layers_{i - first_num_dense_layers}``); MTP: ``mtp_block/mtp_layer_{k}/mtp_{k}_*``;
* model state that is not an ``nnx.Param`` — DeepSeek's router bias, a ``MoEBiasVar`` — sits in
  its own collection: ``MoEBiasVar/<path>`` here (``params/MoEBiasVar/...`` in a param-only
  checkpoint, ``nnx_aux/model/...`` in a training one), scanned on axis 0, not 1;
* scanned layers: ``decoder/layers/...`` (``dense_layers``, ``moe_layers``) holding every layer
  stacked on axis ``PARAM_SCAN_AXIS`` = 1 (MaxText's default ``param_scan_axis``), for every
  parameter (a norm scale [D] becomes [D, L], an expert kernel [E, D, F] becomes [E, L, D, F]);
  Gemma 3 scans blocks of six layers: ``decoder/layers/layers_{j}/...`` (layer ``6 b + j`` at
  index ``b``) and ``decoder/layers_remainder/layers_{j}/...`` (the last ``L % 6`` layers).
  Llama 4 scans blocks of ``inhomogeneous_layer_cycle_interval`` layers the same way (even a
  block of one: ``layers/layers_0``), with no remainder; Qwen3.5 too, its block's layers named
  ``layers/layer_{j}`` (``Qwen3_5ScannableBlock``, ``MaxTextMap.block_layer``).

The names per family are the family's ``MaxTextMap`` (``Family.maxtext``, ``models/maxtext_map.py``:
layer rules, top-level rules, layer prefixes, the scanned block length); this module applies them.

Kernels have nnxtron's layout (``[*in, *out]``, heads split), so a name map suffices, plus the
value conventions where MaxText's parametrisation differs from nnxtron's (HF's):

* ``QUERY``: Llama 2 / Mistral / Mixtral fold ``1/sqrt(head_dim)`` into the query kernel and do
  not scale the attention logits; nnxtron scales them by ``query_pre_attn_scalar ** -0.5``
  (0: ``head_dim``), so its kernel is MaxText's times ``1 / scale`` (none with
  ``query_pre_attn_scalar=1``);
* ``NORM_OFFSET``: Gemma's RMSNorm multiplies by ``scale`` in MaxText, by ``1 + scale`` in
  nnxtron (``nnxtron = maxtext - 1``);
* ``SCALE_PLUS_ONE``: GPT-3's LayerNorm multiplies by ``1 + scale`` in MaxText (Paxml's
  zero-centred scale), by ``scale`` in nnxtron (HF's) (``nnxtron = maxtext + 1``). Lossy one
  way: MaxText -> nnxtron -> MaxText gives ``fl(1 + s) - 1`` for ``s`` (half an ulp of ``1 + s``
  at most: 2^-24 for ``|s| < 1``), whose ``1 + scale`` MaxText computes bit-identically (float32);
  nnxtron -> MaxText -> nnxtron is exact;
* ``EMBED_SCALE``: Gemma's ``sqrt(emb_dim)`` input scale is folded into MaxText's table (its
  tied logits divide by it again, ``normalize_embedding_logits``); nnxtron applies it at run
  time (``nnxtron = maxtext / sqrt(emb_dim)``). MaxText's tied head also rounds that table to
  bfloat16 (any dtype): ``tied_head_bf16``, which a MaxText config sets (``layers/embed.py``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from nnxtron.config.layout import LayerKind
from nnxtron.config.schema import Config
from nnxtron.config.stacks import layer_stacks
from nnxtron.errors import CheckpointError
from nnxtron.models.maxtext_map import BIAS_COLLECTION, EMBED_SCALE, NONE, NORM_OFFSET, QUERY, SCALE_PLUS_ONE, MaxTextMap, Rule
from nnxtron.models.registry import FAMILIES, family_for

PARAM_SCAN_AXIS = 1
SUPPORTED = tuple(name for name, family in FAMILIES.items() if family.maxtext is not None)
STATE_SCAN_AXIS = 0


@dataclass(frozen=True)
class Entry:
    """One MaxText array (unscanned name) and where it goes in nnxtron: ``path`` in the
    layer-list layout when ``block`` is None, else block ``block`` of the scanned ``path``."""

    maxtext: str
    path: str
    rule: Rule
    block: int | None = None


def maxtext_map(cfg: Config) -> MaxTextMap:
    """The MaxText names of ``cfg``'s family; refuses a family without them."""
    check_supported(cfg)
    mapping = family_for(cfg.decoder_block).maxtext
    assert mapping is not None  # check_supported
    return mapping


def layer_rules(cfg: Config, kind: LayerKind) -> tuple[Rule, ...]:
    """The parameters of one layer of ``kind``: MaxText names -> nnxtron names."""
    return maxtext_map(cfg).layer_rules(cfg, kind)


def top_rules(cfg: Config) -> tuple[Rule, ...]:
    return maxtext_map(cfg).top_rules(cfg)


def maxtext_layer_prefix(cfg: Config, layer: int) -> str:
    """MaxText's unscanned name of decoder layer ``layer``."""
    return maxtext_map(cfg).layer_prefix(cfg, layer)


def check_supported(cfg: Config) -> None:
    if cfg.decoder_block not in SUPPORTED:
        raise CheckpointError(
            f"MaxText checkpoint conversion covers decoder_block {', '.join(SUPPORTED)}; decoder_block="
            f"{cfg.decoder_block} is not one of them"
        )


def entries(cfg: Config) -> Iterator[Entry]:
    """Every MaxText array of ``cfg``'s model (unscanned names) and its nnxtron place."""
    mapping = maxtext_map(cfg)
    for rule in mapping.top_rules(cfg):
        yield Entry(rule.maxtext, rule.nnxtron, rule)
    for stack in layer_stacks(cfg):
        if stack.global_layers:  # MaxText's names (Gemma 2's local / global) follow each layer's kind
            raise CheckpointError(
                f"MaxText checkpoint conversion of the '{stack.name}' stack of one-layer blocks whose attention kind is "
                "data (a pipeline whose stages whole cycles do not fill) is not supported; convert with the config "
                "without the pipeline (ici_pipeline_parallelism=1), whose layers are the same"
            )
        for position, kind in enumerate(stack.kinds):
            sub = "/".join(map(str, stack.sub_path(position)))
            sub = f"{sub}/" if sub else ""
            for rule in mapping.layer_rules(cfg, kind):
                for block in range(stack.num_layers):
                    prefix = mapping.layer_prefix(cfg, stack.hf_layer(block, position))
                    if cfg.stacked_layers:
                        yield Entry(rule.name(prefix), f"{stack.name}/layers/{sub}{rule.nnxtron}", rule, block)
                    else:
                        yield Entry(rule.name(prefix), f"{stack.name}/layers/{block}/{sub}{rule.nnxtron}", rule)
    for depth in range(cfg.mtp_num_layers):
        yield from _mtp_entries(cfg, depth)


def _mtp_entries(cfg: Config, depth: int) -> Iterator[Entry]:
    k = depth + 1
    mt, nx = f"mtp_block/mtp_layer_{k}/mtp_{k}", f"mtp/depths/{depth}/"
    for rule in (
        Rule("embedding_norm/scale", "embedding_norm/scale"),
        Rule("hidden_state_norm/scale", "hidden_norm/scale"),
        Rule("projection/kernel", "projection/kernel"),
        Rule("final_norm/scale", "final_norm/scale"),
    ):
        yield Entry(f"{mt}_{rule.maxtext}", nx + rule.nnxtron, rule)
    kind = LayerKind(moe=cfg.num_experts > 1)
    for rule in layer_rules(cfg, kind):
        yield Entry(rule.name(f"{mt}_transformer_layer"), f"{nx}block/{rule.nnxtron}", rule)


def query_factor(cfg: Config) -> float:
    """nnxtron query kernel = MaxText's x this (``maxtext_query_folded`` families; 1.0 = same values)."""
    scale = cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else cfg.head_dim**-0.5
    return 1.0 / scale


def to_nnxtron_value(value: np.ndarray, convention: str, cfg: Config) -> np.ndarray:
    """MaxText's value -> nnxtron's (float32 arithmetic, then the input's dtype)."""
    return _apply(value, convention, cfg, forward=True)


def to_maxtext_value(value: np.ndarray, convention: str, cfg: Config) -> np.ndarray:
    return _apply(value, convention, cfg, forward=False)


def _apply(value: np.ndarray, convention: str, cfg: Config, forward: bool) -> np.ndarray:
    if convention == NONE:
        return value
    x = value.astype(np.float32)
    if convention == QUERY:
        factor = query_factor(cfg)
        if factor == 1.0:
            return value
        out = x * np.float32(factor) if forward else x / np.float32(factor)
    elif convention == NORM_OFFSET:
        out = x - np.float32(1.0) if forward else x + np.float32(1.0)
    elif convention == SCALE_PLUS_ONE:
        out = x + np.float32(1.0) if forward else x - np.float32(1.0)
    elif convention == EMBED_SCALE:
        scale = np.float32(math.sqrt(cfg.base_emb_dim))
        out = x / scale if forward else x * scale
    else:  # a table bug
        raise ValueError(f"unknown convention {convention!r}")
    return out.astype(value.dtype)


_STATE = f"(?:{BIAS_COLLECTION}/)?"
_SCANNED = re.compile(rf"^({_STATE})decoder/(layers|dense_layers|moe_layers|scanned_blocks)/(.*)$")
_REMAINDER = re.compile(rf"^({_STATE})decoder/layers_remainder/layers_(\d+)/(.*)$")
_OWN_REMAINDER = re.compile(r"^decoder/layers_remainder/local_layers/")  # Qwen3-Next's remainder block
_UNSCANNED = re.compile(rf"^({_STATE})decoder/(layers|dense_layers|moe_layers)_(\d+)/(.*)$")


def _axis(collection: str) -> int:
    return STATE_SCAN_AXIS if collection else PARAM_SCAN_AXIS


def _cycle(cfg: Config) -> tuple[int, str | None]:
    """Layers per scanned block, and MaxText's name of a block's layers (``layers_`` in ``layers/layers_{j}``;
    Qwen3.5's ``layer_``), None where it scans layers, not blocks."""
    mapping = maxtext_map(cfg)
    cycle = mapping.cycle(cfg)
    return cycle, f"{mapping.block_layer}_" if cycle > 1 or mapping.scan_blocks else None


def _prefix(cfg: Config) -> tuple[int, str]:
    """The leading layers MaxText keeps unscanned in a scanned tree (``decoder/layers_{i}``) and the
    name of the scanned blocks' group (DeepSeek-V4: its hash-routed prefix, ``scanned_blocks``)."""
    mapping = maxtext_map(cfg)
    return mapping.scan_prefix(cfg) if mapping.scan_prefix else 0, mapping.scan_group


def is_scanned(flat: dict[str, np.ndarray]) -> bool:
    return any(_SCANNED.match(k) or _REMAINDER.match(k) or _OWN_REMAINDER.match(k) for k in flat)


def unscan(flat: dict[str, np.ndarray], cfg: Config) -> dict[str, np.ndarray]:
    """A scanned MaxText tree under its unscanned names (one array per layer)."""
    if (own := maxtext_map(cfg).unscan) is not None:
        return own(flat, cfg)
    cycle, blocked = _cycle(cfg)
    prefix, _ = _prefix(cfg)
    blocks = (cfg.base_num_decoder_layers - prefix) // cycle
    out: dict[str, np.ndarray] = {}
    for key, value in flat.items():
        rem, scanned = _REMAINDER.match(key), _SCANNED.match(key)
        if rem:
            out[f"{rem[1]}decoder/layers_{prefix + blocks * cycle + int(rem[2])}/{rem[3]}"] = value
            continue
        if not scanned:
            out[key] = value
            continue
        collection, group, rest = scanned[1], scanned[2], scanned[3]
        axis = _axis(collection)
        if value.ndim <= axis:
            raise CheckpointError(
                f"MaxText array '{key}' has shape {list(value.shape)}: a scanned layer parameter needs a layer axis at "
                f"axis {axis}; the checkpoint does not match the config"
            )
        position = 0
        if blocked:
            inner = re.match(rf"^{blocked}(\d+)/(.*)$", rest)
            if not inner:
                raise CheckpointError(
                    f"MaxText array '{key}' is not in a {cfg.decoder_block} scanned block of {cycle} layers "
                    f"(layers/{blocked}j/...)"
                )
            position, rest, group = int(inner[1]), inner[2], "layers"
        for index in range(value.shape[axis]):
            layer = prefix + index * cycle + position
            out[f"{collection}decoder/{group}_{layer}/{rest}"] = np.take(value, index, axis=axis)
    return out


def scan(flat: dict[str, np.ndarray], cfg: Config) -> dict[str, np.ndarray]:
    """The inverse of ``unscan``: layers stacked on ``PARAM_SCAN_AXIS``."""
    if (own := maxtext_map(cfg).scan) is not None:
        return own(flat, cfg)
    cycle, blocked = _cycle(cfg)
    prefix, scan_group = _prefix(cfg)
    blocks = (cfg.base_num_decoder_layers - prefix) // cycle
    groups: dict[str, dict[int, np.ndarray]] = {}
    out: dict[str, np.ndarray] = {}
    for key, value in flat.items():
        m = _UNSCANNED.match(key)
        if not m:
            out[key] = value
            continue
        collection, group, layer, rest = m[1], m[2], int(m[3]), m[4]
        if layer < prefix:
            out[key] = value
            continue
        if blocked:
            block, position = divmod(layer - prefix, cycle)
            if block >= blocks:
                out[f"{collection}decoder/layers_remainder/layers_{position}/{rest}"] = value
                continue
            groups.setdefault(f"{collection}decoder/{scan_group}/{blocked}{position}/{rest}", {})[block] = value
        else:
            groups.setdefault(f"{collection}decoder/{group}/{rest}", {})[layer] = value
    for key, parts in groups.items():
        axis = _axis(BIAS_COLLECTION if key.startswith(f"{BIAS_COLLECTION}/") else "")
        out[key] = np.stack([parts[i] for i in range(len(parts))], axis=axis)
    return out
