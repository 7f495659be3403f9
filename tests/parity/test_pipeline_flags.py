"""Every pipeline flag combination computes the sequential model's function (a generated matrix).

The flags — ``scan_pipeline_iterations``, ``scan_pipeline_repeats``,
``set_remat_policy_on_pipeline_iterations``, ``set_remat_policy_on_layers_per_stage``,
``pipeline_delay_activation_forwarding``, ``pipeline_fsdp_ag_once``, ``scan_layers``,
``scan_layers_per_stage`` — times the two schedules (GPipe with 2 layers per stage, circular
with 2 repeats) make 512 combinations, all of which the config accepts (4 microbatches satisfy the circular
schedule's bound with delayed forwarding). CI runs a *pairwise covering* subset, generated
below: every value pair of every two factors appears in some row (8 rows instead of 512),
so any bug that needs two flags together to show is caught. ``NNXTRON_PIPELINE_FLAGS=all``
runs all 512 (about 40 minutes on 2 cores; run before changing the pipeline's loops).

Each row runs llama3.1-tiny (4 layers) on 4 fake devices (pipeline 2 x fsdp 2) and compares
loss, input cotangent, every parameter gradient and the non-trainable state with the
sequential model, with the bounds of tests/parity/test_pipeline.py.
"""

from __future__ import annotations

import itertools
import os

import jax
import pytest

from nnxtron.models.build import build_model
from nnxtron.parallel.mesh import make_mesh
from nnxtron.tools.parity import assert_grad_parity, loss_and_grads
from tests.conftest import tiny_config
from tests.parity.test_pipeline import BOUNDS, PP2_FSDP2, _batch, _sequential

FLAGS = (
    "scan_pipeline_iterations",
    "scan_pipeline_repeats",
    "set_remat_policy_on_pipeline_iterations",
    "set_remat_policy_on_layers_per_stage",
    "pipeline_delay_activation_forwarding",
    "pipeline_fsdp_ag_once",
    "scan_layers",
    "scan_layers_per_stage",
)
SCHEDULES = {"gpipe": dict(num_layers_per_pipeline_stage=2), "circular": dict(num_layers_per_pipeline_stage=1)}
MODEL = dict(base_num_decoder_layers=4)


def pairwise_rows(levels: list[tuple]) -> list[tuple]:
    """A covering array of strength 2: rows of ``itertools.product(*levels)`` chosen greedily
    (most uncovered value pairs first, ties by order) until every value pair of every two
    factors appears in some row. Deterministic."""
    candidates = list(itertools.product(*levels))
    factors = range(len(levels))

    def pairs(row: tuple) -> set:
        return {(i, row[i], j, row[j]) for i, j in itertools.combinations(factors, 2)}

    uncovered = set().union(*(pairs(row) for row in candidates))
    rows = []
    while uncovered:
        best = max(candidates, key=lambda row: len(pairs(row) & uncovered))
        rows.append(best)
        uncovered -= pairs(best)
    return rows


def _rows() -> list[tuple]:
    levels = [tuple(SCHEDULES), *[(False, True)] * len(FLAGS)]
    if os.environ.get("NNXTRON_PIPELINE_FLAGS") == "all":
        return list(itertools.product(*levels))
    return pairwise_rows(levels)


def _row_id(row: tuple) -> str:
    schedule, *values = row
    return "-".join([schedule, *(f"{name}={int(value)}" for name, value in zip(FLAGS, values, strict=True))])


ROWS = _rows()


def test_the_pairwise_rows_cover_every_pair_and_are_few():
    levels = [tuple(SCHEDULES), *[(False, True)] * len(FLAGS)]
    rows = pairwise_rows(levels)
    for i, j in itertools.combinations(range(len(levels)), 2):
        assert {(row[i], row[j]) for row in rows} == set(itertools.product(levels[i], levels[j]))
    assert len(rows) <= 12


@pytest.mark.parametrize("row", ROWS, ids=[_row_id(row) for row in ROWS])
def test_pipeline_flag_combination_equals_the_sequential_model(row):
    schedule, *values = row
    flags = dict(zip(FLAGS, values, strict=True))
    cfg = tiny_config(**MODEL, **PP2_FSDP2, **SCHEDULES[schedule], num_pipeline_microbatches=4, **flags)
    result = loss_and_grads(build_model(cfg), _batch(cfg), mesh=make_mesh(cfg, jax.devices()[:4]))
    assert_grad_parity(result, _sequential("llama3.1-tiny", tuple(MODEL.items()), 1, 4), **BOUNDS)
