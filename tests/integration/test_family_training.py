"""End to end through the Trainer for the patterned families: Gemma 3 (pattern block +
remainder), Llama 4 (cycle blocks with chunked, NoPE and MoE layers) and GPT-3 (learned
positions) train on text with sequences longer than the window / chunk, on a sharded mesh,
and their loss falls. Numerical parity of these models is in tests/parity."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from nnxtron.config import load_config
from nnxtron.train.loop import Trainer
from tests.integration.conftest import train_overrides


@pytest.mark.parametrize(
    "model, layers",
    [("gemma3-tiny", 8), ("llama4-tiny", 4), ("gpt3-52k", 2)],  # gemma3: pattern block + remainder
)
def test_family_trains_and_the_loss_falls(corpus, tmp_path, model, layers):
    extra = dict(
        model_name=model,
        base_num_decoder_layers=layers,
        steps=8,
        eval_interval=-1,
        checkpoint_period=8,
        enable_tensorboard=False,
        ici_fsdp_parallelism=4,
        ici_tensor_parallelism=2,
    )
    cfg = load_config(overrides=train_overrides(corpus, str(tmp_path), "run", **extra))
    assert cfg.max_target_length > 8  # longer than gemma3-tiny's window and llama4-tiny's chunk
    Trainer(cfg, progress=False).run()
    records = [json.loads(line) for line in (Path(tmp_path) / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.8 * losses[0], losses


def test_deepseek4_trains_on_synthetic_data_and_keeps_its_hash_table(tmp_path):
    """deepseek4-test (hash-routed prefix, CSA + indexer, HCA, mHC streams) on synthetic data over
    fsdp: the loss falls, the router bias moves by the loss-free rule, and the token -> expert
    table (a non-trainable variable) is bit-unchanged and kept out of the parameters."""
    import numpy as np
    from flax import nnx

    from nnxtron.models.build import build_model
    from nnxtron.params import flatten

    extra = dict(
        model_name="deepseek4-test",
        dataset_type="synthetic",
        base_output_directory=str(tmp_path),
        run_name="v4",
        steps=10,
        learning_rate=0.01,
        warmup_steps_fraction=0.0,
        max_target_length=32,
        per_device_batch_size=1,
        eval_interval=-1,
        checkpoint_period=10,
        enable_tensorboard=False,
        sample_after_training=0,
        ici_data_parallelism=2,
        ici_fsdp_parallelism=4,
    )
    cfg = load_config(overrides=[f"{k}={v}" for k, v in extra.items()])
    result = Trainer(cfg, progress=False).run()
    records = [json.loads(line) for line in (tmp_path / "v4" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    initial = flatten(nnx.to_pure_dict(nnx.state(build_model(cfg), nnx.Not(nnx.Param))))
    rest = flatten(result.state["rest"])
    tables = [k for k in rest if k.endswith("tid2eid")]
    assert tables and all(np.array_equal(np.asarray(rest[k]), np.asarray(initial[k])) for k in tables)
    assert not any("tid2eid" in k for k in flatten(result.state["params"]))
    biases = [k for k in rest if k.endswith("router_bias")]
    assert biases and all(np.abs(np.asarray(rest[k])).sum() > 0 for k in biases)
