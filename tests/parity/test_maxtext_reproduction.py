"""nnxtron reproduces MaxText 0.2.5's training step for step (issue 24).

The goldens (tests/assets/maxtext/reference/<family>/, README there) are MaxText's own runs, made
by scripts/maxtext_reference.py in MaxText's environment: its initial checkpoint (MaxText's
initialiser, saved by MaxText's param-only writer, loaded back by MaxText), its logits on fixed
tokens, and 20 steps of MaxText's jitted ``train_step`` on stored token batches (float32, one CPU
device, AdamW with MaxText's defaults, lr 1e-3 with warm-up and cosine decay, clipping at 1.0).
Each family's ``key=value`` list (manifest.json) is given unchanged to nnxtron's MaxText config
loader with MaxText's base.yml: the same command, and these tests check the same numbers:

* the logits of nnxtron's model loaded from MaxText's checkpoint (``convert.maxtext``) equal
  MaxText's;
* nnxtron's own train step (``train.step.make_train_step``) on the same batches from the same
  parameters gives MaxText's loss at every step (relative difference <= 1e-4, the issue's bound)
  — and DeepSeek's MTP loss, Mixtral's MoE load-balance loss (weight 0.01, MaxText's per-sequence
  definition averaged over the layers: ``load_balance_convention=maxtext``, which a MaxText config
  sets) and the objective they add up to — and its final parameters.

Measured (float32, CPU, jax 0.10.2; XLA -O0 as tests/conftest.py sets it); max relative
difference per step of the cross-entropy (loss), MTP loss, load-balance loss (lb) and objective:

    family     logits max |d|   loss     MTP      lb       objective   final params max |d| / max |leaf|
    llama2     1.4e-6           2.7e-7   -        -        2.7e-7      2.1e-7
    mixtral    1.2e-6           3.6e-7   -        9.0e-8   3.5e-7      2.2e-7
    deepseek3  1.4e-6           2.7e-7   2.2e-7   -        2.7e-7      2.9e-7

Bounds, from these: logits LOGIT_TOL (abs; |logits| <= 4.1); loss LOSS_RTOL = 1e-5 per step,
stricter than the issue's 1e-4; parameters per leaf ``max |d| <= PARAM_RTOL * max |MaxText leaf|``
with PARAM_RTOL = 2e-5. A different optimizer setting moves the loss by >= 4e-5 and a parameter
by >= 8.8e-4 (test_a_different_optimizer_setting_is_caught); nnxtron's own load-balance convention
moves Mixtral's lb loss by 0.98, its loss by 4.8e-5 and a parameter by 4.7e-3
(test_nnxtrons_load_balance_convention_is_caught); a wrongly transposed expert kernel moves the
logits by 0.35.
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxtron.config import derive
from nnxtron.config.loader import load_config
from nnxtron.config.schema import Config
from nnxtron.convert.maxtext import from_maxtext, load_maxtext_model, read_maxtext_checkpoint
from nnxtron.errors import ConfigError
from nnxtron.parallel.mesh import make_mesh
from nnxtron.params import flatten
from nnxtron.train.optimizer import make_optimizer
from nnxtron.train.state import init_state, setup
from nnxtron.train.step import batch_sharding, device_batch, make_train_step

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the MaxText reference helpers
from maxtext_reference import nnxtron_batch  # noqa: E402

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "maxtext"
REFERENCE = ASSETS / "reference"
BASE_YML = ASSETS / "base.yml"  # MaxText 0.2.5's own base.yml
MANIFEST = json.loads((REFERENCE / "manifest.json").read_text())
FAMILIES = tuple(MANIFEST["families"])
LOGIT_TOL = 5e-6
LOSS_RTOL = 1e-5  # the issue asks <= 1e-4; measured <= 4e-7
PARAM_RTOL = 2e-5  # measured <= 2.3e-6


def maxtext_config(family: str, *extra: str) -> Config:
    """nnxtron's config from the family's MaxText key=value list, as `nnxtron train base.yml k=v ...`."""
    return load_config(BASE_YML, [*MANIFEST["families"][family]["overrides"], *extra])


def npz(family: str, name: str) -> dict[str, np.ndarray]:
    with np.load(REFERENCE / family / name) as data:
        return dict(data)


def maxtext_metrics(family: str) -> list[dict[str, float]]:
    return json.loads((REFERENCE / family / "metrics.json").read_text())


@dataclass(frozen=True)
class Run:
    logits: np.ndarray
    metrics: list[dict[str, float]]
    params: dict[str, np.ndarray]  # flat, nnxtron's paths
    state: dict[str, np.ndarray]  # model state (router biases), flat


@functools.cache
def reproduce(family: str, *extra: str) -> Run:
    """nnxtron from MaxText's initial checkpoint: logits on the fixed tokens, then one train
    step per stored batch (one device, like MaxText's run)."""
    cfg = maxtext_config(family, *extra)
    model = load_maxtext_model(REFERENCE / family / "initial_checkpoint", cfg)
    tokens = npz(family, "logits.npz")
    logits = model(
        jnp.asarray(tokens["inputs"]), jnp.asarray(tokens["inputs_position"]), jnp.asarray(tokens["inputs_segmentation"])
    )
    _, params, rest = nnx.split(model, nnx.Param, ...)
    mesh = make_mesh(cfg, devices=jax.devices()[:1])
    tx, schedule = make_optimizer(cfg, derive(cfg, 1))
    model_setup = setup(cfg, mesh, tx)
    state = init_state(cfg, model_setup, tx, params=nnx.to_pure_dict(params), rest=nnx.to_pure_dict(rest))
    step = make_train_step(cfg, model_setup, tx, schedule)
    shardings = batch_sharding(cfg, model_setup)
    batches = npz(family, "batches.npz")
    metrics = []
    for i in range(cfg.steps):
        state, step_metrics = step(state, device_batch(nnxtron_batch(batches, i), shardings))
        metrics.append({k: float(v) for k, v in jax.device_get(step_metrics).items()})
    params_out = flatten(jax.tree.map(np.asarray, state["params"]))
    state_out = flatten(jax.tree.map(np.asarray, state["rest"]))
    return Run(np.asarray(logits.logits), metrics, params_out, state_out)


def loss_differences(run: Run, family: str) -> dict[str, np.ndarray]:
    """Per-step relative differences to MaxText: the cross-entropy (MaxText's lm_loss), with MTP
    the scaled MTP loss (MaxText's mtp_loss, nnxtron's aux/mtp), with a load-balance weight the
    MoE load-balance loss (moe_lb_loss, nnxtron's aux/moe_lb_loss) and the objective (MaxText's
    loss: the cross-entropy plus those)."""
    reference = maxtext_metrics(family)
    cfg = maxtext_config(family)

    def relative(ours: list[float], key: str) -> np.ndarray:
        theirs = np.array([r[key] for r in reference])
        return np.abs(np.array(ours) - theirs) / np.abs(theirs)

    out = {"loss": relative([m["loss"] for m in run.metrics], "learning/lm_loss")}
    if cfg.mtp_num_layers:
        out["mtp"] = relative([m["aux/mtp"] for m in run.metrics], "learning/mtp_loss")
    if cfg.load_balance_loss_weight > 0:
        out["moe_lb_loss"] = relative([m["aux/moe_lb_loss"] for m in run.metrics], "learning/moe_lb_loss")
    objective = [m["loss"] + sum(v for k, v in m.items() if k.startswith("aux/")) for m in run.metrics]
    out["objective"] = relative(objective, "learning/loss")
    return out


def parameter_differences(run: Run, family: str) -> dict[str, float]:
    """max |nnxtron - MaxText| / max |MaxText| per leaf of the final parameters and model state."""
    params, state = from_maxtext(npz(family, "final_params.npz"), maxtext_config(family))
    expected = {**flatten(params), **flatten(state)}
    got = {**run.params, **{k: v for k, v in run.state.items() if k in flatten(state)}}
    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
    return {k: float(np.abs(got[k] - v).max() / max(np.abs(v).max(), 1e-30)) for k, v in expected.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_stored_checkpoint_holds_the_stored_initial_parameters(family: str) -> None:
    """MaxText's initial checkpoint and initial_params.npz are the same arrays (the driver wrote
    both from MaxText's state); the checkpoint is read without MaxText."""
    stored = read_maxtext_checkpoint(REFERENCE / family / "initial_checkpoint")
    initial = npz(family, "initial_params.npz")
    assert stored.keys() == initial.keys(), sorted(set(stored) ^ set(initial))
    for key, value in initial.items():
        np.testing.assert_array_equal(stored[key], value, err_msg=key)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_maxtexts(family: str) -> None:
    expected = npz(family, "logits.npz")["logits"]
    diff = float(np.abs(reproduce(family).logits - expected).max())
    assert diff <= LOGIT_TOL, (
        f"{family}: max |logits - MaxText's| = {diff:.3g} > {LOGIT_TOL} (max |logit| {np.abs(expected).max():.3g})"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_the_loss_curve_reproduces_maxtexts(family: str) -> None:
    run = reproduce(family)
    reference = maxtext_metrics(family)
    lr = np.array([m["learning_rate"] for m in run.metrics])
    np.testing.assert_allclose(lr, [r["learning/current_learning_rate"] for r in reference], rtol=1e-6, atol=1e-12)
    for name, diff in loss_differences(run, family).items():
        worst = int(np.argmax(diff))
        assert diff.max() <= LOSS_RTOL, f"{family}: {name} differs from MaxText's by {diff.max():.3g} (relative) at step {worst}"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_final_parameters_are_maxtexts(family: str) -> None:
    diffs = parameter_differences(reproduce(family), family)
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= PARAM_RTOL, f"{family}: {worst} differs from MaxText's by {diffs[worst]:.3g} of its max |value|"


def test_a_different_optimizer_setting_is_caught() -> None:
    """adam_b2=0.99 instead of MaxText's 0.95 moves both the loss curve and the final parameters
    past the bounds above (measured: loss 4.1e-5, parameters 8.8e-4). nnxtron's own weight-decay
    mask (matrices only: 2.8e-4 / 1.0e-3) and schedule arithmetic (2.6e-4 / 1.4e-3) are caught
    too: mutants maxtext-decay-on-matrices-only and maxtext-optax-schedule (tests/mutation/mutants.py)."""
    run = reproduce("llama2", "adam_b2=0.99")
    loss = loss_differences(run, "llama2")["loss"].max()
    params = max(parameter_differences(run, "llama2").values())
    assert loss > LOSS_RTOL and params > PARAM_RTOL, (loss, params)


def test_nnxtrons_load_balance_convention_is_caught() -> None:
    """The mixtral run trains with MaxText's load-balance loss (weight 0.01): nnxtron's own
    convention (over the call, summed over the layers) moves the loss past the bound
    (measured: moe_lb_loss 0.98 relative, cross-entropy 4.8e-5, parameters 4.7e-3)."""
    run = reproduce("mixtral", "load_balance_convention=nnxtron")
    diffs = loss_differences(run, "mixtral")
    params = max(parameter_differences(run, "mixtral").values())
    assert diffs["moe_lb_loss"].max() > 0.5 and diffs["loss"].max() > LOSS_RTOL and params > PARAM_RTOL, (diffs, params)


def test_maxtexts_schedule_arithmetic_is_for_its_own_schedules() -> None:
    """MaxText has cosine and WSD; its arithmetic on nnxtron's other schedules is one error line."""
    with pytest.raises(ConfigError, match="lr_schedule_convention=maxtext follows MaxText's schedules"):
        load_config(values={"model_name": "llama2-tiny", "lr_schedule_convention": "maxtext", "lr_schedule_type": "linear"})
