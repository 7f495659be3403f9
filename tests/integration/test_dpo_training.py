"""DPO end to end: ``use_dpo=true`` on preference records with a chat template file, the byte
tokenizer and a tiny model; the held-out pairs' DPO loss falls below log 2 and their reward
accuracy rises; a resumed run reads the same reference and continues exactly; the strategies
(fsdp, tensor, unrolled layers with remat, gradient accumulation, a pipeline) compute the same steps."""

from __future__ import annotations

import json
import math
import random

import pytest

from nnxtron.config import load_config
from nnxtron.errors import CheckpointError, ConfigError
from nnxtron.train.checksum import DPO_REFERENCE_FILE
from nnxtron.train.loop import Trainer
from tests.integration.conftest import train_overrides
from tests.integration.test_sft_training import WORDS
from tests.unit.test_chat_template import GENERATION


def preference_records(count: int, seed: int = 0) -> list[dict]:
    """'repeat: a b c': the chosen answer 'A B C' (in capitals), the rejected one 'a b c'."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        words = rng.sample(WORDS, 3)
        prompt = [{"role": "user", "content": "repeat: " + " ".join(words)}]
        chosen, rejected = " ".join(words).upper(), " ".join(words)
        if i % 2:  # conversations, and plain text
            records.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}],
                            "rejected": [{"role": "assistant", "content": rejected}]})  # fmt: skip
        else:
            records.append({"prompt": prompt[0]["content"] + " =", "chosen": " " + chosen, "rejected": " " + rejected})
    return records


@pytest.fixture(scope="module")
def dpo_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    lines = [json.dumps(r) for r in preference_records(200)]
    lines.insert(5, json.dumps({"prompt": "same", "chosen": " a", "rejected": " a"}))  # bad: no preference
    lines.insert(9, json.dumps({"prompt": "no answers"}))  # bad: no chosen / rejected
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    (root / "template.jinja").write_text(GENERATION)
    return root


def dpo_overrides(root, base, run, **extra):
    values = dict(
        dataset_type="jsonl", dataset_path=str(root / "train.jsonl"), use_dpo=True, packing="pad",
        chat_template_path=str(root / "template.jinja"), skip_bad_records=True, max_target_length=96, per_device_batch_size=1,
        eval_split_fraction=0.2, dpo_beta=0.5,
    )  # fmt: skip
    return train_overrides(str(root), base, run, **{**values, **extra})


def test_dpo_learns_the_preference_on_held_out_pairs(dpo_data, tmp_path, capsys):
    cfg = load_config(overrides=dpo_overrides(dpo_data, str(tmp_path), "dpo", steps=60, eval_interval=60, eval_steps=4,
                                              checkpoint_period=60, learning_rate=0.0003))  # fmt: skip
    trainer = Trainer(cfg, progress=False)
    result = trainer.run()
    assert result.losses[0] == pytest.approx(math.log(2), abs=1e-6)  # the policy starts as the reference
    assert min(result.losses[-5:]) < 0.5 * math.log(2), result.losses
    held_out = result.eval_losses[60]
    assert held_out < 0.6 * math.log(2), held_out
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["eval_dpo/reward_accuracy"] for r in records if "eval_dpo/reward_accuracy" in r]
    assert accuracy and accuracy[-1] >= 0.8, accuracy
    assert "preference pairs" in capsys.readouterr().err


def test_a_resumed_dpo_run_continues_exactly_and_checks_its_reference(dpo_data, tmp_path):
    base = str(tmp_path)
    common = dict(eval_interval=-1, checkpoint_period=2, learning_rate=0.001, learning_rate_schedule_steps=6)
    whole = Trainer(load_config(overrides=dpo_overrides(dpo_data, base, "whole", steps=4, **common)), progress=False).run()
    Trainer(load_config(overrides=dpo_overrides(dpo_data, base, "parts", steps=2, **common)), progress=False).run()
    resumed = Trainer(load_config(overrides=dpo_overrides(dpo_data, base, "parts", steps=4, **common)), progress=False).run()
    assert resumed.start_step == 2
    assert resumed.losses == pytest.approx(whole.losses[2:], rel=1e-6, abs=1e-7)
    record = resumed.run_dir / DPO_REFERENCE_FILE
    record.write_text(json.dumps({"checksum": "0123456789abcdef", "step": 0}))  # another reference than the start's
    with pytest.raises(CheckpointError, match="the reference weights read now .* are not the ones run"):
        Trainer(load_config(overrides=dpo_overrides(dpo_data, base, "parts", steps=6, **common)), progress=False).run()


STRATEGIES = {
    "fsdp8": {},
    "tensor2": {"ici_tensor_parallelism": 2},
    "unrolled_remat_full": {"scan_layers": False, "remat_policy": "full"},
    "accumulation2_tensor4": {"gradient_accumulation_steps": 2, "ici_tensor_parallelism": 4},
    "pipeline2": {"ici_pipeline_parallelism": 2},
}


def test_dpo_strategies_compute_the_same_steps(dpo_data, tmp_path):
    """Step 1's gradient norm (the policy is the reference: only the gradient differs) and step 2's
    loss and margin (after an update) agree over meshes, remat/unrolled layers, accumulation and
    a pipeline (2 stages)."""
    runs = {}
    for name, extra in STRATEGIES.items():
        overrides = dpo_overrides(dpo_data, str(tmp_path), name, steps=2, eval_interval=-1, enable_checkpointing=False,
                                  learning_rate=0.003, **extra)  # fmt: skip
        Trainer(load_config(overrides=overrides), progress=False).run()
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [json.loads(line) for line in lines if '"loss"' in line]
    base = runs["fsdp8"]
    for name, records in runs.items():
        assert records[0]["grad_norm"] == pytest.approx(base[0]["grad_norm"], rel=1e-4), name
        assert records[1]["loss"] == pytest.approx(base[1]["loss"], rel=1e-4), name
        assert records[1]["dpo/margin"] == pytest.approx(base[1]["dpo/margin"], rel=1e-3, abs=1e-5), name


def test_dpo_settings_are_checked(dpo_data, tmp_path):
    base = str(tmp_path)
    with pytest.raises(ConfigError, match="dpo_beta is read only with use_dpo=true"):
        load_config(overrides=train_overrides(str(dpo_data), base, "x", dpo_beta=0.3))
    with pytest.raises(ConfigError, match="use_dpo=true puts one answer in each row: set packing=pad"):
        load_config(overrides=dpo_overrides(dpo_data, base, "x", packing="concat"))
    with pytest.raises(ConfigError, match="use_dpo=true and use_sft=true are two training objectives"):
        load_config(overrides=dpo_overrides(dpo_data, base, "x", use_sft=True))
    with pytest.raises(ConfigError, match="must be a multiple of 2 x gradient_accumulation_steps x processes = 16"):
        Trainer(
            load_config(overrides=dpo_overrides(dpo_data, base, "x", gradient_accumulation_steps=8, ici_tensor_parallelism=8)),
            progress=False,
        )
