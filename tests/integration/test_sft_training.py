"""Instruction fine-tuning end to end: ``use_sft=true`` on chat records with a chat template
file, the byte tokenizer and a tiny model; the loss on the answers falls and the held-out
answers' loss improves; bad rows are counted and skipped; bad settings are one line."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from nnxtron.config import load_config
from nnxtron.errors import ConfigError
from nnxtron.train.loop import Trainer
from tests.integration.conftest import run_cli, train_overrides
from tests.unit.test_chat_template import GENERATION

WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "fish", "star"]


def instruction_records(count: int, seed: int = 0) -> list[dict]:
    """'reverse: a b c' -> 'c b a' conversations (a task the answers alone teach)."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        words = rng.sample(WORDS, 3)
        records.append({"messages": [
            {"role": "user", "content": "reverse: " + " ".join(words)},
            {"role": "assistant", "content": " ".join(reversed(words))},
        ]})  # fmt: skip
    return records


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    records = instruction_records(60)
    lines = [json.dumps(r) for r in records]
    lines.insert(7, json.dumps({"messages": [{"role": "user", "content": "no answer"}]}))  # a bad row: nothing to train on
    lines.insert(20, "{not json")
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    (root / "template.jinja").write_text(GENERATION)
    return root


def sft_overrides(root, base, run, **extra):
    return train_overrides(
        str(root), base, run, dataset_type="jsonl", dataset_path=str(root / "train.jsonl"), use_sft=True,
        chat_template_path=str(root / "template.jinja"), skip_bad_records=True, max_target_length=64, per_device_batch_size=1,
        eval_split_fraction=0.2, **extra,
    )  # fmt: skip


def test_sft_loss_falls_and_the_held_out_answers_improve(sft_data, tmp_path):
    cfg = load_config(overrides=sft_overrides(sft_data, str(tmp_path), "sft", steps=60, eval_interval=20,
                                              checkpoint_period=60, learning_rate=0.01))  # fmt: skip
    result = Trainer(cfg, progress=False).run()
    first, last = float(np.mean(result.losses[:3])), float(np.mean(result.losses[-5:]))
    assert last < 0.5 * first, (first, last)
    evals = result.eval_losses
    assert evals[60] < 0.8 * evals[20], evals


def test_sft_settings_are_checked(sft_data, tmp_path):
    base = str(tmp_path)
    with pytest.raises(ConfigError, match="chat_template_path is read only with use_sft=true"):
        load_config(overrides=train_overrides(str(sft_data), base, "x", chat_template_path="t.jinja"))
    for key, value in (("chat_template_timeout", 3), ("chat_template_memory_mib", 1024), ("chat_template_max_chars", 10)):
        with pytest.raises(ConfigError, match=f"{key} is read only with use_sft=true or use_dpo=true"):
            load_config(overrides=train_overrides(str(sft_data), base, "x", **{key: value}))
    with pytest.raises(ConfigError, match="use_sft=true reads instruction records: set dataset_type"):
        load_config(overrides=train_overrides(str(sft_data), base, "x", use_sft=True))
    missing = sft_overrides(sft_data, base, "x", steps=1)
    missing = [o for o in missing if not o.startswith("chat_template_path=")] + ["chat_template_path=/nonexistent.jinja"]
    with pytest.raises(ConfigError, match="chat_template_path='/nonexistent.jinja' is not a file"):
        Trainer(load_config(overrides=missing), progress=False).run()


def test_sft_from_an_hf_directory_uses_its_chat_template(tmp_path, capsys):
    """init_from an HF directory (the golden llama2 with a BPE and a chat template in tokenizer_config.json):
    the template comes from the source's tokenizer, the loss falls, the start-up line says what is trained."""
    from tests.integration.test_serve import write_model_dir

    source = write_model_dir(tmp_path / "hf")
    words = "quick brown fox lazy dog stitch time nine glitters gold will way".split()
    rng = random.Random(1)
    rows = []
    for _ in range(48):
        picked = rng.sample(words, 2)
        rows.append({"prompt": [{"role": "user", "content": f"join {picked[0]} {picked[1]}"}],
                     "completion": [{"role": "assistant", "content": f"{picked[0]}-{picked[1]}"}]})  # fmt: skip
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:40]))
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[40:]))
    overrides = [
        f"init_from={source}", "use_sft=true", "dataset_type=jsonl", f"dataset_path={tmp_path / 'rows.jsonl'}",
        "steps=30", "eval_interval=-1", "checkpoint_period=30", "learning_rate=0.01", "warmup_steps_fraction=0",
        "per_device_batch_size=1", "max_target_length=32", f"base_output_directory={tmp_path}", "run_name=ft",
        "sample_after_training=0", "enable_tensorboard=false", "log_period=1",
    ]  # fmt: skip
    code, out, err = run_cli(capsys, "train", *overrides, "--no-progress")
    assert code == 0, err
    assert "instruction records, trained on the answers" in out + err
    records = [json.loads(line) for line in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 30 and np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3]), losses
    # nnxtron eval on held-out rows: the answers' loss of the fine-tuned run is below the source model's
    scores = {}
    for name, path in (("source", source), ("tuned", tmp_path / "ft")):
        args = ["eval", str(path), "use_sft=true", "dataset_type=jsonl", f"dataset_path={tmp_path / 'held_out.jsonl'}",
                "max_target_length=32", "--json"]  # fmt: skip
        code, out, err = run_cli(capsys, *args)
        assert code == 0, err
        scores[name] = json.loads(out.strip().splitlines()[-1])
    assert scores["tuned"]["tokens"] == scores["source"]["tokens"] > 0 and scores["source"]["bits_per_byte"] is None
    assert scores["tuned"]["loss"] < 0.6 * scores["source"]["loss"], scores


def test_a_chat_template_that_never_ends_is_one_line(sft_data, tmp_path, capsys):
    """A template whose loop would run for hours: training stops after one rendering's time limit
    (``chat_template_timeout``; each later record is refused at once), with one line naming the
    limit and the fix, and exit status 2."""
    from tests.integration.conftest import assert_user_error

    template = tmp_path / "loop.jinja"
    template.write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    overrides = [o for o in sft_overrides(sft_data, str(tmp_path), "loop", steps=1) if not o.startswith("chat_template_path=")]
    code, _, err = run_cli(
        capsys, "train", *overrides, f"chat_template_path={template}", "chat_template_timeout=0.3", "--no-progress"
    )
    assert_user_error(code, err, "chat template did not finish rendering within 0.3 s")
    assert "chat_template_path" in err and "raise the limit (--chat-template-timeout / chat_template_timeout)" in err
