"""``nnxtron serve`` end to end: one uvicorn server (in a thread of this process) around the
stored tiny HF llama2 golden model, given a small BPE tokenizer and a chat template, asked
through the official ``openai`` client and raw HTTP.

Token-level parity uses the ``return_token_ids`` extension: every choice carries the ids it
generated (``token_ids``) and, in a non-streamed answer, its prompt's (``prompt_token_ids``).
The tokenizer's EOS is set to the token the golden greedy row 1 generates third, so that row
also checks that the EOS stops a sequence (``finish_reason="stop"``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nnxtron.serve.sequences import ServeState
from nnxtron.serve.server import ServeOptions, listen, load, make_engine, make_server
from tests.integration.conftest import assert_user_error, run_cli

GOLDEN = Path(__file__).parents[1] / "assets" / "golden" / "llama2"
MAX_LENGTH = 512
API_KEY = "sk-test-nnxtron"
EOS_ID = 140  # golden row 1 generates it third; row 0 never does
TEXT = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. All that glitters is not gold. "
    "Where there is a will there is a way! Hello, world? 0123456789 user assistant system"
)
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
LONG = 480  # max_tokens of a request that runs long enough to be cut


def write_model_dir(directory: Path) -> Path:
    """The llama2 golden model (vocab 256) with a 172-token BPE (SentencePiece-style ``▁``) and a chat template."""
    directory.mkdir(parents=True)
    shutil.copyfile(GOLDEN / "model.safetensors", directory / "model.safetensors")
    config = json.loads((GOLDEN / "config.json").read_text())  # a context longer than the golden 256 (MAX_LENGTH)
    (directory / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2 * MAX_LENGTH}))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(vocab_size=256, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(directory / "tokenizer.json"))
    settings = {"bos_token": "<s>", "eos_token": tok.id_to_token(EOS_ID), "unk_token": "<unk>", "chat_template": TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


@dataclass
class Served:
    directory: Path
    state: ServeState
    port: int

    @property
    def engine(self):
        return self.state.engine

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", API_KEY)
        return openai.OpenAI(base_url=f"{self.url}/v1", timeout=60, **kwargs)

    def post(self, path: str, body=None, content: bytes | None = None, headers: dict | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **(headers or {})}
        if content is None:
            content = json.dumps(body).encode()
        return httpx.post(self.url + path, content=content, headers=headers, timeout=60)

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """The engine's stats once nothing runs, waits or holds a block (fails after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine.stats()
            if stats["blocks_in_use"] == 0 and stats["running"] == 0 and stats["queue_depth"] == 0:
                return stats
            assert time.monotonic() < deadline, f"the engine is not idle: {stats}"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = write_model_dir(tmp_path_factory.mktemp("serve") / "tiny-llama2")
    loaded = load(directory)
    options = ServeOptions(max_length=MAX_LENGTH, max_sequences=8, prefill_chunk=32, max_queue=64, log_level="warning")
    engine = make_engine(loaded.model, options)
    engine.start()
    state = ServeState(
        engine, loaded.tokenizer, loaded.name, loaded.config.vocab_size, loaded.chat_template, loaded.no_chat_template,
        api_key=API_KEY, request_timeout=120, limits=options.limits(),
    )  # fmt: skip
    sock = listen("127.0.0.1", 0)
    server = make_server(state, options, 0)  # the server `nnxtron serve` runs: its protocol and limits
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield Served(directory, state, sock.getsockname()[1])
    server.should_exit = True
    thread.join(timeout=30)
    engine.stop()
    sock.close()


def complete(served: Served, prompt, **kwargs):
    kwargs.setdefault("temperature", 0)
    extra = {"return_token_ids": True, **kwargs.pop("extra_body", {})}
    if "top_k" in kwargs:  # an extension: not an argument of the client
        extra["top_k"] = kwargs.pop("top_k")
    return served.client().completions.create(model=served.state.model_name, prompt=prompt, extra_body=extra, **kwargs)


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


# ---- parity ----------------------------------------------------------------------------------


def test_greedy_completions_equal_hf_generate(served):
    """Both golden prompts (token ids) in one request, and each alone: the ids HF's greedy
    ``generate`` wrote; row 1 ends at its first EOS with finish_reason "stop"."""
    golden = load_file(str(GOLDEN / "generate.safetensors"))
    prompts = [[int(t) for t in row] for row in golden["prompt_ids"]]
    expected = [[int(t) for t in row] for row in golden["generated"]]
    steps = len(expected[0])
    assert EOS_ID not in expected[0] and expected[1].index(EOS_ID) == 2
    both = complete(served, prompts, max_tokens=steps)
    alone = [complete(served, prompt, max_tokens=steps).choices[0] for prompt in prompts]
    for choices in (both.choices, alone):
        assert [c.index for c in choices] == ([0, 1] if choices is both.choices else [0, 0])
        assert token_ids(choices[0]) == expected[0] and choices[0].finish_reason == "length"
        assert token_ids(choices[1]) == expected[1][:3] and choices[1].finish_reason == "stop"
        assert [c.model_extra["prompt_token_ids"] for c in choices] == prompts
    assert (
        both.usage.prompt_tokens == 24 and both.usage.completion_tokens == steps + 3 and both.usage.total_tokens == 24 + steps + 3
    )


def test_greedy_text_equals_nnxtron_generate(served, capsys):
    """A text prompt: BOS + the prompt's ids, the same tokens and completion text as ``nnxtron generate --json``."""
    prompt = "Hello there, the quick brown"
    code, out, err = run_cli(
        capsys, "generate", str(served.directory), "--prompt", prompt, "max_new_tokens=20", "decode_sampling_strategy=greedy",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    generated = json.loads(out)
    answer = complete(served, prompt, max_tokens=20)
    choice = answer.choices[0]
    tokenizer = served.state.tokenizer
    assert choice.model_extra["prompt_token_ids"] == [tokenizer.bos_id, *tokenizer.encode(prompt).tolist()]
    assert token_ids(choice) == generated["tokens"]
    assert choice.text == generated["completion"]


def test_streaming_chunks_join_to_the_plain_answer(served):
    client = served.client()
    prompt = "A stitch in time"
    plain = complete(served, prompt, max_tokens=30, n=2, seed=3, temperature=0.8)
    stream = complete(served, prompt, max_tokens=30, n=2, seed=3, temperature=0.8, stream=True,
                      stream_options={"include_usage": True})  # fmt: skip
    texts, ids, reasons, usage = ["", ""], [[], []], [None, None], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            ids[c.index] += c.model_extra["token_ids"]
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.text for c in plain.choices] and ids == [token_ids(c) for c in plain.choices]
    assert reasons == [c.finish_reason for c in plain.choices] and usage == plain.usage
    assert texts[0] != texts[1] or ids[0] != ids[1]  # seeds 3 and 4

    messages = [{"role": "user", "content": "Where there is a will"}]
    ask = dict(
        model=served.state.model_name, messages=messages, max_tokens=25, temperature=0, extra_body={"return_token_ids": True}
    )
    chat = client.chat.completions.create(**ask).choices[0]
    deltas, chunk_ids, roles, finish = "", [], [], None
    for chunk in client.chat.completions.create(**ask, stream=True):
        for c in chunk.choices:
            deltas += c.delta.content or ""
            chunk_ids += c.model_extra["token_ids"]
            roles += [c.delta.role] if c.delta.role else []
            finish = c.finish_reason or finish
    assert deltas == chat.message.content and chunk_ids == chat.model_extra["token_ids"]
    assert roles == ["assistant"] and finish == chat.finish_reason


def test_chat_completions_render_the_template(served):
    """The chat prompt is the template's text encoded without another BOS (the template writes it); its answer
    is the completion of those ids."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world?"}]
    chat = served.client().chat.completions.create(
        model=served.state.model_name, messages=messages, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = chat.choices[0]
    text = served.state.chat_template.render(messages, add_generation_prompt=True)
    assert text.startswith("<s>system: Be brief.\nuser: Hello, world?\nassistant:")
    prompt = served.state.tokenizer.encode(text).tolist()
    assert choice.model_extra["prompt_token_ids"] == prompt and prompt.count(served.state.tokenizer.bos_id) == 1
    plain = complete(served, prompt, max_tokens=12).choices[0]
    assert choice.model_extra["token_ids"] == token_ids(plain) and choice.message.content == plain.text
    assert choice.message.role == "assistant" and chat.usage.prompt_tokens == len(prompt)


def test_chat_without_a_template_is_a_400_and_completions_still_work(served):
    template = served.state.chat_template
    served.state.chat_template = None
    try:
        response = served.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 400 and response.json()["error"]["code"] == "no_chat_template"
        assert "no chat template" in response.json()["error"]["message"]
        assert complete(served, "Hello", max_tokens=2).choices[0].finish_reason in ("length", "stop")
    finally:
        served.state.chat_template = template


def test_n_choices_use_seed_plus_index(served):
    """n=2 with a seed: choice i is the answer to n=1 with seed + i; greedy choices are equal."""
    prompt = "All that glitters"
    two = complete(served, prompt, max_tokens=15, n=2, seed=11, temperature=1.0, top_k=50, top_p=0.9)
    ones = [complete(served, prompt, max_tokens=15, seed=seed, temperature=1.0, top_k=50, top_p=0.9) for seed in (11, 12)]
    assert [token_ids(c) for c in two.choices] == [token_ids(o.choices[0]) for o in ones]
    assert token_ids(two.choices[0]) != token_ids(two.choices[1])
    greedy = complete(served, prompt, max_tokens=15, n=2)
    assert token_ids(greedy.choices[0]) == token_ids(greedy.choices[1])


def test_logprobs(served):
    """Completions: the chosen token's log-probability and its top alternatives (greedy: the best one);
    chat: the same numbers as ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    messages = [{"role": "user", "content": "the lazy dog"}]
    chat = served.client().chat.completions.create(
        model=served.state.model_name, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    prompt = chat.choices[0].model_extra["prompt_token_ids"]
    plain = complete(served, prompt, max_tokens=6, logprobs=3).choices[0]
    lp = plain.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(token_ids(plain)) == 6
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 4 and logprob == pytest.approx(max(top.values()))
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(lp.token_logprobs)
    for item in content:
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert bytes(item.bytes) == item.token.encode()
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_stop_strings_cut_the_text_and_the_stream_never_shows_them(served):
    prompt = "Where there is"
    free = complete(served, prompt, max_tokens=40).choices[0]
    tokenizer = served.state.tokenizer
    prompt_ids = free.model_extra["prompt_token_ids"]
    ids = token_ids(free)
    # a stop string across a token boundary, well inside the text
    ends = [len(tokenizer.decode(prompt_ids + ids[: k + 1])) - len(tokenizer.decode(prompt_ids)) for k in range(len(ids))]
    k = next(k for k in range(4, len(ids) - 2) if ends[k] - ends[k - 1] >= 2 and ends[k + 1] - ends[k] >= 2)
    stop = free.text[ends[k] - 2 : ends[k] + 2]
    assert len(stop) == 4 and stop in free.text
    expected = free.text[: free.text.index(stop)]

    cut = complete(served, prompt, max_tokens=40, stop=[stop, "never-generated"]).choices[0]
    assert cut.text == expected and cut.finish_reason == "stop" and len(token_ids(cut)) < 40
    chunks = [c.choices[0].text for c in complete(served, prompt, max_tokens=40, stop=stop, stream=True) if c.choices]
    assert "".join(chunks) == expected and not any(stop in chunk for chunk in chunks)
    served.wait_idle()  # the cut sequence was cancelled, its blocks freed


def test_models_health_and_metrics(served):
    client = served.client()
    assert [m.id for m in client.models.list().data] == [served.state.model_name]
    assert client.models.retrieve(served.state.model_name).id == served.state.model_name
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}  # no key needed
    complete(served, "Hello", max_tokens=3)
    response = httpx.get(served.url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples, types = parse_prometheus(response.text)
    assert samples[("nnxtron_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] >= 1
    for name in ("nnxtron_queue_depth", "nnxtron_running_sequences", "nnxtron_kv_blocks_in_use"):
        assert types[name] == "gauge" and samples[(name, ())] >= 0
    assert samples[("nnxtron_kv_blocks_capacity", ())] == served.engine.stats()["blocks_capacity"] > 0
    assert samples[("nnxtron_generated_tokens_total", ())] >= 3 and types["nnxtron_generated_tokens_total"] == "counter"
    assert samples[("nnxtron_generation_tokens_per_second", ())] > 0
    for base in ("nnxtron_time_to_first_token", "nnxtron_request_latency"):
        assert types[f"{base}_seconds"] == "histogram" and types[f"{base}_recent_seconds"] == "summary"
        buckets = sorted((float(dict(labels)["le"]), v) for (n, labels), v in samples.items() if n == f"{base}_seconds_bucket")
        assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1] == (
            float("inf"),
            samples[(f"{base}_seconds_count", ())],
        )
        quantiles = [samples[(f"{base}_recent_seconds", (("quantile", q),))] for q in ("0.5", "0.9", "0.99")]
        assert 0 < quantiles[0] <= quantiles[1] <= quantiles[2]


def parse_prometheus(text: str) -> tuple[dict, dict]:
    """{(name, sorted labels): value} and {family: type} of a Prometheus text exposition (strict)."""
    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*)\})? (\S+)$')
    samples, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram", "summary") and name not in types
            types[name] = kind
        elif line.startswith("# HELP ") or not line:
            continue
        else:
            match = sample.match(line)
            assert match, line
            name, labels, value = match.groups()
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in types or family in types, f"{name} has no # TYPE line"
            pairs = tuple(sorted(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels or "")))
            samples[(name, pairs)] = float(value)
    return samples, types


# ---- refusals ------------------------------------------------------------------------------


def test_api_key_is_required(served):
    with pytest.raises(openai.AuthenticationError) as raised:
        served.client(api_key="wrong", max_retries=0).completions.create(model=served.state.model_name, prompt="hi")
    assert raised.value.status_code == 401 and raised.value.code == "invalid_api_key"
    response = httpx.post(served.url + "/v1/completions", json={"prompt": "hi"})  # no header
    assert response.status_code == 401 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(served.url + "/v1/models").status_code == 401
    assert httpx.get(served.url + "/health").status_code == 200


BAD_INPUT = [  # (endpoint, body or raw bytes, status, param, code)
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 3', 400, None, "invalid_json"),
    ("/v1/completions", b"", 400, None, "invalid_json"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "the lazy dog " * 200}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [5] * MAX_LENGTH}, 400, "prompt", "context_length_exceeded"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "dog " * 600}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [5] * 500, "max_tokens": 13}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "hi", "temperature": 3}, 400, "temperature", None),
    ("/v1/completions", {"prompt": {"text": "hi"}}, 400, "prompt", None),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [1, 256]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "hi", "stop": ["", "x"]}, 400, "stop", None),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo", None),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs", None),
    ("/v1/nothing", {"prompt": "hi"}, 404, None, "not_found"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"prompt": ["hi", ""]}, 400, "prompt", None),
    ("/v1/completions", b'{"prompt": "hi \\ud800"}', 400, "prompt", None),  # a lone surrogate, as JSON can write it
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, "messages", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"\\ud83d": 1}]}', 400, "tools", None),
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "hi"}', 400, "model", None),  # echoed, it could not be encoded
]


@pytest.mark.parametrize("endpoint, body, status, param, code", BAD_INPUT, ids=range(len(BAD_INPUT)))
def test_bad_input_is_an_openai_error(served, endpoint, body, status, param, code):
    response = served.post(endpoint, content=body if isinstance(body, bytes) else None, body=body)
    error = response.json()["error"]
    assert response.status_code == status, error
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"]
    assert (error["param"], error["code"]) == (param, code)


def raw_http(served: Served, data: bytes, wait: float = 10.0) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it (or ``wait`` seconds pass)."""
    with socket.create_connection(("127.0.0.1", served.port), timeout=wait) as sock:
        sock.sendall(data)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except TimeoutError:
            pass
    return answer


def http_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)["error"]


def test_large_and_slow_requests_are_refused(served):
    """413 for a body over --max-body-bytes (by its Content-Length, before it is read; or as it streams),
    408 for headers or a body that do not arrive within --read-timeout (a slow-loris client), and the
    server serves on."""
    limits, head = served.state.limits, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
    start = time.monotonic()
    status, error = http_error(raw_http(served, f"{head}Content-Length: 40000000\r\n\r\n{{".encode()))
    assert (status, error["code"]) == (413, "request_too_large") and "8,388,608 bytes" in error["message"]
    assert time.monotonic() - start < 5  # answered without waiting for (or reading) the 40 MB
    saved = limits.max_body_bytes, limits.read_timeout
    limits.max_body_bytes, limits.read_timeout = 4096, 0.3
    before = {key: requests_counted(served, *key) for key in (("/v1/completions", "408"), ("other", "408"), ("other", "400"))}
    try:
        chunked = served.post("/v1/completions", content=iter([b'{"prompt": "' + b"a" * 3000, b"a" * 3000 + b'"}']))
        assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
        for partial in (f'{head}Content-Length: 100\r\n\r\n{{"prompt"', head, ""):  # a body, headers, nothing
            start = time.monotonic()
            status, error = http_error(raw_http(served, partial.encode()))
            assert (status, error["code"]) == (408, "request_timeout"), error
            assert 0.25 < time.monotonic() - start < 5
    finally:
        limits.max_body_bytes, limits.read_timeout = saved
    assert raw_http(served, b"NOT HTTP AT ALL\r\n\r\n").startswith(b"HTTP/1.1 400 ")  # h11's own answer
    # every answer is counted: the body's 408 by its route, the protocol's 408 (headers) and 400 (no route read) as "other"
    after = {key: requests_counted(served, *key) for key in before}
    assert {key: after[key] - before[key] for key in before} == {
        ("/v1/completions", "408"): 1, ("other", "408"): 2, ("other", "400"): 1,
    }  # fmt: skip
    assert complete(served, "Hello", max_tokens=2).usage.completion_tokens >= 1


def requests_counted(served: Served, endpoint: str, status: str) -> float:
    """``nnxtron_requests_total{endpoint, status}`` as ``/metrics`` reports it now (0 before the first)."""
    samples, _ = parse_prometheus(httpx.get(served.url + "/metrics").text)
    return samples.get(("nnxtron_requests_total", (("endpoint", endpoint), ("status", status))), 0.0)


def test_prompts_are_tokenized_and_rendered_off_the_event_loop(served, monkeypatch):
    """Tokenizing a prompt and rendering a chat template run in worker threads: the event loop
    (which answers /health and every other client) never waits for them."""
    on_loop = []

    def recorded(fn):
        def call(*args, **kwargs):
            try:
                on_loop.append(asyncio.get_running_loop() is not None)
            except RuntimeError:  # no event loop runs in this thread
                on_loop.append(False)
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(served.state.tokenizer, "encode", recorded(served.state.tokenizer.encode))
    monkeypatch.setattr(served.state.chat_template, "render", recorded(served.state.chat_template.render))
    complete(served, "Hello", max_tokens=2)
    served.client().chat.completions.create(
        model=served.state.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert len(on_loop) == 3 and not any(on_loop), on_loop


def test_the_server_keeps_serving_after_bad_input(served):
    for endpoint, body, *_ in BAD_INPUT:
        served.post(endpoint, content=body if isinstance(body, bytes) else None, body=body)
    assert complete(served, "Hello", max_tokens=4).usage.completion_tokens >= 1
    served.wait_idle()


def test_a_full_queue_is_429_with_retry_after(served):
    engine = served.engine
    engine.max_queue = 0  # every submission finds the queue full
    try:
        with pytest.raises(openai.RateLimitError) as raised:
            served.client(max_retries=0).completions.create(model=served.state.model_name, prompt="hi", max_tokens=2)
        assert raised.value.status_code == 429 and raised.value.code == "queue_full"
        assert int(raised.value.response.headers["retry-after"]) >= 1
        response = served.post("/v1/completions", {"prompt": "hi", "n": 3})
        assert response.status_code == 429 and response.json()["error"]["type"] == "rate_limit_error"
    finally:
        engine.max_queue = 64
    served.wait_idle()
    assert complete(served, "hi", max_tokens=2).choices[0].finish_reason in ("length", "stop")


def test_a_request_past_its_timeout_is_504(served):
    state = served.state
    state.request_timeout = 0.05
    try:
        response = served.post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": LONG, "temperature": 0})
        assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
        with pytest.raises(openai.APIError, match="timeout"):
            for _ in complete(served, [5, 6, 7], max_tokens=LONG, stream=True):
                pass
    finally:
        state.request_timeout = 120
    served.wait_idle()


def _finished(served, reason: str) -> float:
    return served.state.metrics.finished.value(reason=reason)


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(served):
    """Closing a stream after two chunks cancels the sequence: far fewer than max_tokens are
    generated and its KV blocks go back (the engine runs nothing else meanwhile)."""
    served.wait_idle()
    before, cancelled = served.engine.stats()["tokens_generated"], _finished(served, "cancelled")
    stream = complete(served, [5, 6, 7], max_tokens=LONG, stream=True)
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert served.engine.stats()["blocks_in_use"] > 0
    stream.close()
    after = served.wait_idle()["tokens_generated"]
    assert 2 <= after - before < LONG // 2 and _finished(served, "cancelled") == cancelled + 1

    # a plain (non-streamed) request whose client goes away is cancelled too
    before = after
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": LONG, "temperature": 0}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        )
        sock.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 20
        while served.engine.stats()["tokens_generated"] == before:
            assert time.monotonic() < deadline
            time.sleep(0.002)
    after = served.wait_idle()["tokens_generated"]
    assert 1 <= after - before < LONG // 2 and _finished(served, "cancelled") == cancelled + 2


def test_concurrent_load_answers_as_alone_and_leaks_no_blocks(served):
    """32 client threads x 4 requests of 8 kinds (prompts of 3..90 tokens, 5..40 new tokens),
    plain, streamed, or streamed and dropped after the first chunk: every greedy answer equals
    the same request alone (a dropped one: a prefix of it), and no block is left held."""
    kinds = [([(7 * i + 13 * j) % 160 + 3 for j in range(length)], new) for i, (length, new) in
             enumerate(zip((3, 7, 12, 20, 33, 50, 70, 90), (5, 9, 13, 18, 24, 30, 35, 40)))]  # fmt: skip
    alone = [token_ids(complete(served, prompt, max_tokens=new).choices[0]) for prompt, new in kinds]

    def one(thread: int, i: int) -> tuple[int, str, list[int]]:
        kind = (thread * 4 + i) % len(kinds)
        prompt, new = kinds[kind]
        mode = ("plain", "stream", "drop")[(thread + i) % 3]
        if mode == "plain":
            return kind, mode, token_ids(complete(served, prompt, max_tokens=new).choices[0])
        got: list[int] = []
        stream = complete(served, prompt, max_tokens=new, stream=True)
        for chunk in stream:
            got += chunk.choices[0].model_extra["token_ids"]
            if mode == "drop":
                stream.close()
                break
        return kind, mode, got

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda args: one(*args), [(t, i) for t in range(32) for i in range(4)]))
    assert len(results) == 128
    for kind, mode, got in results:
        if mode == "drop":
            assert got == alone[kind][: len(got)] and got, (kind, got)
        else:
            assert got == alone[kind], (kind, mode)
    stats = served.wait_idle()
    assert stats["blocks_in_use"] == 0


def test_a_run_directory_brings_its_tokenizer_and_chat_template(served, capsys, tmp_path):
    """``convert from-hf`` carries tokenizer.json and tokenizer_config.json into ``<run>/tokenizer/``:
    ``load`` finds the template there; ``--chat-template FILE`` replaces it, seeing the tokenizer's special tokens."""
    run = tmp_path / "run"
    code, _, err = run_cli(capsys, "convert", "from-hf", str(served.directory), str(run))
    assert code == 0, err
    messages = [{"role": "user", "content": "hi"}]
    loaded = load(run)
    assert loaded.name == "run" and loaded.tokenizer.eos_id == EOS_ID
    assert loaded.chat_template.render(messages) == served.state.chat_template.render(messages) == "<s>user: hi\nassistant:"
    file = tmp_path / "template.jinja"
    file.write_text("{{ bos_token }}[{{ messages[0]['content'] }}]{{ eos_token }}")
    assert load(run, chat_template=str(file)).chat_template.render(messages) == f"<s>[hi]{loaded.tokenizer.token_text(EOS_ID)}"


# ---- the command line ----------------------------------------------------------------------


def test_serve_bad_input_is_one_line(served, capsys, tmp_path):
    code, _, err = run_cli(capsys, "serve", str(tmp_path / "nonexistent"))
    assert_user_error(code, err, "is not an nnxtron run directory")
    code, _, err = run_cli(capsys, "serve", str(served.directory), "--port", "70000")
    assert_user_error(code, err, "--port 70000")
    code, _, err = run_cli(capsys, "serve", str(served.directory), "--prefill-chunk", "24")
    assert_user_error(code, err, "power of two")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, _, err = run_cli(capsys, "serve", str(served.directory), "--port", str(taken.getsockname()[1]))
        assert_user_error(code, err, "cannot listen on 127.0.0.1")
    code, _, err = run_cli(capsys, "serve", str(GOLDEN), "--port", "0")  # the golden directory has no tokenizer
    assert_user_error(code, err, "holds no tokenizer file")  # as generate refuses it
    code, _, err = run_cli(capsys, "serve", str(served.directory), "--port", "0", "--max-length", "9000")
    assert_user_error(code, err, "max_position_embeddings")


def test_serve_limit_flags_reach_the_server(served, capsys, monkeypatch):
    """--max-body-bytes, --read-timeout, --max-connections and --drain-timeout: the options, the limits the
    application and protocol read, and uvicorn's settings; a value that cannot work is one line."""
    import nnxtron.serve.server as server_module
    from nnxtron.convert.hf import hf_config
    from nnxtron.data.chat_template import RenderLimits
    from nnxtron.errors import UserError
    from nnxtron.serve.limits import KEEP_ALIVE_SECONDS, MAX_HEADER_BYTES, Limits
    from nnxtron.serve.server import load_chat_template

    given = []
    monkeypatch.setattr(server_module, "serve", lambda path, overrides, options: given.append(options))
    flags = ["--max-body-bytes", "1234", "--read-timeout", "2.5", "--max-connections", "7", "--drain-timeout", "4",
             "--chat-template-timeout", "0.5", "--chat-template-memory-mib", "96", "--chat-template-max-chars", "40"]  # fmt: skip
    code, _, err = run_cli(capsys, "serve", str(served.directory), *flags)
    assert code == 0, err
    (options,) = given
    assert options.limits() == Limits(max_body_bytes=1234, read_timeout=2.5)
    assert options.render_limits() == RenderLimits(seconds=0.5, memory_mib=96, max_chars=40)
    cfg = hf_config(served.directory)  # the config alone (where the template is found), not the weights
    template, _ = load_chat_template(served.directory, cfg, served.state.tokenizer, None, options.render_limits())
    assert template.limits == options.render_limits()  # the template `serve` renders carries them
    with pytest.raises(UserError, match="output exceeds 40 characters.*--chat-template-max-chars"):
        template.render([{"role": "user", "content": "a message longer than forty characters, rendered"}])
    state = ServeState(served.engine, served.state.tokenizer, "x", 256, limits=options.limits())
    config = make_server(state, options, 0).config
    assert (config.limit_concurrency, config.timeout_graceful_shutdown) == (7, 4)
    assert (config.timeout_keep_alive, config.h11_max_incomplete_event_size) == (KEEP_ALIVE_SECONDS, MAX_HEADER_BYTES)
    assert config.http.__name__ == "ReadTimeoutProtocol"
    monkeypatch.undo()
    for flag, value in (
        ("--read-timeout", "0"),
        ("--drain-timeout", "-1"),
        ("--max-body-bytes", "0"),
        ("--max-connections", "0"),
        ("--chat-template-timeout", "0"),
        ("--chat-template-timeout", "nan"),
        ("--chat-template-memory-mib", "63"),
        ("--chat-template-max-chars", "0"),
    ):
        code, _, err = run_cli(capsys, "serve", str(served.directory), flag, value)
        assert_user_error(code, err, flag)


def test_serve_command_answers_and_drains_on_sigterm(served, tmp_path):
    """``nnxtron serve`` in its own process: one line naming the URL, a completion with the API key
    from $NNXTRON_API_KEY, --max-body-bytes applied. SIGTERM in the middle of a stream: new
    connections are refused, the stream still runs to its end, then the process exits with 0.
    A nonexistent path: one line, status 2."""
    env = {**os.environ, "NNXTRON_API_KEY": "sk-env", "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "nnxtron", "serve", str(tmp_path / "missing")], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        f"error: '{tmp_path / 'missing'}' is not an nnxtron run directory (no config.yml); pass a directory written by "
        "`nnxtron train` or `nnxtron convert from-hf`, or an HF model directory"
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "nnxtron", "serve", str(served.directory), "--port", "0", "--max-length", str(MAX_LENGTH),
         "--served-model-name", "tiny", "--log-level", "warning", "--max-body-bytes", "100000", "--drain-timeout", "60"],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        line = proc.stderr.readline()
        match = re.search(r"serving 'tiny' at (http://127\.0\.0\.1:(\d+)/v1) \(context 512 tokens", line)
        assert match, line
        url, port = match.group(1), int(match.group(2))
        client = openai.OpenAI(base_url=url, api_key="sk-env", timeout=60, max_retries=0)
        answer = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
        assert answer.choices[0].finish_reason in ("length", "stop") and answer.usage.completion_tokens >= 1
        big = httpx.post(f"{url}/completions", headers={"Authorization": "Bearer sk-env"}, content=b" " * 200_000)
        assert big.status_code == 413 and "100,000 bytes" in big.json()["error"]["message"]

        stream = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=160, temperature=0, stream=True,
                                           extra_body={"return_token_ids": True})  # fmt: skip
        chunks = iter(stream)
        tokens = list(next(chunks).choices[0].model_extra["token_ids"])
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while True:  # the listening socket closes at once
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except ConnectionRefusedError:
                break
            assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
            time.sleep(0.05)
        assert proc.poll() is None  # draining: the stream is still being answered
        reasons = []
        for chunk in chunks:  # the request in flight runs to its end
            tokens += chunk.choices[0].model_extra["token_ids"]
            reasons.append(chunk.choices[0].finish_reason)
        assert len(tokens) == 160 and reasons[-1] == "length"
        assert proc.wait(timeout=60) == 0  # drained, then a clean exit (not death by SIGTERM)
    finally:
        proc.kill()
        proc.stderr.close()
