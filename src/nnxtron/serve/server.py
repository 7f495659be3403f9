"""``nnxtron serve``: open a run or HF directory, start the engine, answer HTTP with uvicorn.

``serve`` checks its options and takes the port first (a port in use is one line, before the
model is read), then loads the model, its tokenizer and chat template (``load``), starts the
continuous-batching engine (``make_engine``) and runs uvicorn on the bound socket until
SIGINT / SIGTERM; the engine is stopped on the way out.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from nnxtron.config.schema import Config
from nnxtron.convert.runs import load_model
from nnxtron.data.chat_template import ChatTemplate, find_chat_template
from nnxtron.data.sources import tokenizer_directories, tokenizer_for
from nnxtron.data.tokenizer import Tokenizer
from nnxtron.errors import UserError
from nnxtron.infer.engine import Engine
from nnxtron.infer.paging import Paging
from nnxtron.runtime.compile_cache import enable_compilation_cache
from nnxtron.serve.app import create_app
from nnxtron.serve.sequences import ServeState

__all__ = ["DEFAULT_MAX_LENGTH", "Loaded", "ServeOptions", "listen", "load", "load_chat_template", "make_engine", "serve"]

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
        if self.api_key is not None and not self.api_key.strip():
            raise UserError("--api-key is empty; give a key or leave the option out")
        if self.log_level not in LOG_LEVELS:
            raise UserError(f"--log-level {self.log_level} is not one of {', '.join(LOG_LEVELS)}")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise UserError(f"--chat-template {self.chat_template} is not a file; pass a Jinja chat template file")


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


def load(path: str | Path, overrides: Iterable[str] = (), chat_template: str | None = None, name: str | None = None) -> Loaded:
    """The model of a run directory or HF directory (as ``nnxtron generate`` opens it), its
    tokenizer and its chat template (``chat_template``: a file that replaces it)."""
    model = load_model(path, list(overrides))
    cfg = model.config
    tokenizer = tokenizer_for(cfg)
    template, reason = load_chat_template(path, cfg, tokenizer, chat_template)
    return Loaded(model, tokenizer, template, reason, name or Path(path).resolve().name)


def load_chat_template(
    path: str | Path, cfg: Config, tokenizer: Tokenizer, file: str | None = None
) -> tuple[ChatTemplate | None, str]:
    """(template, "") or (None, why there is none): ``file``, else the one that came with the model
    (``tokenizer_directories``: a run's ``tokenizer/``, an HF directory). A template that is there but broken is an error."""
    return find_chat_template(tokenizer_directories(cfg, path), tokenizer, file)


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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(path: str | Path, overrides: Iterable[str], options: ServeOptions, say: Callable[[str], None] | None = None) -> None:
    """Serve the model at ``path`` until SIGINT / SIGTERM."""

    def note(line: str) -> None:
        (say or (lambda text: print(text, file=sys.stderr, flush=True)))(line)

    options.check()
    sock = listen(options.host, options.port)
    try:
        loaded = load(path, overrides, options.chat_template, options.model_name)
        enable_compilation_cache(loaded.config)
        engine = make_engine(loaded.model, options)
        state = ServeState(
            engine, loaded.tokenizer, loaded.name, loaded.config.vocab_size, loaded.chat_template, loaded.no_chat_template,
            api_key=options.api_key, request_timeout=options.request_timeout,
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
        try:
            config = uvicorn.Config(
                create_app(state), host=options.host, port=port, log_level=options.log_level, timeout_graceful_shutdown=5
            )
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            engine.stop()
    finally:
        sock.close()
