"""Rendering a chat template under limits: Jinja's sandbox, in a child process.

A chat template is code from a model directory (``data/chat_template.py`` reads it), so it is
compiled by Jinja's ``ImmutableSandboxedEnvironment`` without evaluating anything in this
process, and rendered in a child process (``_Renderers``, a small pool started when first
needed) under ``RenderLimits``: a time limit (the process is killed), an address-space limit
(Linux ``RLIMIT_AS``: an allocation past it fails at once) and an output limit. A template that
breaks one, or that recurses too deeply, is a one-line :class:`UserError` naming the limit and
how to change it. The limits are ``nnxtron serve``'s ``--chat-template-*`` flags and the
training keys ``chat_template_timeout``, ``chat_template_memory_mib``, ``chat_template_max_chars``.
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import json
import math
import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
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
    "DEFAULT_LIMITS", "LIMIT_FIX", "MARKING", "MARKS", "MIN_MEMORY_MIB", "RENDERERS", "RenderLimits", "TemplateTimeout",
    "compile_template", "one_line", "render",
]  # fmt: skip

MARKS = ("\U000f0000", "\U000f0001")  # private-use characters around {% generation %} bodies while spans are found
MARKING = contextvars.ContextVar("nnxtron_chat_template_marking", default=False)
RENDERERS = 4  # rendering processes at most (started when needed)
MIN_MEMORY_MIB = 64  # a rendering process needs ~26 MiB of address space before it renders anything
LIMIT_FIX = "fix the template (or pass another with --chat-template / chat_template_path)"


def _raise_limit(flag: str) -> str:
    """How to change the limit that a rendering broke: ``nnxtron serve``'s flag, training's key."""
    return f"{LIMIT_FIX}, or raise the limit ({flag} / {flag.lstrip('-').replace('-', '_')})"


@dataclass(frozen=True)
class RenderLimits:
    """What one rendering may take: ``seconds`` of wall time (then its process is killed), a
    process of ``memory_mib`` MiB of address space, ``max_chars`` characters of output. The
    defaults hold for any real chat template (it renders in milliseconds, to a few kilobytes)."""

    seconds: float = 10.0
    memory_mib: int = 512
    max_chars: int = 1 << 24  # 16 Mi

    def __post_init__(self) -> None:
        if not (isinstance(self.seconds, int | float) and math.isfinite(self.seconds) and self.seconds > 0):
            raise UserError(
                "the chat template time limit (--chat-template-timeout / chat_template_timeout) must be a number of "
                f"seconds > 0, got {self.seconds!r}"
            )
        if not (isinstance(self.memory_mib, int) and self.memory_mib >= MIN_MEMORY_MIB):
            raise UserError(
                "the chat template memory limit (--chat-template-memory-mib / chat_template_memory_mib) must be at least "
                f"{MIN_MEMORY_MIB} MiB (the rendering process's own size is ~26 MiB), got {self.memory_mib!r}"
            )
        if not (isinstance(self.max_chars, int) and self.max_chars >= 1):
            raise UserError(
                "the chat template output limit (--chat-template-max-chars / chat_template_max_chars) must be at least 1 "
                f"character, got {self.max_chars!r}"
            )


DEFAULT_LIMITS = RenderLimits()


class TemplateTimeout(UserError):
    """A chat template that did not finish rendering within its time limit."""


def one_line(text: str) -> str:
    return " ".join(text.split())


# ---- the sandbox --------------------------------------------------------------------------


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for HF's assistant-token mask; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        body = caller()
        return f"{MARKS[0]}{body}{MARKS[1]}" if MARKING.get() else body


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


# ---- rendering under limits --------------------------------------------------------------


def compile_template(template: str) -> jinja2.Template:
    """The compiled template; one-line errors for one that does not parse or nests too deeply."""
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"chat template does not parse: {one_line(exc.message or '')} (template line {exc.lineno})") from exc
    except (RecursionError, MemoryError):
        raise UserError(f"chat template nests too deeply to compile; {LIMIT_FIX}") from None


_compiled_template = functools.lru_cache(maxsize=16)(compile_template)


def _render_here(template: str, context: Mapping[str, Any], marking: bool, max_chars: int, memory_mib: int) -> str:
    """``template`` rendered in this process with the output limit (the rendering process's side); one-line errors."""
    pieces, size = [], 0
    try:
        with scoped(MARKING, marking):
            for piece in _compiled_template(template).generate(context):
                size += len(piece)
                if size > max_chars:
                    raise UserError(
                        f"chat template output exceeds {max_chars:,} characters; {_raise_limit('--chat-template-max-chars')}"
                    )
                pieces.append(piece)
        return "".join(pieces)
    except UserError:
        raise
    except jinja2.TemplateError as exc:
        raise UserError(f"chat template failed to render: {one_line(str(exc))}") from None
    except RecursionError:
        raise UserError(f"chat template recurses too deeply (a macro or recursive loop without an end?); {LIMIT_FIX}") from None
    except MemoryError:
        raise UserError(
            f"chat template needs more than {memory_mib} MiB to render (e.g. 'x' * 10**9); "
            f"{_raise_limit('--chat-template-memory-mib')}"
        ) from None
    except Exception as exc:  # a template's own bad operation, e.g. "a" + 1
        raise UserError(f"chat template failed to render: {type(exc).__name__}: {one_line(str(exc))}") from None


def _serve_renders(fd_in: int, fd_out: int, memory_mib: int) -> None:
    """The rendering process: limit its memory to ``memory_mib`` MiB, say it is ready, then answer
    ``(template, context, marking, max_chars)`` requests with ``("ok", text)`` or ``("error",
    message)`` until the pipe closes."""
    try:
        import resource

        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        limit = memory_mib << 20 if hard == resource.RLIM_INFINITY else min(hard, memory_mib << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):  # not Linux: the time and output limits still hold
        pass
    requests, answers = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    answers.send_bytes(json.dumps(["ready", ""]).encode())
    while True:
        try:
            template, context, marking, max_chars = json.loads(requests.recv_bytes())
            answer = ("ok", _render_here(template, context, marking, max_chars, memory_mib))
        except EOFError:
            return
        except UserError as err:
            answer = ("error", str(err))
        except MemoryError:
            answer = ("error", f"chat template input needs more than {memory_mib} MiB to render; "
                      f"{_raise_limit('--chat-template-memory-mib')}")  # fmt: skip
        try:
            answers.send_bytes(json.dumps(answer).encode())
        except OSError:  # the caller stopped waiting (its time limit) and closed the pipe
            return


class _Renderer:
    """One rendering process (``_serve_renders``, limited to ``memory_mib``) and its pipes. It loads
    this file by path, so that it imports Jinja and ``nnxtron.errors`` but not the package's heavier modules."""

    START_SECONDS = 60.0

    def __init__(self, memory_mib: int) -> None:
        self.memory_mib = memory_mib
        child_in, requests = os.pipe()
        answers, child_out = os.pipe()
        code = (
            "import importlib.util, sys; spec = importlib.util.spec_from_file_location('nnxtron_template_renderer', "
            "sys.argv[1]); module = importlib.util.module_from_spec(spec); sys.modules[spec.name] = module; "
            "spec.loader.exec_module(module); "
            "module._serve_renders(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))"
        )
        source_root = str(Path(__file__).resolve().parents[2])  # where `import nnxtron` finds this package
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source_root, os.environ.get("PYTHONPATH")]))}
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code, __file__, str(child_in), str(child_out), str(memory_mib)],
                pass_fds=(child_in, child_out),
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
                f"too long for its input?); {_raise_limit('--chat-template-timeout')}"
            )
        try:
            status, value = json.loads(self.answers.recv_bytes())
            return status, value
        except (EOFError, OSError):
            self.close()
            raise UserError(f"the chat template rendering process died (exit {self.process.returncode}); {LIMIT_FIX}") from None

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
    """Rendering processes, started when first needed and reused (one of the memory limit asked
    for); at most ``size`` render at once (callers wait for one) and at most ``size`` wait idle.
    A process that times out or dies is replaced."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[_Renderer] = []
        self._pid = os.getpid()

    def render(self, template: str, context: Mapping[str, Any], marking: bool, limits: RenderLimits) -> str:
        try:
            request = json.dumps([template, dict(context), marking, limits.max_chars]).encode()  # data only: JSON, never pickle
        except RecursionError:
            raise UserError("the chat messages nest too deeply to render") from None
        except (TypeError, ValueError) as exc:
            raise UserError(f"the chat messages hold a value that cannot be rendered: {one_line(str(exc))}") from None
        with self._slots:
            renderer = self._take(limits.memory_mib)
            try:
                try:
                    renderer.requests.send_bytes(request)
                except OSError:  # the process is gone (killed from outside): once more with a new one
                    renderer.close()
                    renderer = _Renderer(limits.memory_mib)
                    renderer.requests.send_bytes(request)
                status, value = renderer.answer(limits.seconds, "render")
            except BaseException:
                renderer.close()
                raise
            with self._lock:
                self._idle.append(renderer)
                surplus = self._idle[: -self._size]
                del self._idle[: -self._size]
            for extra in surplus:  # processes of another memory limit, no longer asked for
                extra.close()
        if status != "ok":
            raise UserError(value)
        return value

    def _take(self, memory_mib: int) -> _Renderer:
        with self._lock:
            if os.getpid() != self._pid:  # a forked child: the processes belong to the parent
                self._idle, self._pid = [], os.getpid()
            for index in range(len(self._idle) - 1, -1, -1):
                if self._idle[index].memory_mib == memory_mib:
                    return self._idle.pop(index)
        return _Renderer(memory_mib)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        if os.getpid() == self._pid:
            for renderer in idle:
                renderer.close()


_RENDERERS = _Renderers(RENDERERS)
atexit.register(_RENDERERS.close)


def render(template: str, context: Mapping[str, Any], marking: bool, limits: RenderLimits) -> str:
    """``template`` rendered with ``context`` in a rendering process, under ``limits``; one-line
    UserErrors (:class:`TemplateTimeout` for the time limit). ``marking``: ``{% generation %}``
    bodies come between ``MARKS``."""
    return _RENDERERS.render(template, context, marking, limits)
