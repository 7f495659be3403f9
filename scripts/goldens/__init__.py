"""HF golden cases for ``scripts/make_goldens.py`` and ``make_generate_goldens.py``; shared code in ``goldens.harness``.

Which cases exist is the family registry's (``nnxtron.models.registry``): each family's record declares
its goldens (``goldens=(Golden(name, generator), ...)``, ``nnxtron/models/family.py``) and the module
``goldens/<generator>.py`` defines the ``Case`` of that name in its ``CASES`` (HF classes and config,
init tweaks, checks, near-tie refusals). Cases are generated in the registry's order. To add a family,
write ``goldens/<module>.py`` and declare its cases in the family's own module: nothing here lists families.
"""

from __future__ import annotations

import importlib

from goldens.harness import Case
from nnxtron.models.registry import FAMILIES


def _registry() -> dict[str, Case]:
    """The declared cases, in the registry's order; every case of a generator module must be declared."""
    cases: dict[str, Case] = {}
    declared: dict[str, set[str]] = {}
    for family in FAMILIES.values():
        for golden in family.goldens:
            defined = {case.name: case for case in importlib.import_module(f"goldens.{golden.generator}").CASES}
            assert golden.name in defined, f"{family.name}: goldens/{golden.generator}.py defines no case {golden.name!r}"
            assert golden.name not in cases, f"duplicate golden case {golden.name!r}"
            cases[golden.name] = defined[golden.name]
            declared.setdefault(golden.generator, set()).add(golden.name)
    for generator, names in declared.items():
        undeclared = sorted({case.name for case in importlib.import_module(f"goldens.{generator}").CASES} - names)
        assert not undeclared, f"goldens/{generator}.py: no family declares the cases {undeclared} (Family.goldens)"
    return cases


CASES: dict[str, Case] = _registry()
