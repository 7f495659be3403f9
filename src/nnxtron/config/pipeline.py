"""The pipeline schedule: which blocks run on which stage and repeat, and when.

A pipelined stack of ``P`` blocks runs on ``S`` stages (the ``stage`` mesh axis, of size
``ici_pipeline_parallelism x dcn_pipeline_parallelism``). Each stage applies
``layers_per_stage`` consecutive blocks per visit, and a microbatch visits the stages
``repeats`` times:

* non-circular (GPipe, ``repeats == 1``): stage ``s`` holds blocks
  ``[s * lps, (s + 1) * lps)``, a contiguous slice of the stack;
* circular (``repeats > 1``): on repeat ``r`` stage ``s`` applies blocks
  ``(r * S + s) * lps + j`` for ``j < lps`` — with one block per stage, block ``r * S + s``.

The batch is split into ``M`` microbatches (rows ``m, m + M, ...``, as gradient
accumulation splits it). At iteration ``t`` stage ``s`` works on item ``i = t - d * s``
(``d`` = 2 with delayed activation forwarding, else 1): microbatch ``i mod M`` in repeat
``i // M``, a bubble when ``i`` is outside ``[0, M * R)``. There are ``M * R + d * (S - 1)``
iterations; the bubble fraction (idle stage-iterations) is
``d * (S - 1) / (R * M + d * (S - 1))`` — ``(S - 1) / (R * M + S - 1)`` without delay.
A circular schedule needs ``M >= d * (S - 1) + 1`` so that a microbatch has left the last
stage before it re-enters the first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nnxtron.config.layout import StackLayout, cycle_length, pattern_stacks, selectable_reason, selected_stacks
from nnxtron.config.options import PIPELINE_OPTIONS_OFF
from nnxtron.config.pipeline_layout import choose_layout, cycle_layout_fits, too_few_cycles
from nnxtron.errors import ConfigError

if TYPE_CHECKING:
    from nnxtron.config.schema import Config

PIPELINED_STACKS = ("moe_layers", "layers")  # the main stack of a decoder (DeepSeek: after the dense prefix)
UNPIPELINED = "unpipelined_layers"  # main-stack blocks after the first pipeline_parallel_layers


@dataclass(frozen=True)
class PipelineSpec:
    """A resolved schedule (see the module docstring); counts are in stack blocks."""

    stack: str  # the pipelined stack (Decoder attribute and stack axis name)
    layers_per_block: int  # model layers in one block (> 1 for cycle blocks)
    stages: int
    microbatches: int
    repeats: int
    layers_per_stage: int  # blocks a stage applies per visit
    delay: int = 1  # iterations per stage-to-stage hop (2 = delayed activation forwarding)
    scan_iterations: bool = True
    scan_repeats: bool = True
    scan_stage_layers: bool = True  # a stage's blocks under lax.scan (false: a Python loop)
    remat_iterations: bool = True
    remat_layers: bool = False
    fsdp_ag_once: bool = False
    host_weights: bool = False  # parameter_memory_host_offload: the stack's weights come from host memory a repeat at a time
    auto_note: str = ""  # how the layout was chosen when its keys were left at defaults (config/pipeline_layout.py)

    @property
    def blocks(self) -> int:
        return self.stages * self.repeats * self.layers_per_stage

    @property
    def circular(self) -> bool:
        return self.repeats > 1

    @property
    def tail_iterations(self) -> int:
        """Iterations after the last microbatch entered the first stage (the drain)."""
        return self.delay * (self.stages - 1)

    @property
    def iterations(self) -> int:
        return self.microbatches * self.repeats + self.tail_iterations

    @property
    def bubble_fraction(self) -> float:
        return self.tail_iterations / self.iterations

    def block(self, repeat: int, stage: int, position: int) -> int:
        """The stack block applied at ``position`` of ``stage`` on ``repeat``."""
        return (repeat * self.stages + stage) * self.layers_per_stage + position

    def placement(self) -> list[list[list[int]]]:
        """``placement()[stage][repeat]``: the blocks that stage applies on that repeat."""
        return [
            [[self.block(r, s, j) for j in range(self.layers_per_stage)] for r in range(self.repeats)] for s in range(self.stages)
        ]


def _cycle_main(stacks: tuple[StackLayout, ...]) -> StackLayout | None:
    by_name = {stack.name: stack for stack in stacks}
    return next((by_name[name] for name in PIPELINED_STACKS if name in by_name), None)


def selects_kinds(cfg: Config) -> bool:
    """Whether the decoder's main stack is one-layer blocks whose attention kind is data
    (``layout.selected_stacks``): a pipeline whose stages whole cycles cannot fill
    (``pipeline_layout.cycle_layout_fits``) over a pattern whose layers share one structure
    (``layout.selectable_reason``). Elsewhere the cycle blocks stay (the checkpoint layout of
    the unpipelined model, MaxText's scanned cycle, static masks for every attention kernel)."""
    if cfg.pipeline_stages == 1 or cycle_length(cfg) == 1 or selectable_reason(cfg) is not None:
        return False
    main = _cycle_main(pattern_stacks(cfg))
    return main is None or not cycle_layout_fits(cfg, main, cfg.pipeline_stages)


@functools.cache
def decoder_stacks(cfg: Config) -> tuple[StackLayout, ...]:
    """The stacks of the layer pattern a decoder builds before any pipeline split:
    ``layout.pattern_stacks``, or ``layout.selected_stacks`` where ``selects_kinds``."""
    return selected_stacks(cfg) if selects_kinds(cfg) else pattern_stacks(cfg)


def main_stack(cfg: Config) -> StackLayout:
    """The stack a pipeline runs: ``moe_layers`` after a dense prefix, else ``layers``."""
    main = _cycle_main(decoder_stacks(cfg))
    if main is not None:
        return main
    if cycle_length(cfg) > 1:  # the layers do not fill one whole cycle
        raise too_few_cycles(cfg, cfg.pipeline_stages, 0, None)
    raise ConfigError(
        f"ici_pipeline_parallelism: decoder_block {cfg.decoder_block} with {cfg.base_num_decoder_layers} layers has "
        "no main layer stack to pipeline; use more layers or no pipeline"
    )


@functools.cache
def pipeline_spec(cfg: Config) -> PipelineSpec | None:
    """The schedule of ``cfg``, or None with one stage. Raises ConfigError when impossible."""
    stages = cfg.pipeline_stages
    if stages == 1:
        return None
    main = main_stack(cfg)
    if main.global_layers:
        check_selected_attention(cfg)
    per_block = main.layers_per_block
    layout = choose_layout(cfg, main, stages)  # the configured layout, or one chosen for cycle blocks
    layers, layers_per_stage = layout.layers, layout.layers_per_stage
    if layers > main.total_layers or layers < 1:
        raise ConfigError(
            f"pipeline_parallel_layers={cfg.pipeline_parallel_layers} must be between 1 and the {main.total_layers} "
            f"layers of the '{main.name}' stack (or -1 for all of them)"
        )
    for name, value in (
        ("pipeline_parallel_layers", layers),
        ("num_layers_per_pipeline_stage", layers_per_stage),
    ):
        if value % per_block:
            raise ConfigError(
                f"{name}={value} is not a whole number of the {per_block}-layer blocks of the '{main.name}' stack; "
                f"use a multiple of {per_block}"
            )
    blocks, lps = layers // per_block, layers_per_stage // per_block
    if blocks % (stages * lps):
        raise ConfigError(
            f"{layers} pipelined layers do not divide into {stages} stages x num_layers_per_pipeline_stage="
            f"{cfg.num_layers_per_pipeline_stage}; choose num_layers_per_pipeline_stage so that stages x it divides "
            f"{layers} (or set pipeline_parallel_layers)"
        )
    repeats = blocks // (stages * lps)
    if cfg.num_pipeline_repeats not in (-1, repeats):
        raise ConfigError(
            f"num_pipeline_repeats={cfg.num_pipeline_repeats} but {layers} pipelined layers / ({stages} stages x "
            f"{layers_per_stage} layers per stage) = {repeats}; set it to -1 or change "
            "num_layers_per_pipeline_stage"
        )
    delay = 2 if cfg.pipeline_delay_activation_forwarding else 1
    microbatches = stages if cfg.num_pipeline_microbatches == -1 else cfg.num_pipeline_microbatches
    if microbatches < 1:
        raise ConfigError(f"num_pipeline_microbatches={microbatches} must be >= 1 (or -1 for the number of stages)")
    need = delay * (stages - 1) + 1
    if repeats > 1 and microbatches < need:
        raise ConfigError(
            f"a circular pipeline ({repeats} repeats over {stages} stages"
            f"{', delayed forwarding' if delay > 1 else ''}) needs num_pipeline_microbatches >= {need} so a "
            f"microbatch leaves the last stage before re-entering the first; got {microbatches}"
        )
    return PipelineSpec(
        stack=main.name,
        layers_per_block=per_block,
        stages=stages,
        microbatches=microbatches,
        repeats=repeats,
        layers_per_stage=lps,
        delay=delay,
        scan_iterations=cfg.scan_pipeline_iterations,
        scan_repeats=cfg.scan_pipeline_repeats,
        scan_stage_layers=cfg.scan_layers_per_stage,
        remat_iterations=cfg.set_remat_policy_on_pipeline_iterations,
        remat_layers=cfg.set_remat_policy_on_layers_per_stage,
        fsdp_ag_once=cfg.pipeline_fsdp_ag_once,
        host_weights=cfg.parameter_memory_host_offload,
        auto_note=layout.auto_note,
    )


def check_selected_attention(cfg: Config) -> None:
    """A pipeline of one-layer blocks whose kind is data (``selects_kinds``) chooses each
    layer's window at run time: only a mask built from it (``attention=xla``, ``dot_product``;
    ``auto`` runs ``xla``) can apply it; the kernels that take a static mask are refused by name."""
    fix = (
        f"or base_num_decoder_layers / num_layers_per_pipeline_stage that give every stage whole "
        f"{cycle_length(cfg)}-layer cycles (docs/pipeline.md)"
    )
    if cfg.attention in ("splash", "cudnn"):
        raise ConfigError(
            f"attention={cfg.attention} takes a static mask, but this pipeline's layers choose sliding or global "
            f"attention at run time (one-layer blocks whose kind is data); use attention=auto, xla or dot_product {fix}"
        )
    if cfg.ici_context_parallelism > 1 and cfg.context_parallel_strategy == "ring":
        raise ConfigError(
            "context_parallel_strategy=ring takes a static window, but this pipeline's layers choose sliding or global "
            f"attention at run time (one-layer blocks whose kind is data); use context_parallel_strategy=all_gather {fix}"
        )


def check_pipeline_options(cfg: Config) -> None:
    """Config-time checks: options need stages, and the schedule must exist."""
    if cfg.pipeline_stages == 1:
        for name, off in PIPELINE_OPTIONS_OFF.items():
            if getattr(cfg, name) != off:
                raise ConfigError(
                    f"{name}={getattr(cfg, name)} is read only by a pipeline; set ici_pipeline_parallelism > 1 "
                    f"(or leave {name} at {off})"
                )
        return
    pipeline_spec(cfg)
