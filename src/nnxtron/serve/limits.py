"""What ``nnxtron serve`` refuses to wait for or to hold: request size and read time, idle
connections, and the shutdown on SIGINT / SIGTERM.

- ``BodyGuard`` (ASGI middleware) reads a request's body whole before the application sees it:
  413 past ``Limits.max_body_bytes`` (by its ``Content-Length``, before reading it, or as it
  streams), 408 when it does not arrive within ``Limits.read_timeout`` seconds.
- ``read_timeout_protocol`` is uvicorn's h11 protocol with a deadline for a request's headers
  (408, then the connection is closed): a client that opens a connection and sends nothing,
  or sends its headers a byte at a time, is cut after ``Limits.read_timeout`` seconds.
- ``GracefulServer`` is uvicorn's server that, on SIGINT / SIGTERM, stops accepting, lets the
  requests in flight finish (up to uvicorn's ``timeout_graceful_shutdown``) and returns,
  recording the signal, instead of re-raising it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import anyio
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from nnxtron.serve.protocol import error_body

__all__ = ["BodyGuard", "GracefulServer", "Limits", "read_timeout_protocol"]

MAX_HEADER_BYTES = 16 * 1024  # a request line and headers (h11's incomplete-event limit): larger is 400
KEEP_ALIVE_SECONDS = 5.0  # an idle keep-alive connection is closed after this


@dataclass
class Limits:
    """The request limits (mutable: the protocol and middleware read them per request)."""

    max_body_bytes: int = 8 * 1024 * 1024
    read_timeout: float = 30.0  # seconds for a request's headers, and again for its body


def _json_error(status: int, message: str, code: str) -> tuple[dict[str, Any], bytes]:
    body = json.dumps(error_body(message, code=code)).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), (b"connection", b"close")]
    return {"status": status, "headers": headers}, body


async def _refuse(send: Any, status: int, message: str, code: str) -> None:
    start, body = _json_error(status, message, code)
    await send({"type": "http.response.start", **start})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BodyGuard:
    """ASGI middleware: the body is read whole (at most ``max_body_bytes``, within ``read_timeout``)
    before the application is called, then handed to it in one message."""

    def __init__(self, app: Any, limits: Limits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        too_large = f"the request body is larger than this server's limit of {limit:,} bytes (--max-body-bytes)"
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _refuse(send, 413, too_large, "request_too_large")
            return
        body = bytearray()
        with anyio.move_on_after(self.limits.read_timeout) as deadline:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client left before sending its body
                body += message.get("body", b"")
                if len(body) > limit:
                    await _refuse(send, 413, too_large, "request_too_large")
                    return
                if not message.get("more_body", False):
                    break
        if deadline.cancelled_caught:
            timeout = self.limits.read_timeout
            await _refuse(send, 408, f"the request body did not arrive within {timeout:g} s (--read-timeout)", "request_timeout")
            return
        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def read_timeout_protocol(limits: Limits, answered: Callable[[int], None] | None = None) -> type[H11Protocol]:
    """uvicorn's h11 protocol, with a deadline of ``limits.read_timeout`` seconds for a request's
    headers, counted from the connection's opening or from the first byte after a response.
    ``answered(status)`` is called for what the protocol answers itself, before a request reaches
    the application (whose answers the application counts): the 408 of that deadline and h11's 400
    (a malformed request line or headers, headers over ``MAX_HEADER_BYTES``)."""

    def count(status: int) -> None:
        if answered is not None:
            answered(status)

    class ReadTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if not self._in_request():
                self._arm()
            super().data_received(data)
            if self._in_request():
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _in_request(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is not None and not cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(limits.read_timeout, self._timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _timed_out(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self._in_request():
                return
            message = f"the request headers did not arrive within {limits.read_timeout:g} s (--read-timeout)"
            start, body = _json_error(408, message, "request_timeout")
            headers = b"".join(b"%s: %s\r\n" % pair for pair in start["headers"])
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\n%s\r\n%s" % (headers, body))
            self.transport.close()
            count(408)

        def send_400_response(self, msg: str) -> None:
            super().send_400_response(msg)
            count(400)

    return ReadTimeoutProtocol


class GracefulServer(uvicorn.Server):
    """uvicorn's server, stopped by SIGINT / SIGTERM without re-raising the signal afterwards:
    ``stopped_by`` is the first signal received (None: none). A second SIGINT stops the drain."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.stopped_by: int | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.stopped_by is None:
            self.stopped_by = sig
        super().handle_exit(sig, frame)
