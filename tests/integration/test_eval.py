"""``nnxtron eval``: the corpus's loss, perplexity and bits per byte equal scoring each document
alone with the model's full logits; bad input is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nnxtron.convert.hf import from_hf
from nnxtron.data.tokenizer import HFTokenizer
from tests.integration.conftest import assert_user_error, run_cli
from tests.integration.test_serve import TEXT, write_model_dir

DOCUMENTS = [TEXT[:60], TEXT[40:130], "Hello, world? The lazy dog.", TEXT[100:], "nine"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model_dir = write_model_dir(root / "hf")
    (root / "docs").mkdir()
    for i, text in enumerate(DOCUMENTS):
        (root / "docs" / f"{i}.txt").write_text(text)
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCUMENTS) + '{"text": 3}\n')
    return root, model_dir


def alone(model_dir) -> tuple[float, int, int]:
    """(nll, tokens, bytes): each document as its own row, [BOS] doc [EOS], scored with numpy's log-softmax."""
    model, tokenizer = from_hf(model_dir), HFTokenizer(model_dir)
    nll, tokens = 0.0, 0
    for text in DOCUMENTS:
        ids = np.array([tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id], np.int32)
        logits = np.asarray(model(ids[None, :-1]).logits[0], np.float64)
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        nll += float(np.sum(logz - logits[np.arange(ids.size - 1), ids[1:]]))
        tokens += ids.size - 1
    return nll, tokens, sum(len(t.encode()) for t in DOCUMENTS)


def test_eval_equals_scoring_each_document_alone(setup, capsys):
    root, model_dir = setup
    args = ["eval", str(model_dir), "dataset_type=text", f"dataset_path={root / 'docs'}/*.txt", "packing=pad",
            "max_target_length=64", "--batch-rows", "3"]  # fmt: skip
    code, out, err = run_cli(capsys, *args, "--json")
    assert code == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    nll, tokens, text_bytes = alone(model_dir)
    assert (got["documents"], got["tokens"], got["bytes"]) == (len(DOCUMENTS), tokens, text_bytes)
    np.testing.assert_allclose(got["nll"], nll, rtol=1e-5)
    np.testing.assert_allclose(got["perplexity"], np.exp(nll / tokens), rtol=1e-5)
    np.testing.assert_allclose(got["bits_per_byte"], nll / np.log(2) / text_bytes, rtol=1e-5)
    code, out, err = run_cli(capsys, *args)
    assert code == 0 and f"{len(DOCUMENTS)} documents, {tokens} tokens scored: loss {nll / tokens:.4f}" in out


def test_eval_skips_bad_records_when_told(setup, capsys):
    root, model_dir = setup
    args = ["eval", str(model_dir), "dataset_type=jsonl", f"dataset_path={root / 'docs.jsonl'}", "packing=pad",
            "max_target_length=64"]  # fmt: skip
    code, out, err = run_cli(capsys, *args)
    assert_user_error(code, err, "line 6: field 'text' is a int, not a string")
    code, out, err = run_cli(capsys, *args, "skip_bad_records=true", "--json")
    got = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and got["bad_records"] == 1 and got["documents"] == len(DOCUMENTS)
    np.testing.assert_allclose(got["nll"], alone(model_dir)[0], rtol=1e-5)


def test_eval_bad_input_is_one_line(setup, capsys):
    root, model_dir = setup
    code, _, err = run_cli(capsys, "eval", str(model_dir), "dataset_type=synthetic")
    assert_user_error(code, err, "nnxtron eval needs a corpus")
    code, _, err = run_cli(capsys, "eval", str(model_dir), "dataset_type=text", f"dataset_path={root}/nothing*.txt")
    assert code == 2 and "nothing" in err
    code, _, err = run_cli(capsys, "eval", str(root / "missing"), "dataset_type=text")
    assert code == 2 and "missing" in err
