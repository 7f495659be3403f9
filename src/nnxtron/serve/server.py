"""``nnxtron serve``: open a run or HF directory, start the engine, answer HTTP with uvicorn.

``serve`` checks its options and takes the port first (a port in use is one line, before the
model is read), then loads the model, its tokenizer and chat template (``load``), starts the
continuous-batching engine (``make_engine``) and runs uvicorn (``make_server``: the request
limits of ``serve/limits.py``) on the bound socket until SIGINT / SIGTERM. On either signal it
stops accepting, lets the requests in flight finish for ``--drain-timeout`` seconds, stops
the engine and returns (SIGTERM) or raises ``KeyboardInterrupt`` (SIGINT: exit status 130).
"""

from __future__ import annotations

import ipaddress
import signal
import socket
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from nnxtron.config.schema import Config
from nnxtron.convert.runs import check_text_tokenizer, load_model
from nnxtron.data.chat_template import ChatTemplate, RenderLimits, find_chat_template
from nnxtron.data.sources import tokenizer_directories, tokenizer_for
from nnxtron.data.template_render import DEFAULT_LIMITS
from nnxtron.data.tokenizer import Tokenizer
from nnxtron.errors import UserError
from nnxtron.infer.engine import Engine
from nnxtron.infer.paging import Paging
from nnxtron.runtime.compile_cache import enable_compilation_cache
from nnxtron.serve.app import create_app
from nnxtron.serve.limits import KEEP_ALIVE_SECONDS, MAX_HEADER_BYTES, GracefulServer, Limits, read_timeout_protocol
from nnxtron.serve.sequences import ServeState

__all__ = [
    "DEFAULT_MAX_LENGTH", "Loaded", "ServeOptions", "listen", "load", "load_chat_template", "make_engine", "make_server",
    "serve",
]  # fmt: skip

DEFAULT_MAX_LENGTH = 4096  # the context when --max-length is not given (at most the model's max_position_embeddings)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServeOptions:
    """The command line of ``nnxtron serve`` (everything but the model directory and its overrides)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None  # None: the directory's name
    max_length: int | None = None  # prompt + completion; None: min(max_position_embeddings, DEFAULT_MAX_LENGTH)
    max_sequences: int = 16  # the running batch
    block_size: int = 16  # KV cache slots per block
    kv_blocks: int | None = None  # blocks of the global caches; None: every sequence at max_length
    prefill_chunk: int = 64
    max_queue: int = 64  # waiting sequences before 429
    request_timeout: float | None = 600.0
    chat_template: str | None = None  # a Jinja file that replaces the tokenizer's template
    log_level: str = "info"
    max_body_bytes: int = Limits.max_body_bytes  # a larger request body is 413
    read_timeout: float = Limits.read_timeout  # seconds for a request's headers, and again for its body (408)
    max_connections: int = 512  # open connections and requests together; more are answered 503
    drain_timeout: float = 30.0  # seconds the requests in flight get to finish after SIGINT / SIGTERM
    template_timeout: float = DEFAULT_LIMITS.seconds  # one rendering of the chat template (data/template_render.py)
    template_memory_mib: int = DEFAULT_LIMITS.memory_mib
    template_max_chars: int = DEFAULT_LIMITS.max_chars

    def limits(self) -> Limits:
        return Limits(max_body_bytes=self.max_body_bytes, read_timeout=self.read_timeout)

    def render_limits(self) -> RenderLimits:
        """The chat template's rendering limits (``--chat-template-timeout`` / ``-memory-mib`` / ``-max-chars``)."""
        return RenderLimits(self.template_timeout, self.template_memory_mib, self.template_max_chars)

    def check(self) -> None:
        """One-line errors for values that cannot work (before the model is loaded)."""
        if not 0 <= self.port <= 65535:
            raise UserError(f"--port {self.port} is not a TCP port (0 .. 65535; 0 picks a free one)")
        positive = {
            "--max-sequences": self.max_sequences, "--block-size": self.block_size, "--max-length": self.max_length,
            "--kv-blocks": self.kv_blocks,
        }  # fmt: skip
        for flag, value in positive.items():
            if value is not None and value < 1:
                raise UserError(f"{flag} {value} must be at least 1")
        if self.max_queue < 0:
            raise UserError(f"--max-queue {self.max_queue} must be 0 or more")
        if self.prefill_chunk < 16 or self.prefill_chunk & (self.prefill_chunk - 1):
            raise UserError(f"--prefill-chunk {self.prefill_chunk} must be a power of two >= 16")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise UserError(f"--request-timeout {self.request_timeout:g} must be positive (seconds)")
        for flag, value in (("--read-timeout", self.read_timeout), ("--drain-timeout", self.drain_timeout)):
            if not value > 0:
                raise UserError(f"{flag} {value:g} must be positive (seconds)")
        for flag, value in (("--max-body-bytes", self.max_body_bytes), ("--max-connections", self.max_connections)):
            if value < 1:
                raise UserError(f"{flag} {value} must be at least 1")
        if self.api_key is not None and not self.api_key.strip():
            raise UserError("--api-key is empty; give a key or leave the option out")
        if self.log_level not in LOG_LEVELS:
            raise UserError(f"--log-level {self.log_level} is not one of {', '.join(LOG_LEVELS)}")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise UserError(f"--chat-template {self.chat_template} is not a file; pass a Jinja chat template file")
        self.render_limits()  # one line naming the flag whose value cannot work


@dataclass
class Loaded:
    """A model ready to serve: the model, its tokenizer and chat template, and its served name."""

    model: Any
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    no_chat_template: str  # why there is no template (when chat_template is None)
    name: str

    @property
    def config(self) -> Config:
        return self.model.config


def load(
    path: str | Path,
    overrides: Iterable[str] = (),
    chat_template: str | None = None,
    name: str | None = None,
    limits: RenderLimits = DEFAULT_LIMITS,
) -> Loaded:
    """The model of a run directory or HF directory (as ``nnxtron generate`` opens it), its
    tokenizer and its chat template (``chat_template``: a file that replaces it; rendered under ``limits``)."""
    check_text_tokenizer(path, overrides)
    model = load_model(path, list(overrides))
    cfg = model.config
    tokenizer = tokenizer_for(cfg)
    template, reason = load_chat_template(path, cfg, tokenizer, chat_template, limits)
    return Loaded(model, tokenizer, template, reason, name or Path(path).resolve().name)


def load_chat_template(
    path: str | Path, cfg: Config, tokenizer: Tokenizer, file: str | None = None, limits: RenderLimits = DEFAULT_LIMITS
) -> tuple[ChatTemplate | None, str]:
    """(template, "") or (None, why there is none): ``file``, else the one that came with the model
    (``tokenizer_directories``: a run's ``tokenizer/``, an HF directory). A template that is there but broken is an error."""
    return find_chat_template(tokenizer_directories(cfg, path), tokenizer, file, limits)


def make_engine(model: Any, options: ServeOptions) -> Engine:
    """The engine for ``model`` with the options' context, batch, cache and queue sizes (not started)."""
    cfg = model.config
    max_length = options.max_length or min(cfg.max_position_embeddings, DEFAULT_MAX_LENGTH)
    if max_length > cfg.max_position_embeddings:
        raise UserError(
            f"--max-length {max_length} exceeds the model's max_position_embeddings={cfg.max_position_embeddings}; "
            "lower --max-length"
        )
    paging = Paging(block_size=options.block_size, max_sequences=options.max_sequences, global_blocks=options.kv_blocks)
    try:
        return Engine(model, max_length, paging, prefill_chunk=options.prefill_chunk, max_queue=options.max_queue)
    except ValueError as err:
        raise UserError(f"cannot build the serving engine: {err}") from None


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (one-line error if it cannot be had)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise UserError(f"--host {host}: cannot resolve it ({err.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {err.strerror or err}; choose another --port or --host") from None
    sock.set_inheritable(True)
    return sock


def make_server(state: ServeState, options: ServeOptions, port: int) -> GracefulServer:
    """uvicorn (its h11 protocol, with the read deadline) around ``create_app(state)``, with the options'
    body, time and connection limits; ``state.limits`` is shared with the protocol, so changing it applies.
    What the protocol answers before a request has a route (a 408 for headers too slow, h11's 400) is
    counted in ``nnxtron_requests_total`` with ``endpoint="other"``."""

    def answered(status: int) -> None:
        state.metrics.requests.inc(endpoint="other", status=str(status))

    config = uvicorn.Config(
        create_app(state), host=options.host, port=port, log_level=options.log_level, http=read_timeout_protocol(state.limits, answered),
        timeout_keep_alive=KEEP_ALIVE_SECONDS, timeout_graceful_shutdown=options.drain_timeout,
        limit_concurrency=options.max_connections, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )  # fmt: skip
    return GracefulServer(config)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(path: str | Path, overrides: Iterable[str], options: ServeOptions, say: Callable[[str], None] | None = None) -> None:
    """Serve the model at ``path`` until SIGINT / SIGTERM; then drain, and return (SIGTERM) or raise
    ``KeyboardInterrupt`` (SIGINT)."""

    def note(line: str) -> None:
        (say or (lambda text: print(text, file=sys.stderr, flush=True)))(line)

    options.check()
    sock = listen(options.host, options.port)
    try:
        loaded = load(path, overrides, options.chat_template, options.model_name, options.render_limits())
        enable_compilation_cache(loaded.config)
        engine = make_engine(loaded.model, options)
        state = ServeState(
            engine, loaded.tokenizer, loaded.name, loaded.config.vocab_size, loaded.chat_template, loaded.no_chat_template,
            api_key=options.api_key, request_timeout=options.request_timeout, limits=options.limits(),
        )  # fmt: skip
        host, port = sock.getsockname()[:2]
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"
        note(
            f"serving '{loaded.name}' at {url} (context {engine.max_length} tokens, {options.max_sequences} sequences, "
            f"queue {options.max_queue}, chat template: {'yes' if loaded.chat_template else 'no'}, "
            f"API key: {'required' if options.api_key else 'none'})"
        )
        if options.api_key is None and not is_loopback(options.host):
            note(f"warning: listening on {options.host} without --api-key: anyone who can reach this port can use the model")
        engine.start()
        server = make_server(state, options, port)
        try:
            server.run(sockets=[sock])
        finally:
            engine.stop()
    finally:
        sock.close()
    if server.stopped_by == signal.SIGINT:
        raise KeyboardInterrupt  # Ctrl-C: exit status 130, whether it came while loading or while serving
