"""The lm-eval harness adapter (``nnxtron eval --tasks``): log-likelihoods equal HF's golden
log-softmax on four families; the harness runs local tasks from files in the repo
(multiple choice, greedy generation, rolling log-likelihood) and its figures equal those
computed directly with the model; bad requests are one line."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import load_file

from nnxtron.convert.hf import from_hf
from nnxtron.errors import UserError
from nnxtron.infer.decode import decode
from nnxtron.infer.harness import NnxtronLM, evaluate_tasks
from nnxtron.infer.score import score_tokens
from tests.integration.test_serve import write_model_dir
from tests.parity.test_score import GOLDEN, _log_softmax

ASSETS = Path(__file__).parents[1] / "assets" / "lm_eval"


@pytest.mark.parametrize("case", ["llama2", "qwen3", "deepseek3", "gemma3"])
def test_loglikelihoods_equal_hf(case):
    """Continuations of the golden ids after three context lengths: the summed log-probability
    equals the golden log-softmax's, and the greedy flag its argmax's."""
    golden = load_file(str(GOLDEN / case / "golden.safetensors"))
    ids = golden["input_ids"].astype(np.int64)
    logp = _log_softmax(golden["logits"])
    pairs, expected = [], []
    for row in range(ids.shape[0]):
        for split in (1, ids.shape[1] // 2, ids.shape[1] - 2):
            targets = ids[row, split:]
            picked = np.take_along_axis(logp[row, split - 1 : -1], targets[:, None], axis=-1)[:, 0]
            pairs.append((ids[row, :split].tolist(), targets.tolist()))
            expected.append((float(picked.sum()), bool((logp[row, split - 1 : -1].argmax(-1) == targets).all()), targets.size))
            best = int(logp[row, split - 1].argmax())  # a one-token continuation greedy decoding would choose
            pairs.append((ids[row, :split].tolist(), [best]))
            expected.append((float(logp[row, split - 1, best]), True, 1))
    ours = NnxtronLM(from_hf(GOLDEN / case), batch_size=4).loglikelihood_tokens(pairs)
    for (total, greedy), (want, want_greedy, count) in zip(ours, expected):
        assert abs(total - want) <= 2e-5 * count, (total, want)  # the per-token bound of test_score.py, summed
        assert greedy == want_greedy


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    model = from_hf(write_model_dir(root / "model"))
    lm = NnxtronLM(model, batch_size=4)
    # the generation task: half its answers are the model's own greedy continuations, half are not
    questions = [json.loads(line)["question"] for line in (ASSETS / "generate.jsonl").read_text().splitlines()]
    wanted = [direct_generation(lm, q, ["\n", "."], 6) for q in questions]
    answers = [text if i % 2 == 0 else text + " not this" for i, text in enumerate(wanted)]
    tasks = root / "tasks"
    tasks.mkdir()
    for name in ("choice.jsonl", "rolling.jsonl"):
        shutil.copyfile(ASSETS / name, tasks / name)
    (tasks / "generate.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in zip(questions, answers))
    )
    for yaml in ASSETS.glob("*.yaml"):
        (tasks / yaml.name).write_text(yaml.read_text().replace("DATA_DIR", str(tasks)))
    results = evaluate_tasks(model, ["nnxtron_choice", "nnxtron_generate", "nnxtron_rolling"], str(tasks), batch_size=4)
    return SimpleNamespace(model=model, lm=lm, results=results, tasks=tasks)


def direct_generation(lm: NnxtronLM, context: str, until: list[str], limit: int) -> str:
    """Greedy decoding with the decoding loop itself, cut before the first stop string."""
    prompt = lm.prefix + lm.tokenizer.encode(context).tolist()
    tokens = []
    for step, done in decode(lm.model, [prompt], limit, lambda logits: np.argmax(logits, axis=-1), [lm.tokenizer.eos_id]):
        if done[0] or int(step[0]) == lm.tokenizer.eos_id:
            break
        tokens.append(int(step[0]))
    text = lm.tokenizer.decode(tokens)
    return text[: min([text.index(s) for s in until if s in text], default=len(text))]


def direct_logprob(lm: NnxtronLM, context_ids: list[int], continuation_ids: list[int]) -> float:
    tokens = context_ids + continuation_ids
    batch = {"inputs": np.array([tokens[:-1]]), "targets": np.array([tokens[1:]]),
             "positions": np.arange(len(tokens) - 1)[None], "segment_ids": np.ones((1, len(tokens) - 1), np.int32)}  # fmt: skip
    logprobs, _ = score_tokens(lm.model, batch)
    return float(logprobs[0, len(context_ids) - 1 :].sum(dtype=np.float64))


def test_multiple_choice_accuracy_equals_the_direct_computation(harness):
    lm, correct, docs = harness.lm, 0, [json.loads(line) for line in (ASSETS / "choice.jsonl").read_text().splitlines()]
    for doc in docs:
        context = lm.prefix + lm.tokenizer.encode(doc["question"]).tolist()
        scores = [direct_logprob(lm, context, lm.tokenizer.encode(doc["question"] + c).tolist()[len(context) - 1 :])
                  for c in doc["choices"]]  # fmt: skip
        correct += int(np.argmax(scores) == doc["answer"])
    assert harness.results["nnxtron_choice"]["acc,none"] == pytest.approx(correct / len(docs))


def test_generation_equals_greedy_decoding_cut_at_the_stop_strings(harness):
    assert harness.results["nnxtron_generate"]["exact_match,none"] == pytest.approx(0.5)


def test_rolling_loglikelihood_gives_the_bits_per_byte_of_the_texts(harness):
    lm, nll, size = harness.lm, 0.0, 0
    for line in (ASSETS / "rolling.jsonl").read_text().splitlines():
        text = json.loads(line)["text"]
        nll -= direct_logprob(lm, lm.prefix, lm.tokenizer.encode(text).tolist())
        size += len(text.encode())
    assert harness.results["nnxtron_rolling"]["bits_per_byte,none"] == pytest.approx(nll / (math.log(2) * size), rel=1e-5)


def test_an_empty_context_is_the_start_token(harness):
    """As HFLM: a continuation with no context is scored after the start token (BOS) alone."""
    lm, text = harness.lm, "The quick brown fox"
    ((total, _),) = lm.loglikelihood([SimpleNamespace(args=("", text))])
    assert total == pytest.approx(direct_logprob(lm, lm.start, lm.tokenizer.encode(text).tolist()), abs=1e-5)


def test_long_texts_are_scored_in_windows(harness):
    """A text longer than max_length: every token predicted once, over windows of max_length."""
    lm = NnxtronLM(harness.model, batch_size=2, max_length=16)
    text = (ASSETS / "rolling.jsonl").read_text()
    ids = lm.tokenizer.encode(text).tolist()
    assert len(ids) > 3 * 16
    (total,) = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    start, expected = 0, 0.0
    while start < len(ids):  # the harness's disjoint windows: each scores the next 16 tokens after up to 16 of context
        context = (lm.prefix + ids)[max(0, start + 1 - 16) : start + 1] if start else lm.prefix
        chunk = ids[start : start + 16]
        expected += direct_logprob(lm, context[-(16 - len(chunk)) - 1 :] if start else context, chunk)
        start += 16
    assert total == pytest.approx(expected, abs=1e-3)


def test_bad_requests_are_one_line(harness):
    with pytest.raises(UserError, match="asks for sampling"):
        harness.lm.generate_until([SimpleNamespace(args=("Hi", {"until": ["\n"], "do_sample": True}))])
    with pytest.raises(UserError, match="empty continuation"):
        harness.lm.loglikelihood([SimpleNamespace(args=("Hi", ""))])
    with pytest.raises(UserError, match="continuation of 20 tokens is longer than the context"):
        NnxtronLM(harness.model, max_length=16).loglikelihood_tokens([([1], list(range(3, 23)))])
    with pytest.raises(UserError, match="unknown lm-eval task 'no_such_task'"):
        evaluate_tasks(harness.model, ["no_such_task"], str(harness.tasks))


def test_nnxtron_eval_runs_harness_tasks(harness, capsys):
    from tests.integration.conftest import assert_user_error, run_cli

    directory = str(harness.tasks.parent / "model")
    code, out, err = run_cli(
        capsys, "eval", directory, "--tasks", "nnxtron_choice", "--include-path", str(harness.tasks), "--json"
    )
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["nnxtron_choice"]["acc,none"] == harness.results["nnxtron_choice"]["acc,none"]
    code, _, err = run_cli(capsys, "eval", directory, "--limit", "3")
    assert_user_error(code, err, "--limit is read only with --tasks")
