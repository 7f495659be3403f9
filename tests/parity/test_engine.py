"""The continuous-batching engine decodes what single-request decoding decodes.

Requests of mixed prompt lengths (1 to 70 tokens; prefill chunks of 16) join and leave
the running set at different steps; with a block pool too small for all of them the
newest are preempted and recomputed — every greedy answer still equals
``infer.decode.generate`` of that prompt alone, and no cache block is left held.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from nnxtron.convert.hf import from_hf
from nnxtron.infer.engine import Engine, QueueFull, SamplingParams, TokenEvent
from nnxtron.infer.generate import generate
from nnxtron.infer.paging import Paging
from nnxtron.models.build import build_model
from tests.conftest import tiny_config
from tests.parity.test_hf_golden import GOLDEN

NEW = 12
LENGTHS = (3, 40, 1, 17, 9, 70)


class Collector:
    """Tokens and the finish of each submitted sequence."""

    def __init__(self):
        self.tokens: dict[int, list[int]] = {}
        self.finish: dict[int, TokenEvent] = {}

    def emit(self, key: int):
        self.tokens[key] = []

        def on_event(event: TokenEvent) -> None:
            if event.token is not None:
                self.tokens[key].append(event.token)
            if event.finish_reason is not None:
                assert key not in self.finish, "two final events"
                self.finish[key] = event

        return on_event


def _run(engine: Engine, collector: Collector, count: int, limit: int = 2000) -> None:
    for _ in range(limit):
        if len(collector.finish) == count:
            return
        engine.step()
    raise AssertionError(f"{len(collector.finish)} of {count} sequences finished")


@pytest.fixture(scope="module", params=["llama3.1-tiny", "mistral-tiny"])
def model(request):
    """A tiny random model whose greedy choices are decisive: the tied table (llama3.1-tiny) is
    scaled to std ~1, so its logits spread ~sqrt(emb_dim) and no top-2 margin is within the float32
    reordering of chunked prefill (the unit-scale logits of a from-scratch init leave near-ties)."""
    built = build_model(tiny_config(request.param, decode_sampling_strategy="greedy"))
    if built.config.logits_via_embedding:
        table = built.embed.embedding
        table[...] = table[...] / jnp.std(table[...])
    return built


def _prompts(cfg, lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, cfg.vocab_size, size=n)] for n in lengths]


@pytest.mark.parametrize("global_blocks", [None, 12])  # 12 blocks of 8: the newest sequences get preempted
def test_greedy_answers_equal_decoding_each_prompt_alone(model, global_blocks):
    prompts = _prompts(model.config)
    alone = [[step[0] for step in generate(model, [p], model.config, NEW)] for p in prompts]
    engine = Engine(model, 96, Paging(block_size=8, max_sequences=4, global_blocks=global_blocks), prefill_chunk=16)
    out = Collector()
    for i, prompt in enumerate(prompts[:3]):
        engine.submit(prompt, SamplingParams(temperature=0, max_tokens=NEW), out.emit(i))
    for _ in range(5):  # the others join while these decode
        engine.step()
    for i, prompt in enumerate(prompts[3:], start=3):
        engine.submit(prompt, SamplingParams(temperature=0, max_tokens=NEW), out.emit(i))
    _run(engine, out, len(prompts))
    for i in range(len(prompts)):
        assert out.tokens[i] == alone[i], f"prompt {i} ({LENGTHS[i]} tokens)"
        assert out.finish[i].finish_reason == "length"
    assert engine.stats()["blocks_in_use"] == 0
    if global_blocks is not None and model.config.sliding_window_size == 0:
        assert engine.counters.preemptions > 0


def test_seeded_sampling_does_not_depend_on_the_other_requests(model):
    prompts = _prompts(model.config, (5, 9, 30), seed=1)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=8, seed=7, logprobs=2)

    def answers(submitted):
        engine = Engine(model, 64, Paging(block_size=8, max_sequences=4), prefill_chunk=16)
        out = Collector()
        for i in submitted:
            engine.submit(prompts[i], params, out.emit(i))
        _run(engine, out, len(submitted))
        return out

    together, alone = answers([0, 1, 2]), answers([1])
    assert together.tokens[1] == alone.tokens[1]
    assert together.tokens[0] != together.tokens[2]


def test_stop_ids_cancel_and_timeout_end_sequences_and_free_their_blocks(model):
    prompts = _prompts(model.config, (6, 6, 6, 6), seed=2)
    free = [step[0] for step in generate(model, [prompts[0]], model.config, NEW)]
    engine = Engine(model, 64, Paging(block_size=8, max_sequences=2), prefill_chunk=16, max_queue=3)
    out = Collector()
    engine.submit(prompts[0], SamplingParams(temperature=0, max_tokens=NEW, stop_ids=(free[3],)), out.emit(0))
    cancelled = engine.submit(prompts[1], SamplingParams(temperature=0, max_tokens=NEW), out.emit(1))
    engine.submit(prompts[2], SamplingParams(temperature=0, max_tokens=NEW), out.emit(2), timeout=0.0)
    with pytest.raises(QueueFull):  # nothing has run yet: all three still wait, and the queue holds 3
        engine.submit(prompts[3], SamplingParams(), out.emit(3))
    engine.step()
    engine.step()
    engine.cancel(cancelled)
    time.sleep(0.01)
    _run(engine, out, 3)
    assert out.tokens[0] == free[: free.index(free[3]) + 1] and out.finish[0].finish_reason == "stop"
    assert out.finish[1].finish_reason == "cancelled"
    assert out.finish[2].finish_reason == "timeout" and out.tokens[2] == []
    assert engine.stats()["blocks_in_use"] == 0


def test_bad_requests_are_refused_before_queueing(model):
    engine = Engine(model, 32, Paging(block_size=8, max_sequences=2), prefill_chunk=16)
    for prompt, params, words in [
        ([], SamplingParams(), "empty"),
        ([5] * 30, SamplingParams(max_tokens=3), "exceed the context of 32"),
        ([5], SamplingParams(max_tokens=0), "at least 1"),
    ]:
        with pytest.raises(ValueError, match=words):
            engine.submit(prompt, params, lambda event: None)
    assert engine.stats()["queue_depth"] == 0


# one stored HF model per attention kind: GQA, sliding window, Gemma 3's mix, Llama 4 chunks, MLA,
# DeepSeek-V4 compressed attention (tests/parity/test_kv_cache.py runs them all through `generate`)
ATTENTION_KINDS = ("llama31", "mistral", "gemma3", "llama4", "deepseek3", "deepseek4")


@pytest.mark.parametrize("case", ATTENTION_KINDS)
def test_engine_greedy_equals_hf_generate(case):
    """Stored tiny HF models through the engine (all prompts at once, paged cache with
    4-slot blocks, prefill chunks of 16): transformers' own greedy ``generate``."""
    golden = load_file(str(GOLDEN / case / "generate.safetensors"))
    model = from_hf(GOLDEN / case)
    engine = Engine(model, 64, Paging(block_size=4, max_sequences=4), prefill_chunk=16)
    out = Collector()
    new = golden["generated"].shape[1]
    for row, prompt in enumerate(golden["prompt_ids"]):
        engine.submit([int(t) for t in prompt], SamplingParams(temperature=0, max_tokens=new), out.emit(row))
    _run(engine, out, len(golden["prompt_ids"]))
    np.testing.assert_array_equal(np.array([out.tokens[row] for row in range(len(out.tokens))]), golden["generated"])
