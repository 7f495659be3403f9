"""The tokenizer travels with the model: found in a directory, streamed to text exactly as its
``decode`` joins prompt and completion, and written for ``transformers.AutoTokenizer``."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from nnxtron.config import load_config
from nnxtron.convert.hf import to_hf
from nnxtron.data.detokenize import TextStream
from nnxtron.data.sources import tokenizer_for
from nnxtron.data.tokenizer import make_tokenizer
from nnxtron.data.tokenizer_files import detect_tokenizer, tokenizer_values, write_hf_tokenizer
from nnxtron.errors import ConfigError
from nnxtron.models.build import build_model
from tests.tokenizer_files import write_bpe, write_sentencepiece, write_tiktoken

ENGLISH = [
    "The license grants you the right to use, copy and modify the software.",
    "The licensor is not liable for any claim, damages or other liability.",
    "Permission is hereby granted, free of charge, to any person obtaining a copy.",
    "the theme of the thesis: then, there, these. Ünïcödé ß 日本語 🙂",
]
MERGES = [b"th", b"he", b"the", b" t", b" th", b" the", b"in", b"ing", b" a", b"er"]
SENTENCES = [
    (" is granted to you, free of charge.", "The license"),
    (" 日本語 and ✓ marks 🙂 too", "Ünïcödé"),
    ("  double  spaces, then a tab\tand\na newline .", "Text"),
    (" . , ! ? ( ) don't can't", "Punctuation"),
]
KINDS = ["byte", "hf", "sentencepiece", "tiktoken"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    return {
        "hf": write_bpe(root / "hf", ENGLISH * 20, 320),
        "sentencepiece": write_sentencepiece(root / "sp" / "tokenizer.model", ENGLISH, 300),
        "tiktoken": write_tiktoken(root / "tt" / "tokenizer.model", MERGES),
    }


@pytest.fixture(scope="module")
def toks(files) -> dict:
    return {"byte": make_tokenizer("byte"), **{kind: make_tokenizer(kind, str(path)) for kind, path in files.items()}}


def stream_all(tokenizer, prompt_ids, completion_ids) -> str:
    stream = TextStream(tokenizer, prompt_ids)
    pieces = [stream.push()] + [stream.push([i]) for i in completion_ids] + [stream.finish()]
    return "".join(pieces)


@pytest.mark.parametrize("kind", KINDS)
def test_streamed_text_is_the_decode_of_prompt_and_completion(toks, kind):
    tok = toks[kind]
    for completion, prompt in SENTENCES:
        prompt_ids = [tok.bos_id] * (tok.bos_id >= 0) + tok.encode(prompt).tolist()
        completion_ids = tok.encode(prompt + completion).tolist()[len(tok.encode(prompt)) :]
        whole = tok.decode(prompt_ids + completion_ids)
        assert stream_all(tok, prompt_ids, completion_ids) == whole
        stream = TextStream(tok, prompt_ids)
        stream.push(completion_ids)
        assert stream.prompt_text + stream.completion() == whole


def test_sentencepiece_keeps_the_space_between_prompt_and_completion(toks):
    """Piece-by-piece decoding glued words ('The licenseis'): the stream does not."""
    tok = toks["sentencepiece"]
    prompt = tok.encode("The license").tolist()
    completion = tok.encode("The license is granted").tolist()[len(prompt) :]
    assert "".join(tok.decode([i]) for i in completion) != " is granted"  # what decoding one piece at a time gives
    assert stream_all(tok, [tok.bos_id, *prompt], completion) == "The license is granted"


def test_a_character_split_over_tokens_is_held_until_complete(toks):
    tok = toks["byte"]
    ids = tok.encode("✓ok").tolist()  # three UTF-8 bytes, then ascii
    stream = TextStream(tok, [])
    assert [stream.push([i]) for i in ids] == ["", "", "✓", "o", "k"]


@pytest.mark.parametrize("kind", KINDS)
def test_random_token_streams_join_to_the_decode(toks, kind):
    tok = toks[kind]
    rng = np.random.default_rng(0)
    text = " ".join(ENGLISH)
    for _ in range(10):
        start, length = rng.integers(0, len(text) - 40), rng.integers(1, 40)
        ids = tok.encode(text[start : start + length]).tolist()
        cut = int(rng.integers(0, len(ids) + 1))
        assert stream_all(tok, ids[:cut], ids[cut:]) == tok.decode(ids)


def test_detect_each_kind_of_tokenizer_file(files, tmp_path):
    assert detect_tokenizer(files["hf"]) == ("hf", str(files["hf"]))
    assert detect_tokenizer(files["sentencepiece"].parent) == ("sentencepiece", str(files["sentencepiece"]))
    assert detect_tokenizer(files["tiktoken"].parent) == ("tiktoken", str(files["tiktoken"]))
    shutil.copyfile(files["tiktoken"], tmp_path / "cl.tiktoken")
    assert detect_tokenizer(tmp_path) == ("tiktoken", str(tmp_path / "cl.tiktoken"))
    assert detect_tokenizer(tmp_path / "nothing") is None
    # the user's choice wins: a given path, or a given kind read from the directory
    assert tokenizer_values(files["hf"], {"tokenizer_path": "/x"}) == {}
    assert tokenizer_values(files["hf"], {}) == {"tokenizer_type": "hf", "tokenizer_path": str(files["hf"])}
    assert tokenizer_values(files["hf"], {"tokenizer_type": "byte"}) == {}


@pytest.mark.parametrize("kind", KINDS)
def test_written_for_hf_autotokenizer_gives_the_same_ids_and_text(toks, kind, tmp_path):
    from transformers import AutoTokenizer

    tok = toks[kind]
    write_hf_tokenizer(tok, tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    for completion, prompt in SENTENCES:
        text = prompt + completion
        ids = tok.encode(text).tolist()
        assert hf.encode(text, add_special_tokens=False) == ids, kind
        assert hf.decode([tok.bos_id, *ids], skip_special_tokens=True) == tok.decode(ids)
    assert (hf.bos_token_id, hf.eos_token_id) == (tok.bos_id, tok.eos_id)


def test_byte_tokenizer_with_a_vocabulary_it_cannot_cover_is_an_error():
    cfg = load_config(overrides=["vocab_size=32000", "dataset_type=synthetic"])
    with pytest.raises(ConfigError, match="vocab_size=32000 but tokenizer_type=byte covers 259 ids"):
        tokenizer_for(cfg)
    assert tokenizer_for(load_config(overrides=["vocab_size=512"])).name == "byte"


def test_trailing_space_waits_for_a_decode_that_may_rewrite_it(toks):
    """transformers' clean-up rewrites ' .' as '.': a space is emitted only once a later
    character settles it, so the joined stream still equals the decode."""

    class CleanUp:  # the byte tokenizer with transformers' clean_up_tokenization_spaces
        bos_id, eos_id, pad_id = 1, 2, 0

        def encode(self, text):
            return toks["byte"].encode(text)

        def decode(self, ids):
            return toks["byte"].decode(ids).replace(" .", ".").replace(" ,", ",")

    tok = CleanUp()
    ids = tok.encode("Hello , world .").tolist()
    assert stream_all(tok, ids[:2], ids[2:]) == "Hello, world."


LLAMA2_CHAT = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}"
)
SPECIAL_TEXTS = [
    "<s>[INST] Hello there [/INST] The license</s><s>[INST] again [/INST]", "a</s>b", "x  <s>  y  ", "<unk> x<pad>y",
    "  two  spaces<s>x", "a \n  b\t\tc", "<s><s></s>", "", "é€𝄞 zz<s>\n q ✓", " ".join(ENGLISH),
]  # fmt: skip


def test_sentencepiece_splits_special_tokens_and_gives_hf_ids_and_offsets(files, tmp_path):
    """A SentencePiece-only directory: ids and character offsets equal HF's (transformers converts
    tokenizer.model, legacy Llama), for chats holding <s> / </s>; the template sees the tokenizer's
    <s> / </s> without a tokenizer_config.json naming them, as HF's does; legacy=false is refused."""
    from transformers import AutoTokenizer

    from nnxtron.data.chat_template import find_chat_template
    from nnxtron.data.sft import SFTFormat, format_record
    from nnxtron.data.tokenizer import SentencePieceTokenizer
    from nnxtron.errors import DataError

    directory = tmp_path / "sp"
    shutil.copytree(files["sentencepiece"].parent, directory)
    (directory / "chat_template.jinja").write_text(LLAMA2_CHAT)
    hf, tok = AutoTokenizer.from_pretrained(str(directory)), SentencePieceTokenizer(directory / "tokenizer.model")
    for text in SPECIAL_TEXTS:
        ids, offsets = tok.encode_with_offsets(text)
        expected = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        assert ids.tolist() == tok.encode(text).tolist() == expected["input_ids"], text
        assert [tuple(o) for o in offsets.tolist()] == [tuple(o) for o in expected["offset_mapping"]], text
    chat = [
        {"role": "user", "content": "Who grants the license?"}, {"role": "assistant", "content": "The licensor."},
        {"role": "user", "content": "Is it free?"}, {"role": "assistant", "content": "Free of charge."},
    ]  # fmt: skip
    template, _ = find_chat_template([directory], tok)
    text = template.render(chat, add_generation_prompt=False)
    assert text == hf.apply_chat_template(chat, tokenize=False)
    ids, trainable = format_record({"messages": chat}, tok, SFTFormat(template), add_bos=False, add_eos=False)
    assert ids.tolist() == hf.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    answers = tok.decode(ids[trainable])
    assert answers.count("The licensor.") == answers.count("Free of charge.") == 1 and "Who" not in answers
    (directory / "tokenizer_config.json").write_text('{"legacy": false}')
    with pytest.raises(DataError, match="legacy=false.*save_pretrained"):
        SentencePieceTokenizer(directory / "tokenizer.model").encode("<s>[INST] hi")


@pytest.mark.parametrize("kind", ["byte", "sentencepiece"])
def test_a_run_keeps_the_chat_template_it_was_given(files, kind, tmp_path):
    """``chat_template_path`` is kept in the run's tokenizer/ (with the special tokens it sees), where
    serve, generate --chat, init_from and convert to-hf find it."""
    from nnxtron.data.chat_template import find_chat_template
    from nnxtron.data.sources import keep_tokenizer, tokenizer_directories

    file = tmp_path / "chat.jinja"
    file.write_text(LLAMA2_CHAT)
    path = [f"tokenizer_path={files['sentencepiece']}"] if kind == "sentencepiece" else []
    cfg = load_config(
        overrides=[f"tokenizer_type={kind}", *path, "use_sft=true", "dataset_type=jsonl", f"chat_template_path={file}"]
    )
    run = tmp_path / "run"
    keep_tokenizer(cfg, run / "tokenizer")
    later = load_config(overrides=[f"tokenizer_type={kind}", *path])  # a later command on the run, without the flag
    template, _ = find_chat_template(tokenizer_directories(later, run), make_tokenizer(kind, later.tokenizer_path))
    assert template.template == LLAMA2_CHAT
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>[INST] hi [/INST]"
    # convert to-hf of the run writes it where transformers finds it (the byte tokenizer has no files of its own)
    model_cfg = load_config(overrides=["model_name=llama2-tiny", "vocab_size=320", "base_num_decoder_layers=1", *path,
                                       f"tokenizer_type={kind}"])  # fmt: skip
    exported = to_hf(build_model(model_cfg), tmp_path / "hf", kept=run / "tokenizer")
    assert AutoTokenizer.from_pretrained(str(exported)).chat_template == LLAMA2_CHAT
