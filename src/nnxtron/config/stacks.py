"""The layer stacks a decoder builds: the pattern's stacks, the main one split by a pipeline.

``config/pipeline.decoder_stacks`` groups the layers into stacks of identical blocks
(``layout.pattern_stacks``, or for some pipelines ``layout.selected_stacks``);
``config/pipeline.pipeline_spec`` schedules the main stack over the pipeline stages. When
``pipeline_parallel_layers`` pipelines only the first blocks of the main stack, the rest
form ``unpipelined_layers``, applied after the pipeline. Computed once per config;
``pipeline_summary`` says the layout in the training start-up log.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

from nnxtron.config.layout import StackLayout
from nnxtron.config.pipeline import UNPIPELINED, decoder_stacks, pipeline_spec

if TYPE_CHECKING:
    from nnxtron.config.schema import Config


@dataclasses.dataclass(frozen=True)
class BuiltStack:
    """One stack as the decoder builds it.

    ``pattern_index`` is the position of the stack it comes from in ``decoder_stacks``
    (its parameters are initialised from that stack's key, so a partial pipeline builds
    the same weights as the unsplit stack) and ``first_block`` the index of its first
    block within that stack.
    """

    layout: StackLayout
    pattern_index: int
    first_block: int = 0


@functools.cache
def built_stacks(cfg: Config) -> tuple[BuiltStack, ...]:
    """The decoder's stacks in layer order (see the module docstring)."""
    spec = pipeline_spec(cfg)
    built = []
    for index, layout in enumerate(decoder_stacks(cfg)):
        if spec is not None and layout.name == spec.stack and spec.blocks < layout.num_layers:
            built.append(BuiltStack(dataclasses.replace(layout, num_layers=spec.blocks), index))
            rest = dataclasses.replace(
                layout,
                name=UNPIPELINED,
                first_layer=layout.first_layer + spec.blocks * layout.layers_per_block,
                num_layers=layout.num_layers - spec.blocks,
            )
            built.append(BuiltStack(rest, index, first_block=spec.blocks))
        else:
            built.append(BuiltStack(layout, index))
    return tuple(built)


def layer_stacks(cfg: Config) -> tuple[StackLayout, ...]:
    """The layouts of the decoder's stacks, in layer order."""
    return tuple(stack.layout for stack in built_stacks(cfg))


def layer_counts(cfg: Config) -> dict[str, int]:
    """Block count of each stack, by stack name (what ``params`` layout conversions take)."""
    return {stack.name: stack.num_layers for stack in layer_stacks(cfg)}


def pipeline_summary(cfg: Config) -> list[str]:
    """The pipeline layout in a line (and how it was chosen, when automatic) for the training
    start-up log; empty without a pipeline. ``nnxtron plan`` shows it stage by stage."""
    spec = pipeline_spec(cfg)
    if spec is None:
        return []

    def span(stack: StackLayout) -> str:
        first, last = stack.first_layer, stack.first_layer + stack.total_layers - 1
        return f"{stack.name} (layer {first})" if first == last else f"{stack.name} (layers {first}-{last})"

    stacks = layer_stacks(cfg)
    (main,) = (stack for stack in stacks if stack.name == spec.stack)
    outside = [span(stack) for stack in stacks if stack.name != spec.stack]
    per_stage = spec.layers_per_stage * spec.layers_per_block
    line = (
        f"pipeline: {span(main)} on {spec.stages} stages x {spec.repeats} repeat{'s' if spec.repeats > 1 else ''} "
        f"({'circular' if spec.circular else 'GPipe'}), {per_stage} layer{'s' if per_stage > 1 else ''} per stage, "
        f"{spec.microbatches} microbatches, bubble {100 * spec.bubble_fraction:.1f}%"
        + (f"; outside it (data-parallel over the stage axis): {', '.join(outside)}" if outside else "")
    )
    lines = [line, spec.auto_note] if spec.auto_note else [line]
    if spec.host_weights:
        lines.append(
            "parameter_memory_host_offload: the pipelined layers' weights stay in host memory and come to the device "
            + ("one repeat at a time (with the previous one while the stages move on)" if spec.circular else
               "when the pipeline starts (every stage uses its weights in every iteration)")
        )  # fmt: skip
    return lines
