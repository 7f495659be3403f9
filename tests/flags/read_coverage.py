"""Read-site coverage of the flag-sensitivity matrix (issue 54): every place in ``src/nnxtron``
that reads a config key (``nnxtron config readers``) runs in a case of the matrix that changes
that key and sees its observation change — or is listed in :data:`NOT_PROVEN` with its reason.

Each case of ``tests/unit/test_flag_sensitivity.py`` records which read sites of its own key
ran while its variant was observed (:class:`Recorder`: a line tracer confined to the code
objects that hold such a site, in the test's thread and the threads it starts). The case
itself asserts the observation changed. When the whole matrix has run (every case recorded,
across xdist workers), :func:`finish` fails the session on a site that no case ran and no
listing names, and on a listing that names no site (printed after the summary).

The listings (``tests/flags/read_sites_not_proven.py``) are ``(file, function, key)``
(``"*"``: every key read there) -> why no case shows the read: a validation that refuses other
values, a conversion, a report, a message — or the backlog of reads still to be given a case.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import threading
from collections import defaultdict
from pathlib import Path
from types import CodeType
from typing import Any

from tests.flags.read_sites_not_proven import NOT_PROVEN

ENV = "NNXTRON_READ_COVERAGE_DIR"  # the directory the cases of this session write to (set by the controller)
OFF = "off"  # NNXTRON_READ_COVERAGE_DIR=off: no tracing, no verdict (to time the matrix without it)
ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _sites() -> tuple:
    """The package's read sites of named keys (``nnxtron config readers``)."""
    from nnxtron.tools.read_sites import read_sites

    return tuple(s for s in read_sites() if s.key != "*")


@functools.cache
def sites_by_key() -> dict[str, dict[str, dict[int, set[str]]]]:
    """key -> absolute file -> line -> the ids of that key's read sites on the line."""
    table: dict[str, dict[str, dict[int, set[str]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(set)))
    for site in _sites():
        table[site.key][str(ROOT / site.file)][site.line].add(site.id)
    return table


def clear_package_caches() -> None:
    """Empty the package's ``functools`` caches (``pipeline_spec``, ``built_stacks``, the
    optimizer's masks ...): a config another case already loaded would otherwise skip the
    cached functions' reads, and what a case records would depend on the order of the tests."""
    for name, module in list(sys.modules.items()):
        if name == "nnxtron" or name.startswith("nnxtron."):
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)) and getattr(value, "__module__", None) == name:
                    value.cache_clear()


class Recorder:
    """``with Recorder(key):`` records the ids of ``key``'s read sites whose line runs inside
    the block (``hit``); nothing is recorded where another tracer (a debugger, coverage.py) is
    already installed (``traced`` False)."""

    def __init__(self, key: str):
        self.lines = sites_by_key().get(key, {})
        self.hit: set[str] = set()
        self.traced = sys.gettrace() is None and os.environ.get(ENV) != OFF
        self.active = False
        self._spans: dict[CodeType, bool] = {}

    def _global(self, frame, event, arg):
        code = frame.f_code
        lines = self.lines.get(code.co_filename)
        if lines is None:
            return None
        spans = self._spans.get(code)
        if spans is None:
            spans = self._spans[code] = any(line in lines for _, _, line in code.co_lines())
        return self._local if spans else None

    def _local(self, frame, event, arg):
        if event == "line":
            ids = self.lines[frame.f_code.co_filename].get(frame.f_lineno)
            if ids:
                self.hit |= ids
        return self._local

    def __enter__(self) -> Recorder:
        self.active = self.traced and bool(self.lines)
        if self.active:
            threading.settrace(self._global)
            sys.settrace(self._global)
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            sys.settrace(None)
            threading.settrace(None)  # type: ignore[arg-type]


def save(case: str, key: str, hit: set[str], cases: int, traced: bool) -> None:
    """Append one case's record (this process's file in the session's directory)."""
    directory = os.environ.get(ENV)
    if not directory or directory == OFF:
        return
    record = {"case": case, "key": key, "hit": sorted(hit), "cases": cases, "traced": traced}
    with open(Path(directory) / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl", "a") as out:
        out.write(json.dumps(record) + "\n")


def load(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(directory.glob("*.jsonl")) for line in path.read_text().splitlines()]


def listing(site) -> str | None:
    """The reason :data:`NOT_PROVEN` gives for ``site``, or None."""
    for key in ((site.file, site.function, site.key), (site.file, site.function, "*")):
        if key in NOT_PROVEN:
            return NOT_PROVEN[key]
    return None


def report(records: list[dict[str, Any]]) -> list[str]:
    """The problems: read sites no case ran and no listing names, listings that name no site."""
    hit = {site for record in records for site in record["hit"]}
    sites = _sites()
    problems = [
        f"{s.id} ({s.function}: {s.expr}): no case of the flag-sensitivity matrix for {s.key} runs this read; add a case "
        "(tests/unit/test_flag_sensitivity.py MORE) whose observation changes with it, or list it in "
        "tests/flags/read_sites_not_proven.py with its reason"
        for s in sites
        if s.id not in hit and listing(s) is None
    ]
    named = {(s.file, s.function, s.key) for s in sites} | {(s.file, s.function, "*") for s in sites}
    problems += [f"NOT_PROVEN names {entry}, which is no read site now: drop it" for entry in sorted(set(NOT_PROVEN) - named)]
    return problems


def configure(config) -> None:
    """In the controller (or a run without xdist): a fresh directory for this session's records."""
    if hasattr(config, "workerinput") or os.environ.get(ENV):
        return
    import tempfile

    os.environ[ENV] = tempfile.mkdtemp(prefix="nnxtron-read-coverage-")


def finish(session) -> None:
    """In the controller: when every case of the matrix ran, traced, fail the session on
    :func:`report`'s problems (printed)."""
    if hasattr(session.config, "workerinput") or os.environ.get(ENV, OFF) == OFF:
        return
    directory = Path(os.environ[ENV])
    records = load(directory)
    shutil.rmtree(directory, ignore_errors=True)  # the controller made it (configure); nothing reads it later
    if not records or len({r["case"] for r in records}) != records[0]["cases"] or not all(r["traced"] for r in records):
        return  # a part of the matrix ran (or under another tracer): nothing to judge
    problems = report(records)
    if problems:
        writer = session.config.get_terminal_writer()
        writer.line(f"\nread-site coverage (tests/flags/read_coverage.py): {len(problems)} unproven", red=True)
        for problem in problems:
            writer.line(problem)
        session.exitstatus = 1
