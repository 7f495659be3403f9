"""nnxtron's initialiser is MaxText's, per tensor (issue 53): the mean and standard deviation of
every parameter of a model built from scratch equal those of MaxText 0.2.5's own initial
parameters for the same MaxText config (tests/assets/maxtext/reference/<family>/initial_params.npz,
MaxText's ``init_weights_seed=0``), within 10 % of the standard deviation.

The references are small (emb 32: kernels of 1024 to 8192 values) but large enough: the standard
deviation of a 512-value sample is within ~3 % of the population's (one standard error); the means
of two samples differ by ~std * sqrt(2 / n), so the mean's bound is the larger of 10 % of the std
and four such errors (DeepSeek's 512-value wq_a: 1.6 errors apart). Constant tensors (norm scales: ones; the router bias: zeros) must be equal.
The recipes and where nnxtron's own configs differ: docs/init.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from nnxtron.convert.maxtext import checkpoint_config, to_maxtext
from nnxtron.layers.moe import ExpertLoad
from nnxtron.models.build import build_model

REFERENCE = Path(__file__).resolve().parents[1] / "assets" / "maxtext" / "reference"
BASE_YML = REFERENCE.parent / "base.yml"
MANIFEST = json.loads((REFERENCE / "manifest.json").read_text())
TOLERANCE = 0.1  # of the reference's standard deviation


def _initial(family: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """nnxtron's initial parameters of ``family``'s MaxText config, under MaxText's names, and MaxText's."""
    cfg = checkpoint_config(str(BASE_YML), MANIFEST["families"][family]["overrides"])
    _, params, _, rest = nnx.split(build_model(cfg), nnx.Param, ExpertLoad, ...)
    ours = to_maxtext(nnx.to_pure_dict(params), cfg, scanned=True, state=nnx.to_pure_dict(rest))
    theirs = np.load(REFERENCE / family / "initial_params.npz")
    return {k: np.asarray(v) for k, v in ours.items()}, {k: theirs[k] for k in theirs.files}


@pytest.mark.parametrize("family", sorted(MANIFEST["families"]))
def test_every_tensor_starts_with_maxtexts_statistics(family):
    ours, theirs = _initial(family)
    assert set(ours) == set(theirs)
    off = []
    for name, ref in theirs.items():
        got = ours[name]
        std = float(ref.std())
        if std == 0.0:  # a constant: the same constant
            if not np.array_equal(got, ref):
                off.append(f"{name}: {np.unique(got)[:3]} vs {np.unique(ref)[:3]}")
            continue
        # two samples' means differ by ~std * sqrt(2 / n): 4 such errors where that exceeds 10 % (n < 3200)
        mean_tolerance = std * max(TOLERANCE, 4 * np.sqrt(2 / ref.size))
        if abs(got.std() / std - 1) > TOLERANCE or abs(got.mean() - ref.mean()) > mean_tolerance:
            off.append(f"{name}: mean {got.mean():+.4f} std {got.std():.4f} vs MaxText {ref.mean():+.4f} {std:.4f}")
    assert not off, f"{family}: tensors whose initial statistics are not MaxText's:\n" + "\n".join(off)
