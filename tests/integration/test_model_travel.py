"""What a model brings besides its weights travels with it: an HF Llama directory with a
SentencePiece ``tokenizer.model`` only, a chat template, ``max_position_embeddings=256`` and a
``generation_config.json`` goes through ``convert from-hf`` -> SFT (``train init_from=RUN``) ->
``generate --chat`` -> ``serve`` -> ``convert to-hf``, and the export equals the source field by
field: context length, chat template, BOS / EOS / PAD ids, generation settings, tokenizer ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from nnxtron.config import load_config
from nnxtron.convert.hf import to_hf
from nnxtron.convert.runs import load_model
from nnxtron.infer.generate import generate
from nnxtron.models.build import build_model
from nnxtron.serve.server import ServeOptions, load, make_engine
from tests.integration.conftest import PARAGRAPH, assert_user_error, run_cli, train_overrides
from tests.tokenizer_files import write_sentencepiece

LICENSE = [
    "The license grants you the right to use, copy and modify the software.",
    "The licensor is not liable for any claim, damages or other liability.",
    PARAGRAPH,
]
LLAMA2_CHAT = (  # Llama 2's chat format: each turn opens with <s>, each answer closes with </s>
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}"
)
IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
GENERATION = {**IDS, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "max_length": 256}
CHAT = [{"role": "user", "content": "Who is liable?"}]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny Llama as save_pretrained writes it, with tokenizer.model, its settings and a chat template only."""
    root = tmp_path_factory.mktemp("hf") / "llama"
    cfg = load_config(values={"model_name": "llama2-tiny", "vocab_size": 320, "base_num_decoder_layers": 2})
    to_hf(build_model(cfg), root)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / name).unlink()
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, **IDS, "max_position_embeddings": 256}))
    (root / "generation_config.json").write_text(json.dumps(GENERATION))
    settings = {
        "tokenizer_class": "LlamaTokenizer", "legacy": True, "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "unk_token": "<unk>", "chat_template": LLAMA2_CHAT,
    }  # fmt: skip
    (root / "tokenizer_config.json").write_text(json.dumps(settings))
    write_sentencepiece(root / "tokenizer.model", LICENSE, 300)
    return root


def test_context_template_special_tokens_and_generation_settings_travel(source, tmp_path, capsys):
    from transformers import AutoTokenizer

    run = tmp_path / "run"
    assert run_cli(capsys, "convert", "from-hf", str(source), str(run))[0] == 0
    assert yaml.safe_load((run / "config.yml").read_text())["max_position_embeddings"] == 256

    rows = tmp_path / "rows.jsonl"  # "Who is liable?" -> "The licensor." in the Llama 2 chat format
    answer = [*CHAT, {"role": "assistant", "content": "The licensor."}]
    rows.write_text("".join(json.dumps({"messages": answer}) + "\n" for _ in range(16)))
    base = str(tmp_path / "runs")
    common = train_overrides("", base, "sft", steps=2, eval_interval=-1, max_target_length=64)
    common = [o for o in common if not o.startswith(("model_name=", "vocab_size=", "base_num_decoder_layers=", "dataset_"))]
    code, _, err = run_cli(
        capsys, "train", *common, f"init_from={run}", "use_sft=true", "dataset_type=jsonl", f"dataset_path={rows}",
        "--no-progress",
    )  # fmt: skip
    assert code == 0, err  # SentencePiece-only: the template's <s> / </s> are found and the answers masked
    sft = Path(base) / "sft"
    assert yaml.safe_load((sft / "config.yml").read_text())["max_position_embeddings"] == 256

    # generate --chat: the user message rendered with the template, encoded as HF encodes it
    hf = AutoTokenizer.from_pretrained(str(source))
    prompt = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) else list(prompt)
    assert prompt[0] == 1 and prompt.count(1) == 1  # the template's <s>, once
    code, out, err = run_cli(capsys, "generate", str(sft), "--chat", "--prompt", CHAT[0]["content"], "max_new_tokens=4", "--json")
    assert code == 0, err
    model = load_model(sft)
    expected = [step[0] for step in generate(model, [prompt], model.config, 4, (2,)) if step[0] is not None]
    assert json.loads(out)["tokens"] == expected
    (tmp_path / "plain").mkdir()  # a model without a template: one line
    plain = tmp_path / "plain" / "hf"
    to_hf(build_model(load_config(values={"model_name": "llama2-tiny", "vocab_size": 320, "base_num_decoder_layers": 2})), plain)
    (plain / "tokenizer.json").unlink()
    (plain / "tokenizer_config.json").unlink()
    write_sentencepiece(plain / "tokenizer.model", LICENSE, 300)
    code, _, err = run_cli(capsys, "generate", str(plain), "--chat", "--prompt", "x")
    assert_user_error(code, err, "has no chat template")

    # serve: the run's context and template, without flags
    loaded = load(sft)
    assert loaded.chat_template.template == LLAMA2_CHAT
    assert loaded.tokenizer.encode(loaded.chat_template.render(CHAT)).tolist() == prompt
    assert make_engine(loaded.model, ServeOptions()).max_length == 256

    # convert to-hf: every field as in the source
    out_dir = tmp_path / "export"
    assert run_cli(capsys, "convert", "to-hf", str(sft), str(out_dir))[0] == 0
    exported, original = (json.loads((d / "config.json").read_text()) for d in (out_dir, source))
    for key in ("max_position_embeddings", *IDS):
        assert exported[key] == original[key], key
    assert json.loads((out_dir / "generation_config.json").read_text()) == GENERATION
    after = AutoTokenizer.from_pretrained(str(out_dir))
    assert after.chat_template == hf.chat_template == LLAMA2_CHAT
    assert (after.bos_token_id, after.eos_token_id, after.pad_token_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    chat = [*answer, {"role": "user", "content": "And the license?"}]
    assert (
        after.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        == hf.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    )
