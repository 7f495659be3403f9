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

# key -> why no observer can see it change (empty: every key is observed by the matrix)
INERT: dict[str, str] = {
    "num_pipeline_repeats": (
        "a check only (MaxText's key): a value other than -1 must equal the derived repeats, pipelined layers / "
        "(stages x num_layers_per_pipeline_stage), which config/pipeline.py computes anyway and any other value is "
        "refused; so no legal value changes the schedule"
    ),
}


def inert_lines() -> list[str]:
    """The table as ``key: reason`` lines (``nnxtron config show --inert``)."""
    if not INERT:
        return ["(none: every config key changes something the flag-sensitivity matrix observes)"]
    width = max(map(len, INERT))
    return [f"{key:<{width}}  {reason}" for key, reason in sorted(INERT.items())]
