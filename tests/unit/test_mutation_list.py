"""Every mutant of tests/mutation/run.py still applies (its snippet occurs exactly once),
so a refactor cannot silently turn the mutation check into a no-op."""

import pytest

from tests.mutation.run import MUTATIONS, ROOT, SRC


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_mutant_snippet_present_once(mutation):
    assert (SRC / mutation.file).read_text().count(mutation.old) == 1
    for test in mutation.tests:
        assert (ROOT / test.split("::")[0]).is_file(), test
