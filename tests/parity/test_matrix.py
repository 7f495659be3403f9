"""The strategy-parity matrix: one tiny model, one batch, every execution strategy.

Each row is a ``Strategy`` (config overrides + the mesh it runs on + gradient
accumulation); each is compared with the baseline — one device, unrolled layers, no
remat, no accumulation — on loss, input cotangent and every parameter gradient with the
DESIGN.md bounds (``nnxtron.testing.assert_grad_parity``). Later features add rows (or a
new axis to ``ROWS``), not new harnesses.

Bounds, measured on this CPU in float32 (2026-11): the worst row differs from the
baseline by 6e-7 relative (aggregate); the bounds leave ~10x headroom and are orders of
magnitude below what a real bug produces.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest

from nnxtron.decoder import build_model
from nnxtron.parallel.mesh import make_mesh
from nnxtron.parallel.remat import POLICIES
from nnxtron.testing import GradResult, assert_grad_parity, loss_and_grads
from tests.conftest import random_batch, tiny_config

BOUNDS = dict(loss_rtol=2e-6, rel=2e-5, abs_frac=2e-6, aggregate_rel=1e-5)
MODEL = dict(base_num_decoder_layers=2)
MESHES = {
    "1dev": None,  # one device, no mesh
    "data2_fsdp4": dict(ici_data_parallelism=2, ici_fsdp_parallelism=4),
    "fsdp4_tensor2": dict(ici_fsdp_parallelism=4, ici_tensor_parallelism=2),
    "fsdp2_context4": dict(ici_fsdp_parallelism=2, ici_context_parallelism=4),
}
CUSTOM = dict(qkv_proj="device", context="offload", mlpwi_0="device")


@dataclass(frozen=True)
class Strategy:
    scan: bool = False
    remat: str = "none"
    mesh: str = "1dev"
    accumulation: int = 1
    extra: tuple[tuple[str, object], ...] = field(default=())

    @property
    def id(self) -> str:
        return f"{'scan' if self.scan else 'unroll'}-{self.remat}-{self.mesh}-ga{self.accumulation}"

    def overrides(self) -> dict:
        values = {**MODEL, "scan_layers": self.scan, "remat_policy": self.remat, **(MESHES[self.mesh] or {})}
        if self.remat == "custom":
            values.update(CUSTOM)
        values.update(dict(self.extra))
        return values


BASELINE = Strategy()
ROWS = [
    Strategy(scan, remat, mesh, accumulation)
    for scan, remat, mesh, accumulation in itertools.product((False, True), POLICIES, MESHES, (1, 4))
    if Strategy(scan, remat, mesh, accumulation) != BASELINE
]


def _batch():
    return random_batch(tiny_config("llama3.1-tiny"), batch=32, seq=16, seed=3, packed=True)


def run(strategy: Strategy) -> GradResult:
    cfg = tiny_config("llama3.1-tiny", **strategy.overrides())
    mesh = make_mesh(cfg) if MESHES[strategy.mesh] is not None else None
    return loss_and_grads(build_model(cfg), _batch(), mesh=mesh, accumulation_steps=strategy.accumulation)


@pytest.fixture(scope="module")
def baseline() -> GradResult:
    return run(BASELINE)


@pytest.mark.parametrize("strategy", ROWS, ids=lambda s: s.id)
def test_strategy_matches_baseline(strategy, baseline):
    assert_grad_parity(run(strategy), baseline, **BOUNDS)


def test_matrix_covers_every_axis():
    assert len(ROWS) == 2 * len(POLICIES) * len(MESHES) * 2 - 1
    assert {s.remat for s in ROWS} == set(POLICIES) and {s.mesh for s in ROWS} == set(MESHES)
