"""Ctrl-C before training starts: remembered, not only raised.

Python turns SIGINT into a ``KeyboardInterrupt`` raised wherever the main thread happens to
be. During start-up that is often inside JAX's garbage-collection callback, whose exceptions
Python reports as "Exception ignored" and drops: the run used to carry on and finish with
status 0. ``nnxtron train`` installs ``handle`` first thing; it raises as Python's handler
does and also records the signal, and ``stop_if_interrupted`` (called between the start-up
stages and before the first step) raises it again, so a Ctrl-C always stops the start. Once
training runs, ``train.preemption.StopRequests`` handles the signals instead.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

_received: int | None = None  # the signal received since ``installed`` began, if any
BEFORE_TRAINING = "SIGINT: stopped before the first step (nothing was trained or saved)"
AFTER_TRAINING = "SIGINT: stopped after training (the run and its checkpoints are complete)"
_line = BEFORE_TRAINING  # what a SIGINT now stops


class Interrupted(KeyboardInterrupt):
    """A SIGINT stopped ``nnxtron train`` outside its training loop; the message is its one line."""


def handle(signum: int, frame: FrameType | None) -> None:
    global _received
    _received = signum
    raise Interrupted(_line)


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
def installed() -> Iterator[None]:
    """``handle`` as the SIGINT handler within the block (main thread only; restored after)."""
    global _received, _line
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received, _line = None, BEFORE_TRAINING
    previous = signal.signal(signal.SIGINT, handle)
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
        sys.unraisablehook, sys.excepthook = unraisable, excepthook
        _received, _line = None, BEFORE_TRAINING
