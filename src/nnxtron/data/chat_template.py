"""HuggingFace chat templates (Jinja), rendered as ``transformers``' ``apply_chat_template(..., tokenize=False)`` does.

A template is code from a model directory, so it is rendered in Jinja's sandbox *and* in a
child process (``_Renderers``) that has a time limit (``RENDER_SECONDS``: the process is
killed), an address-space limit (``RENDER_MEMORY_BYTES``, Linux: an allocation past it fails
at once) and an output limit (``MAX_RENDERED_CHARS``). A template that breaks one, or that
recurses too deeply, is a one-line :class:`UserError` naming the limit.
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import jinja2
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nnxtron.errors import UserError
from nnxtron.scoped import scoped

__all__ = [
    "MAX_RENDERED_CHARS", "RENDER_MEMORY_BYTES", "RENDER_SECONDS", "TEMPLATE_FILE", "ChatTemplate", "Span",
    "TemplateTimeout", "find_chat_template", "template_directory",
]  # fmt: skip

TEMPLATE_FILE = "chat_template.jinja"  # next to tokenizer_config.json; HF prefers it to the config's chat_template
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # HF fills the first two from whichever is given
SpecialToken = str | Mapping[str, Any] | None  # as in tokenizer_config.json: a string or an AddedToken dict with "content"
Span = tuple[int, int]  # [start, end) characters of a rendered text
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
_MARKS = ("\U000f0000", "\U000f0001")  # private-use characters around {% generation %} bodies while spans are found
_MARKING = contextvars.ContextVar("nnxtron_chat_template_marking", default=False)
RENDER_SECONDS = 10.0  # one rendering's wall time, after which its process is killed
RENDER_MEMORY_BYTES = 512 << 20  # the rendering process's address space (RLIMIT_AS, Linux)
MAX_RENDERED_CHARS = 1 << 24  # characters one rendering may produce (16 Mi)
RENDERERS = 4  # rendering processes at most (started when needed)
_LIMIT_FIX = "fix the template (or pass another with --chat-template / chat_template_path)"


class TemplateTimeout(UserError):
    """A chat template that did not finish rendering within ``RENDER_SECONDS``."""


class ChatTemplate:
    """A chat template and the special tokens it sees (bos_token, eos_token, ... and any other ``*_token``)."""

    def __init__(self, template: str, special_tokens: Mapping[str, SpecialToken] | None = None) -> None:
        self.template = template
        self.special_tokens = {name: _token_text(name, tok) for name, tok in (special_tokens or {}).items() if tok is not None}
        self._compiled = _compile(template)
        self._timed_out: str | None = None  # the message of an assistant_spans rendering that ran out of time

    @classmethod
    def from_directory(cls, path: str | Path, defaults: Mapping[str, SpecialToken] | None = None) -> ChatTemplate:
        """The template of a tokenizer directory (``chat_template.jinja``, else tokenizer_config.json's
        ``chat_template``); ``defaults``: special tokens the config does not name (the tokenizer's own
        BOS / EOS, as HF's Llama tokenizer has ``<s>`` / ``</s>`` without a tokenizer_config.json)."""
        directory = Path(path)
        if not directory.is_dir():
            raise UserError(f"tokenizer directory {directory} does not exist: pass a directory holding tokenizer_config.json")
        config = _read_json(directory / "tokenizer_config.json")
        if "added_tokens_decoder" not in config:  # as HF's legacy path: special_tokens_map.json overrides the config's tokens
            config.update(_read_json(directory / "special_tokens_map.json"))
        file = directory / TEMPLATE_FILE
        text = file.read_text(encoding="utf-8") if file.is_file() else _config_template(config.get("chat_template"), directory)
        # HF passes every named special token: the standard ones and any other string (or AddedToken) under a "*_token" key
        tokens = dict(defaults or {})
        tokens.update({k: v for k, v in config.items() if k.endswith("_token") and (isinstance(v, str) or _is_added_token(v))})
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        if isinstance(extra, Mapping):  # a dict of named model-specific tokens (a list names none)
            tokens.update(extra)
        return cls(text, tokens)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text of ``messages``; ``extra`` (tools, documents, enable_thinking, ...) reaches the template."""
        context = {**self.special_tokens, "tools": None, "documents": None, **extra}  # extra overrides special tokens, as in HF
        context.update(messages=_checked_messages(messages), add_generation_prompt=add_generation_prompt)
        return _RENDERERS.render(self.template, context, _MARKING.get())

    @property
    def marks_generation(self) -> bool:
        """The template marks assistant text with ``{% generation %}`` (what HF's assistant-token mask reads)."""
        return bool(_GENERATION_TAG.search(self.template))

    def assistant_spans(self, messages: Sequence[Mapping[str, Any]], **extra: Any) -> tuple[str, list[Span]]:
        """The text of the whole conversation (no generation prompt) and the character spans of
        the assistant's answers, one per assistant message, in order.

        A template with ``{% generation %}`` blocks gives their bodies, exactly the characters
        HF's ``return_assistant_tokens_mask`` marks. Without them, assistant message ``i`` is
        the text that rendering the first ``i + 1`` messages adds to the first ``i`` rendered
        with the generation prompt (its answer and the template's end of turn); that needs a
        template whose shorter conversations render to prefixes of longer ones.

        Training renders every record with this: once a rendering has run out of time, later
        calls raise the same :class:`TemplateTimeout` at once instead of waiting again."""
        if self._timed_out is not None:
            raise TemplateTimeout(self._timed_out)
        try:
            return self._assistant_spans(messages, **extra)
        except TemplateTimeout as err:
            self._timed_out = str(err)
            raise

    def _assistant_spans(self, messages: Sequence[Mapping[str, Any]], **extra: Any) -> tuple[str, list[Span]]:
        chat = _checked_messages(messages)
        assistants = [i for i, m in enumerate(chat) if m["role"] == "assistant"]
        if any(mark in json.dumps(chat, ensure_ascii=False) for mark in _MARKS):
            raise UserError("chat messages hold the private-use characters U+F0000/U+F0001; remove them")
        if self.marks_generation:
            with scoped(_MARKING, True):
                marked = self.render(chat, add_generation_prompt=False, **extra)
            text, spans = _unmark(marked)
            if len(spans) != len(assistants):
                raise UserError(
                    f"the chat template marks {len(spans)} {{% generation %}} blocks for {len(assistants)} assistant messages; "
                    "each assistant message needs exactly one"
                )
            return text, spans
        text = self.render(chat, add_generation_prompt=False, **extra)
        spans = []
        for i in assistants:
            if i == 0:
                raise UserError("the conversation starts with an assistant message; put a user (or system) message first")
            before = self.render(chat[:i], add_generation_prompt=True, **extra)
            through = self.render(chat[: i + 1], add_generation_prompt=False, **extra)
            if not (through.startswith(before) and text.startswith(through)):
                raise UserError(
                    f"the chat template renders the first {i} messages (with the generation prompt) to text that does not "
                    f"begin the rendering of the first {i + 1} and of the whole conversation, so assistant message {i}'s "
                    "tokens cannot be found; add {% generation %}...{% endgeneration %} around the assistant's text "
                    "(as HF's assistant-token mask needs) or pass a template with chat_template_path"
                )
            spans.append((len(before), len(through)))
        return text, spans


def _unmark(marked: str) -> tuple[str, list[Span]]:
    """The text without the generation marks, and the spans they enclosed."""
    start_mark, end_mark = _MARKS
    pieces, spans, length, start = [], [], 0, None
    for piece in re.split(f"({start_mark}|{end_mark})", marked):
        if piece == start_mark:
            if start is not None:
                raise UserError("the chat template nests {% generation %} blocks; mark each assistant answer once")
            start = length
        elif piece == end_mark:
            spans.append((start, length))
            start = None
        else:
            pieces.append(piece)
            length += len(piece)
    return "".join(pieces), spans


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for HF's assistant-token mask; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        body = caller()
        return f"{_MARKS[0]}{body}{_MARKS[1]}" if _MARKING.get() else body


class _Namespace(jinja2.utils.Namespace):
    """HF's ``namespace``: attributes starting with "_" are refused (they could reach Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        attrs = dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(args[0], attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold underscore-prefixed attributes: {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)  # no HTML escapes


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _RuntimeOnly(CodeGenerator):
    """Jinja's code generator without compile-time evaluation of output expressions, which
    would compute e.g. ``{{ 'x' * 10**9 }}`` while compiling, in the calling process."""

    def _output_child_to_const(self, node: jinja2.nodes.Expr, frame: Any, finalize: Any) -> str:
        if not isinstance(node, jinja2.nodes.TemplateData):
            raise jinja2.nodes.Impossible()
        return super()._output_child_to_const(node, frame, finalize)


class _Environment(ImmutableSandboxedEnvironment):
    code_generator_class = _RuntimeOnly


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    # optimized=False: no constant folding either (it evaluates expressions and filters while compiling)
    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols], optimized=False)
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace)
    return env


def _checked_messages(messages: Any) -> list[dict[str, Any]]:
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence) or not messages:
        raise UserError(f"chat messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got {messages!r:.80}")
    chat = []
    for index, message in enumerate(messages):
        if (problem := _message_problem(message)) is not None:
            raise UserError(f"chat message {index} {problem}")
        message = {key: value for key, value in message.items() if value is not None}  # as HF: a None field is left out
        if (reasoning := next((message[key] for key in REASONING_FIELDS if key in message), None)) is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def _message_problem(message: Any) -> str | None:
    if not isinstance(message, Mapping):
        return f"is a {type(message).__name__}, not a dict with 'role' and 'content'"
    if not isinstance(message.get("role"), str):
        return f"has no 'role' string (got {message.get('role')!r:.40})"
    content = message.get("content")
    if content is None:
        return None if message.get("tool_calls") else "has no 'content' (a string or a list of text parts)"
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return f"has 'content' of type {type(content).__name__}: give a string or a list of {{'type': 'text', 'text': ...}} parts"
    for part_index, part in enumerate(content):
        if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            return f"content part {part_index} is not a {{'type': 'text', 'text': str}} dict (got {part!r:.60})"
    return None


def _token_text(name: str, token: SpecialToken) -> str:
    if isinstance(token, str) or _is_added_token(token):
        return token if isinstance(token, str) else token["content"]
    raise UserError(f"special token {name} must be a string or a {{'content': str}} dict, got {token!r:.60}")


def _is_added_token(value: Any) -> bool:
    return isinstance(value, Mapping) and isinstance(value.get("content"), str)


def _config_template(value: Any, directory: Path) -> str:
    if isinstance(value, list | Mapping):  # named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = (
            value if isinstance(value, Mapping) else {e.get("name"): e.get("template") for e in value if isinstance(e, Mapping)}
        )
        value = named.get("default")
        where = f"chat templates {sorted(map(str, named))} but no 'default'"
    else:
        where = f"neither {TEMPLATE_FILE} nor a chat_template in tokenizer_config.json"
    if not isinstance(value, str):
        raise UserError(f"no chat template in {directory} ({where}): pass one with chat_template=...")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {_one_line(str(exc))}") from exc
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _has_template(directory: Path) -> bool:
    if (directory / TEMPLATE_FILE).is_file():
        return True
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return False
    try:
        return "chat_template" in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return True  # unreadable: ChatTemplate.from_directory reports it


def template_directory(directories: Sequence[Path]) -> Path | None:
    """The first of ``directories`` that holds a chat template (None: none does)."""
    return next((directory for directory in directories if _has_template(directory)), None)


def find_chat_template(directories: Sequence[Path], tokenizer: Any, file: str | None = None) -> tuple[ChatTemplate | None, str]:
    """The chat template of the first of ``directories`` that has one (``file``: a Jinja file
    that replaces it, seeing the directories' special tokens): (template, "") or (None, why
    there is none). A template that is there but broken is an error."""
    if file is not None:
        special = _special_tokens(directories, tokenizer)
        return ChatTemplate(Path(file).read_text(encoding="utf-8"), special), ""
    directory = template_directory(directories)
    if directory is not None:
        return ChatTemplate.from_directory(directory, _special_tokens([], tokenizer)), ""
    where = " or ".join(str(d) for d in directories)
    return None, f"no {TEMPLATE_FILE} and no chat_template in tokenizer_config.json in {where}"


def _special_tokens(directories: Sequence[Path], tokenizer: Any) -> dict[str, Any]:
    """The special tokens a template file sees: tokenizer_config.json's ``*_token`` entries, else the tokenizer's BOS / EOS."""
    tokens: dict[str, Any] = {}
    for kind, token_id in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id)):
        if token_id >= 0:
            tokens[f"{kind}_token"] = tokenizer.token_text(token_id)
    for directory in directories:
        config = directory / "tokenizer_config.json"
        try:
            data = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            for key, value in data.items():
                if key.endswith("_token") and (isinstance(value, str) or isinstance(value, dict) and "content" in value):
                    tokens[key] = value
            break
    return tokens


# ---- rendering under limits --------------------------------------------------------------


def _compile(template: str) -> jinja2.Template:
    """The compiled template; one-line errors for one that does not parse or nests too deeply."""
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"chat template does not parse: {_one_line(exc.message or '')} (template line {exc.lineno})") from exc
    except (RecursionError, MemoryError):
        raise UserError(f"chat template nests too deeply to compile; {_LIMIT_FIX}") from None


_compiled_template = functools.lru_cache(maxsize=16)(_compile)


def _render_here(template: str, context: Mapping[str, Any], marking: bool) -> str:
    """``template`` rendered in this process with the output limit (the rendering process's side); one-line errors."""
    pieces, size = [], 0
    try:
        with scoped(_MARKING, marking):
            for piece in _compiled_template(template).generate(context):
                size += len(piece)
                if size > MAX_RENDERED_CHARS:
                    raise UserError(f"chat template output exceeds {MAX_RENDERED_CHARS:,} characters; {_LIMIT_FIX}")
                pieces.append(piece)
        return "".join(pieces)
    except UserError:
        raise
    except jinja2.TemplateError as exc:
        raise UserError(f"chat template failed to render: {_one_line(str(exc))}") from None
    except RecursionError:
        raise UserError(f"chat template recurses too deeply (a macro or recursive loop without an end?); {_LIMIT_FIX}") from None
    except MemoryError:
        raise UserError(
            f"chat template needs more than {RENDER_MEMORY_BYTES >> 20} MiB to render (e.g. 'x' * 10**9); {_LIMIT_FIX}"
        ) from None
    except Exception as exc:  # a template's own bad operation, e.g. "a" + 1
        raise UserError(f"chat template failed to render: {type(exc).__name__}: {_one_line(str(exc))}") from None


def _serve_renders(fd_in: int, fd_out: int) -> None:
    """The rendering process: limit its memory, say it is ready, then answer ``(template, context,
    marking)`` requests with ``("ok", text)`` or ``("error", message)`` until the pipe closes."""
    try:
        import resource

        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        limit = RENDER_MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(hard, RENDER_MEMORY_BYTES)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):  # not Linux: the time and output limits still hold
        pass
    requests, answers = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    answers.send_bytes(json.dumps(["ready", ""]).encode())
    while True:
        try:
            template, context, marking = json.loads(requests.recv_bytes())
            answer = ("ok", _render_here(template, context, marking))
        except EOFError:
            return
        except UserError as err:
            answer = ("error", str(err))
        except MemoryError:
            answer = ("error", f"chat template input needs more than {RENDER_MEMORY_BYTES >> 20} MiB to render")
        answers.send_bytes(json.dumps(answer).encode())


class _Renderer:
    """One rendering process (``_serve_renders``) and its pipes. It loads this file by path, so
    that it imports Jinja and ``nnxtron.errors`` but not the package's heavier modules."""

    START_SECONDS = 60.0

    def __init__(self) -> None:
        child_in, requests = os.pipe()
        answers, child_out = os.pipe()
        code = (
            "import importlib.util, sys; spec = importlib.util.spec_from_file_location('nnxtron_template_renderer', "
            "sys.argv[1]); module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
            "module._serve_renders(int(sys.argv[2]), int(sys.argv[3]))"
        )
        source_root = str(Path(__file__).resolve().parents[2])  # where `import nnxtron` finds this package
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source_root, os.environ.get("PYTHONPATH")]))}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code, __file__, str(child_in), str(child_out)], pass_fds=(child_in, child_out),
                stdin=subprocess.DEVNULL, env=env,
            )  # fmt: skip
        finally:
            os.close(child_in)
            os.close(child_out)
        self.requests, self.answers = Connection(requests, readable=False), Connection(answers, writable=False)
        if self.answer(self.START_SECONDS, "start")[0] != "ready":
            self.close()
            raise UserError("the chat template rendering process did not start")

    def answer(self, seconds: float, doing: str) -> tuple[str, str]:
        """The process's next answer within ``seconds`` (else it is killed and this is a UserError)."""
        if not self.answers.poll(seconds):
            self.close()
            if doing == "start":
                raise UserError(f"the chat template rendering process did not start within {seconds:g} s")
            raise TemplateTimeout(
                f"chat template did not finish rendering within {seconds:g} s (a loop that does not end, or one far "
                f"too long for its input?); {_LIMIT_FIX}"
            )
        try:
            status, value = json.loads(self.answers.recv_bytes())
            return status, value
        except (EOFError, OSError):
            self.close()
            raise UserError(f"the chat template rendering process died (exit {self.process.returncode}); {_LIMIT_FIX}") from None

    def close(self) -> None:
        """Stop the process (it exits when its pipe closes; killed if it is busy)."""
        self.requests.close()
        self.answers.close()
        try:
            self.process.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class _Renderers:
    """Rendering processes, started when first needed and reused; at most ``size`` render at
    once (callers wait for one). A process that times out or dies is replaced."""

    def __init__(self, size: int) -> None:
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[_Renderer] = []
        self._pid = os.getpid()

    def render(self, template: str, context: Mapping[str, Any], marking: bool) -> str:
        try:
            request = json.dumps([template, dict(context), marking]).encode()  # data only: JSON, never pickle
        except RecursionError:
            raise UserError("the chat messages nest too deeply to render") from None
        except (TypeError, ValueError) as exc:
            raise UserError(f"the chat messages hold a value that cannot be rendered: {_one_line(str(exc))}") from None
        with self._slots:
            renderer = self._take()
            try:
                try:
                    renderer.requests.send_bytes(request)
                except OSError:  # the process is gone (killed from outside): once more with a new one
                    renderer.close()
                    renderer = _Renderer()
                    renderer.requests.send_bytes(request)
                status, value = renderer.answer(RENDER_SECONDS, "render")
            except BaseException:
                renderer.close()
                raise
            with self._lock:
                self._idle.append(renderer)
        if status != "ok":
            raise UserError(value)
        return value

    def _take(self) -> _Renderer:
        with self._lock:
            if os.getpid() != self._pid:  # a forked child: the processes belong to the parent
                self._idle, self._pid = [], os.getpid()
            if self._idle:
                return self._idle.pop()
        return _Renderer()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        if os.getpid() == self._pid:
            for renderer in idle:
                renderer.close()


_RENDERERS = _Renderers(RENDERERS)
atexit.register(_RENDERERS.close)
