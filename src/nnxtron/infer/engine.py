"""Continuous batching over a paged KV cache: the engine behind ``nnxtron serve``.

Requests (``submit``) wait in a bounded FIFO queue and join the running set whenever it
has room (``Paging.max_sequences``), at any step. Each iteration of the scheduler:

1. ends cancelled and timed-out sequences (their cache blocks go back to the free lists);
2. admits waiting sequences in arrival order;
3. runs one prefill chunk (at most ``prefill_chunk`` tokens) of the oldest sequence that
   still has uncached tokens, as a batch of one row — a long prompt is spread over many
   iterations and never stalls the others (chunked prefill);
4. runs one decode step for every sequence whose tokens are all cached but the last,
   batched (rows padded to a power of two), and samples each row's next token with its
   own settings (``infer.sample.sample_row``).

A sequence is ``prompt + generated``; the cache holds its first ``cached`` tokens. When
a growing cache has no free block, the newest running sequence is preempted: its blocks
are freed and it goes back to the front of the queue with its tokens so far, to be
prefilled again (recomputation, as vLLM does); its output is unchanged.

Every sequence ends with one event whose ``finish_reason`` is set: ``stop`` (a stop id),
``length`` (``max_tokens``, or the context is full), ``cancelled``, ``timeout`` or ``error``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxtron.infer.decode import MIN_BUCKET, bucket, prompt_batch, with_caches
from nnxtron.infer.paging import PagedLayout, Paging
from nnxtron.infer.sample import sample_row
from nnxtron.layers.paged_cache import NO_SEQUENCE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings (OpenAI's names): temperature 0 is greedy, top_k 0 is off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # None: none; k: the token's log-probability and the k most likely


@dataclass
class TokenEvent:
    """One new token of a sequence, or its end (``finish_reason`` set; ``token`` may be None)."""

    token: int | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    error: str | None = None


class QueueFull(Exception):
    """The waiting queue is full; try again after ``retry_after`` seconds."""

    def __init__(self, depth: int, retry_after: float):
        super().__init__(f"the request queue is full ({depth} waiting); retry after {retry_after:.0f} s")
        self.retry_after = retry_after


@dataclass
class _Sequence:
    id: int
    tokens: list[int]  # prompt, then generated
    prompt_length: int
    params: SamplingParams
    emit: Callable[[TokenEvent], None]
    deadline: float | None
    rng: np.random.Generator
    cached: int = 0

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_length


@dataclass
class _Counters:
    tokens_generated: int = 0
    preemptions: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0
    peak_growing_blocks: int = 0  # the most blocks the growing (global) caches held at once
    started: float = field(default_factory=time.monotonic)


class Engine:
    """A model served by continuous batching; ``start`` runs the scheduler in a thread."""

    def __init__(
        self, model: nnx.Module, max_length: int, paging: Paging | None = None, prefill_chunk: int = 64, max_queue: int = 64
    ):
        paging = paging or Paging()
        if prefill_chunk < MIN_BUCKET or prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"prefill_chunk={prefill_chunk} must be a power of two >= {MIN_BUCKET}")
        self.max_length, self.paging, self.prefill_chunk, self.max_queue = max_length, paging, prefill_chunk, max_queue
        self.cached = with_caches(model, 1, max_length, paging)
        self.layout = PagedLayout(self.cached.caches, paging, max_length)
        for group in self.layout.groups.values():
            if group.needed(max_length) > group.capacity:
                raise ValueError(
                    f"the KV cache holds {group.capacity} blocks of {paging.block_size} tokens; one sequence of "
                    f"max_length={max_length} needs {group.needed(max_length)}: raise the block count or lower max_length"
                )
        self.caches = self.cached.caches
        self._shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.caches)
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []  # admission order: the last is preempted first
        self._cancels: set[int] = set()
        self._ids = itertools.count(1)
        self._seeds = np.random.SeedSequence()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.counters = _Counters()

    # ---- client side (any thread)
    def submit(
        self, prompt_ids: list[int], params: SamplingParams, emit: Callable[[TokenEvent], None], timeout: float | None = None
    ) -> int:
        """Queue a sequence; returns its id. Raises ``QueueFull`` or ``ValueError`` (bad request)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens={params.max_tokens} must be at least 1")
        if len(prompt_ids) + params.max_tokens > self.max_length:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceed the context of {self.max_length} tokens"
            )
        seed = params.seed if params.seed is not None else self._seeds.spawn(1)[0]
        with self._lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(len(self.waiting), retry_after=max(1.0, self._seconds_per_request()))
            sequence = _Sequence(
                next(self._ids), [int(t) for t in prompt_ids], len(prompt_ids), params, emit,
                None if timeout is None else time.monotonic() + timeout, np.random.default_rng(seed),
            )  # fmt: skip
            self.waiting.append(sequence)
            self._lock.notify()
        return sequence.id

    def cancel(self, sequence: int) -> None:
        """End ``sequence`` (waiting or running) with ``finish_reason="cancelled"``; frees its blocks."""
        with self._lock:
            self._cancels.add(sequence)
            self._lock.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="nnxtron-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()

    def stats(self) -> dict:
        in_use, capacity = self.layout.growing_blocks()
        return {
            "queue_depth": len(self.waiting),
            "running": len(self.running),
            "blocks_in_use": self.layout.blocks_in_use(),
            "growing_blocks_in_use": in_use,
            "growing_blocks_capacity": capacity,
            "blocks_capacity": sum(g.capacity for g in self.layout.groups.values()),
            "tokens_generated": self.counters.tokens_generated,
            "preemptions": self.counters.preemptions,
            "peak_growing_blocks": self.counters.peak_growing_blocks,
        }

    def _seconds_per_request(self) -> float:
        elapsed = time.monotonic() - self.counters.started
        return elapsed / max(1, self.counters.tokens_generated) * 16

    # ---- the scheduler (engine thread)
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not (self.waiting or self.running or self._cancels):
                    self._lock.wait()
                if self._stopping:
                    break
            try:
                self.step()
            except Exception as err:  # a failed step: end what runs, start over with empty caches, keep serving
                log.exception("engine step failed")
                for sequence in list(self.running):
                    self._finish(sequence, "error", error=f"{type(err).__name__}: {err}")
                self.caches = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self._shapes)  # owner 0: all empty

    def step(self) -> None:
        """One scheduler iteration (see the module docstring)."""
        self._end_cancelled_and_late()
        with self._lock:
            while self.waiting and len(self.running) < self.paging.max_sequences:
                self.running.append(self.waiting.popleft())
        prefilling = next((s for s in self.running if len(s.tokens) - s.cached > 1), None)
        if prefilling is not None:
            self._prefill_chunk(prefilling)
        decoding = [s for s in self.running if len(s.tokens) - s.cached == 1]
        if decoding:
            self._decode(decoding)

    def _end_cancelled_and_late(self) -> None:
        now = time.monotonic()
        with self._lock:
            cancels, self._cancels = self._cancels, set()
            ended = [s for s in self.waiting if s.id in cancels or (s.deadline is not None and s.deadline < now)]
            for sequence in ended:
                self.waiting.remove(sequence)
        for sequence in ended + list(self.running):
            if sequence.id in cancels:
                self._finish(sequence, "cancelled")
            elif sequence.deadline is not None and sequence.deadline < now:
                self._finish(sequence, "timeout", error="the request timed out")

    def _reserve(self, sequence: _Sequence, tokens: int) -> bool:
        """Blocks for ``tokens`` tokens of ``sequence``, preempting newer sequences if need be
        (False: ``sequence`` itself was the newest and went back to the queue)."""
        while not self.layout.reserve(sequence.id, tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is sequence:
                return False
        in_use = self.layout.growing_blocks()[0]
        self.counters.peak_growing_blocks = max(self.counters.peak_growing_blocks, in_use)
        return True

    def _preempt(self, sequence: _Sequence) -> None:
        self.layout.release(sequence.id)
        sequence.cached = 0
        self.running.remove(sequence)
        self.counters.preemptions += 1
        with self._lock:
            self.waiting.appendleft(sequence)

    def _run(self, ids: list[int], tokens: np.ndarray, positions: np.ndarray, segments: np.ndarray) -> jax.Array:
        caches = self.layout.with_tables(self.caches, ids)
        self.caches = None  # donated: never reused if the step fails
        logits, self.caches = self.cached.step(caches, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments))
        return logits

    def _prefill_chunk(self, sequence: _Sequence) -> None:
        end = min(len(sequence.tokens), sequence.cached + self.prefill_chunk)
        if not self._reserve(sequence, end):
            return
        chunk = sequence.tokens[sequence.cached : end]
        batch = prompt_batch([chunk], bucket(len(chunk)))
        logits = self._run([sequence.id], batch["tokens"], batch["positions"] + sequence.cached, batch["segment_ids"])
        sequence.cached = end
        self.counters.prefill_chunks += 1
        if end == len(sequence.tokens):  # the prompt is in: its last logits give the next token
            self._sample(sequence, np.asarray(logits[0, len(chunk) - 1]))

    def _decode(self, decoding: list[_Sequence]) -> None:
        # a reservation may preempt another row: skip rows already preempted, drop earlier ones preempted later
        reserved = [s for s in decoding if s in self.running and self._reserve(s, s.cached + 1)]
        rows = [s for s in reserved if s in self.running]
        if not rows:
            return
        width = min(1 << (len(rows) - 1).bit_length(), max(self.paging.max_sequences, len(rows)))
        pad = width - len(rows)
        ids = [s.id for s in rows] + [NO_SEQUENCE] * pad
        tokens = np.array([[s.tokens[-1]] for s in rows] + [[0]] * pad, np.int32)
        positions = np.array([[s.cached] for s in rows] + [[0]] * pad, np.int32)
        segments = np.array([[1]] * len(rows) + [[0]] * pad, np.int32)
        logits = np.asarray(self._run(ids, tokens, positions, segments))
        self.counters.decode_steps += 1
        for row, sequence in enumerate(rows):
            sequence.cached += 1
            self._sample(sequence, logits[row, 0])

    def _sample(self, sequence: _Sequence, logits: np.ndarray) -> None:
        p = sequence.params
        token, logprob, top = sample_row(logits, sequence.rng, p.temperature, p.top_k, p.top_p, p.logprobs)
        sequence.tokens.append(token)
        self.counters.tokens_generated += 1
        if token in p.stop_ids:
            reason = "stop"
        elif sequence.generated >= p.max_tokens or len(sequence.tokens) >= self.max_length:
            reason = "length"
        else:
            sequence.emit(TokenEvent(token, logprob, top))
            return
        self._finish(sequence, reason, TokenEvent(token, logprob, top))

    def _finish(self, sequence: _Sequence, reason: str, last: TokenEvent | None = None, error: str | None = None) -> None:
        self.layout.release(sequence.id)
        if sequence in self.running:
            self.running.remove(sequence)
        event = last or TokenEvent(None)
        event.finish_reason, event.error = reason, error
        sequence.emit(event)
