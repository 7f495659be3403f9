"""A family lives in one place (docs/architecture.md, "Adding a family"), and every module is on the map.

Read with ``ast``, no import of the package (no JAX):

* outside a family's own modules (``models/<family>.py`` or ``models/<family>/`` from the registry's
  module tuple, and ``config/<family>.py``) and the ``ALLOWED`` files, no source file names a
  ``decoder_block`` value in a comparison (``==``, ``!=``, ``in``, ``not in``, either side, also inside
  a tuple / list / set operand), as a dict key, in a ``match`` case or in a tuple / list / set (a list
  of families kept aside to compare against later): what differs per family is data
  on its ``Family`` record (``models/family.py``) or its ``FamilyRules`` row (``config/families.py``);
* every module under ``src/nnxtron`` is listed in docs/architecture.md (``__init__.py`` files that hold
  more than a docstring too), and every module the page lists exists.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "nnxtron"
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"
# the files outside a family that adding one touches (besides new presets): its name, its config rules, its module
ALLOWED = ("config/options.py", "config/families.py", "models/registry.py")


def _assigned(path: Path, name: str) -> ast.expr:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
                return node.value
    raise AssertionError(f"{path} assigns no {name}")


def decoder_blocks() -> tuple[str, ...]:
    return ast.literal_eval(_assigned(PACKAGE / "config" / "options.py", "DECODER_BLOCKS"))


def family_modules() -> tuple[str, ...]:
    """The family modules of ``models/registry.py``'s ``_MODULES`` (names, e.g. ``llama``)."""
    value = _assigned(PACKAGE / "models" / "registry.py", "_MODULES")
    assert isinstance(value, ast.Tuple) and all(isinstance(e, ast.Name) for e in value.elts)
    return tuple(e.id for e in value.elts)  # type: ignore[attr-defined]


def is_family_own(relative: str, modules: tuple[str, ...]) -> bool:
    """``relative`` (to src/nnxtron) is one of a family's own files."""
    for name in modules:
        if relative in (f"models/{name}.py", f"config/{name}.py") or relative.startswith(f"models/{name}/"):
            return True
    return False


def _strings(node: ast.expr) -> Iterator[ast.Constant]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for element in node.elts:
            yield from _strings(element)


def block_names_branched_on(source: str, blocks: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, name) of each decoder_block value compared against, used as a dict key, matched or listed."""
    found = []
    for node in ast.walk(ast.parse(source)):
        candidates: list[ast.expr] = []
        if isinstance(node, ast.Compare):
            candidates = [node.left, *node.comparators]
        elif isinstance(node, ast.Dict):
            candidates = [k for k in node.keys if k is not None]
        elif isinstance(node, ast.MatchValue):
            candidates = [node.value]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):  # a list of families kept aside: FOLDED = ("llama2", ...)
            candidates = [e for e in node.elts if isinstance(e, ast.Constant)]
        for candidate in candidates:
            found += [(c.lineno, c.value) for c in _strings(candidate) if c.value in blocks]
    return found


def family_branches(package: Path | None = None) -> list[str]:
    package = package or PACKAGE
    blocks, modules = decoder_blocks(), family_modules()
    bad = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if relative in ALLOWED or is_family_own(relative, modules):
            continue
        bad += [f"{relative}:{line}: {name!r}" for line, name in sorted(set(block_names_branched_on(path.read_text(), blocks)))]
    return bad


def test_allowed_list_is_small() -> None:
    assert len(ALLOWED) <= 3 and all((PACKAGE / f).is_file() for f in ALLOWED)


def test_no_module_outside_a_family_branches_on_a_decoder_block() -> None:
    bad = family_branches()
    assert not bad, (
        "family knowledge outside its family (put it on its Family record, models/family.py, or its "
        "FamilyRules row, config/families.py):\n  " + "\n  ".join(bad)
    )


def test_the_check_sees_comparisons_dict_keys_and_cases() -> None:
    source = """
if cfg.decoder_block == "llama2": pass
if block in ("mistral", "x"): pass
if "gemma3" != b: pass
table = {"gpt3": 1, "other": 2}
match b:
    case "qwen3": pass
FOLDED = ("mixtral",)
name = "deepseek"  # a plain value is not a branch
call(decoder_block="llama4")
"""
    found = sorted(block_names_branched_on(source, decoder_blocks()))
    assert sorted(set(found)) == [(2, "llama2"), (3, "mistral"), (4, "gemma3"), (5, "gpt3"), (7, "qwen3"), (8, "mixtral")]


def test_every_family_module_is_registered() -> None:
    """Each ``models/<name>`` that defines ``FAMILIES`` is in the registry's tuple (else it would be exempt unseen)."""
    modules = set(family_modules())
    defining = set()
    for path in (PACKAGE / "models").iterdir():
        init = path / "__init__.py" if path.is_dir() else path
        if init.suffix == ".py" and init.is_file() and re.search(r"^FAMILIES\s*=", init.read_text(), re.M):
            defining.add(path.stem if path.is_file() else path.name)
    assert defining == modules, f"family modules {sorted(defining)}, registered {sorted(modules)}"


def _has_code(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in body)


def documented_modules(text: str) -> set[str]:
    """Module paths (relative to src/nnxtron) the page names in backticks: ``config/families.py``."""
    return set(re.findall(r"`((?:[a-z_0-9]+/)*[a-z_0-9]+\.py)`", text))


def test_every_module_is_listed_in_the_architecture_doc() -> None:
    listed = documented_modules(ARCHITECTURE_DOC.read_text().split("\n## Every module\n", 1)[1])  # not the worked example's
    modules = {
        path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py") if path.name != "__init__.py" or _has_code(path)
    }
    missing = sorted(modules - listed)
    assert not missing, f"docs/architecture.md does not list (one line each, path in backticks): {missing}"
    every = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")}
    stale = sorted(m for m in listed if m not in every and "/" in m and m.split("/")[0] in _packages())
    assert not stale, f"docs/architecture.md lists modules that do not exist: {stale}"


def _packages() -> set[str]:
    return {path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").is_file()}
