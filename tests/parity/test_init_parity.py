"""nnxtron's initialiser is MaxText's, per tensor (issue 53): the mean and standard deviation of
every parameter of a model built from scratch equal those of MaxText 0.2.5's own initial
parameters for the same MaxText config (MaxText's ``init_weights_seed=0``), within 10 % of the
standard deviation. MaxText's side (scripts/maxtext_reference.py, tests/assets/maxtext/reference/):

* llama2, llama2_tied, mixtral, deepseek3: the reproduction runs' ``<family>/initial_params.npz``;
* gemma3, gpt3, llama4, qwen3, qwen3_moe: ``init/<family>/initial_statistics.json`` (each tensor's
  shape, mean, std, min and max; MaxText's model config of the family, shrunk to emb 32).

The references are small (emb 32: kernels of 512 to 8192 values) but large enough: the standard
deviation of a 512-value sample is within ~3 % of the population's (one standard error); the means
of two samples differ by ~std * sqrt(2 / n), so the mean's bound is the larger of 10 % of the std
and four such errors (DeepSeek's 512-value wq_a: 1.6 errors apart). Constant tensors (norm scales:
ones; the router bias: zeros) must be the same constant. Where nnxtron's recipe differs from
MaxText's on purpose (``DELIBERATE``), the expected std is MaxText's times the documented factor.
The recipes, and why nnxtron differs: docs/init.md. DeepSeek-V4: test_init_recipe_deepseek4.py.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from nnxtron.config.schema import Config
from nnxtron.convert import maxtext_tree
from nnxtron.convert.maxtext import checkpoint_config, to_maxtext
from nnxtron.layers.moe import ExpertLoad
from nnxtron.models.build import build_model
from nnxtron.params import flatten

REFERENCE = Path(__file__).resolve().parents[1] / "assets" / "maxtext" / "reference"
BASE_YML = REFERENCE.parent / "base.yml"
MANIFEST = json.loads((REFERENCE / "manifest.json").read_text())
RUNS, INIT = MANIFEST["families"], MANIFEST["init_statistics"]
TOLERANCE = 0.1  # of the reference's standard deviation


@dataclass(frozen=True)
class Stats:
    size: int
    mean: float
    std: float
    low: float
    high: float

    @classmethod
    def of(cls, x: np.ndarray) -> Stats:
        x = np.asarray(x, np.float64)
        return cls(x.size, float(x.mean()), float(x.std()), float(x.min()), float(x.max()))


@dataclass(frozen=True)
class Deliberate:
    """nnxtron's std = MaxText's x ``factor(cfg)``, for ``reason`` (docs/init.md's table)."""

    factor: Callable[[Config], float]
    reason: str


TIED_TABLE = Deliberate(
    lambda cfg: cfg.base_emb_dim**-0.5,
    "tied head with normalize_embedding_logits=false: HF's head x @ E^T, so nnxtron's table is "
    "N(0, 1/sqrt(D)) (logits at unit scale); MaxText keeps its N(0, 1) table and gets logits of std sqrt(D)",
)
DELIBERATE: dict[str, dict[str, Deliberate]] = {
    "qwen3": {"token_embedder/embedding": TIED_TABLE},
    "gpt3": {"token_embedder/embedding": TIED_TABLE},
}

# nnxtron name -> MaxText name (in order) for the families convert.maxtext does not map yet; the
# scan axis differs (nnxtron 0, MaxText 1) but a statistic does not see it
_COMMON = (
    (r"^embed/embedding$", "token_embedder/embedding"),
    (r"^position_embed/embedding$", "decoder/position_embedder/embedding"),
    (r"^final_norm/", "decoder/decoder_norm/"),
    (r"^logits/kernel$", "decoder/logits_dense/kernel"),
    (r"^layers/layers/cycle/(\d+)/", r"decoder/layers/layers_\1/"),
    (r"^layers/layers/", "decoder/layers/"),
    (r"/attention/qkv/", "/self_attention/qkv_proj/"),
    (r"/attention/", "/self_attention/"),
)
_LLAMA_NORMS = (
    (r"/pre_attention_norm/", "/pre_self_attention_layer_norm/"),
    (r"/post_attention_norm/", "/post_self_attention_layer_norm/"),
)
MAXTEXT_NAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "gpt3": (*_COMMON, (r"/pre_attention_norm/", "/pre_self_attention_norm/"), (r"/pre_mlp_norm/", "/mlp/mlp_layer_norm/")),
    "qwen3": (*_COMMON, *_LLAMA_NORMS),
    "qwen3_moe": (
        (r"/mlp/router/kernel$", "/moe_block/gate/kernel"),
        (r"/mlp/(wi_0|wi_1|wo)$", r"/moe_block/\1"),
        *_COMMON,
        *_LLAMA_NORMS,
    ),
    "llama4": (
        (r"/mlp/router/kernel$", "/Llama4MoEBlock_0/MoeBlock_0/gate/kernel"),
        (r"/mlp/shared/", "/Llama4MoEBlock_0/shared_experts/"),
        (r"/mlp/(wi_0|wi_1|wo)$", r"/Llama4MoEBlock_0/MoeBlock_0/\1"),
        *_COMMON,
        *_LLAMA_NORMS,
    ),
}
# MaxText's GPT-3 builds its fused attention with as many key/value heads as query heads whatever
# base_num_kv_heads says (its reference was made with 2 of 4); nnxtron refuses the mismatch
IGNORED_BY_MAXTEXT = {"gpt3": {"base_num_kv_heads=2": "base_num_kv_heads=4"}}
NORM_OFFSET_BLOCKS = ("gpt3",)  # MaxText's GPT-3 LayerNorm multiplies by 1 + scale (scale 0), nnxtron's by scale (1)


def maxtext_statistics(family: str) -> dict[str, Stats]:
    if family in RUNS:
        with np.load(REFERENCE / family / "initial_params.npz") as data:
            return {k: Stats.of(data[k]) for k in data.files}
    stats = json.loads((REFERENCE / "init" / family / "initial_statistics.json").read_text())
    return {k: Stats(math.prod(s["shape"]), s["mean"], s["std"], s["min"], s["max"]) for k, s in stats.items()}


def _renamed(name: str, rules: tuple[tuple[str, str], ...]) -> str:
    for pattern, replacement in rules:
        name = re.sub(pattern, replacement, name)
    return name


def nnxtron_statistics(family: str) -> tuple[Config, dict[str, Stats]]:
    """nnxtron's initial parameters of ``family``'s MaxText config, under MaxText's names and values."""
    entry = RUNS.get(family) or INIT[family]
    ignored = IGNORED_BY_MAXTEXT.get(family, {})
    cfg = checkpoint_config(str(BASE_YML), [ignored.get(o, o) for o in entry["overrides"]])
    _, params, _, rest = nnx.split(build_model(cfg), nnx.Param, ExpertLoad, ...)
    if cfg.decoder_block in maxtext_tree.SUPPORTED:
        ours = to_maxtext(nnx.to_pure_dict(params), cfg, scanned=True, state=nnx.to_pure_dict(rest))
    else:
        offset = 1.0 if cfg.decoder_block in NORM_OFFSET_BLOCKS else 0.0
        flat = flatten(nnx.to_pure_dict(params))
        ours = {
            _renamed(k, MAXTEXT_NAMES[family]): np.asarray(v) - (offset if k.endswith("norm/scale") else 0.0)
            for k, v in flat.items()
        }
    return cfg, {k: Stats.of(v) for k, v in ours.items()}


def differences(ours: dict[str, Stats], theirs: dict[str, Stats], cfg: Config, deliberate: dict[str, Deliberate]) -> list[str]:
    off = []
    for name, ref in theirs.items():
        got = ours[name]
        if got.size != ref.size:
            off.append(f"{name}: {got.size} values vs MaxText's {ref.size}")
        elif ref.std == 0.0:  # a constant: the same constant
            if not got.low == got.high == ref.low:
                off.append(f"{name}: values in [{got.low}, {got.high}] vs MaxText's constant {ref.low}")
        else:
            factor = deliberate[name].factor(cfg) if name in deliberate else 1.0
            std = ref.std * factor
            # two samples' means differ by ~std * sqrt(2 / n): 4 such errors where that exceeds 10 % (n < 3200)
            mean_tolerance = std * max(TOLERANCE, 4 * np.sqrt(2 / ref.size))
            if abs(got.std / std - 1) > TOLERANCE or abs(got.mean - ref.mean * factor) > mean_tolerance:
                why = f" x {factor:.4f} ({deliberate[name].reason})" if name in deliberate else ""
                off.append(f"{name}: mean {got.mean:+.4f} std {got.std:.4f} vs MaxText {ref.mean:+.4f} {ref.std:.4f}{why}")
    return off


@pytest.mark.parametrize("family", [*RUNS, *INIT])
def test_every_tensor_starts_with_maxtexts_statistics(family):
    cfg, ours = nnxtron_statistics(family)
    theirs = maxtext_statistics(family)
    assert set(ours) == set(theirs), sorted(set(ours) ^ set(theirs))
    off = differences(ours, theirs, cfg, DELIBERATE.get(family, {}))
    assert not off, f"{family}: tensors whose initial statistics are not MaxText's:\n" + "\n".join(off)
