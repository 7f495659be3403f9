"""The command line: happy paths and bad input (one line, exit 2, nothing deleted)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nnxtron.cli import main
from tests.integration.conftest import assert_user_error, run_cli, train_overrides


@pytest.fixture(scope="module")
def trained_run(corpus, tmp_path_factory):
    base = str(tmp_path_factory.mktemp("cli_runs"))
    assert main(["train", *train_overrides(corpus, base, "r1"), "sample_after_training=8", "--no-progress"]) == 0
    return Path(base) / "r1", base


def test_config_show(capsys):
    code, out, _ = run_cli(capsys, "config", "show", "model_name=llama3.1-8b", "steps=5")
    assert code == 0 and "rope_type: llama3" in out and "steps: 5" in out and "global_batch_size" in out


def test_train_prints_summary_and_sample(trained_run):
    run, _ = trained_run
    assert (run / "checkpoints" / "6").is_dir()


def test_generate_from_a_run_is_deterministic(trained_run, capsys):
    run, _ = trained_run
    outs = []
    for _ in range(2):
        code, out, _ = run_cli(capsys, "generate", str(run), "--prompt", "The quick", "max_new_tokens=12", "--json")
        assert code == 0
        outs.append(json.loads(out))
    assert outs[0] == outs[1] and outs[0]["prompt"] == "The quick" and 1 <= len(outs[0]["tokens"]) <= 12


def test_convert_round_trip_through_the_cli(tmp_path, capsys):
    golden = Path(__file__).parents[1] / "assets" / "golden" / "mistral"
    assert run_cli(capsys, "convert", "from-hf", str(golden), str(tmp_path / "run"))[0] == 0
    assert run_cli(capsys, "convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "hf"))[0] == 0
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (golden / "model.safetensors").read_bytes()
    code, _, err = run_cli(capsys, "convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "hf"))
    assert_user_error(code, err, "overwrite")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["train", "stpes=3"], "did you mean 'steps'"),
        (["train", "steps=ten"], "config key 'steps'"),
        (["train", "base_num_kv_heads=3"], "base_num_kv_heads"),
        (["train", "dataset_path=/nonexistent/*.txt"], "/nonexistent/*.txt"),
        (["train", "ici_fsdp_parallelism=3"], "the mesh"),
        (["train", "per_device_batch_size=0.25", "ici_fsdp_parallelism=8"], "does not divide"),
        (["train", "model_name=llama2-tiny", "vocab_size=320", "ici_tensor_parallelism=8"], "does not divide over mesh axes"),
        (["train", "a.yml", "b.yml"], "at most one YAML file"),
        (["train", "remat_policy=save_everything"], "config key 'remat_policy'"),
        (
            ["train", "ici_fsdp_parallelism=2", "ici_context_parallelism=4", "max_target_length=30"],
            "does not divide over ici_context_parallelism",
        ),
        (["train", "per_device_batch_size=1", "gradient_accumulation_steps=3"], "gradient_accumulation_steps=3 does not divide"),
        (["plan", "devices=abc"], "devices"),
        (["train", "--bogus"], "unrecognized arguments"),
        (["frobnicate"], "invalid choice"),
        (["generate", "/nonexistent-run"], "not an nnxtron run directory"),
        # mixture of experts and multi-token prediction
        (["train", "model_name=mixtral-tiny", "num_experts_per_tok=5"], "num_experts_per_tok (5) is larger than num_experts (4)"),
        (
            ["train", "model_name=deepseek3-test", "n_routing_groups=3", "topk_routing_group=1"],
            "n_routing_groups=3 does not divide",
        ),
        (["train", "model_name=deepseek3-test", "n_routing_groups=4"], "set both n_routing_groups and topk_routing_group"),
        (
            ["train", "model_name=mixtral-tiny", "ici_expert_parallelism=3"],
            "ici_expert_parallelism=3 does not divide num_experts=4",
        ),
        (["train", "ici_expert_parallelism=2"], "needs num_experts > 1"),
        (["train", "model_name=deepseek3-test", "mtp_num_layers=1", "mtp_loss_scaling_factor=0"], "mtp_loss_scaling_factor=0"),
        (["train", "model_name=deepseek3-test", "mtp_eval_target_module=1"], "beyond mtp_num_layers=0"),
        (["train", "model_name=mixtral-tiny", "capacity_factor=0"], "capacity_factor=0.0 must be -1"),
        (["train", "model_name=mixtral-tiny", "routed_bias_update_rate=0.01"], "needs routed_bias=true"),
        (["train", "model_name=mixtral-tiny", "first_num_dense_layers=2"], "leaves no MoE layer"),
        # layer patterns
        (["train", "model_name=llama4-tiny", "inhomogeneous_layer_cycle_interval=6"], "does not fit the layer pattern"),
        (["train", "model_name=gemma3-tiny", "sliding_window_size=100000"], "larger than max_position_embeddings"),
        (["train", "model_name=deepseek4-test", "compress_ratios=[0,4,8]"], "compress_ratios has 3 entries"),
        (["train", "model_name=deepseek4-test", "compress_ratios=[0,4,8,4,3]"], "entries [3] are not supported"),
        # pipeline parallelism
        (["train", "model_name=llama4-tiny", "ici_pipeline_parallelism=4"], "a cycle cannot be split across stages"),
        (["train", "num_pipeline_microbatches=4"], "read only by a pipeline"),
        (["train", "ici_pipeline_parallelism=3"], "do not divide into 3 stages"),
        (["train", "ici_pipeline_parallelism=2", "num_pipeline_microbatches=1"], "needs num_pipeline_microbatches >= 2"),
        # quantized training
        (["train", "use_qwix_quantization=true", "quantization=int4"], "config key 'quantization'"),
        (["train", "quantization=fp8"], "needs use_qwix_quantization=true"),
        (["train", "use_qwix_quantization=true", "quantization=fp8", "qwix_module_path=embed"], "quantizes no matmul"),
        (["train", "use_qwix_quantization=true", "quantization=int8", "quantization_tile_size=7"], "qwix cannot quantize"),
        (
            [
                "train",
                "model_name=mixtral-tiny",
                "use_qwix_quantization=true",
                "quantization=fp8",
                "quantization_bwd_tile_size=8",
            ],
            "cannot apply to the MoE grouped matmuls",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, args, fragment):
    code, _, err = run_cli(capsys, *args)
    assert_user_error(code, err, fragment)


def test_bad_corpus_files(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    code, _, err = run_cli(capsys, "train", f"dataset_path={tmp_path}/empty.txt", "eval_interval=-1")
    assert_user_error(code, err, "empty.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    code, _, err = run_cli(capsys, "train", f"dataset_path={tmp_path}/latin1.txt", "eval_interval=-1")
    assert_user_error(code, err, "latin1.txt")


def test_bad_data_of_every_format(tmp_path, capsys):
    """Whole-file problems stop at start-up; a bad record stops unless skip_bad_records counts it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text('{"content": "hello"}\n')
    pq.write_table(pa.table({"text": ["some text"] * 50}), tmp_path / "ok.parquet")
    (tmp_path / "broken.parquet").write_bytes((tmp_path / "ok.parquet").read_bytes()[:-40])
    (tmp_path / "garbage.arrayrecord").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "vocab.model").write_text("this is not a tokenizer\n")
    bad_line = "\n".join(['{"text": "fine words here"}'] * 5 + ["{not json"]) + "\n"
    (tmp_path / "badline.jsonl").write_text(bad_line)
    off = ["eval_interval=-1", "steps=1", "per_device_batch_size=1", "max_target_length=8", "enable_checkpointing=false",
           "model_name=llama2-tiny", "vocab_size=320", "base_num_decoder_layers=1", "sample_after_training=0"]  # fmt: skip
    cases = [
        (["dataset_type=jsonl", f"dataset_path={tmp_path}/a.jsonl"], "a.jsonl' has no 'text' field"),
        (["dataset_type=parquet", f"dataset_path={tmp_path}/ok.parquet", "dataset_text_field=body"], "no column 'body'"),
        (["dataset_type=parquet", f"dataset_path={tmp_path}/broken.parquet"], "broken.parquet' is not a readable Parquet file"),
        (["dataset_type=arrayrecord", f"dataset_path={tmp_path}/garbage.arrayrecord"], "garbage.arrayrecord' is not a readable"),
        (["tokenizer_type=sentencepiece", f"tokenizer_path={tmp_path}/vocab.model"], "vocab.model' is not a SentencePiece model"),
        (["tokenizer_type=tiktoken", f"tokenizer_path={tmp_path}/vocab.model"], "vocab.model' line 1 is not"),
        (["dataset_type=jsonl", f"dataset_path={tmp_path}/badline.jsonl"], "badline.jsonl' line 6: is not valid JSON"),
        (["dataset_type=synthetic", "packing=pad"], "packing is not read with dataset_type=synthetic"),
    ]
    for args, fragment in cases:
        code, _, err = run_cli(capsys, "train", *off, *args)
        assert_user_error(code, err, fragment)
    code, out, err = run_cli(capsys, "train", *off, "dataset_type=jsonl", f"dataset_path={tmp_path}/badline.jsonl", "steps=3",
                          "skip_bad_records=true", "base_output_directory=" + str(tmp_path / "runs"), "--no-progress")  # fmt: skip
    assert code == 0, err
    assert "1 bad records will be skipped" in out + err, out + err
    assert re.search(r"skipped [12] bad records so far .* line 6: is not valid JSON", out + err), out + err


def test_unsupported_hf_family(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    code, _, err = run_cli(capsys, "convert", "from-hf", str(tmp_path), str(tmp_path / "out"))
    assert_user_error(code, err, "bert")


GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "golden"


@pytest.mark.parametrize(
    "case, edit, fragment",
    [
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("gemma3", {"layer_types": ["full_attention"] + ["sliding_attention"] * 7}, "layer_types"),
        ("gemma3", {"hidden_activation": "relu"}, "hidden_activation"),
        ("llama4", {"no_rope_layers": [1, 0, 1, 1]}, "no_rope_layers"),
        ("llama4", {"num_experts_per_tok": 2}, "num_experts_per_tok"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ("deepseek4", {"mlp_layer_types": ["moe", "hash_moe", "moe", "moe"]}, "mlp_layer_types"),
        ("deepseek4", {"layer_types": ["sliding_attention"] * 3 + ["full_attention"]}, "full_attention"),
    ],
)
def test_hf_config_fields_not_understood(tmp_path, capsys, case, edit, fragment):
    """An HF config value the family cannot reproduce: one line naming it, exit 2, nothing written."""
    hf = json.loads((GOLDEN / case / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, **edit}))
    (tmp_path / "model.safetensors").symlink_to(GOLDEN / case / "model.safetensors")
    code, _, err = run_cli(capsys, "convert", "from-hf", str(tmp_path), str(tmp_path / "out"))
    assert_user_error(code, err, fragment)
    assert not (tmp_path / "out").exists()


def test_hash_layers_without_a_table_are_refused(tmp_path, capsys):
    """A DeepSeek-V4 checkpoint whose hash-routed layer lacks its tid2eid table: one line, exit 2."""
    from safetensors.numpy import load_file, save_file

    (tmp_path / "config.json").write_text((GOLDEN / "deepseek4" / "config.json").read_text())
    weights = load_file(str(GOLDEN / "deepseek4" / "model.safetensors"))
    del weights["model.layers.0.ffn.gate.tid2eid"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    code, _, err = run_cli(capsys, "convert", "from-hf", str(tmp_path), str(tmp_path / "out"))
    assert_user_error(code, err, "model.layers.0.ffn.gate.tid2eid")
    assert not (tmp_path / "out").exists()


def _snapshot(path: Path) -> dict:
    return {str(p): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_foreign_checkpoint_is_refused_and_kept(trained_run, corpus, capsys):
    run, base = trained_run
    before = _snapshot(run)
    code, _, err = run_cli(capsys, "train", *train_overrides(corpus, base, "r1", steps=9, base_emb_dim=32))
    assert_user_error(code, err, "base_emb_dim")
    assert _snapshot(run) == before


def test_corrupted_checkpoint_is_reported_and_not_deleted(corpus, tmp_path, capsys):
    base = str(tmp_path)
    assert main(["train", *train_overrides(corpus, base, "c1", steps=3, eval_interval=-1), "--no-progress"]) == 0
    capsys.readouterr()
    step_dir = Path(base) / "c1" / "checkpoints" / "3"
    for f in (step_dir / "params").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\x00garbage")
    before = _snapshot(Path(base) / "c1")
    code, _, err = run_cli(capsys, "train", *train_overrides(corpus, base, "c1", steps=6, eval_interval=-1))
    assert_user_error(code, err, "checkpoint")
    assert _snapshot(Path(base) / "c1") == before


def test_console_script_exit_status_without_traceback():
    env = {**os.environ, "XLA_FLAGS": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "nnxtron", "train", "stpes=3"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: unknown config key 'stpes' in command-line overrides; did you mean 'steps'?"


def test_generate_longer_than_the_model_is_one_line(trained_run, capsys):
    run, _ = trained_run
    code, _, err = run_cli(capsys, "generate", str(run), "--prompt", "The quick", "max_new_tokens=1000000")
    assert_user_error(code, err, "exceed max_position_embeddings")


def test_generate_with_an_hf_tokenizer(trained_run, capsys, tmp_path):
    """A run's ids mean its own tokenizer's: decoding them with another is refused (one line
    naming tokenizer_type); an HF model directory uses its own tokenizer.json unasked."""
    from nnxtron.data.tokenizer import HFTokenizer
    from tests.unit.test_hf_tokenizer import write_bpe

    run, _ = trained_run
    bpe = write_bpe(tmp_path / "bpe")
    code, _, err = run_cli(capsys, "generate", str(run), "--prompt", "The quick", "max_new_tokens=6", "tokenizer_type=hf",
                          f"tokenizer_path={bpe}", "--json")  # fmt: skip
    assert_user_error(code, err, "tokenizer_type='byte'")

    from tokenizers import Tokenizer, models, pre_tokenizers

    hf_dir = tmp_path / "llama2"
    shutil.copytree(Path(__file__).parents[1] / "assets" / "golden" / "llama2", hf_dir)
    words = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "the": 3, "quick": 4, "fox": 5}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    code, out, err = run_cli(capsys, "generate", str(hf_dir), "--prompt", "the quick fox", "max_new_tokens=4", "--json")
    assert code == 0, err
    result = json.loads(out)
    words = HFTokenizer(hf_dir)
    prompt = [words.bos_id, *words.encode("the quick fox").tolist()]
    assert prompt == [1, 3, 4, 5] and 1 <= len(result["tokens"]) <= 4
    assert result["completion"] == words.decode(prompt + result["tokens"])[len(words.decode(prompt)) :]


@pytest.mark.parametrize(
    "source, extra, fragment",
    [
        ("hf", ["tokenizer_type=hf"], "needs tokenizer_path"),  # an HF directory without tokenizer files
        ("hf", ["tokenizer_type=hf", "tokenizer_path=/nonexistent"], "does not exist"),
        ("run", ["tokenizer_type=hf"], "was created with tokenizer_type='byte'"),  # a run's ids are its tokenizer's
        ("run", ["tokenizer_type=wordpiece"], "config key 'tokenizer_type'"),
        ("run", ["base_emb_dim=128"], "was created with base_emb_dim=64"),  # the checkpoint of another model
    ],
)
def test_generate_bad_input_is_one_line(trained_run, capsys, source, extra, fragment):
    run, _ = trained_run
    path = run if source == "run" else Path(__file__).parents[1] / "assets" / "golden" / "llama2"
    code, _, err = run_cli(capsys, "generate", str(path), "max_new_tokens=2", *extra)
    assert_user_error(code, err, fragment)


def test_plan_of_a_patterned_model_chooses_the_pipeline_layout(capsys):
    """Llama 4's 4-layer cycles with the layout keys at their defaults: one cycle per stage
    (formerly 'num_layers_per_pipeline_stage=1 is not a whole number of the 4-layer blocks')."""
    args = (
        "model_name=llama4-tiny",
        "ici_pipeline_parallelism=2",
        "devices=2",
        "per_device_batch_size=1",
        "max_target_length=32",
    )
    code, out, err = run_cli(capsys, "plan", *args)
    assert code == 0, err
    assert "pipeline: 2 stages x 1 repeat (GPipe), 2 microbatches, 4 layers (1 block of 4) per stage" in out
    assert "  stage 0: repeat 0 layers 0-3\n  stage 1: repeat 0 layers 4-7\n" in out
    assert "  pipeline layout chosen automatically (layout keys at their defaults): one 4-layer block (a whole cycle)" in out
