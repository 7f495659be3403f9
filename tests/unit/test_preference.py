"""Preference (DPO) records: each side's tokens and scored mask equal the SFT rendering of
prompt + answer (HF's assistant-token mask for conversations); prompts shared by whole texts
or conversations are found; bad pairs are BadRecords; pairs become two rows each, laid out
as the chosen sides then the rejected sides, resumable at any batch."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nnxtron.data.chat_template import ChatTemplate
from nnxtron.data.preference import format_pair
from nnxtron.data.records import BadRecord, open_corpus
from nnxtron.data.sft import SFTFormat, format_record
from nnxtron.data.stream import BatchIterator, PairPacker, RowSpec, document_iterator, make_packer
from nnxtron.data.tokenizer import ByteTokenizer, HFTokenizer
from tests.unit.test_sft import SYSTEM, directories  # noqa: F401 (a fixture)

BYTES = ByteTokenizer()
PLAIN = SFTFormat(None)
USER = {"role": "user", "content": "Name a colour."}


def side(prompt, answer, tokenizer=BYTES, spec=PLAIN):
    return format_record({"prompt": prompt, "completion": answer}, tokenizer, spec, True, True)


def test_plain_pair_scores_each_answer_and_its_eos():
    pair = format_pair({"prompt": "Q: 2+2?", "chosen": " 4", "rejected": " 5"}, BYTES, PLAIN, True, True)
    for ids, scored, answer in ((pair.chosen, pair.chosen_scored, " 4"), (pair.rejected, pair.rejected_scored, " 5")):
        np.testing.assert_array_equal(ids, [BYTES.bos_id, *BYTES.encode("Q: 2+2?"), *BYTES.encode(answer), BYTES.eos_id])
        assert scored.tolist() == [False] * 8 + [True] * 3


def test_conversation_pair_equals_the_sft_rendering(directories):  # noqa: F811
    directory = directories["generation"]
    spec = SFTFormat(ChatTemplate.from_directory(directory))
    tokenizer = HFTokenizer(directory)
    prompt = [SYSTEM, USER]
    chosen, rejected = [{"role": "assistant", "content": "Blue."}], [{"role": "assistant", "content": "I won't."}]
    pair = format_pair({"prompt": prompt, "chosen": chosen, "rejected": rejected}, tokenizer, spec, True, True)
    for ids, scored, answer in ((pair.chosen, pair.chosen_scored, chosen), (pair.rejected, pair.rejected_scored, rejected)):
        want_ids, want_scored = side(prompt, answer, tokenizer, spec)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(scored, want_scored)
        assert 0 < scored.sum() < scored.size
    # the same pair as whole conversations: the shared messages are the prompt
    whole = format_pair({"chosen": prompt + chosen, "rejected": prompt + rejected}, tokenizer, spec, True, True)
    np.testing.assert_array_equal(whole.chosen_scored, pair.chosen_scored)
    np.testing.assert_array_equal(whole.rejected, pair.rejected)


def test_whole_texts_share_their_prompt_up_to_a_word_boundary():
    record = {"chosen": "Human: pick one\n\nAssistant: The cat sat", "rejected": "Human: pick one\n\nAssistant: The car sat"}
    pair = format_pair(record, BYTES, PLAIN, True, True)
    prompt = "Human: pick one\n\nAssistant: The "
    np.testing.assert_array_equal(pair.chosen_scored, side(prompt, "cat sat")[1])
    np.testing.assert_array_equal(pair.rejected, side(prompt, "car sat")[0])


@pytest.mark.parametrize(
    "record, match",
    [
        ({"prompt": "q", "chosen": " a", "rejected": " a"}, "identical 'chosen' and 'rejected'"),
        ({"chosen": "same text", "rejected": "same text"}, "identical 'chosen' and 'rejected'"),
        ({"prompt": "q", "chosen": " a"}, "has no 'rejected' answer"),
        ({"text": "q"}, "has no 'chosen' and no 'rejected' answer"),
        ({"prompt": "q", "chosen": " a", "rejected": ""}, "'rejected' side: has an empty answer"),
        ({"prompt": "q", "chosen": [USER], "rejected": " b"}, "not both strings or both lists of messages"),
        ({"chosen": "ab", "rejected": ["ab"]}, "not both strings or both lists of messages"),
    ],
)
def test_bad_pairs(record, match):
    with pytest.raises(BadRecord, match=match):
        format_pair(record, BYTES, PLAIN, True, True)


def pair_records(count: int) -> list[dict]:
    return [{"prompt": f"prompt {i}:" + "x" * (i % 3), "chosen": f" yes {i}" * (1 + i % 4), "rejected": f" no {i}"}
            for i in range(count)]  # fmt: skip


def pair_rows(tmp_path, records, seq_len=24, rows=4):
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    corpus = open_corpus("jsonl", [tmp_path / "pairs.jsonl"], records=True)
    spec = RowSpec(seq_len=seq_len, packing="pad", preference=PLAIN, skip_bad_records=True)
    docs = document_iterator(corpus, np.arange(len(corpus)), BYTES, spec, seed=None, epochs=1, read_threads=0)
    packer = make_packer(docs, spec, BYTES.pad_id)
    assert isinstance(packer, PairPacker)
    return packer, BatchIterator(packer, rows)


def test_pairs_become_chosen_rows_then_rejected_rows(tmp_path):
    records = pair_records(6)
    packer, batches = pair_rows(tmp_path, records)
    batch = next(batches)  # pairs 0 and 1: rows chosen 0, chosen 1, rejected 0, rejected 1
    for row, (pair, name) in enumerate([(0, "chosen"), (1, "chosen"), (0, "rejected"), (1, "rejected")]):
        ids, scored = side(records[pair]["prompt"], records[pair][name])
        n = min(ids.size, 25) - 1
        np.testing.assert_array_equal(batch["inputs"][row, :n], ids[:n])
        np.testing.assert_array_equal(batch["targets"][row, :n], ids[1 : n + 1])
        np.testing.assert_array_equal(batch["loss_mask"][row, :n].astype(bool), scored[1 : n + 1])
        assert batch["loss_mask"][row, n:].sum() == 0 and (batch["segment_ids"][row, :n] == 1).all()
        np.testing.assert_array_equal(batch["positions"][row, :n], np.arange(n))
    assert packer.counts["truncated_tokens"] == 0
    next(batches)  # pairs 2 and 3: sides longer than 25 tokens keep their first 25
    sizes = [side(records[i]["prompt"], records[i][name])[0].size for i in (2, 3) for name in ("chosen", "rejected")]
    assert packer.counts["truncated_tokens"] == sum(max(size - 25, 0) for size in sizes) > 0


def test_pair_batches_resume_exactly(tmp_path):
    records = pair_records(10)
    _, batches = pair_rows(tmp_path, records)
    next(batches)
    state = batches.get_state()
    want = [next(batches) for _ in range(2)]
    _, again = pair_rows(tmp_path, records)
    again.set_state(state)
    for expected in want:
        got = next(again)
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key])


def test_a_prompt_that_fills_the_row_is_a_bad_record(tmp_path):
    records = [{"prompt": "p" * 40, "chosen": " a", "rejected": " b"}] + pair_records(4)
    packer, batches = pair_rows(tmp_path, records)
    next(batches)
    assert packer.counts["bad_records"] == 1
    assert "its prompt fills the row: no 'chosen' answer token within max_target_length=24" in packer.first_problem


def test_an_odd_number_of_rows_is_refused(tmp_path):
    with pytest.raises(Exception, match="two rows, but this process has 3 rows per batch"):
        pair_rows(tmp_path, pair_records(2), rows=3)
