"""The pipeline section of `nnxtron plan`: which model layers run on which stage and repeat.

``pipeline_plan(cfg)`` resolves the schedule (``config.pipeline.pipeline_spec``) and maps
its stack blocks to model layers (0-based, HuggingFace numbering) through the stack layout
(``config.stacks.layer_stacks``); ``format_pipeline`` renders it as the "pipeline:" lines
of ``format_plan``. Layer lists are compressed into ranges (``0-3, 8-11``), and long
schedules are elided, so a 128-layer model on 16 stages stays a screenful.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nnxtron.config.pipeline import pipeline_spec
from nnxtron.config.schema import Config
from nnxtron.config.stacks import layer_stacks

MAX_REPEATS_SHOWN = 4  # per stage line: more repeats show the first MAX - 1, "...", the last
MAX_STAGES_SHOWN = 8  # more stages show the first MAX - 1, "...", the last


def pipeline_plan(cfg: Config) -> dict[str, Any] | None:
    """The pipeline entry of the plan (JSON-ready), or None without a pipeline.

    ``layout[stage][repeat]`` lists the model layers that stage applies on that repeat, in
    order; ``outside`` lists the other stacks (dense prefix, remainder, the blocks after
    ``pipeline_parallel_layers``), which run data-parallel over the stage axis;
    ``auto_note`` says how the layout was chosen when its keys were left at the defaults.
    """
    spec = pipeline_spec(cfg)
    if spec is None:
        return None
    stacks = layer_stacks(cfg)
    (main,) = (s for s in stacks if s.name == spec.stack)
    per_block = spec.layers_per_block
    layout = [
        [[main.hf_layer(b, j) for b in blocks for j in range(per_block)] for blocks in repeats] for repeats in spec.placement()
    ]
    outside = [
        {"stack": s.name, "layers": list(range(s.first_layer, s.first_layer + s.total_layers))}
        for s in stacks
        if s.name != spec.stack
    ]
    return {
        "stack": spec.stack,
        "stages": spec.stages,
        "repeats": spec.repeats,
        "circular": spec.circular,
        "microbatches": spec.microbatches,
        "layers_per_block": per_block,
        "layers_per_stage": spec.layers_per_stage * per_block,  # model layers per stage visit
        "pipelined_layers": spec.blocks * per_block,
        "delay": spec.delay,
        "iterations": spec.iterations,
        "bubble_fraction": spec.bubble_fraction,
        "schedule": {
            "scan_iterations": spec.scan_iterations,
            "scan_repeats": spec.scan_repeats,
            "remat_iterations": spec.remat_iterations,
            "remat_layers": spec.remat_layers,
            "delayed_forwarding": spec.delay > 1,
            "fsdp_ag_once": spec.fsdp_ag_once,
        },
        "layout": layout,
        "outside": outside,
        "outside_note": "data-parallel over the stage axis: outside the pipeline the stage axis splits the batch",
        "auto_note": spec.auto_note,  # how the layout was chosen, when its keys were left at defaults ("" otherwise)
    }


def layer_ranges(layers: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 8, 10]`` -> ``"0-3, 8, 10"`` (runs of consecutive layers as ranges)."""
    parts: list[str] = []
    i = 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        parts.append(str(layers[i]) if i == j else f"{layers[i]}-{layers[j]}")
        i = j + 1
    return ", ".join(parts)


def _layers(layers: Sequence[int]) -> str:
    return f"layer{'' if len(layers) == 1 else 's'} {layer_ranges(layers)}"


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def _elide(items: list[str], limit: int) -> list[str]:
    return items if len(items) <= limit else [*items[: limit - 1], "...", items[-1]]


def format_pipeline(p: dict[str, Any] | None) -> list[str]:
    """The "pipeline:" lines of the text plan (none without a pipeline)."""
    if p is None:
        return []
    d, s = p["delay"], p["stages"]
    formula = "(S-1)/(R*M+S-1)" if d == 1 else f"{d}(S-1)/(R*M+{d}(S-1))"
    per_stage = _plural(p["layers_per_stage"], "layer")
    if p["layers_per_block"] > 1:
        per_stage += f" ({_plural(p['layers_per_stage'] // p['layers_per_block'], 'block')} of {p['layers_per_block']})"
    out = [
        f"pipeline: {_plural(s, 'stage')} x {_plural(p['repeats'], 'repeat')} ({'circular' if p['circular'] else 'GPipe'}), "
        f"{_plural(p['microbatches'], 'microbatch', 'microbatches')}, {per_stage} per stage, "
        f"bubble {100 * p['bubble_fraction']:.1f}% = {formula} = {d * (s - 1)}/{p['iterations']}",
    ]
    flags = p["schedule"]
    on = [name for name, value in flags.items() if value]
    pipelined = sorted(layer for repeats in p["layout"] for layers in repeats for layer in layers)
    out.append(
        f"  stack {p['stack']}, {_layers(pipelined)}; {p['iterations']} iterations; "
        f"schedule flags: {', '.join(on) if on else 'none'}"
    )
    stage_lines = []
    for stage, repeats in enumerate(p["layout"]):
        parts = [f"repeat {r} {_layers(layers)}" for r, layers in enumerate(repeats)]
        stage_lines.append(f"  stage {stage}: " + " | ".join(_elide(parts, MAX_REPEATS_SHOWN)))
    out += [line if line != "..." else "  ..." for line in _elide(stage_lines, MAX_STAGES_SHOWN)]
    if p["outside"]:
        rest = "; ".join(f"{o['stack']} {_layers(o['layers'])}" for o in p["outside"])
        out.append(f"  outside the pipeline, data-parallel over the stage axis: {rest}")
    if p.get("auto_note"):
        out.append(f"  {p['auto_note']}")
    return out
