"""The config keys that change nothing observable, each with its reason: the one explicit
list of exceptions to "a flag that is set is read" (DESIGN.md, principle 3).

Every other key of the schema has an entry in the flag-sensitivity matrix
(``tests/unit/test_flag_sensitivity.py``): a valid non-default value, the model family it
applies to and an observer (the traced train step, the batches, the files a run writes ...)
that must change when the key changes. A key in neither place fails that test, and so does
a matrix key whose value leaves its observer unchanged. ``nnxtron config show --inert``
prints this table (docs/config.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nnxtron.config.schema import Config

# key -> why no observer can see it change (empty: every key is observed by the matrix)
INERT: dict[str, str] = {
    "num_pipeline_repeats": (
        "a check only (MaxText's key): a value other than -1 must equal the derived repeats, pipelined layers / "
        "(stages x num_layers_per_pipeline_stage), which config/pipeline.py computes anyway and any other value is "
        "refused; so no legal value changes the schedule"
    ),
}


@dataclass(frozen=True)
class ReadOnlyWhen:
    """A key read only by configs where ``reads(cfg)``; elsewhere any value is accepted and
    changes nothing. Keys here are accepted rather than refused because MaxText's base.yml
    (which MaxText configs start from) gives them another default than nnxtron's, so a
    refusal would stop MaxText configs of models that never read them."""

    condition: str  # where the key is read, in words
    reads: Callable[[Config], bool]


_YARN = ReadOnlyWhen("rope_type=yarn", lambda c: c.rope_type == "yarn")
_MOE = ReadOnlyWhen("num_experts > 1 (MoE layers)", lambda c: c.num_experts > 1)
INERT_UNLESS: dict[str, ReadOnlyWhen] = {
    "beta_fast": _YARN,
    "beta_slow": _YARN,
    "mscale": _YARN,
    "mscale_all_dim": ReadOnlyWhen(
        "rope_type != default (yarn's cos/sin factor, MLA's softmax scale)", lambda c: c.rope_type != "default"
    ),
    "rope_scaling_factor": ReadOnlyWhen("rope_type=linear, llama3 or yarn", lambda c: c.rope_type != "default"),
    "rope_low_freq_factor": ReadOnlyWhen("rope_type=llama3", lambda c: c.rope_type == "llama3"),
    "rope_high_freq_factor": ReadOnlyWhen("rope_type=llama3", lambda c: c.rope_type == "llama3"),
    "rope_original_max_position_embeddings": ReadOnlyWhen(
        "rope_type=llama3 or yarn", lambda c: c.rope_type in ("llama3", "yarn")
    ),
    "base_moe_mlp_dim": _MOE,
    "routed_score_func": _MOE,
    "norm_topk_prob": _MOE,
    "moe_compute": _MOE,
    "normalize_embedding_logits": ReadOnlyWhen("logits_via_embedding=true (the tied head)", lambda c: c.logits_via_embedding),
    "load_balance_convention": ReadOnlyWhen(
        "num_experts > 1 and load_balance_loss_weight > 0", lambda c: c.num_experts > 1 and c.load_balance_loss_weight > 0
    ),
}


def inert_lines() -> list[str]:
    """The tables as ``key: reason`` lines (``nnxtron config show --inert``)."""
    lines = [f"{key}  {reason}" for key, reason in sorted(INERT.items())]
    lines += [f"{key}  read only when {when.condition}; no effect otherwise" for key, when in sorted(INERT_UNLESS.items())]
    return lines or ["(none: every config key changes something the flag-sensitivity matrix observes)"]
