"""How much of the main stack a pipeline runs, and in what steps: as configured, or chosen.

The layout keys are ``num_layers_per_pipeline_stage`` and ``pipeline_parallel_layers``
(``num_pipeline_repeats`` is a check of the layout, not a choice: any layout's repeats must
equal it unless it is -1). Set explicitly, they are the layout (``config/pipeline.py``
checks them and says what is wrong). Left at their base.yml defaults (``PIPELINE_OPTIONS_OFF``)
for a main stack of cycle blocks (Gemma 3, Llama 4, DeepSeek-V4: a block is one cycle
of several layers, ``config/layout.py``), the defaults would name an impossible layout
(one layer per stage splits a cycle), so one is chosen:

* one block (a whole cycle) per stage visit;
* the largest multiple of the stage count of whole blocks is pipelined (all of them when
  the block count divides); the rest form ``unpipelined_layers``, applied after the
  pipeline (``config/stacks.py``);
* fewer blocks than stages is an error: a cycle cannot be split across stages, because
  every stage runs one program under ``vmap`` (``parallel/pipeline.py``) and the layers
  of a cycle differ — unless the pattern is sliding/global attention over layers of one
  structure (Gemma 2/3, OLMo 3, GPT-OSS; ``layout.selectable_reason``): then
  ``config/pipeline.decoder_stacks`` makes the main stack one-layer blocks of kind
  ``selected`` (``cycle_layout_fits`` false: also for set keys that are not whole cycles),
  whose per-layer kind is data, and the one-layer rules below apply.

A main stack of one-layer blocks keeps the defaults' meaning (one layer per stage, all
layers pipelined). The chosen layout is said in ``PipelineSpec.auto_note``, which the
training start-up log and ``nnxtron plan`` print.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nnxtron.config.layout import StackLayout, cycle_length, selectable_reason
from nnxtron.config.options import PIPELINE_OPTIONS_OFF
from nnxtron.errors import ConfigError

if TYPE_CHECKING:
    from nnxtron.config.schema import Config

LAYOUT_KEYS = ("num_layers_per_pipeline_stage", "pipeline_parallel_layers")


@dataclass(frozen=True)
class Layout:
    """The pipelined part of the main stack, in model layers (before the whole-block checks)."""

    layers: int  # pipelined layers (the first ones of the main stack)
    layers_per_stage: int  # model layers a stage applies per visit
    auto_note: str = ""  # how it was chosen ("" = as configured)


def layout_at_defaults(cfg: Config) -> bool:
    """Whether every layout key holds its base.yml value (a value equal to it counts as left)."""
    return all(getattr(cfg, key) == PIPELINE_OPTIONS_OFF[key] for key in LAYOUT_KEYS)


def cycle_layout_fits(cfg: Config, main: StackLayout, stages: int) -> bool:
    """Whether ``main``'s blocks (whole cycles) can be laid over ``stages``: at the defaults, one
    block per stage needs a block per stage; set keys must count whole blocks."""
    if layout_at_defaults(cfg):
        return main.num_layers >= stages
    per_block = main.layers_per_block
    layers = main.total_layers if cfg.pipeline_parallel_layers == -1 else cfg.pipeline_parallel_layers
    return layers % per_block == 0 and cfg.num_layers_per_pipeline_stage % per_block == 0


def choose_layout(cfg: Config, main: StackLayout, stages: int) -> Layout:
    """The layout of ``main`` over ``stages`` (see the module docstring)."""
    per_block = main.layers_per_block
    if main.global_layers:
        return _selected_layout(cfg, main, stages)
    if per_block == 1 or not layout_at_defaults(cfg):
        layers = main.total_layers if cfg.pipeline_parallel_layers == -1 else cfg.pipeline_parallel_layers
        return Layout(layers, cfg.num_layers_per_pipeline_stage)
    if main.num_layers < stages:
        raise too_few_cycles(cfg, stages, main.num_layers, main)
    blocks = main.num_layers // stages * stages
    repeats = blocks // stages
    rest = main.num_layers - blocks
    pipelined = f"all {blocks} blocks pipelined"
    if rest:
        pipelined = f"{blocks} of {main.num_layers} blocks pipelined (a multiple of {stages} stages), {rest} in unpipelined_layers after it"
    note = (
        f"pipeline layout chosen automatically (layout keys at their defaults): one {per_block}-layer block (a whole cycle) "
        f"per stage, {repeats} repeat{'s' if repeats > 1 else ''}, {pipelined}; set num_layers_per_pipeline_stage / "
        "pipeline_parallel_layers to choose another"
    )
    return Layout(blocks * per_block, per_block, note)


def _selected_layout(cfg: Config, main: StackLayout, stages: int) -> Layout:
    """A main stack of one-layer blocks whose kind is data (``layout.selected_stacks``): set keys
    are the layout; at the defaults, one layer per stage and the largest multiple of the stage
    count of layers pipelined (the rest in ``unpipelined_layers``), as for cycles."""
    why = (
        f"whole {cycle_length(cfg)}-layer cycles do not fill {stages} stages{'' if layout_at_defaults(cfg) else ' as configured'} "
        "and the pattern's layers share one structure, so the pipelined layers are one-layer blocks whose attention kind "
        "(sliding or global: window and RoPE table) is data, read per layer at run time"
    )
    if not layout_at_defaults(cfg):
        layers = main.total_layers if cfg.pipeline_parallel_layers == -1 else cfg.pipeline_parallel_layers
        return Layout(layers, cfg.num_layers_per_pipeline_stage, f"pipeline layout: {why}")
    layers = main.total_layers // stages * stages
    if layers == 0:
        raise ConfigError(
            f"ici_pipeline_parallelism: {cfg.decoder_block} with {main.total_layers} layers cannot give each of {stages} "
            f"stages a layer; use at most {main.total_layers} pipeline stages"
        )
    rest = main.total_layers - layers
    pipelined = f"all {layers} layers pipelined"
    if rest:
        pipelined = f"{layers} of {main.total_layers} layers pipelined (a multiple of {stages} stages), {rest} in unpipelined_layers after it"
    note = (
        f"pipeline layout chosen automatically (layout keys at their defaults): {why}; one layer per stage, "
        f"{layers // stages} repeat{'s' if layers // stages > 1 else ''}, {pipelined}; set num_layers_per_pipeline_stage / "
        "pipeline_parallel_layers to choose another"
    )
    return Layout(layers, 1, note)


def too_few_cycles(cfg: Config, stages: int, blocks: int, main: StackLayout | None) -> ConfigError:
    """The error for a patterned model with fewer whole cycles than pipeline stages (``main``:
    its cycle stack, None when the layers do not fill one cycle) whose layers cannot be
    one-layer blocks with the kind as data (``layout.selectable_reason``)."""
    cycle = main.layers_per_block if main is not None else cycle_length(cfg)
    prefix = main.first_layer if main is not None else _prefix_layers(cfg)
    differ = f" ({', '.join(dict.fromkeys(kind.label for kind in main.kinds))})" if main is not None else ""
    needed = prefix + stages * cycle
    fewer = f"at most {blocks} pipeline stages" if blocks > 1 else "no pipeline"
    ratios = " (and compress_ratios to match)" if cfg.compress_ratios else ""
    return ConfigError(
        f"ici_pipeline_parallelism: {cfg.decoder_block} with {cfg.base_num_decoder_layers} layers has {blocks} whole "
        f"{cycle}-layer cycle{'' if blocks == 1 else 's'} to pipeline but {stages} stages need one each; a cycle cannot "
        f"be split across stages: every stage runs one program under vmap, and the layers of a cycle differ{differ}; "
        f"nor can they run as one-layer blocks whose attention kind is data (as the sliding/global patterns of "
        f"Gemma 2/3, OLMo 3 and GPT-OSS do): {selectable_reason(cfg)}; use base_num_decoder_layers >= {needed}{ratios} "
        f"or {fewer}"
    )


def _prefix_layers(cfg: Config) -> int:
    """Layers before the pattern's cycles (as ``pattern_stacks`` counts them)."""
    if cfg.num_experts > 1 and cfg.first_num_dense_layers:
        return cfg.first_num_dense_layers
    return cfg.first_num_hash_layers
