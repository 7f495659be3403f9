"""Worker processes for `nnxtron plan --search`: compile jobs in parallel, on fake devices.

Each worker is ``python -m nnxtron.tools.search.worker`` started with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` and ``JAX_PLATFORMS=cpu``; it takes
one job at a time, and is replaced after ``jobs_per_worker`` jobs (every compiled program
holds memory mappings of its own; a fresh process starts from none). ``close`` kills
whatever is still compiling, so a time budget ends the search on time.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from typing import Any

from nnxtron.runtime.fake_devices import child_env

JOBS_PER_WORKER = 8


class _Worker:
    def __init__(self, devices: int, results: queue.Queue):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nnxtron.tools.search.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=child_env(devices),
        )
        self.jobs_done = 0
        self.busy: dict[str, Any] | None = None
        self._results = results
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._results.put((self, json.loads(line)))
        self._results.put((self, None))  # the process ended

    def send(self, job: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.busy = job
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class WorkerPool:
    """``workers`` compile processes; ``submit`` when ``idle``, ``next_result`` to collect."""

    def __init__(self, devices: int, workers: int, jobs_per_worker: int = JOBS_PER_WORKER):
        self.devices, self.jobs_per_worker = devices, jobs_per_worker
        self._results: queue.Queue = queue.Queue()
        self._workers = [_Worker(devices, self._results) for _ in range(workers)]

    @property
    def idle(self) -> int:
        return sum(w.busy is None for w in self._workers)

    @property
    def in_flight(self) -> int:
        return len(self._workers) - self.idle

    def submit(self, job: dict[str, Any]) -> None:
        worker = next(w for w in self._workers if w.busy is None)
        worker.send(job)

    def next_result(self, timeout: float) -> dict[str, Any] | None:
        """The next job's result, or None after ``timeout`` seconds. A worker that dies
        answers its job with an error and is replaced."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                worker, result = self._results.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                return None
            if worker not in self._workers:  # a replaced worker's end of output
                continue
            job, worker.busy = worker.busy, None
            if result is None:  # died (killed for memory, or crashed inside XLA)
                self._replace(worker)
                if job is not None:
                    return {"id": job["id"], "error": f"the compile process ended with status {worker.proc.returncode}"}
                continue
            worker.jobs_done += 1
            if worker.jobs_done >= self.jobs_per_worker:
                self._replace(worker)
            return result

    def _replace(self, worker: _Worker) -> None:
        worker.stop()
        self._workers[self._workers.index(worker)] = _Worker(self.devices, self._results)

    def close(self) -> None:
        for w in self._workers:
            w.stop()
