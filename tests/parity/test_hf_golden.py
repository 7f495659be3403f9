"""nnxtron reproduces the HF transformers forward pass on the golden checkpoints.

Goldens (tests/assets/golden, see its README) are tiny random HF models with float32
logits from transformers 5.24. Measured max |logits - golden| (float32, CPU, jax 0.10.2):

    case      scan_layers=true  scan_layers=false
    llama2    2.7e-7            2.4e-7
    llama31   2.4e-7            2.4e-7
    mistral   2.8e-7            2.7e-7

(logits are O(1): max |golden| is 0.68-1.22). TOL below leaves ~7x headroom.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from nnxtron.hf import from_hf

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "golden"
CASES = ("llama2", "llama31", "mistral")
TOL = 2e-6


@pytest.fixture(scope="module")
def goldens() -> dict[str, dict[str, np.ndarray]]:
    return {case: load_file(str(GOLDEN / case / "golden.safetensors")) for case in CASES}


def _abs_diff(golden: dict[str, np.ndarray], case: str, **overrides) -> np.ndarray:
    """|nnxtron logits - golden logits| per element, [B, S, V]."""
    model = from_hf(GOLDEN / case, **overrides)
    with jax.default_matmul_precision("highest"):  # no TF32 on accelerators
        logits = model(jnp.asarray(golden["input_ids"])).logits
    assert logits.dtype == jnp.float32 and logits.shape == golden["logits"].shape
    return np.abs(np.asarray(logits) - golden["logits"])


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf(goldens, case: str, scan: bool) -> None:
    diff = float(_abs_diff(goldens[case], case, scan_layers=scan).max())
    assert diff <= TOL, f"{case} scan_layers={scan}: max |logits - golden| = {diff:.3g} > {TOL}"


def test_llama3_rope_scaling_is_checked(goldens) -> None:
    """Dropping the llama3 RoPE scaling moves the logits far beyond the tolerance (measured 3.6e-3)."""
    diff = float(_abs_diff(goldens["llama31"], "llama31", rope_type="default").max())
    assert diff > 100 * TOL


def test_sliding_window_is_checked(goldens) -> None:
    """Without mistral's window (8) logits match up to position 7 and differ after (measured 0.68)."""
    diff = _abs_diff(goldens["mistral"], "mistral", sliding_window_size=0).max(axis=(0, 2))
    assert diff[:8].max() <= TOL
    assert diff[8:].min() > 100 * TOL
