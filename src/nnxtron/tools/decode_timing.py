"""Decoding throughput: prefill and per-token decode of the jitted cached steps.

Used by ``nnxtron bench --decode`` and ``benchmarks/decode_vs_hf.py``. Compilation is
timed separately (the first call of each shape); then ``repeats`` prefills of the whole
batch and ``new_tokens`` decode steps are timed, each waited for (the host loop,
``infer.decode.decode``), and, without paging, ``repeats`` runs of ``new_tokens`` tokens
through the device loop that ``generate`` runs (``infer.generate``, ``TOKENS_PER_CALL`` a call).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxtron.infer.decode import prompt_batch, with_caches
from nnxtron.infer.generate import TOKENS_PER_CALL, default_tokens_per_iteration, device_calls
from nnxtron.infer.paging import PagedLayout, Paging
from nnxtron.infer.sample import sampling


def _timed(fn, *args) -> tuple[Any, float]:
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def time_decoding(
    model: nnx.Module,
    batch: int,
    prompt_length: int,
    new_tokens: int,
    repeats: int = 3,
    seed: int = 0,
    paging: Paging | None = None,
) -> dict:
    """Tokens per second of prefill (``batch`` prompts of ``prompt_length``) and of decode
    (``batch`` rows, one token each per step, ``new_tokens`` steps after the prompt). With
    ``paging``: the serving engine's paged cache (``batch`` sequences holding the blocks of
    their whole length), the block tables written into the caches before every step as the
    engine does (that host work is timed too)."""
    cfg = model.config
    length = prompt_length + new_tokens
    cached = with_caches(model, batch, length, paging)
    step = cached.step
    if paging is not None:
        layout = PagedLayout(cached.caches, paging, length)
        sequences = list(range(1, batch + 1))
        for sequence in sequences:
            assert layout.reserve(sequence, length), "the block pool is too small for the batch"

        def step(caches, *inputs):
            return cached.step(layout.with_tables(caches, sequences), *inputs)

    prompts = np.random.default_rng(seed).integers(3, cfg.vocab_size, size=(batch, prompt_length))
    inputs = [jnp.asarray(v) for v in prompt_batch(list(prompts), prompt_length).values()]
    empty = cached.caches

    def fresh() -> dict:  # the step donates its caches: every prefill starts from a copy
        return jax.tree.map(jnp.copy, empty)

    (_, caches), prefill_compile = _timed(step, fresh(), *inputs)
    prefill = [_timed(step, fresh(), *inputs)[1] for _ in range(repeats)]
    token = jnp.zeros((batch, 1), jnp.int32)
    ones = jnp.ones((batch, 1), jnp.int32)
    decode_times = []
    for i in range(new_tokens):
        position = jnp.full((batch, 1), prompt_length + i, jnp.int32)
        (_, caches), seconds = _timed(step, caches, token, position, ones)
        decode_times.append(seconds)
    decode_compile, steady = decode_times[0], decode_times[1:] or decode_times
    prefill_seconds, decode_seconds = statistics.median(prefill), statistics.median(steady)
    on_device = {} if paging is not None else _time_device_loop(cached, step, fresh, inputs, sampling(cfg), new_tokens, repeats)
    return {
        "decode_batch": batch,
        "prompt_length": prompt_length,
        "new_tokens": new_tokens,
        "prefill_compile_seconds": prefill_compile,
        "decode_compile_seconds": decode_compile,
        "prefill_seconds": prefill_seconds,
        "prefill_tokens_per_s": batch * prompt_length / prefill_seconds,
        "decode_step_seconds": decode_seconds,
        "decode_tokens_per_s": batch / decode_seconds,
        **on_device,
    }


def _time_device_loop(cached, step, fresh, inputs, draw, new_tokens: int, repeats: int) -> dict:
    """Seconds per token of ``generate``'s device loop (``infer.generate.device_calls``) after a
    fresh prefill: ``new_tokens`` tokens in calls of ``TOKENS_PER_CALL`` (the first run compiles)."""
    batch, length = inputs[0].shape
    unroll = default_tokens_per_iteration(jax.default_backend())  # as generate runs it here

    def run() -> float:
        logits, caches = step(fresh(), *inputs)
        last, positions = jax.block_until_ready((logits[:, -1], jnp.full((batch,), length, jnp.int32)))
        start = time.perf_counter()
        calls = device_calls(cached, caches, last, positions, draw, (), new_tokens, TOKENS_PER_CALL, unroll)
        assert sum(ran for _, _, ran, _, _ in calls) == new_tokens, "the device loop stopped early"
        return time.perf_counter() - start

    compile_seconds = run()
    seconds = statistics.median([run() for _ in range(repeats)]) / new_tokens
    return {
        "generate_compile_seconds": compile_seconds,
        "generate_token_seconds": seconds,
        "generate_tokens_per_s": batch / seconds,
    }
