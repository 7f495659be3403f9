"""End-to-end MoE training (deepseek3-test: MLA, dense + MoE stacks, MTP) through the
Trainer on an expert-parallel mesh: aux losses logged, loss-free bias updated outside the
gradient and kept out of the parameters, MTP acceptance reported in eval, and the
two-stack state (router bias included) restored from a checkpoint in the other layout.
(Exact resume through the Trainer is tested on the dense model in test_train.py; the
restore path it uses is the one checked here.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nnxtron.config import load_config
from nnxtron.params import flatten
from nnxtron.train.loop import Trainer
from tests.integration.conftest import train_overrides

RATE = 0.01
MOE = dict(
    model_name="deepseek3-test",
    vocab_size=320,
    mtp_num_layers=1,
    mtp_eval_target_module=1,
    load_balance_loss_weight=0.01,
    routed_bias_update_rate=RATE,
    ici_fsdp_parallelism=4,
    ici_expert_parallelism=2,
    per_device_batch_size=1,
)


def _train(corpus, base, run, **extra):
    cfg = load_config(overrides=train_overrides(corpus, base, run, **{**MOE, **extra}))
    return Trainer(cfg, progress=False).run()


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    base = str(tmp_path_factory.mktemp("moe_runs"))
    return base, _train(corpus, base, "straight", steps=4, eval_interval=2, checkpoint_period=2)


def test_aux_losses_are_logged_next_to_the_loss(runs):
    base, *_ = runs
    records = [json.loads(line) for line in (Path(base) / "straight" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 4
    for record in steps:
        assert record["aux/mtp"] > 0.01 and record["aux/moe_lb_loss"] > 0
    evals = [r for r in records if "eval_loss" in r]
    assert evals and all(0.0 <= r["eval_mtp_acceptance"] <= 1.0 for r in evals)


def test_router_bias_moves_by_the_update_rule_and_is_checkpointed(runs):
    _, straight, *_ = runs
    rest = flatten(straight.state["rest"])
    biases = {k: np.asarray(v) for k, v in rest.items() if k.endswith("router_bias")}
    loads = {k: np.asarray(v) for k, v in rest.items() if k.endswith("expert_load")}
    assert biases and len(biases) == len(loads)
    for key, bias in biases.items():
        # four updates of +-RATE (or 0 at exact balance) per expert
        steps = np.round(bias / RATE)
        assert np.allclose(bias, steps * RATE, atol=1e-6) and np.abs(steps).max() <= 4 and np.abs(bias).sum() > 0, key
        assert np.all(loads[key.replace("router_bias", "expert_load")] == 0), "load must be reset after each update"
    assert not any("router_bias" in k for k in flatten(straight.state["params"])), "the bias is not a parameter"


@pytest.mark.parametrize(
    "model, values, deep_key",
    [
        ("deepseek3-test", dict(mtp_num_layers=1, routed_bias_update_rate=RATE), "moe_layers/layers/1/"),
        ("gemma3-tiny", {}, "remainder_layers/layers/0/cycle/1/"),  # pattern block + remainder block
        ("llama4-tiny", {}, "layers/layers/1/cycle/3/mlp/shared/"),  # two cycle blocks of mixed kinds
        ("deepseek4-test", {}, "hash_layers/layers/0/cycle/1/attention/indexer/"),  # + tid2eid, router bias
    ],
)
def test_multi_stack_checkpoint_restores_into_the_other_layer_layout(tmp_path, model, values, deep_key):
    """A scanned checkpoint with several stacks (DeepSeek's dense_layers + moe_layers with
    MTP and router bias; Gemma 3's pattern + remainder blocks; Llama 4's cycle blocks)
    restores into the unrolled model: parameters and non-parameter state equal layer by layer."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nnxtron.config.stacks import layer_counts
    from nnxtron.models.build import abstract_model, build_model
    from nnxtron.params import layer_list_layout
    from nnxtron.train.checkpoint import Checkpointer
    from tests.conftest import tiny_config

    scanned = build_model(tiny_config(model, **values), seed=7)
    rest = nnx.to_pure_dict(nnx.state(scanned, nnx.Not(nnx.Param)))
    # non-zero bias / load so the check is not vacuous (integer tables, e.g. tid2eid, stay as they are)
    rest = jax.tree.map(lambda x: x + 0.5 if jnp.issubdtype(x.dtype, jnp.floating) else x, rest)
    state = {"params": nnx.to_pure_dict(nnx.state(scanned, nnx.Param)), "rest": rest}
    parts = [part for part in ("params", "rest") if jax.tree.leaves(state[part])]  # orbax refuses empty items
    state = {part: state[part] for part in parts}
    ckpt = Checkpointer(tmp_path / "ckpt", 2)
    ckpt.save(1, state, {"data_position": 1})
    ckpt.wait()
    target_cfg = tiny_config(model, scan_layers=False, **values)
    target = abstract_model(target_cfg)
    abstract = {
        "params": nnx.to_pure_dict(nnx.state(target, nnx.Param)),
        "rest": nnx.to_pure_dict(nnx.state(target, nnx.Not(nnx.Param))),
    }
    abstract = {part: abstract[part] for part in parts}
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract)
    restored, _ = ckpt.restore(1, abstract, shardings)
    counts = layer_counts(target_cfg)
    for part in parts:
        want, got = layer_list_layout(state[part], counts), layer_list_layout(restored[part], counts)
        assert want.keys() == got.keys() and (part == "rest" or any(deep_key in k for k in got)), part
        for key in want:
            np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=key)
