"""Multi-token prediction: the loss against a hand-built reference, packed-segment shifts,
gradients reaching every MTP parameter, and the loss reaching the training objective."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxtron.models.build import build_model
from nnxtron.models.mtp import shift_left, valid_ahead
from nnxtron.tools.parity import loss_and_grads
from tests.conftest import random_batch, tiny_config

FACTOR = 0.3


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config("deepseek3-test", mtp_num_layers=2, mtp_loss_scaling_factor=FACTOR, mtp_eval_target_module=2)
    batch = {k: jnp.asarray(v) for k, v in random_batch(cfg, batch=2, seq=12, packed=True).items()}
    return cfg, build_model(cfg), batch


@nnx.jit
def _forward(model, batch):
    return model(batch["inputs"], batch["positions"], batch["segment_ids"], batch["targets"], batch["loss_mask"])


@pytest.fixture(scope="module")
def output(setup):
    _, model, batch = setup
    return _forward(model, batch)


def _np_cross_entropy(logits: np.ndarray, target: int) -> float:
    logits = logits.astype(np.float64)
    return float(np.log(np.sum(np.exp(logits - logits.max()))) + logits.max() - logits[target])


def test_shift_and_validity_respect_segments():
    segments = jnp.asarray([[1, 1, 1, 2, 2, 0]])
    mask = jnp.asarray([[1, 1, 0, 1, 1, 0]], jnp.float32)
    assert shift_left(jnp.arange(6)[None], 2).tolist() == [[2, 3, 4, 5, 0, 0]]
    # t+1 exists, same segment, and the loss mask at t+1 is on
    assert valid_ahead(segments, mask, 1).tolist() == [[1, 0, 0, 1, 0, 0]]
    assert valid_ahead(segments, None, 2).tolist() == [[1, 0, 0, 0, 0, 0]]


@pytest.fixture(scope="module")
def by_hand(setup):
    """Per-depth MTP logits built from the model's pieces, following the definition:
    depth k at t = block_k(W_k [norm(emb(tok[t+k])) ; norm(h_{k-1}[t])]) -> own norm -> shared LM head."""
    cfg, model, batch = setup

    @nnx.jit
    def run(model, batch):
        positions, segments, inputs = batch["positions"], batch["segment_ids"], batch["inputs"]
        h = model.embed(inputs)
        for name in model.stack_names:
            h, _ = getattr(model, name)(h, positions, segments)
        logits = []
        for k, depth in enumerate(model.mtp.depths, start=1):
            ahead = jnp.zeros_like(inputs).at[:, :-k].set(inputs[:, k:])
            combined = jnp.concatenate([depth.embedding_norm(model.embed(ahead)), depth.hidden_norm(h)], -1)
            h, _ = depth.block(depth.projection(combined), positions, segments)
            logits.append(model.output_head(depth.final_norm(h)))
        return logits

    return [np.asarray(x) for x in run(model, batch)]


def _valid(batch, b: int, t: int, k: int) -> bool:
    seg, mask = np.asarray(batch["segment_ids"]), np.asarray(batch["loss_mask"])
    return t + k < seg.shape[1] and seg[b, t + k] == seg[b, t] and bool(mask[b, t + k])


def test_mtp_loss_matches_a_hand_computed_reference(setup, by_hand, output):
    """Scored against target[t+k], only where t+k is in t's segment and a loss token;
    token-weighted over depths and scaled by mtp_loss_scaling_factor."""
    cfg, model, batch = setup
    out = output
    targets = np.asarray(batch["targets"])
    total, count = 0.0, 0
    for k, logits in enumerate(by_hand, start=1):
        for b in range(targets.shape[0]):
            for t in range(targets.shape[1]):
                if _valid(batch, b, t, k):
                    total += _np_cross_entropy(logits[b, t], int(targets[b, t + k]))
                    count += 1
    reference = total / count
    assert count > 0 and abs(float(out.aux["mtp_loss"]) - reference) <= 1e-5 * reference
    assert abs(float(out.aux["losses"]["mtp"]) - FACTOR * reference) <= 1e-5 * reference


def test_acceptance_rate_counts_agreement_with_the_main_head(setup, by_hand, output):
    """Depth k's prediction at t agrees with the main head's at t+k (both predict target[t+k])."""
    cfg, model, batch = setup
    out = output
    main = np.argmax(np.asarray(out.logits), -1)
    mtp = np.argmax(by_hand[cfg.mtp_eval_target_module - 1], -1)
    k, accepted, predictions = cfg.mtp_eval_target_module, 0, 0
    for b in range(main.shape[0]):
        for t in range(main.shape[1]):
            if _valid(batch, b, t, k):
                predictions += 1
                accepted += int(mtp[b, t] == main[b, t + k])
    assert [float(v) for v in out.aux["mtp_acceptance"]] == [accepted, predictions]


def test_mtp_is_in_the_objective_and_trains_every_mtp_parameter(setup):
    """The training objective carries the scaled MTP loss; dropping or zeroing it would leave
    the MTP parameters without gradient (and the aux entry missing or zero)."""
    cfg, model, batch = setup
    result = loss_and_grads(model, batch)
    assert result.aux["mtp"] > 0.1 * FACTOR
    mtp_grads = {k: v for k, v in result.param_grads.items() if k.startswith("mtp/")}
    assert {k.split("/")[3] for k in mtp_grads} >= {"embedding_norm", "hidden_norm", "projection", "block"}
    for key, grad in mtp_grads.items():
        assert np.linalg.norm(grad) > 0, f"{key} gets no gradient"
    # the scale factor is applied to what the optimizer sees: the MTP gradients scale with it
    half = nnx.clone(model)
    half.mtp.scale = FACTOR / 2
    halved = loss_and_grads(half, batch)
    key = "mtp/depths/0/projection/kernel"
    np.testing.assert_allclose(halved.param_grads[key], result.param_grads[key] / 2, rtol=2e-4, atol=1e-9)


def test_no_targets_means_no_mtp(setup):
    _, model, batch = setup
    out = nnx.jit(lambda m, b: m(b["inputs"], b["positions"], b["segment_ids"]))(model, batch)
    assert "mtp_loss" not in out.aux and "mtp" not in out.aux.get("losses", {})
