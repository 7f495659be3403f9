"""Multi-host start-up: join a ``jax.distributed`` run from flags or the cluster environment.

Every process runs the same ``nnxtron train`` command. Either all three of
``--coordinator-address HOST:PORT --num-processes N --process-id I`` are given, or
``--distributed`` lets JAX detect them (SLURM, Open MPI, TPU VMs, Kubernetes...;
``JAX_COORDINATOR_ADDRESS`` is read too). CPU processes exchange collectives through gloo.

While the run lasts, every process writes a heartbeat to the coordination service and
watches the others' (``PeerWatch``): a process not heard from for ``--peer-timeout``
seconds (hung, stopped, its host gone) ends the others with one line and status 3, before
JAX's own heartbeat (set to twice as long) would abort them with a stack dump.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

from nnxtron.errors import UserError
from nnxtron.runtime.private_api import coordination_client

EXIT_PEER_LOST = 3  # another process died or stopped answering; the run resumes from its last checkpoint
EXIT_JOIN_FAILED = 2  # the run could not be joined (as a bad command line: nothing was started)

INIT_TIMEOUT_S = 300  # --init-timeout: joining (the coordinator answers, every process registers) takes at most this
JAX_INIT_GRACE_S = 30  # JAX's own deadline comes this much later: it aborts the process with a C++ stack dump
PEER_TIMEOUT_S = 60  # a process silent this long (JAX's heartbeat) is taken for dead; the others stop


def check_flags(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    detect: bool = False,
    peer_timeout: int | None = None,
    init_timeout: int | None = None,
) -> bool:
    """Whether the flags join a multi-host run; one-line errors for flags that cannot work
    together, among them a timeout given to a single-process run (which has no peers to time
    out: the flag would be ignored). Checked before anything is loaded."""
    given = [coordinator_address, num_processes, process_id]
    if not detect and all(v is None for v in given):
        unread = [flag for flag, v in (("--peer-timeout", peer_timeout), ("--init-timeout", init_timeout)) if v is not None]
        if unread:
            raise UserError(
                f"{' and '.join(unread)} {'is' if len(unread) == 1 else 'are'} read only by a multi-host run (with "
                "--coordinator-address, --num-processes and --process-id, or --distributed); this run is single-process: "
                "drop it"
            )
        return False
    if not detect and any(v is None for v in given):
        raise UserError(
            "--coordinator-address, --num-processes and --process-id go together; give all three, "
            "or --distributed to detect them from the cluster (SLURM, MPI, TPU, Kubernetes)"
        )
    for flag, seconds in (("--peer-timeout", peer_timeout), ("--init-timeout", init_timeout)):
        if seconds is not None and seconds < 1:
            raise UserError(f"{flag} must be at least 1 second, got {seconds}")
    if num_processes is not None and num_processes < 1:
        raise UserError(f"--num-processes must be at least 1, got {num_processes}")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise UserError(f"--process-id must be in [0, {num_processes}), got {process_id}")
    return True


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    detect: bool = False,
    peer_timeout: int | None = None,
    init_timeout: int | None = None,
) -> bool:
    """Join the distributed run described by the arguments (``check_flags``; a timeout left
    None: its default); False (nothing done) when none is given and ``detect`` is off. Must run
    before anything touches a JAX backend.

    Not joined within ``init_timeout`` seconds (no coordinator answers, a process was never
    started): the process ends with one line and status 2 (``_JoinDeadline``)."""
    if not check_flags(coordinator_address, num_processes, process_id, detect, peer_timeout, init_timeout):
        return False
    peer_timeout = PEER_TIMEOUT_S if peer_timeout is None else peer_timeout
    init_timeout = INIT_TIMEOUT_S if init_timeout is None else init_timeout
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only read by the CPU backend
    try:
        with _JoinDeadline(init_timeout, coordinator_address, num_processes):
            jax.distributed.initialize(
                coordinator_address,
                num_processes,
                process_id,
                initialization_timeout=init_timeout + JAX_INIT_GRACE_S,  # _JoinDeadline speaks first, in one line
                heartbeat_timeout_seconds=2 * peer_timeout,  # the PeerWatch speaks first, in one line
            )
    except (RuntimeError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"could not join the distributed run ({first[:200]}); check the coordinator address, the process "
            "count and id, and that every process was started"
        ) from None
    global _WATCH
    _WATCH = PeerWatch(peer_timeout)
    _WATCH.start()
    return True


class _JoinDeadline:
    """Ends the process with one line and status 2 when joining takes longer than ``seconds``.

    JAX gives up on an unreachable coordinator (or on processes that never register) by
    aborting the whole process from C++ (SIGABRT and a stack dump, no Python exception to
    catch); a timer thread speaks first. ``jax.distributed.initialize`` releases the GIL while
    it waits, so the timer runs."""

    def __init__(self, seconds: int, address: str | None, processes: int | None):
        self.seconds, self.address, self.processes = seconds, address, processes
        self.timer = threading.Timer(seconds, self._expired)
        self.timer.daemon = True

    def __enter__(self) -> _JoinDeadline:
        self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timer.cancel()

    def _expired(self) -> None:
        where = f"the coordinator {self.address}" if self.address else "the coordinator found by --distributed"
        if self.address and not _answers(self.address):
            problem = f"{where} does not answer (nothing listens there, or a firewall drops it)"
        else:
            count = f"all {self.processes} processes" if self.processes else "every process"
            problem = f"{where} answers but not {count} joined (one was not started, or has another address)"
        print(
            f"error: could not join the distributed run within {self.seconds} s (--init-timeout): {problem}; check the "
            "address and port, and start every process with the same --coordinator-address and --num-processes",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_JOIN_FAILED)


def _answers(address: str) -> bool:
    """Whether a TCP connection to ``HOST:PORT`` is accepted within a second."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


def shutdown() -> None:
    """Stop watching the peers, then leave the distributed run (a barrier with all of them)."""
    import jax

    if _WATCH is not None:
        _WATCH.stop()
    jax.distributed.shutdown()


def peer_lost(reason: str) -> None:
    """End this process at once with one line: a peer is gone (JAX's own shutdown would wait
    for it, then abort with a stack dump)."""
    print(
        f"error: {reason}; a peer process died or was stopped: restart all processes with the same command to resume "
        "from the last checkpoint",
        file=sys.stderr,
        flush=True,
    )
    os._exit(EXIT_PEER_LOST)


class PeerWatch(threading.Thread):
    """Heartbeats through the coordination service's key-value store (see the module docstring)."""

    def __init__(self, timeout: float):
        import jax

        super().__init__(name="nnxtron-peer-watch", daemon=True)
        self.client = coordination_client()
        self.me, self.count = jax.process_index(), jax.process_count()
        self.timeout, self.period = float(timeout), max(float(timeout) / 6, 0.2)
        self.done = threading.Event()

    def stop(self) -> None:
        self.done.set()
        self.join()

    def run(self) -> None:
        started = time.monotonic()
        seen = {peer: ("", started) for peer in range(self.count) if peer != self.me}  # last value, when it changed
        beat = 0
        while not self.done.is_set():
            beat += 1
            try:
                self.client.key_value_set(f"nnxtron/heartbeat/{self.me}", str(beat), allow_overwrite=True)
                values = {peer: self._get(peer) for peer in seen}
            except Exception as err:  # noqa: BLE001 - the coordinator (process 0) is gone
                if not self.done.is_set():
                    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
                    peer_lost(f"the coordination service (process 0) cannot be reached ({first})")
                return
            now = time.monotonic()
            for peer, value in values.items():
                if value != seen[peer][0]:
                    seen[peer] = (value, now)
                elif now - seen[peer][1] > self.timeout and not self.done.is_set():
                    peer_lost(f"process {peer} of {self.count} has not been heard from for {self.timeout:g} s (--peer-timeout)")
            self.done.wait(self.period)

    def _get(self, peer: int) -> str:
        try:
            return self.client.key_value_try_get(f"nnxtron/heartbeat/{peer}")
        except Exception as err:  # noqa: BLE001 - not written yet: the peer has not started beating
            if "NOT_FOUND" in str(err) or "not found" in str(err).lower():
                return ""
            raise


_WATCH: PeerWatch | None = None
