"""Stopping on request: SIGTERM / SIGINT finish the step, save a checkpoint and exit.

One process: the first SIGTERM or SIGINT (Ctrl-C) is noted; the loop finishes the step in
flight, saves a checkpoint, flushes the metrics and returns, and ``nnxtron train`` exits
with 128 + the signal number (143 for SIGTERM, 130 for SIGINT). A second signal ends the
process at once (same status, nothing more saved).

Several processes must stop at the same step, or the checkpoint would mix steps. JAX's
preemption service (started by ``jax.distributed.initialize``) receives SIGTERM on any
process and agrees on a step with all of them; every process asks it after each step
(``reached_preemption_sync_point``), so all stop after the same one. SIGINT is turned
into that same notice (the process sends itself SIGTERM), a second SIGINT ends the
process at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

import jax
from jax.experimental import multihost_utils

from nnxtron.runtime.interrupt import stop_if_interrupted, training_ended


class StopRequests:
    """The signals of one training run (a context manager: handlers installed inside only)."""

    def __init__(self) -> None:
        self.signal: int | None = None  # the first signal received (one process), or SIGTERM (several)
        self.distributed = jax.process_count() > 1
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        stop_if_interrupted()  # a Ctrl-C of the start-up (``runtime/interrupt.py``): no step is taken
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only; a library caller there keeps its handlers
        signals = (signal.SIGINT,) if self.distributed else (signal.SIGINT, signal.SIGTERM)  # JAX owns SIGTERM
        for signum in signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        training_ended()  # a Ctrl-C from now on (during the sample) stops a complete run
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:
            print(f"\n{signal.Signals(signum).name} again: stopping now, without a checkpoint", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signal = signum
        name = signal.Signals(signum).name
        print(
            f"\n{name}: finishing this step, saving a checkpoint, then stopping ({name} again stops at once)",
            file=sys.stderr,
            flush=True,
        )
        if self.distributed:  # the preemption service agrees on the step with the other processes
            os.kill(os.getpid(), signal.SIGTERM)

    def stop_after(self, step: int) -> bool:
        """Whether to stop after ``step`` (called by every process after every step)."""
        if not self.distributed:
            return self.signal is not None
        if multihost_utils.reached_preemption_sync_point(step):
            self.signal = self.signal or signal.SIGTERM
            return True
        return False
