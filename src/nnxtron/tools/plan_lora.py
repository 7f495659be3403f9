"""The LoRA section of `nnxtron plan`: what is trained, and the memory against full fine-tuning.

A LoRA run (``lora_rank`` > 0) holds the frozen base on the devices beside its train state
(adapters, their optimizer state, model state); ``lora_plan`` puts next to its figures those
of the same config without adapters (``layers.lora.base_config``: full fine-tuning), planned
and compiled the same way, so the two columns are read from the same XLA memory analysis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

from nnxtron.config.schema import Config
from nnxtron.layers.lora import base_config, layout_free_path
from nnxtron.models.build import abstract_model

COMPARED = (  # (label, where in a plan)
    ("parameters trained", ("params", "trained")),
    ("train state + frozen base", ("state_per_device", "state_bytes")),
    ("  optimizer state", ("state_per_device", "optimizer_state_bytes")),
    ("compiled step: arguments", ("memory", "argument_bytes")),
    ("compiled step: temporaries", ("memory", "temp_bytes")),
    ("compiled step: peak estimate", ("memory", "peak_bytes")),
)


def _pick(plan: dict[str, Any], where: tuple[str, str]) -> int | None:
    part = plan.get(where[0])
    return None if part is None else part.get(where[1])


def lora_plan(cfg: Config, plan: dict[str, Any], make_plan: Callable[[Config], dict[str, Any]]) -> dict[str, Any] | None:
    """The ``lora`` entry of ``plan`` (JSON-ready), or None without LoRA. ``make_plan`` plans
    another config the way ``plan`` was made (the full fine-tuning column)."""
    if not cfg.lora_rank:
        return None
    modules = sorted(
        {layout_free_path(path) for path, node in nnx.iter_graph(abstract_model(cfg)) if getattr(node, "lora_scale", 0.0)}
    )
    full = make_plan(base_config(cfg))
    rows = [{"label": label, "lora": _pick(plan, where), "full": _pick(full, where)} for label, where in COMPARED]
    return {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "modules": modules, "compared": rows}


def format_lora(section: dict[str, Any] | None, show_bytes: Callable[[int | None], str]) -> list[str]:
    """The "LoRA" lines of ``format_plan``."""
    if section is None:
        return []
    out = [
        "",
        f"LoRA: rank {section['rank']}, alpha {section['alpha']:g}, adapters on {len(section['modules'])} dense layers: "
        + ", ".join(section["modules"]),
        f"  {'per device':32}{'LoRA':>14}{'full fine-tuning':>20}{'LoRA / full':>14}",
    ]
    for row in section["compared"]:
        lora, full = row["lora"], row["full"]
        if lora is None or full is None:
            continue
        shown = (lambda n: f"{n:,}") if row["label"] == "parameters trained" else show_bytes
        ratio = f"{lora / full:.3f}" if full else "-"
        out.append(f"  {row['label']:32}{shown(lora):>14}{shown(full):>20}{ratio:>14}")
    return out
