"""The OpenAI-compatible HTTP API of ``nnxtron serve``, on FastAPI.

``create_app(state)`` builds the application around a running engine (``infer.engine.Engine``
or anything with its ``submit`` / ``cancel`` / ``stats`` / ``max_length``). Each request
becomes one engine sequence per choice (``n`` choices of each prompt); the engine's thread
calls each sequence's ``emit`` and the events cross to the event loop through
``loop.call_soon_threadsafe``. A request whose client goes away, or that is cut by a stop
string, cancels its sequences (``engine.cancel``), which frees their KV blocks.

Errors are OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` with
400 (bad input, including pydantic's validation errors and malformed JSON), 401 (API key),
404 (unknown model or route), 408 / 413 (a body too slow or too large: ``serve/limits.py``),
429 (queue full, with ``Retry-After``), 504 (the request timed out) and 500 (anything else);
the server keeps serving. Once a stream has begun, an error arrives as a last
``data: {"error": ...}`` event before ``data: [DONE]``.

Chat templates are rendered, and prompts tokenized, in worker threads (``ServeState.off_loop``),
so that a large prompt does not stop the event loop from answering others (``/health``).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nnxtron.errors import UserError
from nnxtron.serve.limits import BodyGuard
from nnxtron.serve.protocol import (
    DONE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    CompletionText,
    chat_logprobs,
    completion_logprobs,
    error_body,
    new_id,
    now,
    sse,
    usage,
    validation_error,
)
from nnxtron.serve.sequences import Choice, EventStream, RequestRun, ServeState, run_to_end

__all__ = ["ENDPOINTS", "create_app"]

log = logging.getLogger("nnxtron.serve")

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")  # metric labels
MAX_CHOICES = 64  # prompts x n of one request
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away (seen only in the metrics)
TEMPLATE_RESERVED = ("messages", "add_generation_prompt")


# ---- prompts -----------------------------------------------------------------------------


def _check_prompt(state: ServeState, ids: list[int], param: str) -> list[int]:
    if not ids:
        raise APIError(400, f"the {param} is empty (no tokens)", param=param)
    bad = next((t for t in ids if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0 .. {state.vocab_size - 1})", param=param)
    if len(ids) >= state.max_length:
        raise APIError(
            400, f"This model's maximum context length is {state.max_length} tokens; the {param} has {len(ids)} tokens, "
            "which leaves no room for a completion. Shorten the prompt.", param=param, code="context_length_exceeded",
        )  # fmt: skip
    return ids


def _completion_prompts(state: ServeState, prompt: str | list) -> list[list[int]]:
    """Token ids of each prompt: text (BOS first when the tokenizer has one, as ``nnxtron generate``) or ids as given."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items or any(p == "" for p in items):
        raise APIError(400, "the prompt is empty", param="prompt")
    bos = [state.tokenizer.bos_id] if state.tokenizer.bos_id >= 0 else []
    return [
        _check_prompt(state, bos + state.tokenizer.encode(p).tolist() if isinstance(p, str) else [int(t) for t in p], "prompt")
        for p in items
    ]


def _chat_prompt(state: ServeState, body: ChatCompletionRequest) -> list[int]:
    """The rendered chat template, encoded without adding BOS (the template writes it, as HF's ``apply_chat_template``)."""
    if state.chat_template is None:
        raise APIError(
            400, f"this model has no chat template ({state.no_chat_template}): use /v1/completions, or start the server "
            "with --chat-template FILE", param="messages", code="no_chat_template",
        )  # fmt: skip
    extra = dict(body.chat_template_kwargs or {})
    reserved = [key for key in TEMPLATE_RESERVED if key in extra]
    if reserved:
        raise APIError(400, f"chat_template_kwargs cannot set {', '.join(reserved)}", param="chat_template_kwargs")
    if body.tools is not None:
        extra["tools"] = body.tools
    try:
        text = state.chat_template.render(body.messages, add_generation_prompt=body.add_generation_prompt, **extra)
    except UserError as err:
        raise APIError(400, str(err), param="messages") from None
    return _check_prompt(state, state.tokenizer.encode(text).tolist(), "messages")


def _max_tokens(state: ServeState, prompts: Sequence[list[int]], requested: int | None, default: int | None) -> int:
    longest = max(map(len, prompts))
    requested = default if requested is None else requested
    if requested is None:  # chat: up to the end of the context
        return state.max_length - longest
    if longest + requested > state.max_length:
        raise APIError(
            400, f"max_tokens={requested} is too large: the prompt has {longest} tokens and the context is "
            f"{state.max_length} tokens, so at most {state.max_length - longest} new tokens fit", param="max_tokens",
            code="context_length_exceeded",
        )  # fmt: skip
    return requested


def _start_run(
    state: ServeState, body, prompts: list[list[int]], max_tokens: int, logprobs: int | None, stops: list[str], start: float
) -> RequestRun:
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts x n={body.n} choices: at most {MAX_CHOICES} in one request", param="n")
    choices = []
    for prompt in prompts:
        for j in range(body.n):
            params = body.sampling(max_tokens, state.stop_ids, logprobs, j)
            choices.append(Choice(len(choices), prompt, params, CompletionText(state.tokenizer, prompt, stops)))
    run = RequestRun(state, choices, sum(map(len, prompts)), start)
    run.submit()
    return run


def _openai_reason(choice: Choice) -> str | None:
    return choice.finish_reason if choice.finish_reason in ("stop", "length") else None


# ---- responses ---------------------------------------------------------------------------


def _completion_choice(state: ServeState, body: CompletionRequest, choice: Choice, text: str, tokens, entries, final) -> dict:
    out: dict[str, Any] = {
        "index": choice.index, "text": text, "logprobs": None, "finish_reason": _openai_reason(choice) if final else None,
    }  # fmt: skip
    if body.logprobs is not None:
        out["logprobs"] = completion_logprobs(state.tokenizer, entries, choice.logprob_offset)
        if entries:  # a stream's next chunk counts on from here
            choice.logprob_offset = out["logprobs"]["text_offset"][-1] + len(out["logprobs"]["tokens"][-1])
    if body.return_token_ids:
        out["token_ids"] = list(tokens)
    return out


def _completion_body(state: ServeState, body: CompletionRequest, run: RequestRun, rid: str, created: int) -> dict:
    choices = []
    for choice in run.choices:
        item = _completion_choice(state, body, choice, choice.text.text, choice.tokens, choice.logprobs, True)
        if body.return_token_ids:
            item["prompt_token_ids"] = choice.prompt_ids
        choices.append(item)
    return {
        "id": rid, "object": "text_completion", "created": created, "model": state.model_name, "system_fingerprint": None,
        "choices": choices, "usage": usage(run.prompt_tokens, run.completion_tokens),
    }  # fmt: skip


async def _event_stream(body, run: RequestRun, head: dict, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A stream's events: the ``chunks``, then the usage (if asked for) and ``[DONE]``; an error
    becomes a last error event; the run is closed however the stream ends."""
    try:
        async for chunk in chunks:
            yield chunk
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": usage(run.prompt_tokens, run.completion_tokens)})
    except APIError as err:
        yield sse(err.body())
    except Exception as err:  # a bug: the stream ends with an error event instead of a broken connection
        log.exception("stream failed")
        yield sse(error_body(f"internal server error: {type(err).__name__}: {err}", "server_error", code="internal_error"))
    finally:
        run.close()
    yield DONE


def _completion_events(state: ServeState, body: CompletionRequest, run: RequestRun, rid: str, created: int):
    head = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name, "system_fingerprint": None}

    async def chunks() -> AsyncIterator[bytes]:
        async for updates in run.updates():
            for u in updates:
                wanted = (
                    u.text or u.finished or (body.logprobs is not None and u.logprobs) or (body.return_token_ids and u.tokens)
                )
                if wanted:
                    yield sse(
                        {**head, "choices": [_completion_choice(state, body, u.choice, u.text, u.tokens, u.logprobs, u.finished)]}
                    )

    return _event_stream(body, run, head, chunks())


def _chat_choice(state: ServeState, body: ChatCompletionRequest, choice: Choice) -> dict:
    out: dict[str, Any] = {
        "index": choice.index, "message": {"role": "assistant", "content": choice.text.text}, "logprobs": None,
        "finish_reason": _openai_reason(choice),
    }  # fmt: skip
    if body.logprobs:
        out["logprobs"] = chat_logprobs(state.tokenizer, choice.logprobs)
    if body.return_token_ids:
        out["token_ids"], out["prompt_token_ids"] = choice.tokens, choice.prompt_ids
    return out


def _chat_body(state: ServeState, body: ChatCompletionRequest, run: RequestRun, rid: str, created: int) -> dict:
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": state.model_name, "system_fingerprint": None,
        "choices": [_chat_choice(state, body, c) for c in run.choices], "usage": usage(run.prompt_tokens, run.completion_tokens),
    }  # fmt: skip


def _chat_events(state: ServeState, body: ChatCompletionRequest, run: RequestRun, rid: str, created: int):
    head = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": state.model_name,
        "system_fingerprint": None,
    }

    def chunk(index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None, ids=None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if body.return_token_ids:
            choice["token_ids"] = list(ids or [])
        return sse({**head, "choices": [choice]})

    async def chunks() -> AsyncIterator[bytes]:
        for choice in run.choices:
            yield chunk(choice.index, {"role": "assistant", "content": ""})
        async for updates in run.updates():
            for u in updates:
                logprobs = chat_logprobs(state.tokenizer, u.logprobs) if body.logprobs and u.logprobs else None
                if u.text or logprobs is not None or (body.return_token_ids and u.tokens):
                    yield chunk(u.choice.index, {"content": u.text}, logprobs, ids=u.tokens)
                if u.finished:
                    yield chunk(u.choice.index, {}, finish=_openai_reason(u.choice))

    return _event_stream(body, run, head, chunks())


# ---- the application -----------------------------------------------------------------------


class _Gate:
    """ASGI middleware: the API key for ``/v1/*`` and the request counter by endpoint and status."""

    def __init__(self, app, state: ServeState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = "/v1/models" if path.startswith("/v1/models/") else path if path in ENDPOINTS else "other"
        status = 500  # an exception that escapes answers 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self.state.api_key is not None and path.startswith("/v1") and not self._authorized(scope):
                body = error_body(
                    "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
                response = JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send_status)
                return
            await self.app(scope, receive, send_status)
        finally:
            self.state.metrics.requests.inc(endpoint=endpoint, status=str(status))

    def _authorized(self, scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        expected = self.state.api_key.encode("utf-8")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), expected)


def create_app(state: ServeState) -> FastAPI:
    """The FastAPI application of ``state`` (its engine already started)."""
    app = FastAPI(title="nnxtron", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    app.add_middleware(BodyGuard, limits=state.limits)
    app.add_middleware(_Gate, state=state)  # outermost: it also counts the refusals of BodyGuard

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        problem = validation_error(err.errors())
        return JSONResponse(problem.body(), problem.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        if err.status_code == 404:
            message, code = f"unknown endpoint {request.method} {request.url.path}", "not_found"
        elif err.status_code == 405:
            message, code = f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
        else:
            message, code = str(err.detail), None
        return JSONResponse(error_body(message, code=code), err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        log.exception("request %s %s failed", request.method, request.url.path)
        body = error_body(f"internal server error: {type(err).__name__}: {err}", "server_error", code="internal_error")
        return JSONResponse(body, 500)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = state.metrics.render(state.engine.stats())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "nnxtron",
            "max_model_len": state.max_length,
        }  # fmt: skip

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        state.check_model(model)
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        start = time.monotonic()
        state.check_model(body.model)
        body.check_supported()
        stops = body.stop_strings()
        prompts = await state.off_loop(_completion_prompts, state, body.prompt)
        max_tokens = _max_tokens(state, prompts, body.max_tokens, 16)
        run = _start_run(state, body, prompts, max_tokens, body.logprobs, stops, start)
        rid, created = new_id("cmpl"), now()
        if body.stream:
            return EventStream(_completion_events(state, body, run, rid, created), run.close)
        if not await run_to_end(request, run):
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(_completion_body(state, body, run, rid, created))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        start = time.monotonic()
        state.check_model(body.model)
        body.check_supported()
        stops = body.stop_strings()
        logprobs = body.logprob_count()
        prompt = await state.off_loop(_chat_prompt, state, body)
        max_tokens = _max_tokens(state, [prompt], body.requested_max_tokens(), None)
        run = _start_run(state, body, [prompt], max_tokens, logprobs, stops, start)
        rid, created = new_id("chatcmpl"), now()
        if body.stream:
            return EventStream(_chat_events(state, body, run, rid, created), run.close)
        if not await run_to_end(request, run):
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(_chat_body(state, body, run, rid, created))

    return app
