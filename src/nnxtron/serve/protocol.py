"""The OpenAI wire format of ``nnxtron serve``: request models, error bodies, stop strings,
log-probabilities and the response / stream-chunk bodies.

Nothing here touches the network or the engine's thread: ``serve/app.py`` runs requests
and uses these pieces to read them and write their answers.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nnxtron.data.detokenize import PARTIAL, TextStream, text_after
from nnxtron.data.tokenizer import Tokenizer
from nnxtron.infer.engine import SamplingParams

__all__ = [
    "MAX_LOGPROBS", "MAX_N", "MAX_STOP", "APIError", "ChatCompletionRequest", "CompletionRequest", "CompletionText",
    "TokenLogprob", "chat_logprobs", "completion_logprobs", "error_body", "new_id", "sse", "validation_error",
]  # fmt: skip

MAX_N = 16  # choices per prompt
MAX_LOGPROBS = 20  # alternatives per token (completions: logprobs; chat: top_logprobs)
MAX_STOP = 16  # stop strings per request
MAX_SEED = 2**63
DONE = b"data: [DONE]\n\n"


# ---- errors --------------------------------------------------------------------------------


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class APIError(Exception):
    """A request the server answers with an OpenAI-style error (``status`` and the body)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """A 400 for pydantic's ``RequestValidationError.errors()`` (the first problem, its field as ``param``)."""
    if not errors:
        return APIError(400, "the request body is invalid")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ())]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        return APIError(400, f"the request body is not valid JSON ({detail})", code="invalid_json")
    fields = loc[1:] if loc and loc[0] == "body" else loc
    param = fields[0] if fields else None
    if param is None:
        if first.get("type") == "missing":
            return APIError(400, "the request has no JSON body", code="invalid_json")
        return APIError(400, f"the request body must be a JSON object ({first.get('msg', '')})", code="invalid_json")
    union = any(_is_type_name(part) for part in fields[1:])  # one error per member of a union type
    if param in UNION_MESSAGES and (union or first.get("type") == "missing"):
        return APIError(400, UNION_MESSAGES[param] if union else f"{param} is required", param=param)
    where = ".".join(part for part in fields if not _is_type_name(part))
    return APIError(400, f"{where}: {first.get('msg', 'invalid value')}", param=param)


UNION_MESSAGES = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "stop must be a string or a list of strings",
}


def _is_type_name(part: str) -> bool:
    """A union member in pydantic's error location (``str``, ``list[int]``...), not a field name."""
    return "[" in part or part in ("str", "int", "float", "bool", "none", "dict")


# ---- requests ------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """The fields both endpoints share. Unknown fields are ignored (as vLLM does)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model
    temperature: float | None = Field(None, ge=0, le=2)  # None: 1.0, OpenAI's default
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # nnxtron / vLLM extension: 0 or -1 = off
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-MAX_SEED, lt=MAX_SEED)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_token_ids: bool = False  # extension: each choice carries the ids it generated (token_ids)

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        """Refuse text with a lone surrogate (JSON's "\\ud800"): it is not Unicode text, and neither the
        tokenizer nor an answer that quoted it could encode it."""
        if _has_lone_surrogate(value):
            raise ValueError("the text holds a lone UTF-16 surrogate (such as \\ud800), which is not valid Unicode")
        return value

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} stop strings, got {len(stops)}", param="stop")
        if any(not s for s in stops):
            raise APIError(400, "stop: stop strings must not be empty", param="stop")
        return stops

    def check_supported(self) -> None:
        """Refuse parameters that would change the answer but are not implemented."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported by this server; leave it at 0", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", param="logit_bias")

    def sampling(self, max_tokens: int, stop_ids: tuple[int, ...], logprobs: int | None, choice: int) -> SamplingParams:
        """The engine's settings for choice ``choice`` (the seed of choice i is seed + i)."""
        seed = None if self.seed is None else (self.seed + choice) % 2**64
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            max_tokens=max_tokens,
            stop_ids=stop_ids,
            seed=seed,
            logprobs=logprobs,
        )


_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(value: Any) -> bool:
    """Whether a string in the JSON value ``value`` (its keys too) holds a surrogate code point."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is not supported by this server (leave it unset or equal to n)", param="best_of")


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # None: up to the end of the context
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None  # passed to the chat template (tool calls are not parsed)
    chat_template_kwargs: dict[str, Any] | None = None  # extension: extra template variables (e.g. enable_thinking)
    add_generation_prompt: bool = True  # extension

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- generated text ----------------------------------------------------------------------


class CompletionText:
    """The text of one generated sequence, released piece by piece and cut at its first stop string.

    Tokens are decoded with ``TextStream`` (the whole sequence each time, so the pieces joined
    are ``decode(prompt + completion)`` past the prompt's text). ``add`` returns the text that is
    settled and cannot be the start of a stop string; the tail that could be is held back until
    later text rules it out. When a stop string appears, the text is cut before it, ``stopped``
    is set and nothing more is released. ``finish`` releases the rest.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
        self.stream = TextStream(tokenizer, prompt_ids)
        self.stop = tuple(stop)
        self.longest = max(map(len, self.stop), default=0)
        self.text = ""  # released so far
        self.stopped = False

    def add(self, token_ids: Sequence[int]) -> str:
        """Push new tokens; the text released by them ("" if none)."""
        if self.stopped:
            return ""
        self.stream.push(token_ids)
        settled = text_after(self.stream.emitted, self.stream.prompt_text)
        # stop strings are looked for in the whole decoded text (trailing whitespace too), less a partial character
        raw = text_after(self.stream.text(), self.stream.prompt_text).rstrip(PARTIAL) if self.stop else settled
        return self._release(settled, raw, final=False)

    def finish(self) -> str:
        """The rest of the text (the held-back tail, unless it holds a stop string)."""
        if self.stopped:
            return ""
        self.stream.finish()
        full = self.stream.completion()
        return self._release(full, full, final=True)

    def _release(self, settled: str, raw: str, final: bool) -> str:
        done = len(self.text)
        if self.stop:
            # a stop string cannot start in the released text: its possible starts were held back
            start = max(0, done - self.longest + 1)
            hits = [i for i in (raw.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                new = raw[done : max(min(hits), done)]
                self.text += new
                self.stopped = True
                return new
        end = len(settled) if final else len(settled) - self._held(settled, done)
        new = settled[done:end] if end > done else ""
        self.text += new
        return new

    def _held(self, text: str, done: int) -> int:
        """Length of the longest tail of ``text`` (not yet released) that begins a stop string."""
        for k in range(min(self.longest - 1, len(text) - done), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


# ---- log-probabilities -------------------------------------------------------------------


@dataclass
class TokenLogprob:
    """One generated token with its log-probability and the most likely alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_string(tokenizer: Tokenizer, token: int) -> str:
    """A token's text as OpenAI shows it (its decoded text; a special token's name)."""
    text = tokenizer.decode([token])
    return text if text else tokenizer.token_text(token)


def completion_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob], offset: int = 0) -> dict:
    """``/v1/completions``' ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset
    (offsets count from ``offset``, the text already sent in earlier chunks)."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        text = token_string(tokenizer, entry.token)
        top: dict[str, float] = {}
        for token, logprob in [*entry.top, (entry.token, entry.logprob)]:
            key = token_string(tokenizer, token)
            top[key] = max(top.get(key, -float("inf")), logprob)
        tokens.append(text)
        logprobs.append(entry.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob]) -> dict:
    """``/v1/chat/completions``' ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def item(token: int, logprob: float) -> dict:
        text = token_string(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries],
        "refusal": None,
    }


# ---- bodies --------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(data: Mapping[str, Any]) -> bytes:
    """One server-sent event: ``data: {...}\\n\\n``."""
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"
