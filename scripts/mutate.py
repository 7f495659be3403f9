"""Mutation check: break critical code on purpose and check that a test turns red.

Each mutant of ``tests/mutation/mutants.py`` replaces one snippet in one file of ``src/nnxtron``
and runs the tests it names (``pytest -x``, so a killed mutant stops at its first red test).
Mutants run in a private copy of the working tree (one per worker, imported through
``PYTHONPATH``), never in the tree itself: an interrupted run leaves the checkout untouched.

Outcomes: KILLED (a named test went red and every ``spared`` test stayed green), SURVIVED (the
tests stayed green), SPARED-FAILED (a ``spared`` test went red too), STALE (the snippet does not
occur exactly once, or a named test no longer exists), TIMEOUT, ERROR (pytest itself failed).
Each result replaces that mutant's entry in the record (``tests/mutation/last_run.json``, one
line per mutant with the commit it ran on), so a run split over sessions or shards still adds up
to one score; ``--report`` prints it. Exit status 0 only if every mutant run (or reported) is KILLED.

    .venv/bin/python scripts/mutate.py [-j N] [--shard I/N] [NAME ...]
    .venv/bin/python scripts/mutate.py --report
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.mutation.mutants import MUTATIONS, Mutation  # noqa: E402

RECORD = ROOT / "tests" / "mutation" / "last_run.json"
PACKAGE = Path("src") / "nnxtron"
KILLED, SURVIVED, STALE, SPARED_FAILED, TIMEOUT, ERROR = "KILLED", "SURVIVED", "STALE", "SPARED-FAILED", "TIMEOUT", "ERROR"
PYTEST = ("-m", "pytest", "-x", "-q", "-p", "no:cacheprovider")

STOP = threading.Event()  # set on Ctrl-C or SIGTERM: no new mutant starts, running pytests are killed
_live: set[subprocess.Popen] = set()
_live_lock = threading.Lock()


@dataclass(frozen=True)
class Result:
    """One mutant's outcome, as stored in the record (under the mutant's name)."""

    outcome: str
    seconds: float
    commit: str
    dirty: bool  # the copied tree differed from ``commit`` (uncommitted changes in src/, tests/ or pyproject.toml)
    date: str
    detail: str = ""  # the first red test, or why the mutant is stale / errored


def git_state() -> tuple[str, bool]:
    """HEAD's commit and whether the files that the mutants run on differ from it."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    paths = ["src", "tests", "pyproject.toml", f":(exclude){RECORD.relative_to(ROOT)}"]
    status = subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=ROOT, capture_output=True, text=True, check=True)
    return commit, bool(status.stdout.strip())


def tree_files() -> list[Path]:
    """The working tree's files that git tracks or would track (relative paths that exist)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout  # fmt: skip
    return [Path(p) for p in dict.fromkeys(listed.split("\0")) if p and (ROOT / p).is_file()]


class Sandbox:
    """A private copy of the working tree in which mutants are applied, tested and undone."""

    def __init__(self, directory: Path, timeout_s: float) -> None:
        self.root = directory
        self.timeout_s = timeout_s
        self.commit, self.dirty = git_state()
        for relative in tree_files():
            (directory / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / relative, directory / relative)
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(directory / "src"), str(directory)])}
        self.env.pop("PYTEST_ADDOPTS", None)
        where = subprocess.run([sys.executable, "-c", "import nnxtron; print(nnxtron.__file__)"],
                               cwd=directory, env=self.env, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        if not Path(where).resolve().is_relative_to(directory.resolve()):
            raise RuntimeError(f"the copy in {directory} imports nnxtron from {where}, not from the copy")

    def _pytest(self, tests: tuple[str, ...]) -> tuple[str | None, str]:
        """Run ``tests``: "red", "green", STALE (a named test does not exist), TIMEOUT or ERROR, and one
        line of detail (the first red test); None if the run was stopped meanwhile."""
        proc = subprocess.Popen([sys.executable, *PYTEST, *tests], cwd=self.root, env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        with _live_lock:
            _live.add(proc)
        try:
            output, _ = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            proc.communicate()
            return TIMEOUT, f"the tests ran past {self.timeout_s:.0f} s"
        finally:
            with _live_lock:
                _live.discard(proc)
        if STOP.is_set():
            return None, ""
        code = proc.returncode
        if code == 0:
            return "green", ""
        if code == 5 or (code == 4 and "not found:" in output):  # no tests collected / no such test
            return STALE, _line(output, "ERROR") or "no tests collected"
        if code in (1, 2, 4):  # failed, interrupted (an error at collection), conftest import error
            return "red", _line(output, "FAILED", "ERROR") or _line(output)
        return ERROR, f"pytest exit code {code}: {_line(output)}"

    def _write(self, path: Path, text: str) -> None:
        """Write a source file and drop its bytecode, so that no stale ``.pyc`` is imported."""
        path.write_text(text)
        for cached in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
            cached.unlink()

    def run(self, mutation: Mutation) -> Result | None:
        """Apply ``mutation``, run its tests, undo it; None if the run was stopped meanwhile."""
        start = time.monotonic()
        path = self.root / PACKAGE / mutation.file
        original = path.read_text() if path.is_file() else ""
        missing = [t for t in (*mutation.tests, *mutation.spared) if not (self.root / t.split("::")[0]).is_file()]
        count = original.count(mutation.old)
        if count != 1 or missing:
            detail = f"snippet found {count} times in {mutation.file}" if count != 1 else f"no test file {missing[0]}"
            return self._result(STALE, start, detail)
        self._write(path, original.replace(mutation.old, mutation.new))
        try:
            outcome, detail = self._judge(mutation)
        finally:
            self._write(path, original)
        return None if outcome is None else self._result(outcome, start, detail)

    def _judge(self, mutation: Mutation) -> tuple[str | None, str]:
        """The outcome of the applied mutant and its detail; None if the run was stopped."""
        verdict, detail = self._pytest(mutation.tests)
        if verdict in (STALE, TIMEOUT, ERROR, None):
            return verdict, detail
        if verdict == "green":
            return SURVIVED, ""
        if not mutation.spared:
            return KILLED, detail
        spared, spared_detail = self._pytest(mutation.spared)
        if spared in (STALE, TIMEOUT, ERROR, None):
            return spared, f"spared tests: {spared_detail}"
        return (KILLED, detail) if spared == "green" else (SPARED_FAILED, f"spared test also red: {spared_detail}")

    def _result(self, outcome: str, start: float, detail: str) -> Result:
        date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        return Result(outcome, round(time.monotonic() - start, 1), self.commit, self.dirty, date, detail[:300])


def _line(output: str, *prefixes: str) -> str:
    """The first line of pytest's output that starts with one of ``prefixes``; its last line if none are given."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if not prefixes:
        return lines[-1] if lines else ""
    return next((line for line in lines if line.startswith(prefixes)), "")


def _kill(proc: subprocess.Popen) -> None:
    """Kill a pytest run and everything it started (its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_all(*_: object) -> None:
    """Start no new mutant and kill the running pytests (the handler of SIGINT and SIGTERM)."""
    STOP.set()
    with _live_lock:
        for proc in list(_live):
            _kill(proc)


def load_record(path: Path) -> dict[str, dict]:
    return json.loads(path.read_text()) if path.is_file() else {}


def save_result(path: Path, name: str, result: Result) -> None:
    """Put ``result`` in the record at ``path`` (one line per mutant, sorted by name), atomically and
    under a lock on the record's directory, which other runs sharing the record (shards) take too."""
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(directory, fcntl.LOCK_EX)
        record = load_record(path)
        record[name] = asdict(result)
        lines = [f"  {json.dumps(key)}: {json.dumps(record[key])}" for key in sorted(record)]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("{\n" + ",\n".join(lines) + "\n}\n")
        os.replace(tmp, path)
    finally:
        os.close(directory)  # releases the lock


def run_mutants(mutations: list[Mutation], jobs: int = 1, record: Path = RECORD, timeout_s: float = 3600) -> dict[str, Result]:
    """Run ``mutations`` on ``jobs`` workers (a private copy each); each result goes to ``record`` as it comes."""
    todo: queue.Queue[Mutation] = queue.Queue()
    for mutation in mutations:
        todo.put(mutation)
    results: dict[str, Result] = {}
    lock = threading.Lock()
    failures: list[BaseException] = []

    def worker() -> None:
        try:
            with tempfile.TemporaryDirectory(prefix="nnxtron-mutate-") as directory:
                sandbox = Sandbox(Path(directory), timeout_s)
                while not STOP.is_set():
                    try:
                        mutation = todo.get_nowait()
                    except queue.Empty:
                        return
                    result = sandbox.run(mutation)
                    if result is None:
                        return
                    with lock:
                        results[mutation.name] = result
                        save_result(record, mutation.name, result)
                        print(f"{result.outcome:<13} {result.seconds:7.1f} s  {mutation.name}  {result.detail}", flush=True)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            failures.append(err)
            stop_all()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(jobs, len(mutations)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(0.5)  # wake up regularly so that Ctrl-C is handled
    if failures:
        raise failures[0]
    return results


def shard(mutations: list[Mutation], spec: str) -> list[Mutation]:
    """Mutants ``i, i+n, i+2n, …`` (1-based) of ``mutations`` for ``spec`` = ``"i/n"``."""
    index, count = (int(part) for part in spec.split("/"))
    if not 1 <= index <= count:
        raise ValueError(f"--shard {spec}: want i/n with 1 <= i <= n")
    return mutations[index - 1 :: count]


def report(record: dict[str, dict], commit: str) -> int:
    """Print the score of ``commit`` from the record; 0 if every mutant was KILLED on that commit."""
    here = {m.name: record[m.name] for m in MUTATIONS if m.name in record and record[m.name]["commit"] == commit}
    not_here = [m.name for m in MUTATIONS if m.name not in here]
    killed = [name for name, entry in here.items() if entry["outcome"] == KILLED]
    dirty = sum(entry["dirty"] for entry in here.values())
    print(f"mutation score on {commit[:12]}: {len(killed)}/{len(MUTATIONS)} killed "
          f"({len(here)} run on this commit, {dirty} of them with uncommitted changes; {len(not_here)} not run on it)")  # fmt: skip
    for outcome in (SURVIVED, SPARED_FAILED, STALE, TIMEOUT, ERROR):
        names = [
            f"{name} ({entry['detail']})" if entry["detail"] else name
            for name, entry in here.items()
            if entry["outcome"] == outcome
        ]
        if names:
            print(f"{outcome} ({len(names)}):\n  " + "\n  ".join(names))
    if not_here:
        older = {name: record[name] for name in not_here if name in record}
        elsewhere = sum(entry["outcome"] == KILLED for entry in older.values())
        print(f"not run on {commit[:12]} ({len(not_here)}; {len(older)} have a result on another commit, {elsewhere} KILLED):")
        listed = [
            f"{name} ({older[name]['outcome']} on {older[name]['commit'][:12]})" if name in older else name for name in not_here
        ]
        print(textwrap.fill(", ".join(listed), width=120, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False))
    unknown = sorted(set(record) - {m.name for m in MUTATIONS})
    if unknown:
        print(f"in the record but no longer defined: {', '.join(unknown)}")
    return 0 if len(killed) == len(MUTATIONS) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help="mutants to run (default: all)")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="parallel workers, each with its own copy (default 1)")
    parser.add_argument("--shard", metavar="I/N", help="run only the I-th of N interleaved slices of the (chosen) mutants")
    parser.add_argument("--report", action="store_true", help="print the score of the current commit from the record")
    parser.add_argument("--record", type=Path, default=RECORD, help=f"results file (default {RECORD.relative_to(ROOT)})")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one mutant's tests may run (default 3600)")
    args = parser.parse_args(argv)
    if args.report:
        return report(load_record(args.record), git_state()[0])
    unknown = sorted(set(args.names) - {m.name for m in MUTATIONS})
    if unknown:
        parser.error(f"no mutant named {', '.join(unknown)}")
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    if args.shard:
        chosen = shard(chosen, args.shard)
    signal.signal(signal.SIGINT, stop_all)
    signal.signal(signal.SIGTERM, stop_all)
    results = run_mutants(chosen, args.jobs, args.record, args.timeout)
    if STOP.is_set():
        print(f"stopped: {len(results)} of {len(chosen)} mutants ran (recorded in {args.record})")
        return 130
    killed = [name for name, result in results.items() if result.outcome == KILLED]
    failed = {name: result.outcome for name, result in results.items() if result.outcome != KILLED}
    print(f"mutation score: {len(killed)}/{len(chosen)} killed" + "".join(f"; {o} {n}" for n, o in failed.items()))
    return 0 if len(killed) == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
