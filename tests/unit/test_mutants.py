"""The mutants of ``tests/mutation/mutants.py`` still apply: a snippet that no longer occurs (code moved on) makes
``scripts/mutate.py`` report an error instead of a kill, and the break it stood for goes unchecked."""

from __future__ import annotations

from pathlib import Path

from tests.mutation.mutants import MUTATIONS

SRC = Path(__file__).resolve().parents[2] / "src" / "nnxtron"
ROOT = SRC.parents[1]


def test_every_mutant_snippet_occurs_once_and_names_test_files_that_exist():
    stale = [f"{m.name}: found {(SRC / m.file).read_text().count(m.old)} times in {m.file}" for m in MUTATIONS
             if (SRC / m.file).read_text().count(m.old) != 1]  # fmt: skip
    missing = [f"{m.name}: {test}" for m in MUTATIONS for test in m.tests if not (ROOT / test.split("::")[0]).is_file()]
    names = [m.name for m in MUTATIONS]
    assert not stale and not missing and len(names) == len(set(names)), (stale, missing)
