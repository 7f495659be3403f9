"""One request's engine sequences, as the HTTP side sees them.

``ServeState`` is what the application serves. A ``RequestRun`` submits one engine sequence
per choice (``n`` choices of each prompt); the engine's thread calls each sequence's ``emit``
and the events cross to the event loop through ``loop.call_soon_threadsafe``; ``updates``
yields them as text, token ids and log-probabilities per choice, cut at stop strings. A run
whose client goes away, or that a stop string ends, cancels its sequences
(``engine.cancel``), which frees their KV blocks. ``EventStream`` is the server-sent-event
response that notices a client leaving at once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from fastapi import Request
from fastapi.responses import StreamingResponse

from nnxtron.data.chat_template import ChatTemplate
from nnxtron.data.tokenizer import Tokenizer
from nnxtron.infer.engine import QueueFull, SamplingParams, TokenEvent
from nnxtron.serve.limits import Limits
from nnxtron.serve.metrics import Metrics
from nnxtron.serve.protocol import APIError, CompletionText, TokenLogprob, now

T = TypeVar("T")


@dataclass
class ServeState:
    """What the application serves and how (``app.state.serve``)."""

    engine: Any  # infer.engine.Engine, started by the caller
    tokenizer: Tokenizer
    model_name: str
    vocab_size: int
    chat_template: ChatTemplate | None = None
    no_chat_template: str = "the tokenizer has no chat template"  # why chat_template is None
    api_key: str | None = None
    request_timeout: float | None = 600.0  # seconds from arrival to the last token; None: no limit
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=now)
    limits: Limits = field(default_factory=Limits)  # request body size and read time
    work_threads: int = 4  # threads that render chat templates and tokenize prompts, off the event loop
    _work_limiter: anyio.CapacityLimiter | None = field(default=None, init=False, repr=False)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in one of ``work_threads`` worker threads, so that the event loop keeps answering."""
        if self._work_limiter is None:
            self._work_limiter = anyio.CapacityLimiter(self.work_threads)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._work_limiter)

    @property
    def max_length(self) -> int:
        return self.engine.max_length

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.tokenizer.eos_id,) if self.tokenizer.eos_id >= 0 else ()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404, f"The model '{model}' does not exist; this server serves '{self.model_name}'", param="model",
                code="model_not_found",
            )  # fmt: skip


# ---- one request's sequences -----------------------------------------------------------


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    text: CompletionText
    sequence: int | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length, or cancelled | timeout | error
    error: str | None = None
    logprob_offset: int = 0  # completions' text_offset of the next token


@dataclass
class Update:
    """What one batch of events added to one choice."""

    choice: Choice
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False


class RequestRun:
    """The engine sequences of one request and their events, bridged to the event loop."""

    def __init__(self, state: ServeState, choices: list[Choice], prompt_tokens: int, start: float):
        self.state, self.choices, self.prompt_tokens = state, choices, prompt_tokens
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()
        self.start = start  # the request's arrival (time.monotonic)
        self.deadline = None if state.request_timeout is None else self.start + state.request_timeout
        self.first_token = False
        self.ended = False

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.choices)

    def submit(self) -> None:
        engine = self.state.engine
        try:
            for choice in self.choices:
                emit = self._emitter(choice.index)
                choice.sequence = engine.submit(choice.prompt_ids, choice.params, emit, timeout=self.state.request_timeout)
        except QueueFull as err:
            self._cancel_submitted()
            retry = max(1, math.ceil(err.retry_after))
            raise APIError(
                429, f"{err}", type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry)}
            ) from None
        except ValueError as err:  # the engine's own checks (the server checks the same first)
            self._cancel_submitted()
            raise APIError(400, str(err), param="max_tokens") from None
        self.state.metrics.prompt_tokens.inc(self.prompt_tokens)
        self.state.metrics.in_flight += 1

    def _cancel_submitted(self) -> None:
        for choice in self.choices:
            if choice.sequence is not None:
                self.state.engine.cancel(choice.sequence)
            choice.finish_reason = "cancelled"

    def _emitter(self, index: int) -> Callable[[TokenEvent], None]:
        loop, queue = self.loop, self.queue

        def emit(event: TokenEvent) -> None:  # the engine's thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (index, event))
            except RuntimeError:  # the event loop is closed: the server is shutting down
                pass

        return emit

    async def updates(self) -> AsyncIterator[list[Update]]:
        """Batches of what the choices gained, until every choice has finished. Raises
        ``APIError`` for a timeout or an engine error (the other choices are cancelled)."""
        while not self.done:
            events = [await self._next()]
            while not self.queue.empty():
                events.append(self.queue.get_nowait())
            updates: dict[int, Update] = {}
            for index, event in events:
                choice = self.choices[index]
                if choice.finish_reason is None:
                    self._apply(choice, event, updates.setdefault(index, Update(choice)))
            failed = next((c for c in self.choices if c.finish_reason in ("timeout", "error", "cancelled")), None)
            if failed is not None:
                raise self._failure(failed)
            yield list(updates.values())
        self.close()

    async def _next(self) -> tuple[int, TokenEvent]:
        wait = None if self.deadline is None else self.deadline - time.monotonic()
        if wait is not None and wait <= 0:
            raise self._timed_out()
        try:
            return await asyncio.wait_for(self.queue.get(), wait)
        except TimeoutError:
            raise self._timed_out() from None

    def _apply(self, choice: Choice, event: TokenEvent, update: Update) -> None:
        metrics = self.state.metrics
        if event.token is not None:
            if not self.first_token:
                self.first_token = True
                metrics.ttft.observe(time.monotonic() - self.start)
            metrics.rate.add(1)
            metrics.completion_tokens.inc()
            choice.tokens.append(event.token)
            update.tokens.append(event.token)
            if event.logprob is not None:
                entry = TokenLogprob(event.token, event.logprob, list(event.top_logprobs or []))
                choice.logprobs.append(entry)
                update.logprobs.append(entry)
            update.text += choice.text.add([event.token])
        if choice.text.stopped:  # a stop string: the rest of the sequence is not needed
            if event.finish_reason is None:
                self.state.engine.cancel(choice.sequence)
            self._finish(choice, "stop")
        elif event.finish_reason is not None:
            update.text += choice.text.finish()
            self._finish(choice, "stop" if choice.text.stopped else event.finish_reason, event.error)
        update.finished = choice.finish_reason is not None

    def _finish(self, choice: Choice, reason: str, error: str | None = None) -> None:
        choice.finish_reason, choice.error = reason, error
        self.state.metrics.finished.inc(reason=reason)

    def _timed_out(self) -> APIError:
        for choice in self.choices:
            if choice.finish_reason is None:
                self.state.engine.cancel(choice.sequence)
                self._finish(choice, "timeout")
        return self._failure(next(c for c in self.choices if c.finish_reason == "timeout"))

    def _failure(self, failed: Choice) -> APIError:
        self.close()
        if failed.finish_reason == "timeout":
            limit = self.state.request_timeout
            return APIError(
                504, f"the request did not finish within the server's request timeout of {limit:g} s", type="server_error",
                code="timeout",
            )  # fmt: skip
        if failed.finish_reason == "cancelled":
            return APIError(503, "the request was cancelled by the server", type="server_error", code="cancelled")
        return APIError(500, f"generation failed: {failed.error or 'engine error'}", type="server_error", code="engine_error")

    def close(self) -> None:
        """Cancel the choices that have not finished (the client is gone) and record the request."""
        for choice in self.choices:
            if choice.finish_reason is None:
                if choice.sequence is not None:
                    self.state.engine.cancel(choice.sequence)
                self._finish(choice, "cancelled")
        if not self.ended:
            self.ended = True
            self.state.metrics.in_flight -= 1
            if all(c.finish_reason in ("stop", "length") for c in self.choices):
                self.state.metrics.latency.observe(time.monotonic() - self.start)


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_to_end(request: Request, run: RequestRun) -> bool:
    """Run every choice to its end (False: the client went away first; its sequences are cancelled)."""

    async def drain() -> None:
        async for _ in run.updates():
            pass

    work = asyncio.ensure_future(drain())
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    finished = False
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finished = work.done()
    finally:
        gone.cancel()
        if not work.done():  # the client left (or the server is stopping)
            work.cancel()
            run.close()
    if finished:
        work.result()  # raises the run's APIError
    return finished


class EventStream(StreamingResponse):
    """A server-sent-event response that notices a client going away at once: a task waits
    for ``http.disconnect`` while the events are sent, and the event generator is closed
    (its ``finally`` cancels what has not finished) however the response ends."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events, self.on_close = events, on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                try:
                    await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                    async for chunk in self.events:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:  # the client is gone
                    pass
                group.cancel_scope.cancel()
        finally:
            await self.events.aclose()
            self.on_close()  # also when the generator never started
