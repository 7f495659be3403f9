"""The traced train step of a pipeline scans what ``scan_pipeline_repeats`` and
``scan_layers_per_stage`` say, on every schedule (issue 49): circular (2 repeats) and GPipe
(1), each with the weights on the device and in host memory (``parameter_memory_host_offload``).

With 4 microbatches the iteration loop is a scan of length 4; the rounds are a scan of length
``R`` (the repeats) around it, or a Python loop (``scan_pipeline_repeats=false``) — except where
every round reads the same weights (on the device, or GPipe's offloaded ones, moved once): there
scanned repeats are one scan over every iteration, ``R * 4 + 1`` with the drain
(``parallel/pipeline.py: _Run.rounds``). A stage's ``lps`` layers are a scan of length ``lps``
inside the iterations, or a Python loop (``scan_layers_per_stage=false``). Each path is traced
with each key at both values (two traces: repeats scanned + layers looped, then the other way
round). The values equal the sequential model's: tests/parity/test_pipeline_flags.py (both keys are
factors of its pairwise rows)."""

from __future__ import annotations

import pytest

from tests.conftest import sub_jaxprs, tiny_config, trace_train_step

MICROBATCHES = 4
DRAIN = 1  # (stages - 1) iterations after the last round, 2 stages
PATHS = {  # name: (overrides, repeats, layers per stage)
    "circular": (dict(num_layers_per_pipeline_stage=3), 2, 3),
    "circular_host_offload": (dict(num_layers_per_pipeline_stage=3, parameter_memory_host_offload=True), 2, 3),
    "gpipe": (dict(num_layers_per_pipeline_stage=6), 1, 6),
    "gpipe_host_offload": (dict(num_layers_per_pipeline_stage=6, parameter_memory_host_offload=True), 1, 6),
}
FETCHED_PER_ROUND = {"circular_host_offload"}  # GPipe's offloaded weights come to the device once, before the loop


def scans(jaxpr, found: list | None = None) -> list[tuple[int, frozenset]]:
    """Every scan of ``jaxpr`` at any depth: (its length, the lengths of the scans inside it)."""
    found = [] if found is None else found
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        inner: list = []
        for sub in sub_jaxprs(eqn):
            scans(sub, inner)
        if eqn.primitive.name == "scan":
            found.append((eqn.params["length"], frozenset(length for length, _ in inner)))
        found.extend(inner)
    return found


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("repeats_scanned", [True, False])
def test_the_traced_pipeline_scans_what_the_keys_say(path, repeats_scanned):
    overrides, repeats, lps = PATHS[path]
    layers_scanned = not repeats_scanned
    cfg = tiny_config(
        "llama3.1-tiny", base_num_decoder_layers=12, ici_pipeline_parallelism=2, num_pipeline_microbatches=MICROBATCHES,
        per_device_batch_size=MICROBATCHES, max_target_length=16, scan_pipeline_repeats=repeats_scanned,
        scan_layers_per_stage=layers_scanned, **overrides,
    )  # fmt: skip
    found = scans(trace_train_step(cfg, 2)[1].jaxpr)
    flat = repeats_scanned and path not in FETCHED_PER_ROUND  # the same weights every round: one loop
    rounds = [inner for length, inner in found if length == repeats and MICROBATCHES in inner]
    assert bool(rounds) == (repeats_scanned and not flat), (path, found)
    iterations = repeats * MICROBATCHES + DRAIN if flat else MICROBATCHES
    assert any(length == iterations for length, _ in found), found  # the iterations stay scanned
    assert any(length == lps for length, _ in found) == layers_scanned, (path, found)
