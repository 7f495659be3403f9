"""Instruction (SFT) records: tokens and assistant masks equal HF's apply_chat_template(...,
return_assistant_tokens_mask=True); templates without {% generation %} find the answers by
rendering prefixes; plain prompt/completion; bad rows are BadRecords; the mask reaches the
packed rows' loss mask."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizerFile
from transformers import AutoTokenizer

from nnxtron.data.chat_template import ChatTemplate
from nnxtron.data.records import BadRecord, open_corpus
from nnxtron.data.sft import SFTFormat, assistant_token_mask, format_record
from nnxtron.data.stream import RowPacker, RowSpec, document_iterator
from nnxtron.data.tokenizer import ByteTokenizer, HFTokenizer, SentencePieceTokenizer
from nnxtron.errors import DataError
from tests import tokenizer_files
from tests.unit.test_chat_template import CHATML, GENERATION, LLAMA3, SYSTEM

CHAT_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TWO_ANSWERS = [
    SYSTEM,
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": 'Tell me a joke <with> & "quotes" — ünïcödé.'},
    {"role": "assistant", "content": "Why did the   tensor cross the road? ünï"},
]
ONE_ANSWER = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": " 4 "}]
MID_ANSWER = TWO_ANSWERS[:4]  # an answer, then a user turn last
CONVERSATIONS = {"two_answers": TWO_ANSWERS, "one_answer": ONE_ANSWER, "mid_answer": MID_ANSWER}


def make_tokenizer(directory: Path, template: str) -> Path:
    """A byte-level BPE whose chat markers are special tokens, with ``template`` in its config."""
    tokenizer_files.write_bpe(directory, ["Hello there, how can I help with a joke? " * 4], vocab_size=280)
    built = HFTokenizerFile.from_file(str(directory / "tokenizer.json"))
    built.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIALS])
    built.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return directory


@pytest.fixture(scope="module")
def directories(tmp_path_factory) -> dict[str, Path]:
    templates = {"generation": GENERATION, "chatml": CHATML, "llama3": LLAMA3}
    return {name: make_tokenizer(tmp_path_factory.mktemp(name), t) for name, t in templates.items()}


def ours(directory: Path, messages, completion_only: bool = True):
    spec = SFTFormat(ChatTemplate.from_directory(directory), completion_only)
    return format_record({"messages": messages}, HFTokenizer(directory), spec, add_bos=True, add_eos=True)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_tokens_and_mask_equal_transformers(conversation, directories):
    """A {% generation %} template: ids and assistant mask equal HF's, token for token."""
    messages = CONVERSATIONS[conversation]
    hf = AutoTokenizer.from_pretrained(str(directories["generation"]))
    expected = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, trainable = ours(directories["generation"], messages)
    np.testing.assert_array_equal(ids, expected["input_ids"])
    np.testing.assert_array_equal(trainable.astype(int), expected["assistant_masks"])
    assert trainable.any()


@pytest.mark.parametrize("name, end_of_turn", [("chatml", "<|im_end|>\n"), ("llama3", "<|eot_id|>")])
def test_templates_without_generation_marks_train_on_each_answer_and_its_end_of_turn(name, end_of_turn, directories):
    """Rendering prefixes: the trained tokens are each answer's text (as the template writes it) and its end of turn."""
    tokenizer = HFTokenizer(directories[name])
    ids, trainable = ours(directories[name], TWO_ANSWERS)
    assert "".join(tokenizer.decode(ids)) == tokenizer.decode(ids)  # (ids decode)
    runs = np.split(np.arange(ids.size), np.flatnonzero(np.diff(trainable.astype(int))) + 1)
    trained = [r for r in runs if trainable[r[0]]]
    raw = HFTokenizerFile.from_file(str(directories[name] / "tokenizer.json"))
    texts = [raw.decode(ids[r].tolist(), skip_special_tokens=False) for r in trained]
    strip = name == "llama3"  # Llama 3's template trims the content
    expected = [(m["content"].strip() if strip else m["content"]) + end_of_turn for m in TWO_ANSWERS if m["role"] == "assistant"]
    assert texts == expected


def test_every_token_without_completion_only(directories):
    ids, trainable = ours(directories["generation"], TWO_ANSWERS, completion_only=False)
    assert trainable.all() and trainable.size == ids.size


def test_conversational_prompt_and_completion_train_on_the_completion_only(directories):
    directory = directories["generation"]
    spec = SFTFormat(ChatTemplate.from_directory(directory))
    record = {"prompt": TWO_ANSWERS[:4], "completion": TWO_ANSWERS[4:]}
    ids, trainable = format_record(record, HFTokenizer(directory), spec, True, True)
    full_ids, full_trainable = ours(directory, TWO_ANSWERS)
    np.testing.assert_array_equal(ids, full_ids)
    first = np.flatnonzero(full_trainable)
    second_answer = full_trainable.copy()
    second_answer[: np.flatnonzero(np.diff(full_trainable.astype(int)) == -1)[0] + 1] = False
    np.testing.assert_array_equal(trainable, second_answer)
    assert trainable.sum() < full_trainable.sum() and first.size


def test_plain_prompt_and_completion():
    tok = ByteTokenizer()
    ids, trainable = format_record({"prompt": "Q: hi\nA:", "completion": " yo"}, tok, SFTFormat(None), True, True)
    assert ids.tolist() == [tok.bos_id, *tok.encode("Q: hi\nA:"), *tok.encode(" yo"), tok.eos_id]
    assert trainable.tolist() == [False] * 9 + [True] * 4  # " yo" and EOS


def test_assistant_token_mask_is_overlap():
    offsets = np.array([[0, 2], [2, 5], [5, 5], [5, 9], [9, 10]])
    assert assistant_token_mask(offsets, [(3, 6)]).tolist() == [
        False,
        True,
        True,
        True,
        False,
    ]  # (HF marks a zero-width token inside)
    assert assistant_token_mask(offsets, [(0, 1), (9, 10)]).tolist() == [True, False, False, False, True]


FAILS = "{{ raise_exception('only user and assistant roles') }}"
NOT_PREFIX = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} ({{ messages | length }})\n{% endfor %}"


@pytest.mark.parametrize(
    "record, template, match",
    [
        ({"text": "hi"}, CHATML, "neither 'messages' nor 'prompt' and 'completion'"),
        ({"messages": "hi"}, CHATML, "not a list"),
        ({"messages": [{"role": "user"}]}, CHATML, "has no 'content'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, CHATML, "no assistant message"),
        ({"messages": ONE_ANSWER}, FAILS, "failed to render: only user and assistant roles"),
        ({"messages": ONE_ANSWER}, NOT_PREFIX, "does not begin the rendering"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, CHATML, "starts with an assistant message"),
        ({"prompt": "q", "completion": "  "}, CHATML, "empty 'completion'"),
        ({"prompt": "q", "completion": ["a"]}, CHATML, "not both strings or both lists"),
        ({"prompt": ONE_ANSWER[:1], "completion": []}, CHATML, "empty 'completion'"),
    ],
)
def test_bad_records(record, template, match):
    with pytest.raises(BadRecord, match=match):
        format_record(record, ByteTokenizer(), SFTFormat(ChatTemplate(template)), True, True)


def test_a_conversation_needs_a_template():
    with pytest.raises(BadRecord, match="no chat template; give one with chat_template_path"):
        format_record({"messages": ONE_ANSWER}, ByteTokenizer(), SFTFormat(None), True, True)


def test_tokenizers_without_offsets_are_refused(tmp_path):
    from nnxtron.data.sft import check_tokenizer
    from nnxtron.data.tokenizer import TiktokenTokenizer

    ranks = tokenizer_files.write_tiktoken(tmp_path / "tokenizer.model", [b"he", b"ll"])  # SentencePiece has offsets now
    with pytest.raises(DataError, match="use_sft=true needs a tokenizer that reports each token's characters"):
        check_tokenizer(TiktokenTokenizer(ranks))
    model = tokenizer_files.write_sentencepiece(tmp_path / "sp.model", ["hello world, a tiny corpus\n" * 50], vocab_size=280)
    check_tokenizer(SentencePieceTokenizer(model))


def test_the_mask_travels_through_packing(tmp_path, directories):
    """Rows packed across documents: a target is trained on iff it is an answer token of the same document."""
    directory = directories["generation"]
    records = [{"messages": TWO_ANSWERS}, {"prompt": "Q:", "completion": " A"}, {"messages": ONE_ANSWER}] * 3
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    corpus = open_corpus("jsonl", [tmp_path / "sft.jsonl"], records=True)
    tokenizer = HFTokenizer(directory)
    spec = RowSpec(seq_len=24, sft=SFTFormat(ChatTemplate.from_directory(directory)))
    docs = document_iterator(corpus, np.arange(len(corpus)), tokenizer, spec, seed=None, epochs=1, read_threads=0)
    rows = list(RowPacker(docs, spec, tokenizer.pad_id))
    from nnxtron.data.packing import row_arrays

    batch = row_arrays(*(np.stack(x) for x in zip(*rows)))
    expected = [format_record(r, tokenizer, spec.sft, True, True) for r in records]
    stream_ids = np.concatenate([ids for ids, _ in expected])
    stream_trainable = np.concatenate([t for _, t in expected])
    starts = np.cumsum([0] + [ids.size for ids, _ in expected])[:-1]
    first_of_doc = np.zeros(stream_ids.size, bool)
    first_of_doc[starts] = True
    # stream position of target j of row r is r * 24 + j + 1
    n = stream_ids.size - 1
    targets = batch["targets"].reshape(-1)[:n]
    np.testing.assert_array_equal(targets, stream_ids[1:])
    want = stream_trainable[1:] & ~first_of_doc[1:]
    np.testing.assert_array_equal(batch["loss_mask"].reshape(-1)[:n].astype(bool), want)
    assert batch["loss_mask"].reshape(-1)[n:].sum() == 0


def test_truncated_records_keep_their_mask(tmp_path, directories):
    """truncate_documents with pad packing: each row is one record's first seq_len + 1 tokens, with their mask."""
    directory = directories["chatml"]  # a long system prompt: the answer starts past the first rows of a short seq_len
    records = [{"messages": TWO_ANSWERS}, {"messages": ONE_ANSWER}]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    corpus = open_corpus("jsonl", [tmp_path / "sft.jsonl"], records=True)
    tokenizer = HFTokenizer(directory)
    spec = RowSpec(seq_len=48, packing="pad", truncate_documents=True, sft=SFTFormat(ChatTemplate.from_directory(directory)))
    docs = document_iterator(corpus, np.arange(len(corpus)), tokenizer, spec, seed=None, epochs=1, read_threads=0)
    from nnxtron.data.packing import row_arrays

    batch = row_arrays(*(np.stack(x) for x in zip(*RowPacker(docs, spec, tokenizer.pad_id))))
    for row, record in enumerate(records):
        ids, trainable = format_record(record, tokenizer, spec.sft, True, True)
        n = min(ids.size, 49) - 1
        np.testing.assert_array_equal(batch["targets"][row, :n], ids[1 : n + 1])
        np.testing.assert_array_equal(batch["loss_mask"][row, :n].astype(bool), trainable[1 : n + 1])
    assert batch["loss_mask"].sum() > 0
