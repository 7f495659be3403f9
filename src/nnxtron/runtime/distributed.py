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
import sys
import threading
import time

from nnxtron.errors import UserError

EXIT_PEER_LOST = 3  # another process died or stopped answering; the run resumes from its last checkpoint

INIT_TIMEOUT_S = 300
PEER_TIMEOUT_S = 60  # a process silent this long (JAX's heartbeat) is taken for dead; the others stop


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    detect: bool = False,
    peer_timeout: int = PEER_TIMEOUT_S,
) -> bool:
    """Join the distributed run described by the arguments; False (nothing done) when none
    is given and ``detect`` is off. Must run before anything touches a JAX backend."""
    given = [coordinator_address, num_processes, process_id]
    if not detect and all(v is None for v in given):
        return False
    if not detect and any(v is None for v in given):
        raise UserError(
            "--coordinator-address, --num-processes and --process-id go together; give all three, "
            "or --distributed to detect them from the cluster (SLURM, MPI, TPU, Kubernetes)"
        )
    if peer_timeout < 1:
        raise UserError(f"--peer-timeout must be at least 1 second, got {peer_timeout}")
    if num_processes is not None and num_processes < 1:
        raise UserError(f"--num-processes must be at least 1, got {num_processes}")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise UserError(f"--process-id must be in [0, {num_processes}), got {process_id}")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only read by the CPU backend
    try:
        jax.distributed.initialize(
            coordinator_address,
            num_processes,
            process_id,
            initialization_timeout=INIT_TIMEOUT_S,
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
        from jax._src import distributed

        super().__init__(name="nnxtron-peer-watch", daemon=True)
        self.client = distributed.global_state.client
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
