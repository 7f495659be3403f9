"""Real models end to end: an HF directory with a SentencePiece tokenizer is generated from,
converted, fine-tuned in one command (``init_from``) and exported again, and the tokenizer
travels the whole way; a failed start leaves no run directory behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from flax import nnx

from nnxtron.config import load_config
from nnxtron.config.loader import parse_overrides, run_config_to_yaml
from nnxtron.convert.hf import from_hf, to_hf
from nnxtron.convert.runs import init_config, init_config_report, load_model
from nnxtron.data.tokenizer import SentencePieceTokenizer
from nnxtron.errors import ConfigError
from nnxtron.models.build import build_model
from nnxtron.params import flatten
from tests.integration.conftest import PARAGRAPH, assert_user_error, metric_records, run_cli, train_overrides
from tests.tokenizer_files import write_sentencepiece

LICENSE = [
    "The license grants you the right to use, copy and modify the software.",
    "The licensor is not liable for any claim, damages or other liability.",
    PARAGRAPH,
]

FT_KEYS = ("learning_rate", "lr_schedule_type", "warmup_steps_fraction", "learning_rate_final_fraction")
MODEL_OR_SCHEDULE_KEYS = ("model_name=", "vocab_size=", "base_num_decoder_layers=", "learning_rate=", "warmup_steps_fraction=")
OLD_DEFAULTS = (
    "learning_rate=0.003",
    "lr_schedule_type=cosine",
    "warmup_steps_fraction=0.05",
    "cosine_learning_rate_final_fraction=0.1",
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny Llama as save_pretrained writes it, with a SentencePiece ``tokenizer.model`` only."""
    root = tmp_path_factory.mktemp("hf") / "llama"
    cfg = load_config(values={"model_name": "llama2-tiny", "vocab_size": 320, "base_num_decoder_layers": 2})
    to_hf(build_model(cfg), root)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (root / name).unlink()
    write_sentencepiece(root / "tokenizer.model", LICENSE, 300)
    return root


def generate_json(capsys, path: Path, *extra: str) -> dict:
    code, out, err = run_cli(capsys, "generate", str(path), "--prompt", "The license", "max_new_tokens=8", *extra, "--json")
    assert code == 0, err
    return json.loads(out)


def test_generate_on_an_hf_directory_uses_its_sentencepiece_model(hf_dir, capsys):
    sp = SentencePieceTokenizer(hf_dir / "tokenizer.model")
    result = generate_json(capsys, hf_dir)
    prompt = [sp.bos_id, *sp.encode("The license").tolist()]
    assert result["completion"] == sp.decode(prompt + result["tokens"])[len("The license") :]
    assert result["completion"] and any(t > 258 for t in result["tokens"])  # ids only the SentencePiece model has
    code, out, err = run_cli(capsys, "generate", str(hf_dir), "--prompt", "The license", "max_new_tokens=8")
    assert code == 0 and out == "The license" + result["completion"] + "\n"  # the stream joins as decode does


def test_convert_carries_the_tokenizer_into_the_run(hf_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert run_cli(capsys, "convert", "from-hf", str(hf_dir), str(run))[0] == 0
    assert (run / "tokenizer" / "tokenizer.model").read_bytes() == (hf_dir / "tokenizer.model").read_bytes()
    moved = tmp_path / "moved"
    shutil.move(run, moved)  # the run reads its own copy wherever it lives
    assert generate_json(capsys, moved) == generate_json(capsys, hf_dir)


def test_fine_tune_an_hf_model_in_one_command(hf_dir, corpus, tmp_path, capsys):
    """The README's three failed tries, then the one command that works."""
    base = str(tmp_path / "runs")
    common = train_overrides(corpus, base, "ft", steps=1, eval_interval=-1, warmup_steps_fraction=1.0)
    common = [o for o in common if not o.startswith(("model_name=", "vocab_size=", "base_num_decoder_layers="))]
    code, _, err = run_cli(capsys, "train", *common, f"load_parameters_path={hf_dir}", "--no-progress")
    assert_user_error(code, err, f"start from it with init_from={hf_dir}")
    assert not (Path(base) / "ft").exists()  # the failed start left nothing that blocks the name
    converted = tmp_path / "converted"
    assert run_cli(capsys, "convert", "from-hf", str(hf_dir), str(converted))[0] == 0
    code, _, err = run_cli(capsys, "train", *common, f"load_parameters_path={converted}", "--no-progress")
    assert_user_error(code, err, "was created with")  # the weights of another model than the default config's
    assert not (Path(base) / "ft").exists()
    code, _, err = run_cli(capsys, "train", *common, f"init_from={hf_dir}", "base_emb_dim=256", "--no-progress")
    assert_user_error(code, err, "base_emb_dim")
    assert not (Path(base) / "ft").exists()
    code, out, err = run_cli(capsys, "train", *common, f"init_from={hf_dir}", "--no-progress")
    assert code == 0, err
    assert "warning: learning_rate=0.01 is a pre-training rate" in err  # this test's own rate, said at start-up
    run = Path(base) / "ft"
    assert (run / "tokenizer" / "tokenizer.model").is_file()
    # warmup over the one step: its learning rate is 0, so the weights are still exactly the HF ones
    tuned, original = (
        flatten(nnx.to_pure_dict(nnx.state(load_model(run), nnx.Param))),
        flatten(nnx.to_pure_dict(nnx.state(from_hf(hf_dir), nnx.Param))),
    )
    assert tuned.keys() == original.keys()
    for key in original:
        np.testing.assert_array_equal(np.asarray(tuned[key]), np.asarray(original[key]), err_msg=key)

    out_dir = tmp_path / "export"
    assert run_cli(capsys, "convert", "to-hf", str(run), str(out_dir))[0] == 0
    hf_config = json.loads((out_dir / "config.json").read_text())
    generation = json.loads((out_dir / "generation_config.json").read_text())
    assert (
        (hf_config["bos_token_id"], hf_config["eos_token_id"])
        == (1, 2)
        == (generation["bos_token_id"], generation["eos_token_id"])
    )
    from transformers import AutoTokenizer

    text = "The licensor grants you the right, free of charge."
    before, after = AutoTokenizer.from_pretrained(str(hf_dir)), AutoTokenizer.from_pretrained(str(out_dir))
    assert after.encode(text) == before.encode(text)
    assert after.decode(after.encode(text), skip_special_tokens=True) == before.decode(
        before.encode(text), skip_special_tokens=True
    )


def test_fine_tuning_takes_fine_tuning_defaults_and_says_so(hf_dir, corpus, tmp_path, capsys):
    """`nnxtron train init_from=HF_DIR` without a learning rate: not base.yml's pre-training 3e-3 but
    TRL's / transformers' fine-tuning values, one start-up line each with its source, recorded in
    the run and used by the steps; a YAML file's and the command line's values win, a resumed run
    keeps the values its config.yml recorded, and a pre-training rate is said at start-up."""
    base = str(tmp_path / "runs")
    common = train_overrides(corpus, base, "ft", steps=2, eval_interval=-1)
    common = [o for o in common if not o.startswith(MODEL_OR_SCHEDULE_KEYS)]
    code, _, err = run_cli(capsys, "train", *common, f"init_from={hf_dir}", "--no-progress")
    assert code == 0, err
    for line in (
        "fine-tuning default (init_from): learning_rate=2e-05 (TRL SFTConfig, MaxText sft.yml)",
        "fine-tuning default (init_from): lr_schedule_type=linear (transformers TrainingArguments.lr_scheduler_type",
        "fine-tuning default (init_from): warmup_steps_fraction=0 (transformers TrainingArguments.warmup_steps",
        "fine-tuning default (init_from): learning_rate_final_fraction=0 (transformers' schedules decay to 0)",
    ):
        assert line in err, err
    assert "warning: learning_rate" not in err
    run = Path(base) / "ft"
    recorded = yaml.safe_load((run / "config.yml").read_text())
    assert {k: recorded[k] for k in FT_KEYS} == {
        "learning_rate": 2e-5, "lr_schedule_type": "linear", "warmup_steps_fraction": 0.0, "learning_rate_final_fraction": 0.0,
    }  # fmt: skip
    rates = [r["learning_rate"] for r in metric_records(run) if "learning_rate" in r]
    assert rates == pytest.approx([2e-5, 1e-5], rel=1e-6)  # linear from 2e-5 to 0 over 2 steps, no warm-up

    # a YAML file's values and the command line's win over the defaults
    (tmp_path / "ft.yml").write_text("learning_rate: 5.0e-6\nlr_schedule_type: cosine\n")
    given = {"init_from": str(hf_dir), "learning_rate": 5e-6, "lr_schedule_type": "cosine", "warmup_steps_fraction": 0.1}
    cfg, lines = init_config_report(str(tmp_path / "ft.yml"), [f"init_from={hf_dir}", "warmup_steps_fraction=0.1"], given)
    assert (cfg.learning_rate, cfg.lr_schedule_type, cfg.warmup_steps_fraction) == (5e-6, "cosine", 0.1)
    assert cfg.cosine_learning_rate_final_fraction == 0.0  # the final fraction the chosen schedule reads
    assert [line.split(":")[1].split("=")[0].strip() for line in lines] == ["cosine_learning_rate_final_fraction"]
    # an explicit pre-training rate is kept, and said
    cfg, lines = init_config_report(
        None, [f"init_from={hf_dir}", "learning_rate=0.003"], {"init_from": str(hf_dir), "learning_rate": 0.003}
    )
    assert cfg.learning_rate == 0.003
    assert lines[-1].startswith("warning: learning_rate=0.003 is a pre-training rate"), lines

    # a run recorded with base.yml's schedule (an older nnxtron) resumes with it, not with the new defaults
    old_args = [f"init_from={hf_dir}", *OLD_DEFAULTS]
    old = init_config(None, old_args, parse_overrides(old_args))
    (Path(base) / "old").mkdir()
    (Path(base) / "old" / "config.yml").write_text(run_config_to_yaml(old))
    args = [f"init_from={hf_dir}", f"base_output_directory={base}", "run_name=old"]
    cfg, lines = init_config_report(None, args, parse_overrides(args))
    assert (cfg.learning_rate, cfg.lr_schedule_type, cfg.warmup_steps_fraction) == (0.003, "cosine", 0.05)
    assert "fine-tuning default (init_from): learning_rate=0.003 (the run's config.yml: a resumed run keeps its values)" in lines
    assert lines[-1].startswith("warning: learning_rate=0.003")


def test_init_from_a_run_takes_its_model_and_refuses_other_model_keys(hf_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert run_cli(capsys, "convert", "from-hf", str(hf_dir), str(run))[0] == 0
    given = {"init_from": str(run), "steps": 3}
    cfg = init_config(None, ["steps=3", f"init_from={run}"], given)
    assert (cfg.vocab_size, cfg.base_num_decoder_layers, cfg.tokenizer_type) == (320, 2, "sentencepiece")
    assert cfg.tokenizer_path == str(run / "tokenizer")
    with pytest.raises(ConfigError, match="base_num_decoder_layers=2.*base_num_decoder_layers=4"):
        init_config(None, [f"init_from={run}", "base_num_decoder_layers=4"], {**given, "base_num_decoder_layers": 4})
    with pytest.raises(ConfigError, match="drop model_name"):
        init_config(None, [f"init_from={run}", "model_name=llama2-tiny"], {**given, "model_name": "llama2-tiny"})


def test_version_and_the_key_value_hint(capsys):
    import nnxtron

    with pytest.raises(SystemExit) as stop:
        run_cli(capsys, "--version")
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"nnxtron {nnxtron.__version__}"
    code, _, err = run_cli(capsys, "train", "--steps", "100")
    assert_user_error(code, err, "write steps=100")


@pytest.mark.parametrize("family", ["deepseek3", "deepseek4"])
def test_model_state_travels_through_a_run(family, tmp_path, capsys):
    """DeepSeek's router correction biases and V4's token -> expert hash tables are model
    state, not parameters: HF -> run -> HF gives the same file, and a run started from the
    converted run (init_from) starts from that same state."""
    golden = Path(__file__).parents[1] / "assets" / "golden" / family
    run = tmp_path / "run"
    assert run_cli(capsys, "convert", "from-hf", str(golden), str(run))[0] == 0
    assert run_cli(capsys, "convert", "to-hf", str(run), str(tmp_path / "hf"))[0] == 0
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (golden / "model.safetensors").read_bytes()
    state = nnx.to_pure_dict(nnx.split(load_model(run), nnx.Param, ...)[2])
    original = nnx.to_pure_dict(nnx.split(from_hf(golden), nnx.Param, ...)[2])
    assert flatten(state).keys() == flatten(original).keys()
    for key, value in flatten(original).items():
        np.testing.assert_array_equal(np.asarray(flatten(state)[key]), np.asarray(value), err_msg=key)
