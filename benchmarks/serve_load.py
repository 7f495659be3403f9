"""Serving load: the continuous-batching engine at concurrency 1, 8 and 32, against the same
requests run one at a time and against HF transformers' batched ``generate``.

One request set (``--requests`` prompts of 8 to 96 random tokens, each asking for 16 to
64 greedy tokens, fixed seed) on one tiny HF model (a golden checkpoint, default
``tests/assets/golden/llama2``), all in this process on the CPU:

* ``engine, concurrency 1``: the requests one at a time (the baseline of the ratios);
* ``engine, concurrency C``: C client threads each submit a request to
  ``infer.engine.Engine`` (paged cache, chunked prefill, continuous batching) and the next
  when it is answered; per request: time to first token and latency; overall tokens/s;
* ``server, concurrency C``: the same through ``nnxtron serve``'s HTTP API (uvicorn in this
  process, C client threads streaming ``/v1/completions`` with token-id prompts): what
  HTTP, JSON, server-sent events and incremental detokenization add;
* ``HF generate, batches of C``: transformers' greedy ``generate`` on the requests in
  batches of C (left-padded, ``max_new_tokens`` = the batch's largest; only each
  request's own tokens count).

Every engine answer must equal ``infer.decode.generate`` of the request alone (untimed:
it compiles for each request's length) before anything is reported. Each configuration
runs once over all requests to compile and warm up; the engine then runs ``--repeats``
timed passes (median time; percentiles over all passes), HF one. Prints a table and one
JSON line. The HF row needs torch (``pip install -e '.[golden]'``); without it the row
says so and the rest runs.

    python benchmarks/serve_load.py [--case llama2] [--requests 64] [--concurrency 1 8 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import uvicorn

from nnxtron.convert.hf import from_hf
from nnxtron.data.tokenizer import ByteTokenizer
from nnxtron.infer.engine import Engine, SamplingParams, TokenEvent
from nnxtron.infer.generate import generate
from nnxtron.infer.paging import Paging
from nnxtron.serve.app import create_app
from nnxtron.serve.sequences import ServeState
from nnxtron.serve.server import listen

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "assets" / "golden"


def make_requests(vocab: int, count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    return [
        ([int(t) for t in rng.integers(3, vocab, size=int(rng.integers(8, 97)))], int(rng.integers(16, 65))) for _ in range(count)
    ]


def reference_answers(model, requests) -> list[list[int]]:
    cfg = model.config.model_copy(update={"decode_sampling_strategy": "greedy"})
    return [[step[0] for step in generate(model, [prompt], cfg, new)] for prompt, new in requests]


class NoStopTokenizer(ByteTokenizer):
    """Text for the server's responses; no EOS, so every request runs to its max_tokens (the
    golden checkpoints carry no tokenizer; prompts are sent as token ids)."""

    eos_id = -1


def closed_loop(requests, concurrency: int, run_one) -> dict:
    """``concurrency`` clients, each running ``run_one(index) -> (answer, ttft, latency)`` on the
    next request until none is left."""
    answers: list[list[int] | None] = [None] * len(requests)
    ttft, latency = [0.0] * len(requests), [0.0] * len(requests)
    next_request = iter(range(len(requests)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                index = next(next_request, None)
            if index is None:
                return
            answers[index], ttft[index], latency[index] = run_one(index)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"answers": answers, "seconds": time.perf_counter() - start, "ttft": ttft, "latency": latency}


def engine_load(engine: Engine, requests, concurrency: int) -> dict:
    def run_one(index: int):
        prompt, new = requests[index]
        tokens: list[int] = []
        done = threading.Event()
        sent = time.perf_counter()
        first = [0.0]

        def on_event(event: TokenEvent) -> None:
            if event.token is not None:
                if not tokens:
                    first[0] = time.perf_counter() - sent
                tokens.append(event.token)
            if event.finish_reason is not None:
                done.set()

        engine.submit(prompt, SamplingParams(temperature=0, max_tokens=new), on_event)
        done.wait()
        return tokens, first[0], time.perf_counter() - sent

    return closed_loop(requests, concurrency, run_one)


def http_load(url: str, requests, concurrency: int) -> dict:
    local = threading.local()

    def run_one(index: int):
        prompt, new = requests[index]
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=300)
        body = {"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True, "return_token_ids": True}
        tokens: list[int] = []
        sent, first = time.perf_counter(), 0.0
        with local.client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids and not tokens:
                        first = time.perf_counter() - sent
                    tokens.extend(ids)
        return tokens, first, time.perf_counter() - sent

    return closed_loop(requests, concurrency, run_one)


class Server:
    """``nnxtron serve``'s application around ``engine``, on a free loopback port, in a thread."""

    def __init__(self, engine: Engine, vocab_size: int):
        state = ServeState(engine, NoStopTokenizer(), "bench", vocab_size, request_timeout=None)
        self.sock = listen("127.0.0.1", 0)
        self.server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.sock.close()


def hf_batched(path: Path, requests, batch: int) -> float | None:
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def run() -> float:
        start = time.perf_counter()
        for first in range(0, len(requests), batch):
            group = requests[first : first + batch]
            width = max(len(p) for p, _ in group)
            ids = torch.zeros((len(group), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (prompt, _) in enumerate(group):  # left padding, as HF's decoder-only generate expects
                ids[row, width - len(prompt) :] = torch.as_tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            new = max(n for _, n in group)
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    run()  # warm-up
    return run()


def percentiles(values: list[float]) -> dict[str, float]:
    q = np.percentile(values, [50, 90, 99])
    return {"p50": round(float(q[0]), 4), "p90": round(float(q[1]), 4), "p99": round(float(q[2]), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", default="llama2")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes of the engine per concurrency (median)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=64)
    args = parser.parse_args()
    path = GOLDEN / args.case
    model = from_hf(path)
    requests = make_requests(model.config.vocab_size, args.requests)
    max_length = max(len(p) + n for p, n in requests)
    total_new = sum(n for _, n in requests)

    reference = reference_answers(model, requests)
    rows = []
    for concurrency in args.concurrency:
        paging = Paging(block_size=args.block_size, max_sequences=concurrency)
        engine = Engine(model, max_length, paging, prefill_chunk=args.prefill_chunk, max_queue=args.requests)
        engine.start()
        server = Server(engine, model.config.vocab_size)
        engine_load(engine, requests, concurrency)  # compile every prefill bucket and batch width
        for mode in ("engine", "server"):
            if mode == "engine":
                passes = [engine_load(engine, requests, concurrency) for _ in range(args.repeats)]
            else:
                passes = [http_load(server.url, requests, concurrency) for _ in range(args.repeats)]
            for result in passes:
                wrong = [i for i, (a, b) in enumerate(zip(result["answers"], reference)) if a != b]
                if wrong:
                    raise SystemExit(f"{mode} answers differ from decoding each request alone for requests {wrong[:5]}")
            seconds = statistics.median(result["seconds"] for result in passes)
            rows.append(
                {
                    "mode": f"{mode}, concurrency {concurrency}",
                    "tokens_per_s": total_new / seconds,
                    "seconds": seconds,
                    "ttft_s": percentiles([t for result in passes for t in result["ttft"]]),
                    "latency_s": percentiles([t for result in passes for t in result["latency"]]),
                }
            )
        server.close()
        engine.stop()
        assert engine.stats()["blocks_in_use"] == 0, "cache blocks left held"
        rows[-2]["preemptions"] = engine.counters.preemptions
        # the global caches' blocks: the most held at once, against every running sequence at max_length
        rows[-2]["kv_blocks_peak"] = engine.counters.peak_growing_blocks
        rows[-2]["kv_blocks_worst_case"] = engine.stats()["growing_blocks_capacity"]
        hf_seconds = hf_batched(path, requests, concurrency)
        rows.append(
            {"mode": f"HF generate, batches of {concurrency}", "tokens_per_s": total_new / hf_seconds, "seconds": hf_seconds}
            if hf_seconds is not None
            else {
                "mode": f"HF generate, batches of {concurrency}",
                "skipped": "torch is not installed (pip install -e '.[golden]')",
            }
        )
    base = rows[0]["tokens_per_s"]
    print(f"{args.requests} requests, {total_new} new tokens, model {args.case} ({model.config.decoder_block})")
    print(f"{'mode':34s} {'tok/s':>8s} {'vs engine, 1':>15s} {'TTFT p50/p99 s':>16s} {'latency p50/p90/p99 s':>24s}")
    for row in rows:
        if "skipped" in row:
            print(f"{row['mode']:34s} skipped: {row['skipped']}")
            continue
        ttft = f"{row['ttft_s']['p50']:.3f}/{row['ttft_s']['p99']:.3f}" if "ttft_s" in row else ""
        lat = "/".join(f"{row['latency_s'][k]:.2f}" for k in ("p50", "p90", "p99")) if "latency_s" in row else ""
        print(f"{row['mode']:34s} {row['tokens_per_s']:8.0f} {row['tokens_per_s'] / base:14.2f}x {ttft:>16s} {lat:>24s}")
    for row in rows:
        if "kv_blocks_peak" in row:
            print(f"{row['mode']}: KV blocks of the global caches held at most {row['kv_blocks_peak']} "
                  f"of {row['kv_blocks_worst_case']} (every running sequence at the longest request's length)")  # fmt: skip
    print(json.dumps({"benchmark": "serve_load", "case": args.case, "requests": args.requests, "rows": rows}))


if __name__ == "__main__":
    main()
