"""Read-site coverage of the flag-sensitivity matrix (issue 54): every place in ``src/nnxtron``
that reads a config key (``nnxtron config readers``) runs in a case of the matrix that changes
that key and sees its observation change — or is listed in :data:`NOT_PROVEN` with its reason.

Each case of ``tests/unit/test_flag_sensitivity.py`` records which read sites of its own key
ran while its variant was observed (:class:`Recorder`: the attribute reads of ``Config`` and
of the carrier classes, by the line they are made on). The case
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
from collections import defaultdict
from pathlib import Path
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


@functools.cache
def _read_classes() -> tuple[type, ...]:
    """The classes whose attribute reads are read sites: ``Config`` and the carriers of
    ``nnxtron.tools.read_carriers.CARRIERS`` (each imported from the module that defines it)."""
    import importlib
    import re

    from nnxtron.config.schema import Config
    from nnxtron.tools.read_carriers import CARRIERS
    from nnxtron.tools.read_sites import package_sources

    found = {}
    for file, text in package_sources().items():
        for name in re.findall(r"^class (\w+)\b", text, flags=re.MULTILINE):
            if name in CARRIERS:
                module = file.removeprefix("src/").removesuffix(".py").replace("/", ".").removesuffix(".__init__")
                found[name] = getattr(importlib.import_module(module), name)
    missing = set(CARRIERS) - set(found)
    assert not missing, f"read_carriers.CARRIERS names classes the package does not define: {sorted(missing)}"
    return (Config, *found.values())


class Recorder:
    """``with Recorder(key):`` records the ids of ``key``'s read sites whose line reads an
    attribute of a ``Config`` or of a carrier class inside the block, in any thread (``hit``).

    The classes' ``__getattribute__`` is wrapped for the block: each attribute read looks up
    its caller's file and line among the key's sites. (A line tracer would see the same lines,
    at the price of a Python call on every function call JAX's tracing makes: twice the
    matrix's time.)"""

    def __init__(self, key: str):
        self.lines = sites_by_key().get(key, {})
        self.hit: set[str] = set()
        self.traced = os.environ.get(ENV) != OFF
        self.active = False
        self._saved: list[tuple[type, Any]] = []

    def _wrap(self, cls: type) -> Any:
        read = cls.__getattribute__
        lines = self.lines
        hit = self.hit
        getframe = sys._getframe

        def __getattribute__(obj, name):
            frame = getframe(1)
            file_lines = lines.get(frame.f_code.co_filename)
            if file_lines is not None:
                ids = file_lines.get(frame.f_lineno)
                if ids:
                    hit.update(ids)
            return read(obj, name)

        return __getattribute__

    def __enter__(self) -> Recorder:
        self.active = self.traced and bool(self.lines)
        if self.active:
            for cls in _read_classes():
                self._saved.append((cls, cls.__dict__.get("__getattribute__")))
                cls.__getattribute__ = self._wrap(cls)
        return self

    def __exit__(self, *exc) -> None:
        for cls, own in reversed(self._saved):
            if own is None:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = own
        self._saved.clear()


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
