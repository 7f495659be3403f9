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
