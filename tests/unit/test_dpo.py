"""DPO: the loss, its statistics and every parameter gradient equal a direct implementation
(each answer scored alone with log_softmax, the pairs' losses written out); gradient
accumulation, label smoothing and the row layout of pairs; the train step's metrics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxtron.models.build import build_model
from nnxtron.params import flatten_with_treedef
from nnxtron.train.dpo import DPOSettings, pair_halves
from nnxtron.train.step import Reference, compute_gradients
from tests.conftest import tiny_config

PAIRS, SEQ = 4, 16


def pair_batch(cfg, seed: int = 0) -> dict:
    """``PAIRS`` pairs as 2P rows (chosen sides, then rejected sides): a shared prompt of 5 tokens,
    answers of different lengths, padding after them; the loss mask covers the answers only."""
    rng = np.random.default_rng(seed)
    rows = 2 * PAIRS
    tokens = np.zeros((rows, SEQ + 1), np.int32)
    scored = np.zeros((rows, SEQ + 1), bool)
    for pair in range(PAIRS):
        prompt = rng.integers(3, cfg.vocab_size, 5)
        for side in range(2):
            answer = rng.integers(3, cfg.vocab_size, 4 + pair + 3 * side)
            sequence = np.concatenate([prompt, answer])
            row = side * PAIRS + pair
            tokens[row, : sequence.size] = sequence
            scored[row, 5 : sequence.size] = True
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (rows, SEQ)).copy(),
        "segment_ids": np.ones((rows, SEQ), np.int32),
        "loss_mask": scored[:, 1:].astype(np.float32),
    }


def direct_dpo(model_fn, params, reference_params, batch, beta, eps):
    """The DPO loss written out: every answer scored alone; pair j = rows j and P + j."""

    def answer_logp(p, row):
        logits = model_fn(p, batch["inputs"][row : row + 1])[0]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(logp, batch["targets"][row][:, None], axis=-1)[:, 0]
        return jnp.sum(picked * batch["loss_mask"][row])

    losses, accuracy = [], []
    for j in range(PAIRS):
        chosen = beta * (answer_logp(params, j) - jax.lax.stop_gradient(answer_logp(reference_params, j)))
        rejected = beta * (answer_logp(params, PAIRS + j) - jax.lax.stop_gradient(answer_logp(reference_params, PAIRS + j)))
        margin = chosen - rejected
        losses.append(-(1 - eps) * jnp.log(jax.nn.sigmoid(margin)) - eps * jnp.log(jax.nn.sigmoid(-margin)))
        accuracy.append(margin > 0)
    return jnp.mean(jnp.stack(losses)), jnp.mean(jnp.stack(accuracy).astype(jnp.float32))


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config("llama3.1-tiny", base_num_decoder_layers=2)
    model = build_model(cfg, seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    # the policy: the reference moved by a step of noise, so the two differ
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    moved = [x + 0.05 * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    policy = jax.tree.unflatten(treedef, moved)
    return cfg, graphdef, policy, params, rest


@pytest.mark.parametrize("beta, eps", [(0.1, 0.0), (0.5, 0.2)])
def test_dpo_loss_and_gradients_equal_a_direct_implementation(setup, beta, eps):
    cfg, graphdef, policy, reference, rest = setup
    batch = {k: jnp.asarray(v) for k, v in pair_batch(cfg).items()}
    settings = DPOSettings(beta, eps, blocks=1)
    ours = compute_gradients(graphdef, policy, rest, batch, reference=Reference(reference, rest), dpo=settings)

    def direct(p):
        fn = lambda params, tokens: nnx.merge(graphdef, params, rest)(tokens).logits  # noqa: E731
        return direct_dpo(fn, p, reference, batch, beta, eps)

    (loss, accuracy), grads = jax.value_and_grad(direct, has_aux=True)(policy)
    # the answers' log-probabilities are sums of ~10 tokens of ~6 nats, computed in a batch of 8 rows against
    # rows alone (float32 op order): measured 3.6e-6 on the loss at beta 0.5; a swapped pair or a missing
    # reference term moves it by > 0.05
    assert abs(float(ours.loss) - float(loss)) < 2e-5, (float(ours.loss), float(loss))
    assert float(ours.stats["dpo/reward_accuracy"]) == float(accuracy)
    assert float(ours.tokens) == float(batch["loss_mask"].sum())
    assert_close_trees(ours.grads, grads)
    assert 0.0 < float(accuracy) < 1.0 and float(loss) != pytest.approx(np.log(2), abs=1e-3)  # the pairs disagree


def test_dpo_with_gradient_accumulation_equals_one_batch(setup):
    cfg, graphdef, policy, reference, rest = setup
    batch = {k: jnp.asarray(v) for k, v in pair_batch(cfg, seed=3).items()}
    settings = DPOSettings(0.2, 0.1, blocks=1)
    whole = compute_gradients(graphdef, policy, rest, batch, reference=Reference(reference, rest), dpo=settings)
    split = compute_gradients(graphdef, policy, rest, batch, 2, reference=Reference(reference, rest), dpo=settings)
    assert abs(float(whole.loss) - float(split.loss)) < 1e-6
    for name in whole.stats:
        assert abs(float(whole.stats[name]) - float(split.stats[name])) < 1e-5, name
    assert_close_trees(split.grads, whole.grads)


def test_at_the_reference_the_loss_is_log_2_and_the_gradient_prefers_the_chosen(setup):
    """policy = reference: every margin is 0, the loss log 2; a small step down the gradient
    raises the chosen answers' log-probabilities relative to the rejected ones."""
    cfg, graphdef, _, reference, rest = setup
    batch = {k: jnp.asarray(v) for k, v in pair_batch(cfg, seed=5).items()}
    settings = DPOSettings(0.1, 0.0, blocks=1)
    g = compute_gradients(graphdef, reference, rest, batch, reference=Reference(reference, rest), dpo=settings)
    assert float(g.loss) == pytest.approx(np.log(2), abs=1e-6)
    stepped = optax.apply_updates(reference, jax.tree.map(lambda x: -1e-2 * x / optax.tree.norm(g.grads), g.grads))
    after = compute_gradients(graphdef, stepped, rest, batch, reference=Reference(reference, rest), dpo=settings)
    assert float(after.loss) < float(g.loss)
    assert float(after.stats["dpo/margin"]) > 0


def test_pair_halves_pairs_rows_of_each_block():
    rows = jnp.arange(12.0)  # 2 blocks of 6 rows: chosen 0,1,2 / rejected 3,4,5; chosen 6,7,8 / rejected 9,10,11
    chosen, rejected = pair_halves(rows, blocks=2)
    assert chosen.tolist() == [0, 1, 2, 6, 7, 8] and rejected.tolist() == [3, 4, 5, 9, 10, 11]


def assert_close_trees(ours, direct, rtol: float = 1e-4):
    """Every leaf within ``rtol`` of its norm, and the whole within ``rtol`` of the total norm."""
    a, _ = flatten_with_treedef(ours)
    b, _ = flatten_with_treedef(direct)
    assert a.keys() == b.keys()
    total = np.sqrt(sum(float(np.sum(np.square(np.asarray(v, np.float64)))) for v in b.values()))
    assert total > 0
    diff = np.sqrt(sum(float(np.sum(np.square(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64)))) for k in a))
    assert diff <= rtol * total, (diff, total)
    for key in a:
        scale = float(np.linalg.norm(np.asarray(b[key], np.float64)))
        err = float(np.linalg.norm(np.asarray(a[key], np.float64) - np.asarray(b[key], np.float64)))
        assert err <= rtol * max(scale, 1e-3 * total), (key, err, scale)


def test_plan_counts_the_reference_in_the_step_arguments(tmp_path):
    """`nnxtron plan use_dpo=true`: the compiled step's arguments grow by one copy of the parameters
    and model state (the frozen reference), and the report says so."""
    from nnxtron.tools.plan import format_plan, make_plan

    (tmp_path / "pairs.jsonl").write_text('{"prompt": "a", "chosen": " b", "rejected": " c"}\n')
    common = dict(model_name="llama3.1-tiny", dataset_type="jsonl", dataset_path=(str(tmp_path / "pairs.jsonl"),))
    plain = make_plan(tiny_config(**common))
    dpo = make_plan(tiny_config(**common, use_dpo=True, packing="pad"))
    state = dpo["state_per_device"]
    grown = dpo["memory"]["argument_bytes"] - plain["memory"]["argument_bytes"]
    # (a model-state leaf the step never reads is dropped from the compiled arguments by jit)
    assert state["params_bytes"] <= grown <= state["params_bytes"] + state["other_state_bytes"]
    assert "the DPO reference" in format_plan(dpo) and "the DPO reference" not in format_plan(plain)
