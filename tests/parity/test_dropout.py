"""Dropout (``dropout_rate``, ``enable_dropout``): real masks, the same under every strategy.

The masks are a pure function of (``init_weights_seed``, step, row of the global batch,
layer, site) (``layers/dropout.py``), so with dropout on every execution strategy still
computes the same training objective: scanned == unrolled layers, gradient accumulation
== one batch, GPipe and circular pipelines (and a partial pipeline with its tail stack)
== the sequential model, data and fsdp meshes == one device. Measured on this CPU in
float32 (2026-12) with dropout_rate=0.5 (relative errors): scanned vs unrolled bit-identical
(llama, gemma3, gpt3, mixtral); accumulation 2 vs 1: loss 0, aggregate gradient 3.3e-7;
data2 / fsdp2 vs one device: loss 0, aggregate 1.8e-7; GPipe 4 stages: loss 2.2e-7, aggregate
7.4e-7; circular 2x2: loss 1.1e-7, aggregate 7.5e-7 — as without dropout. The bounds are the
strategy-parity ones (tests/parity/test_pipeline.py), >= 6x each measurement; a mask that
depends on the strategy (a pipeline repeat or a tail stack folding the wrong block index)
moves the loss by 1.2e-1 (the dropout mutants in tests/mutation/mutants.py).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxtron.config import derive, load_config
from nnxtron.config.stacks import built_stacks
from nnxtron.errors import ConfigError
from nnxtron.infer.generate import generate
from nnxtron.layers import dropout
from nnxtron.models.build import build_model
from nnxtron.models.mtp import MultiTokenPrediction
from nnxtron.models.registry import family_for
from nnxtron.parallel.mesh import make_mesh
from nnxtron.parallel.remat import RematSpec
from nnxtron.parallel.row_keys import row_keys
from nnxtron.parallel.scan import LayerStack
from nnxtron.tools.parity import GradResult, assert_grad_parity, loss_and_grads, with_tail_stack_merged
from nnxtron.train.loop import Trainer
from nnxtron.train.optimizer import make_optimizer
from nnxtron.train.state import setup
from nnxtron.train.step import batch_sharding, device_batch, make_eval_step, make_train_step
from tests.conftest import random_batch, tiny_config
from tests.integration.conftest import PARAGRAPH, metric_records, train_overrides

BOUNDS = dict(loss_rtol=2e-6, rel=1e-5, abs_frac=1e-6, aggregate_rel=5e-6)
RATE = 0.5
STEP = 7
LAYERS = dict(base_num_decoder_layers=4)


def _batch(cfg) -> dict:
    return random_batch(cfg, batch=8, seq=16, packed=True)


@functools.cache
def _result(model: str, devices: int = 1, accumulation: int = 1, step: int | None = STEP, **overrides) -> GradResult:
    cfg = tiny_config(model, dropout_rate=RATE, **overrides)
    mesh = make_mesh(cfg, jax.devices()[:devices]) if devices > 1 or "ici_pipeline_parallelism" in overrides else None
    return loss_and_grads(build_model(cfg), _batch(cfg), mesh=mesh, accumulation_steps=accumulation, dropout_step=step)


def _initial_state(model: nnx.Module, tx) -> dict:
    _, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    return {"params": params, "rest": rest, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}


# ------------------------------------------------------------------ (a) strategy parity with dropout on
@pytest.mark.parametrize("model", ["llama3.1-tiny", "gemma3-tiny", "gpt3-52k", "mixtral-tiny"])
def test_scanned_equals_unrolled(model):
    """Per-block keys in the scan (the block index is scanned over) equal the Python loop's;
    gemma3 runs a cycle stack and a remainder stack, mixtral MoE blocks, gpt3 its plain MLP."""
    assert_grad_parity(_result(model, scan_layers=False), _result(model, scan_layers=True), **BOUNDS)


def test_accumulation_equals_one_batch():
    """The per-row keys travel with their rows into the microbatches."""
    assert_grad_parity(_result("llama3.1-tiny", accumulation=2), _result("llama3.1-tiny"), **BOUNDS)


@pytest.mark.parametrize(
    "mesh", [dict(ici_data_parallelism=2, ici_fsdp_parallelism=1), dict(ici_fsdp_parallelism=2)], ids=["data2", "fsdp2"]
)
def test_sharded_equals_one_device(mesh):
    assert_grad_parity(_result("llama3.1-tiny", devices=2, **mesh), _result("llama3.1-tiny"), **BOUNDS)


PIPELINES = {
    "gpipe_4_stages": dict(ici_pipeline_parallelism=4, ici_fsdp_parallelism=1),
    "circular_2_stages_2_repeats_4_microbatches": dict(
        ici_pipeline_parallelism=2, ici_fsdp_parallelism=2, num_pipeline_microbatches=4
    ),
}


@pytest.mark.parametrize("case", list(PIPELINES))
def test_pipeline_equals_the_sequential_model(case):
    """Block (repeat, stage, j) folds in its stack index: every stage, repeat and
    microbatch draws the masks the sequential model draws there."""
    result = _result("llama3.1-tiny", devices=4, **LAYERS, **PIPELINES[case])
    assert_grad_parity(result, _result("llama3.1-tiny", **LAYERS), **BOUNDS)


def test_partial_pipeline_tail_stack_continues_the_block_indices():
    """pipeline_parallel_layers=2 of 4: the tail stack's blocks fold in 2 and 3 (``first_block``)."""
    pipeline = dict(PIPELINES["circular_2_stages_2_repeats_4_microbatches"], pipeline_parallel_layers=2)
    result = _result("llama3.1-tiny", devices=4, **LAYERS, **pipeline)
    result = with_tail_stack_merged(result, first_block=2)
    assert_grad_parity(result, _result("llama3.1-tiny", **LAYERS), **BOUNDS)


# ------------------------------------------------------------------ (b) the masks are real and differ
def test_dropout_changes_the_step_and_each_step_draws_new_masks():
    off, on, other_step = (_result("llama3.1-tiny", step=s) for s in (None, STEP, STEP + 1))
    assert abs(on.loss - off.loss) > 1e-2 * off.loss
    assert abs(other_step.loss - on.loss) > 1e-3 * on.loss


def test_the_mtp_depths_drop_with_their_own_masks():
    """MTP drops (MaxText's sites: its embeddings ahead, inside its block, its normed output):
    its loss moves with dropout on and from step to step, and the main loss is unchanged by it."""
    mtp = dict(mtp_num_layers=1, **LAYERS)
    off, on, other_step = (_result("llama3.1-tiny", step=s, **mtp) for s in (None, STEP, STEP + 1))
    mtp_loss = [r.aux["mtp"] for r in (off, on, other_step)]  # scaled by mtp_loss_scaling_factor
    assert abs(mtp_loss[1] - mtp_loss[0]) > 1e-2 * mtp_loss[0]
    assert abs(mtp_loss[2] - mtp_loss[1]) > 1e-3 * mtp_loss[1]
    assert on.loss == _result("llama3.1-tiny", **LAYERS).loss  # the main model's masks do not depend on MTP


def test_the_mtp_depths_drop_on_the_same_hidden_states():
    """The MTP module alone (as the decoder builds it), on fixed hidden states, embeddings and head:
    its loss moves with dropout keys and with the step. The main model plays no part, so depths that
    ignore their keys leave the loss exactly as without them (the dropout-not-in-mtp mutant)."""
    cfg = tiny_config("llama3.1-tiny", dropout_rate=RATE, mtp_num_layers=1, base_num_decoder_layers=1)
    kind = built_stacks(cfg)[-1].layout.kinds[-1]  # the decoder's MTP blocks are of its last layer's kind
    with nnx.use_eager_sharding(False):
        mtp = MultiTokenPrediction(cfg, lambda rngs: family_for(cfg.decoder_block).make_block(cfg, rngs, kind), jax.random.key(0))
    rows, seq = 4, 8
    batch = random_batch(cfg, batch=rows, seq=seq)
    rng = np.random.default_rng(0)
    hidden, embedded = (jnp.asarray(rng.normal(size=(rows, seq, cfg.base_emb_dim)), jnp.float32) for _ in range(2))
    head = jnp.asarray(rng.normal(size=(cfg.base_emb_dim, cfg.vocab_size)), jnp.float32)
    targets, positions, segments = (jnp.asarray(batch[k]) for k in ("targets", "positions", "segment_ids"))
    main_logits = jnp.zeros((rows, seq, cfg.vocab_size), jnp.float32)  # read only by mtp_eval_target_module

    @jax.jit
    def mtp_loss(keys):
        return mtp(hidden, embedded, lambda x: x @ head, main_logits, targets, positions, segments, None, keys)["mtp_loss"]

    off, on, again, other_step = (
        float(mtp_loss(None if step is None else row_keys(0, jnp.int32(step), rows))) for step in (None, STEP, STEP, STEP + 1)
    )
    assert on == again
    assert abs(on - off) > 1e-2 * off
    assert abs(other_step - on) > 1e-3 * on


def _kept_after_stack(num_layers: int, scan: bool, rows: int = 2, width: int = 4096) -> np.ndarray:
    """Ones [rows, 1, width] through a stack of blocks that only drop their output."""

    class DropOnly(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.unused = nnx.Param(jnp.zeros(()))

        def __call__(self, x, dropout_keys=None):
            return dropout.dropout(x, dropout_keys, RATE, dropout.LAYER_OUTPUT)

    stack = LayerStack(DropOnly, num_layers, key=jax.random.key(0), scan=scan, remat=RematSpec("none"))
    keys = row_keys(0, jnp.int32(STEP), rows)
    y, _ = stack(jnp.ones((rows, 1, width)), dropout_keys=keys)
    return np.asarray(y)[:, 0]


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_each_layer_and_row_draws_its_own_mask(scan):
    """Two layers with the same mask would keep 1/2 of the units; independent masks keep 1/4.
    Two rows with the same mask would be equal."""
    y = _kept_after_stack(2, scan)
    kept = np.mean(y != 0, axis=-1)
    np.testing.assert_allclose(kept, (1 - RATE) ** 2, atol=0.03)
    assert not np.array_equal(y[0], y[1])


def test_rows_of_a_batch_and_steps_get_different_keys():
    keys = row_keys(3, jnp.int32(1), 4)
    data = {tuple(np.asarray(jax.random.key_data(k))) for k in keys}
    data |= {tuple(np.asarray(jax.random.key_data(k))) for k in row_keys(3, jnp.int32(2), 4)}
    assert len(data) == 8


# every family's block: the layer-output site (and, in dense blocks and shared experts, the MLP site) is live
BLOCKS = {
    "llama3.1-tiny": dict(),
    "gemma3-tiny": dict(),
    "gpt3-52k": dict(),
    "mixtral-tiny": dict(),
    "qwen3-tiny": dict(),
    "deepseek4-test": dict(shared_experts=0),
    "deepseek3-test": dict(),  # MoE with a shared expert: its intermediate activations are dropped
}


@pytest.mark.parametrize("model", list(BLOCKS))
def test_each_family_block_drops_its_output_and_its_mlp_activations(model):
    """The block's output is zero on a fraction ~rate of the units, one mask per row shared
    along axis -2; the kept units are the undropped output / (1 - rate) exactly when only the
    output is dropped (MoE blocks without a shared expert: routed experts are not dropped, as in
    MaxText), and differ from it when the dense MLP's or the shared expert's intermediate
    activations are dropped too."""
    cfg = tiny_config(model, dropout_rate=RATE, **BLOCKS[model])
    stack = built_stacks(cfg)[-1].layout
    with nnx.use_eager_sharding(False):
        block = family_for(cfg.decoder_block).make_block(cfg, nnx.Rngs(0), stack.kinds[0])
    rows, seq = 16, 4
    batch = random_batch(cfg, batch=rows, seq=seq)
    width = (cfg.mhc_expansion_rate, cfg.base_emb_dim) if cfg.decoder_block == "deepseek4" else (cfg.base_emb_dim,)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(rows, seq, *width)), jnp.float32)
    args = (batch["positions"], batch["segment_ids"]) + ((batch["inputs"],) if cfg.decoder_block == "deepseek4" else ())

    def output(keys):
        out = block(x, *args) if keys is None else block(x, *args, dropout_keys=keys)
        return np.asarray(out[0] if isinstance(out, tuple) else out)

    plain, dropped = output(None), output(row_keys(0, jnp.int32(STEP), rows))
    zero = dropped == 0
    units = zero[..., 0, :].size  # independent draws: the mask is shared along axis -2
    assert abs(zero.mean() - RATE) < 4 * np.sqrt(RATE * (1 - RATE) / units) and (zero == zero[..., :1, :]).all()
    kept_equal = np.allclose(dropped[~zero] * (1 - RATE), plain[~zero], rtol=1e-5, atol=1e-6)
    assert kept_equal == (stack.kinds[0].moe and cfg.shared_experts == 0)


def test_the_embeddings_and_the_final_hidden_states_are_dropped():
    """Embedding site: before GPT-3's learned position embeddings are added (the dropped
    units are exactly the position embedding); head site: after the final norm."""
    cfg = tiny_config("gpt3-52k", dropout_rate=RATE)
    model = build_model(cfg)
    batch = random_batch(cfg, batch=16, seq=4)
    keys = row_keys(0, jnp.int32(STEP), 16)
    tokens, positions = jnp.asarray(batch["inputs"]), jnp.asarray(batch["positions"])
    embedded = model.embed(tokens)
    dropped = np.asarray(model.embed_scale_and_positions(embedded, positions, keys) - model.position_embed(positions))
    zero = dropped == 0
    assert abs(zero.mean() - RATE) < 0.05 and (zero == zero[:, :1]).all()
    np.testing.assert_allclose(dropped[~zero] * (1 - RATE), np.asarray(embedded)[~zero], rtol=1e-5, atol=1e-6)
    hidden = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4, cfg.base_emb_dim)), jnp.float32)
    assert np.array_equal(model.head(hidden, None), model.head(hidden))
    assert not np.allclose(model.head(hidden, keys), model.head(hidden))


# ------------------------------------------------------------------ (c) the mask itself
def test_drop_fraction_scale_and_sequence_broadcast():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8, 2048)), jnp.float32)
    keys = row_keys(0, jnp.int32(0), 4)
    rate = 0.3
    y = np.asarray(dropout.dropout(x, keys, rate, dropout.MLP))
    dropped = y == 0
    assert abs(dropped.mean() - rate) < 0.02
    np.testing.assert_allclose(y[~dropped], np.asarray(x)[~dropped] / (1 - rate), rtol=1e-6)
    assert (dropped == dropped[:, :1]).all()  # one mask per row, shared along the sequence (axis -2)
    assert dropout.dropout(x, None, rate, dropout.MLP) is x and dropout.dropout(x, keys, 0.0, dropout.MLP) is x


# ------------------------------------------------------------------ (d) resume = uninterrupted
RESUME = dict(dropout_rate=RATE, base_num_decoder_layers=1, scan_layers=False, max_target_length=16, eval_interval=-1,
              enable_tensorboard=False, log_period=1, checkpoint_period=2, learning_rate_schedule_steps=4)  # fmt: skip


def _losses(corpus: str, base: str, run: str, steps: int, **extra) -> dict[int, float]:
    Trainer(load_config(overrides=train_overrides(corpus, base, run, steps=steps, **{**RESUME, **extra})), progress=False).run()
    return {r["step"]: r["loss"] for r in metric_records(Path(base) / run) if "loss" in r}


def test_a_resumed_run_draws_the_masks_of_an_uninterrupted_one(tmp_path):
    """Four steps straight vs two steps, then resumed from the step-2 checkpoint to four: the
    same losses (no RNG state is stored: the masks come from the step number)."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "doc.txt").write_text(PARAGRAPH * 40)
    corpus, base = str(tmp_path / "corpus"), str(tmp_path / "runs")
    straight = _losses(corpus, base, "straight", 4)
    _losses(corpus, base, "resumed", 2)
    resumed = _losses(corpus, base, "resumed", 4)
    assert sorted(straight) == [1, 2, 3, 4] and resumed == straight
    undropped = _losses(corpus, base, "undropped", 4, dropout_rate=0.0)
    assert all(abs(undropped[s] - straight[s]) > 1e-4 for s in (2, 3, 4))


# ------------------------------------------------------------------ (e) eval and generation never drop
def test_eval_and_generation_do_not_drop():
    cfg = tiny_config("llama3.1-tiny", dropout_rate=RATE, decode_sampling_strategy="greedy")
    plain = tiny_config("llama3.1-tiny", decode_sampling_strategy="greedy")
    model, reference = build_model(cfg), build_model(plain)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    tokens = np.array(list(generate(model, prompts, cfg, max_new_tokens=6)))
    np.testing.assert_array_equal(tokens, np.array(list(generate(reference, prompts, plain, max_new_tokens=6))))
    tx, _ = make_optimizer(cfg, derive(cfg, 1))
    model_setup = setup(cfg, make_mesh(cfg, jax.devices()[:1]), tx)
    state = jax.device_put(_initial_state(model, tx), model_setup.state_shardings)
    batch = _batch(cfg)
    evaluated = make_eval_step(cfg, model_setup)(state, device_batch(batch, batch_sharding(cfg, model_setup)))
    undropped = loss_and_grads(reference, batch).loss
    assert abs(float(evaluated["loss_sum"]) / float(evaluated["tokens"]) - undropped) <= 1e-6 * undropped


# ------------------------------------------------------------------ off = the step without RNG ops
def _primitives(jaxpr) -> set:
    found = set()
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found |= _primitives(inner)
    return found


def _random_primitives() -> set:
    """JAX's PRNG primitives (by identity): key making, folding, bit drawing, the raw threefry hash."""
    from jax._src.random import prng, threefry2x32

    return {prng.random_bits_p, prng.random_fold_in_p, prng.random_seed_p, prng.random_wrap_p, threefry2x32.threefry2x32_p}


@pytest.mark.parametrize(
    ("overrides", "drops"),
    [(dict(), False), (dict(dropout_rate=RATE, enable_dropout=False), False), (dict(dropout_rate=RATE), True)],
    ids=["rate0", "enable_dropout_false", "on"],
)
def test_the_step_draws_random_numbers_only_with_dropout_on(overrides, drops):
    cfg = tiny_config("llama3.1-tiny", base_num_decoder_layers=1, **overrides)
    tx, schedule = make_optimizer(cfg, derive(cfg, 1))
    model_setup = setup(cfg, make_mesh(cfg, jax.devices()[:1]), tx)
    state = _initial_state(build_model(cfg), tx)
    jaxpr = jax.make_jaxpr(make_train_step(cfg, model_setup, tx, schedule))(state, _batch(cfg)).jaxpr
    assert bool(_primitives(jaxpr) & _random_primitives()) == drops


# ------------------------------------------------------------------ (f) bad values are one line
@pytest.mark.parametrize("rate", [1.0, -0.1])
def test_a_rate_outside_0_1_is_refused(rate):
    with pytest.raises(ConfigError, match="dropout_rate") as err:
        tiny_config("llama3.1-tiny", dropout_rate=rate)
    assert "\n" not in str(err.value)
