"""Ctrl-C before training starts: remembered, not only raised.

Python turns SIGINT into a ``KeyboardInterrupt`` raised wherever the main thread happens to
be. During start-up that is often inside JAX's garbage-collection callback, whose exceptions
Python reports as "Exception ignored" and drops: the run used to carry on and finish with
status 0. Or it is inside an import, where the exception cut an extension module's
initialisation short: an ``ImportError`` traceback, or a segmentation fault.

So ``nnxtron`` (``nnxtron/__main__.py``) installs ``at_start`` before anything heavy is imported,
for every command: a SIGINT inside an import ends the process at once (one line, status 130;
nothing has been written yet), elsewhere it raises and is recorded as ``handle`` does.
``nnxtron train`` installs ``handle`` for its start-up: it raises as Python's handler does (inside
an import it only records the signal) and records it, and ``stop_if_interrupted`` (called
between the start-up stages and before the first step) raises it again, so a Ctrl-C always
stops the start. Once training runs, ``train.preemption.StopRequests`` handles the signals instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import Any

_received: int | None = None  # the signal received since ``installed`` began, if any
BEFORE_TRAINING = "SIGINT: stopped before the first step (nothing was trained or saved)"
AFTER_TRAINING = "SIGINT: stopped after training (the run and its checkpoints are complete)"
_line = BEFORE_TRAINING  # what a SIGINT now stops


class Interrupted(KeyboardInterrupt):
    """A SIGINT stopped ``nnxtron train`` outside its training loop; the message is its one line."""


STARTING = "interrupted"  # what a SIGINT during any command's start-up prints (as cli.main for a KeyboardInterrupt)


def importing(frame: FrameType | None) -> bool:
    """Whether ``frame`` (the signal's) runs inside an import: importlib executing a module, an
    extension module's initialisation among them, which an exception would leave half-done."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def handle(signum: int, frame: FrameType | None) -> None:
    """``nnxtron train``'s start-up: record the signal; raise it, unless inside an import (then the
    next ``stop_if_interrupted`` raises it, after the import has finished)."""
    global _received
    _received = signum
    if not importing(frame):
        raise Interrupted(_line)


def at_start(signum: int, frame: FrameType | None) -> None:
    """Every command's start-up (``nnxtron/__main__.py``): inside an import, one line and status 130
    at once (nothing has been done that needs undoing); elsewhere recorded and raised as ``handle``."""
    global _received
    _received = signum
    if importing(frame):
        with contextlib.suppress(Exception):  # (a write to stdout that the signal interrupted cannot flush)
            sys.stdout.flush()
        os.write(2, f"{STARTING}\n".encode())
        os._exit(128 + signal.SIGINT)
    raise Interrupted(STARTING)


def training_ended() -> None:
    """From now on a SIGINT stops what follows training (the sample): the run is complete."""
    global _line
    _line = AFTER_TRAINING


def received() -> bool:
    """Whether a SIGINT arrived while ``installed`` was active (even one whose exception was swallowed)."""
    return _received is not None


def stop_if_interrupted() -> None:
    """Raise ``Interrupted`` again when a SIGINT arrived (its first exception may have been swallowed)."""
    if _received is not None:
        raise Interrupted(_line)


@contextlib.contextmanager
def installed(handler: Callable[[int, FrameType | None], None] = handle) -> Iterator[None]:
    """``handler`` as the SIGINT handler within the block (main thread only; restored after, with
    what was recorded before it: a block inside another, ``nnxtron train``'s inside ``at_start``'s,
    sees the signal the outer one recorded and leaves it as it found it)."""
    global _received, _line
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer = _received, _line
    _line = BEFORE_TRAINING
    previous = signal.signal(signal.SIGINT, handler)
    unraisable, excepthook = sys.unraisablehook, sys.excepthook

    def quiet_unraisable(info: Any) -> None:  # "Exception ignored in <jax's gc callback>": the one line comes later
        if not isinstance(info.exc_value, Interrupted):
            unraisable(info)

    def quiet_excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if not isinstance(value, Interrupted):  # printed by an extension module whose import it cut short
            excepthook(kind, value, tb)

    sys.unraisablehook, sys.excepthook = quiet_unraisable, quiet_excepthook
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        # restored only where still ours: a hook installed inside the block (the checkpointer's, which
        # quiets orbax's coroutines collected at exit, after this block) chains to ours and stays
        if sys.unraisablehook is quiet_unraisable:
            sys.unraisablehook = unraisable
        if sys.excepthook is quiet_excepthook:
            sys.excepthook = excepthook
        _received, _line = outer
