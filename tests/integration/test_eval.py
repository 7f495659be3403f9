"""``nnxtron eval``: the corpus's loss, perplexity and bits per byte equal scoring each document
alone with the model's full logits; bad input is one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from nnxtron.convert.hf import from_hf
from nnxtron.data.pipeline import split_documents
from nnxtron.data.records import open_corpus
from nnxtron.data.tokenizer import HFTokenizer
from tests.helpers import forward_logits
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
        logits = np.asarray(forward_logits(model, ids[None, :-1])[0], np.float64)
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


def test_eval_of_a_run_without_a_corpus_says_which_it_scores(setup, tmp_path, capsys):
    """`nnxtron eval RUN` with no corpus keys scores the run's own training corpus and says so in one
    line: its held-out split (the documents training did not see), equal to scoring exactly those
    documents, or all of it when the run held none out. An HF directory has no corpus: one line."""
    root, model_dir = setup
    pattern = f"{root / 'docs'}/*.txt"
    keys = ["dataset_type=text", f"dataset_path={pattern}", "packing=pad", "max_target_length=64", "eval_split_fraction=0.4"]
    run = tmp_path / "run"
    assert run_cli(capsys, "convert", "from-hf", str(model_dir), str(run), *keys, "eval_interval=5")[0] == 0
    _, held = split_documents(open_corpus("text", [pattern]), 0.4)
    assert 0 < len(held) < len(DOCUMENTS)
    (tmp_path / "held").mkdir()
    for index in held:
        shutil.copyfile(root / "docs" / f"{index}.txt", tmp_path / "held" / f"{index}.txt")

    code, out, err = run_cli(capsys, "eval", str(run), "--json")
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("scoring")]
    assert lines == [
        f"scoring the run's training corpus, its held-out split: {len(held)} of {len(DOCUMENTS)} text files in "
        f"'{pattern}' (eval_split_fraction=0.4, the documents training did not see); give dataset_type= and "
        "dataset_path= to score another corpus"
    ], err
    got = json.loads(out.strip().splitlines()[-1])
    code, out, err = run_cli(
        capsys, "eval", str(model_dir), *keys[:1], f"dataset_path={tmp_path / 'held'}/*.txt", *keys[2:4], "--json"
    )
    assert code == 0 and "scoring" not in err, err  # a corpus given: it is the one scored
    alone_held = json.loads(out.strip().splitlines()[-1])
    assert [got[k] for k in ("documents", "tokens", "bytes")] == [alone_held[k] for k in ("documents", "tokens", "bytes")]
    np.testing.assert_allclose(got["nll"], alone_held["nll"], rtol=1e-6)  # float32 logits of a run and of an HF dir

    code, out, err = run_cli(capsys, "eval", str(run), "eval_interval=-1", "--json")  # as a run without periodic eval
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["documents"] == len(DOCUMENTS)
    assert f"scoring the run's training corpus, all of it: {len(DOCUMENTS)} text files in '{pattern}' (eval_interval=-1" in err
    code, _, err = run_cli(capsys, "eval", str(model_dir))
    assert_user_error(code, err, "an HF directory has no training corpus to score; give one with dataset_type=")


def test_eval_tasks_needing_a_download_offline_is_one_line(setup):
    """`nnxtron eval RUN --tasks arc_easy` without network (HF offline mode, as on a machine that
    cannot reach the Hub): one line naming the task and its dataset, not a ConnectionError traceback."""
    pytest.importorskip("lm_eval")
    _, model_dir = setup
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(model_dir.parent / "hf_home")}
    proc = subprocess.run(
        [sys.executable, "-m", "nnxtron", "eval", str(model_dir), "--tasks", "arc_easy", "--limit", "2"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert_user_error(proc.returncode, proc.stderr, "lm-eval task 'arc_easy' needs its dataset 'allenai/ai2_arc' downloaded")
    assert "--include-path" in proc.stderr
