"""Where the test suite's time goes: per-file totals from a pytest JUnit XML report.

Run the suite with ``--junitxml=FILE`` (the CI command plus that flag), then::

    .venv/bin/python scripts/suite_durations.py FILE [--top 30]

prints each test file's summed test time (setup + call + teardown, as JUnit records it; with
``pytest -n 2`` the wall time is about half the sum), its share and its number of tests,
slowest first. README.md's "Tests" section quotes it.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def file_totals(report: Path) -> dict[str, tuple[float, int]]:
    """Test file -> (seconds, tests) from a JUnit XML ``report``."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for case in ET.parse(report).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        module = [part for part in parts if not part[:1].isupper()]  # without a test class's name
        name = "/".join(module) + ".py"
        totals[name][0] += float(case.get("time", 0.0))
        totals[name][1] += 1
    return {name: (seconds, int(count)) for name, (seconds, count) in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="pytest --junitxml output")
    parser.add_argument("--top", type=int, default=30, help="files to list (default 30)")
    args = parser.parse_args()
    totals = file_totals(args.report)
    whole = sum(seconds for seconds, _ in totals.values())
    tests = sum(count for _, count in totals.values())
    print(f"{tests} tests, {whole:.0f} s of test time ({whole / 60:.1f} min; wall with -n 2: about half)")
    print(f"{'seconds':>8} {'share':>6} {'tests':>6}  file")
    for name, (seconds, count) in sorted(totals.items(), key=lambda item: -item[1][0])[: args.top]:
        print(f"{seconds:8.1f} {seconds / whole:6.1%} {count:6d}  {name}")


if __name__ == "__main__":
    main()
