"""``nnxtron serve``'s wire format, stop strings and metrics, and the application's bridge to
an engine, with a character tokenizer and a scripted fake engine (no model: the real engine
is served in tests/integration/test_serve.py)."""

from __future__ import annotations

import json
import math
import re
import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from nnxtron.data.chat_template import ChatTemplate
from nnxtron.infer.engine import QueueFull, TokenEvent
from nnxtron.serve.app import create_app
from nnxtron.serve.metrics import Counter, Histogram, Metrics, TokenRate
from nnxtron.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    CompletionText,
    TokenLogprob,
    chat_logprobs,
    completion_logprobs,
    sse,
    validation_error,
)
from nnxtron.serve.sequences import ServeState


class CharTokenizer:
    """One token per character (its code point); 0, 1, 2 are pad, BOS, EOS and decode to nothing."""

    name, vocab_size, pad_id, bos_id, eos_id = "char", 256, 0, 1, 2

    def encode(self, text: str) -> np.ndarray:
        return np.array([ord(c) for c in text], np.int32)

    def decode(self, ids) -> str:
        return "".join(chr(int(i)) for i in np.asarray(ids).ravel() if int(i) > 2)

    def token_text(self, token: int) -> str:
        return ("<pad>", "<s>", "</s>")[token] if token < 3 else chr(token)


TOKENIZER = CharTokenizer()


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


# ---- stop strings --------------------------------------------------------------------------


def released(text: str, stop: list[str], prompt: str = "> ") -> tuple[list[str], CompletionText]:
    """The pieces ``CompletionText`` releases when ``text`` comes one character at a time, then finishes."""
    tracker = CompletionText(TOKENIZER, ids(prompt), stop)
    pieces = [tracker.add([t]) for t in ids(text)]
    return [*pieces, tracker.finish()], tracker


def test_a_stop_string_across_tokens_cuts_the_text_before_it():
    pieces, tracker = released("Hello world. Bye", ["o w", "Bye"])
    assert "".join(pieces) == "Hell" and tracker.stopped and tracker.text == "Hell"
    assert pieces[:7] == ["H", "e", "l", "l", "", "", ""]  # "o" could start "o w": held until the stop is seen


def test_the_tail_that_could_start_a_stop_string_is_held_back_until_ruled_out():
    pieces, tracker = released("abcabd", ["abd!"])
    assert pieces == ["", "", "abc", "", "", "", "abd"] and not tracker.stopped  # "a", "ab", "abd" could start "abd!"
    assert "".join(released("xab", ["abc"])[0]) == "xab"  # finish releases a held tail that never became a stop


def test_stop_strings_are_seen_in_trailing_whitespace_at_once():
    """TextStream holds trailing whitespace back; a stop string ending in it is found when it is generated."""
    tracker = CompletionText(TOKENIZER, ids("> "), ["\n\n"])
    assert [tracker.add([t]) for t in ids("ab\n")] == ["a", "b", ""]
    assert tracker.add(ids("\n")) == "" and tracker.stopped and tracker.text == "ab"
    assert tracker.add(ids("more")) == "" and tracker.finish() == ""


def test_the_earliest_stop_string_wins_and_without_stops_the_text_is_the_completion():
    assert "".join(released("one two three", ["three", "two"])[0]) == "one "
    pieces, tracker = released(" spaced  out ", [])
    assert "".join(pieces) == " spaced  out " == tracker.stream.completion()


def first_stop(text: str, stop: list[str], ends) -> str | None:
    """The text before the stop string seen first when the text grows to each of ``ends``
    (the earliest-starting one among those complete at that point); None if none is."""
    for end in ends:
        hits = [i for i in (text[:end].find(s) for s in stop) if i >= 0]
        if hits:
            return text[: min(hits)]
    return None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab \nc", max_size=30),
    stop=st.lists(st.text(alphabet="ab \nc", min_size=1, max_size=4), max_size=3),
    chunk=st.integers(1, 4),
)
def test_released_text_is_the_text_before_the_first_stop_string(text, stop, chunk):
    """Pushed in chunks of ``chunk`` tokens: the pieces join to the text before the first stop
    string to appear (the whole text if none does), and no piece shows a stop string."""
    tracker = CompletionText(TOKENIZER, ids("> "), stop)
    tokens = ids(text)
    pieces = [tracker.add(tokens[i : i + chunk]) for i in range(0, len(tokens), chunk)]
    final = tracker.finish()
    cut = first_stop(text, stop, [*range(chunk, len(text), chunk), len(text)])
    assert "".join(pieces) + final == (text if cut is None else cut) and tracker.stopped == (cut is not None)
    assert not any(s in "".join(pieces) + final for s in stop)


# ---- requests and errors -------------------------------------------------------------------


def body_errors(model, data) -> list[dict]:
    with pytest.raises(ValidationError) as raised:
        model.model_validate(data)
    return [{**e, "loc": ("body", *e["loc"])} for e in raised.value.errors()]


@pytest.mark.parametrize(
    "data, param, fragment",
    [
        ({"prompt": {"a": 1}}, "prompt", "a list of token ids"),
        ({"prompt": [1, "a"]}, "prompt", "a list of token ids"),
        ({}, "prompt", "prompt is required"),
        ({"prompt": "x", "stop": 5}, "stop", "a string or a list of strings"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens: Input should be greater than or equal to 1"),
        ({"prompt": "x", "temperature": "hot"}, "temperature", "temperature: Input should be a valid number"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"prompt": "x", "n": 17}, "n", "n: Input should be less than or equal to 16"),
        ({"prompt": "x", "stream_options": {"include_usage": "maybe"}}, "stream_options", "stream_options.include_usage"),
    ],
)
def test_validation_errors_name_the_field(data, param, fragment):
    error = validation_error(body_errors(CompletionRequest, data))
    assert (error.status, error.param) == (400, param) and fragment in error.message, error.message


def test_malformed_and_missing_bodies():
    error = validation_error(
        [{"type": "json_invalid", "loc": ("body", 5), "msg": "JSON decode error", "ctx": {"error": "Expecting value"}}]
    )
    assert (error.status, error.code, error.param) == (400, "invalid_json", None) and "Expecting value" in error.message
    assert (
        validation_error([{"type": "missing", "loc": ("body",), "msg": "Field required"}]).message
        == "the request has no JSON body"
    )
    assert "JSON object" in validation_error([{"type": "model_attributes_type", "loc": ("body",), "msg": "x"}]).message
    assert APIError(404, "m", param="model", code="model_not_found").body() == {
        "error": {"message": "m", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    }


def test_sampling_settings_per_choice():
    request = CompletionRequest(prompt="x", seed=2**63 - 1, top_k=-1, n=2)
    first, second = (request.sampling(5, (2,), None, i) for i in range(2))
    assert (first.temperature, first.top_p, first.top_k, first.max_tokens, first.stop_ids) == (1.0, 1.0, 0, 5, (2,))
    assert (first.seed, second.seed) == (2**63 - 1, 2**63)
    assert CompletionRequest(prompt="x").sampling(1, (), 3, 0).seed is None
    chat = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], max_tokens=4, max_completion_tokens=7, logprobs=True
    )
    assert chat.requested_max_tokens() == 7 and chat.logprob_count() == 0
    assert ChatCompletionRequest(messages=[{}], logprobs=True, top_logprobs=5).logprob_count() == 5
    with pytest.raises(APIError, match="needs logprobs=true"):
        ChatCompletionRequest(messages=[{}], top_logprobs=5).logprob_count()


@pytest.mark.parametrize(
    "extra, param",
    [({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of"), ({"logit_bias": {"5": 1}}, "logit_bias"),
     ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": -1}, "frequency_penalty")],
)  # fmt: skip
def test_unsupported_parameters_are_refused(extra, param):
    with pytest.raises(APIError) as raised:
        CompletionRequest(prompt="x", **extra).check_supported()
    assert raised.value.param == param
    CompletionRequest(prompt="x", best_of=1, presence_penalty=0, logit_bias={}).check_supported()


def test_stop_string_lists():
    assert CompletionRequest(prompt="x", stop="a").stop_strings() == ["a"]
    assert CompletionRequest(prompt="x").stop_strings() == []
    for stop in ([""], ["s"] * 17):
        with pytest.raises(APIError):
            CompletionRequest(prompt="x", stop=stop).stop_strings()


def test_logprob_bodies():
    entries = [TokenLogprob(ord("a"), -0.5, [(ord("a"), -0.5), (ord("b"), -1.5)]), TokenLogprob(2, -3.0, [(ord("c"), -0.1)])]
    body = completion_logprobs(TOKENIZER, entries, offset=4)
    assert body == {
        "tokens": ["a", "</s>"], "token_logprobs": [-0.5, -3.0],
        "top_logprobs": [{"a": -0.5, "b": -1.5}, {"c": -0.1, "</s>": -3.0}], "text_offset": [4, 5],
    }  # fmt: skip
    chat = chat_logprobs(TOKENIZER, entries[:1])["content"]
    assert chat == [
        {"token": "a", "logprob": -0.5, "bytes": [97],
         "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}, {"token": "b", "logprob": -1.5, "bytes": [98]}]}
    ]  # fmt: skip
    assert sse({"x": "é"}) == 'data: {"x":"é"}\n\n'.encode()


# ---- metrics -------------------------------------------------------------------------------


def test_metrics_text_format():
    metrics = Metrics()
    metrics.requests.inc(endpoint='/v1/"x"', status="200")
    metrics.requests.inc(endpoint='/v1/"x"', status="200")
    for value in (0.001, 0.02, 0.3, 7.0):
        metrics.latency.observe(value)
    text = metrics.render({"queue_depth": 3, "blocks_in_use": 5, "tokens_generated": 9, "custom_thing": 1.5, "name": "x"})
    lines = text.splitlines()
    assert 'nnxtron_requests_total{endpoint="/v1/\\"x\\"",status="200"} 2' in lines
    assert "nnxtron_queue_depth 3" in lines and "nnxtron_kv_blocks_in_use 5" in lines
    assert "# TYPE nnxtron_generated_tokens_total counter" in lines and "nnxtron_generated_tokens_total 9" in lines
    assert "nnxtron_engine_custom_thing 1.5" in lines and not any(line.startswith("nnxtron_engine_name") for line in lines)
    assert 'nnxtron_request_latency_seconds_bucket{le="0.025"} 2' in lines
    assert 'nnxtron_request_latency_seconds_bucket{le="+Inf"} 4' in lines and "nnxtron_request_latency_seconds_count 4" in lines
    assert 'nnxtron_request_latency_recent_seconds{quantile="0.5"} 0.02' in lines
    assert 'nnxtron_request_latency_recent_seconds{quantile="0.99"} 7.0' in lines
    assert 'nnxtron_time_to_first_token_recent_seconds{quantile="0.9"} NaN' in lines  # nothing observed yet
    assert "nnxtron_prompt_tokens_total 0" in lines
    for line in lines:  # every sample belongs to a family with a TYPE line
        if not line.startswith("#"):
            name = re.match(r"[a-z_]+", line).group(0)
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            assert f"# TYPE {name} " in text or f"# TYPE {family} " in text, line


def test_histogram_quantiles_are_nearest_rank_over_recent_observations():
    histogram = Histogram("x_seconds", "x", buckets=(1.0,), recent=10)
    assert math.isnan(histogram.quantile(0.5))
    for value in range(1, 21):  # the last 10: 11 .. 20
        histogram.observe(float(value))
    assert (histogram.quantile(0.5), histogram.quantile(0.9), histogram.quantile(0.99)) == (15.0, 19.0, 20.0)
    assert histogram.count == 20 and histogram.counts == [1]
    with pytest.raises(ValueError):
        Histogram("x", "not in seconds")
    counter = Counter("c_total", "c", ("a",))
    counter.inc(2, a="x")
    assert counter.value(a="x") == 2 and counter.value(a="y") == 0


def test_token_rate_counts_the_last_window():
    now = [100.0]
    rate = TokenRate(window=10.0, clock=lambda: now[0])
    rate.add(30)
    now[0] = 103.0
    rate.add(30)
    assert rate.rate() == pytest.approx(60 / 3)
    now[0] = 112.0  # the first 30 are older than the window
    assert rate.rate() == pytest.approx(30 / 10)


# ---- the application, over a scripted engine ---------------------------------------------------


class FakeEngine:
    """Engine's interface; each sequence plays ``script(prompt, params)``, a list of events, from a thread."""

    max_length = 64

    def __init__(self, script=None, fail=None):
        self.script = script or (
            lambda prompt, params: [TokenEvent(t) for t in ids("abc")] + [TokenEvent(None, finish_reason="length")]
        )
        self.fail, self.submitted, self.cancelled = fail, [], []

    def submit(self, prompt, params, emit, timeout=None):
        if self.fail is not None:
            raise self.fail
        self.submitted.append((list(prompt), params, timeout))
        events = self.script(prompt, params)
        threading.Thread(target=lambda: [emit(e) for e in events], daemon=True).start()
        return len(self.submitted)

    def cancel(self, sequence):
        self.cancelled.append(sequence)

    def stats(self):
        return {"queue_depth": 0, "running": 0, "blocks_in_use": 0, "blocks_capacity": 8, "tokens_generated": 0}


def fake_client(engine, **state) -> TestClient:
    template = ChatTemplate("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}", {"bos_token": "\x01"})
    return TestClient(create_app(ServeState(engine, TOKENIZER, "fake", 256, template, **state)))


def test_the_bridge_answers_completions_and_chats():
    engine = FakeEngine()
    client = fake_client(engine)
    answer = client.post("/v1/completions", json={"prompt": "hi", "n": 2, "seed": 5, "return_token_ids": True}).json()
    assert [c["text"] for c in answer["choices"]] == ["abc", "abc"] and answer["choices"][0]["token_ids"] == ids("abc")
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert [(p, s.seed, s.max_tokens, s.stop_ids, t) for p, s, t in engine.submitted] == [
        ([1, *ids("hi")], 5, 16, (2,), 600.0),
        ([1, *ids("hi")], 6, 16, (2,), 600.0),
    ]
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "yo"}]}).json()
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "abc"}
    assert engine.submitted[-1][0] == [1, *ids("yo")] and engine.submitted[-1][1].max_tokens == 64 - 3  # the rest of the context
    streamed = client.post("/v1/completions", json={"prompt": "hi", "stream": True}).text
    events = [json.loads(e[len("data: ") :]) for e in streamed.split("\n\n")[:-2]]
    assert streamed.endswith("data: [DONE]\n\n") and "".join(e["choices"][0]["text"] for e in events) == "abc"
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_cancels_the_sequence_and_later_events_are_ignored():
    engine = FakeEngine(
        lambda prompt, params: [TokenEvent(t) for t in ids("abcdef")] + [TokenEvent(None, finish_reason="cancelled")]
    )
    answer = fake_client(engine).post("/v1/completions", json={"prompt": "x", "stop": "cd"}).json()
    assert answer["choices"][0]["text"] == "ab" and answer["choices"][0]["finish_reason"] == "stop"
    assert engine.cancelled == [1]


def test_engine_failures_become_openai_errors():
    boom = lambda prompt, params: [TokenEvent(ord("a")), TokenEvent(None, finish_reason="error", error="XlaRuntimeError: oom")]  # noqa: E731
    client = fake_client(FakeEngine(boom))
    response = client.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 500 and response.json()["error"]["code"] == "engine_error"
    assert "oom" in response.json()["error"]["message"]
    events = client.post("/v1/completions", json={"prompt": "x", "stream": True}).text.split("\n\n")
    assert '"code":"engine_error"' in events[-3] and events[-2] == "data: [DONE]"
    late = lambda prompt, params: [TokenEvent(None, finish_reason="timeout", error="the request timed out")]  # noqa: E731
    response = fake_client(FakeEngine(late)).post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
    response = fake_client(FakeEngine(fail=QueueFull(3, retry_after=2.2))).post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    response = fake_client(FakeEngine(fail=ValueError("too long"))).post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 400 and response.json()["error"] == {
        "message": "too long", "type": "invalid_request_error", "param": "max_tokens", "code": None
    }  # fmt: skip


def test_a_server_side_deadline_cancels_a_silent_engine():
    engine = FakeEngine(lambda prompt, params: [])  # never answers
    response = fake_client(engine, request_timeout=0.05).post("/v1/completions", json={"prompt": "x", "n": 2})
    assert response.status_code == 504 and sorted(engine.cancelled) == [1, 2]


def test_metrics_and_api_key_on_the_app():
    client = fake_client(FakeEngine(), api_key="k")
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    assert client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer k"}).status_code == 200
    assert client.get("/v1/models/fake", headers={"Authorization": "Bearer k"}).json()["id"] == "fake"
    assert client.get("/v1/models/other", headers={"Authorization": "Bearer k"}).status_code == 404
    text = client.get("/metrics").text
    assert 'nnxtron_requests_total{endpoint="/v1/completions",status="401"} 2' in text
    assert 'nnxtron_requests_total{endpoint="/v1/completions",status="200"} 1' in text
    assert 'nnxtron_sequences_finished_total{reason="length"} 1' in text and "nnxtron_kv_blocks_capacity 8" in text
    assert client.put("/health").status_code == 405 and client.put("/health").json()["error"]["code"] == "method_not_allowed"
