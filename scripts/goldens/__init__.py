"""HF golden cases for ``scripts/make_goldens.py``, one module per family; shared code in ``goldens.harness``.

Each family module defines ``CASES: tuple[Case, ...]`` (its configs, init tweaks and checks). To add a family,
write ``goldens/<family>.py`` and add its name to ``FAMILIES``; cases are generated in this order.
"""

from __future__ import annotations

import importlib

from goldens.harness import Case

FAMILIES = ("llama", "mixtral_qwen3", "deepseek3", "deepseek3_mtp", "gemma3", "llama4", "deepseek4", "gpt2")


def _registry() -> dict[str, Case]:
    cases: dict[str, Case] = {}
    for family in FAMILIES:
        for case in importlib.import_module(f"goldens.{family}").CASES:
            assert case.name not in cases, f"duplicate golden case {case.name!r}"
            cases[case.name] = case
    return cases


CASES: dict[str, Case] = _registry()
