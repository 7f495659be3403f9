"""A family lives in one place (docs/architecture.md, "Adding a family"), and every module is on the map.

Read with ``ast``, no import of the package (no JAX):

* outside a family's own modules (``models/<family>.py`` or ``models/<family>/`` from the registry's
  module tuple, and ``config/<family>.py``) and the ``ALLOWED`` files, no source file names a
  ``decoder_block`` value in a comparison (``==``, ``!=``, ``in``, ``not in``, either side, also inside
  a tuple / list / set operand), as a dict key, in a ``match`` case or in a tuple / list / set (a list
  of families kept aside to compare against later): what differs per family is data
  on its ``Family`` record (``models/family.py``) or its ``FamilyRules`` row (``config/families.py``);
* what checks a family is declared by the family too (``Golden`` and ``StrategyRow`` records in its
  module): each declared golden is a ``Case`` of its generator module ``scripts/goldens/<generator>.py``
  and has its stored files, each generator's cases are all declared, and each row's preset exists;
* the golden generators (``scripts/make_goldens.py``, ``scripts/make_generate_goldens.py`` and the
  shared modules of ``scripts/goldens/``) and the test tables (``tests/parity/test_hf_golden.py``,
  ``tests/parity/test_matrix.py``, their module-level statements) list no family, no golden, no
  generator module and no row preset, and import no generator module: they iterate over the registry;
* so adding a family touches at most the ``ALLOWED`` files outside its own (its modules, its golden
  generator modules, its new presets and golden files): for every family, the files outside its own
  that list it are a subset of ``ALLOWED``;
* every module under ``src/nnxtron`` is listed in docs/architecture.md (``__init__.py`` files that hold
  more than a docstring too), and every module the page lists exists.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "nnxtron"
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"
# the files outside a family that adding one touches (besides new presets): its name, its config rules, its module
ALLOWED = ("config/options.py", "config/families.py", "models/registry.py")
GOLDEN_SCRIPTS = ROOT / "scripts" / "goldens"
GOLDEN_ASSETS = ROOT / "tests" / "assets" / "golden"
# the golden generators' entry points and the test tables that cover every family (module level)
GENERATOR_SCRIPTS = ("scripts/make_goldens.py", "scripts/make_generate_goldens.py")
TEST_TABLES = ("tests/parity/test_hf_golden.py", "tests/parity/test_matrix.py")


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


def _listed(trees: Iterable[ast.AST], names: Iterable[str]) -> list[tuple[int, str]]:
    """(line, name) of each of ``names`` compared against, used as a dict key, matched or listed in ``trees``."""
    names, found = set(names), []
    for node in (node for tree in trees for node in ast.walk(tree)):
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
            found += [(c.lineno, c.value) for c in _strings(candidate) if c.value in names]
    return found


def block_names_branched_on(source: str, blocks: Iterable[str]) -> list[tuple[int, str]]:
    """(line, name) of each decoder_block value compared against, used as a dict key, matched or listed."""
    return _listed([ast.parse(source)], blocks)


def module_level(source: str) -> list[ast.stmt]:
    """The statements of a module outside its functions and classes (where a test keeps its tables)."""
    return [n for n in ast.parse(source).body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


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


@dataclass(frozen=True)
class Declared:
    """A family record as its module writes it: its name, its goldens ``(name, generator)`` and row presets."""

    name: str
    goldens: tuple[tuple[str, str], ...]
    row_models: tuple[str, ...]


def _call_name(node: ast.AST) -> str:
    return node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else ""


def _arguments(call: ast.Call, fields: tuple[str, ...]) -> dict[str, object]:
    """The literal arguments of ``call`` by field name (positional ones in ``fields`` order)."""
    values = {field: arg for field, arg in zip(fields, call.args, strict=False)}
    values.update({k.arg: k.value for k in call.keywords if k.arg})
    return {k: v.value if isinstance(v, ast.Constant) else v for k, v in values.items() if k in fields}


def _module_files(module: str) -> list[Path]:
    path = PACKAGE / "models" / f"{module}.py"
    return [path] if path.is_file() else sorted((PACKAGE / "models" / module).rglob("*.py"))


def declared_families() -> dict[str, Declared]:
    """Every ``Family(...)`` / ``pre_norm_family(...)`` call of the registered family modules, by name."""
    found: dict[str, Declared] = {}
    for module in family_modules():
        for path in _module_files(module):
            for call in ast.walk(ast.parse(path.read_text())):
                if _call_name(call) not in ("Family", "pre_norm_family"):
                    continue
                name = _arguments(call, ("name",))["name"]  # type: ignore[arg-type]
                inner = [n for n in ast.walk(call) if isinstance(n, ast.Call)]
                goldens = [_arguments(n, ("name", "generator")) for n in inner if _call_name(n) == "Golden"]
                rows = [_arguments(n, ("model",)) for n in inner if _call_name(n) == "StrategyRow"]
                pairs = tuple((g["name"], g["generator"]) for g in goldens)
                models = tuple(r["model"] for r in rows)
                assert all(isinstance(v, str) for v in (name, *sum(pairs, ()), *models)), f"{path}: write them as literals"
                found[name] = Declared(name, pairs, models)  # type: ignore[arg-type]
    return found


def generator_cases(generator: str) -> list[str]:
    """The names of the ``Case(...)`` records in ``scripts/goldens/<generator>.py``'s ``CASES``."""
    value = _assigned(GOLDEN_SCRIPTS / f"{generator}.py", "CASES")
    return [_arguments(n, ("name",))["name"] for n in ast.walk(value) if _call_name(n) == "Case"]  # type: ignore[misc]


def shared_golden_scripts(generators: Iterable[str]) -> list[str]:
    """The golden scripts that serve every family: the entry points and the non-generator modules of ``goldens/``."""
    modules = sorted(p.relative_to(ROOT).as_posix() for p in GOLDEN_SCRIPTS.glob("*.py") if p.stem not in set(generators))
    return [*GENERATOR_SCRIPTS, *modules]


def generator_imports(source: str, generators: Iterable[str]) -> list[tuple[int, str]]:
    """(line, module) of each import of a generator module (``goldens.<generator>``)."""
    wanted = {f"goldens.{g}" for g in generators}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            modules = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, m) for m in modules if m in wanted]
    return found


def listed_in_shared_files(names: Iterable[str], generators: Iterable[str]) -> dict[str, set[str]]:
    """Which of ``names`` (and of the generator modules, imported) each golden script serving every family
    and each test table (module level) lists: {file: names}, files that list none left out."""
    names, generators, found = set(names), set(generators), {}
    for relative in [*shared_golden_scripts(generators), *TEST_TABLES]:
        source = (ROOT / relative).read_text()
        trees = module_level(source) if relative in TEST_TABLES else [ast.parse(source)]
        hits = {name for _, name in _listed(trees, names)}
        hits |= {module.split(".")[1] for _, module in generator_imports(source, generators)}
        if hits:
            found[relative] = hits
    return found


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


def test_goldens_and_matrix_rows_are_declared_by_their_family() -> None:
    """Each declared golden is a case of its generator module and has its files; every case of a generator
    module is declared once; every generator module is some family's; each row's preset exists."""
    families = declared_families()
    assert set(families) == set(decoder_blocks()), f"family records {sorted(families)}, decoder blocks {sorted(decoder_blocks())}"
    goldens = [golden for family in families.values() for golden in family.goldens]
    names = [name for name, _ in goldens]
    assert len(names) == len(set(names)), f"a golden declared twice: {names}"
    for generator in sorted({g for _, g in goldens}):
        declared = sorted(name for name, g in goldens if g == generator)
        assert sorted(generator_cases(generator)) == declared, f"scripts/goldens/{generator}.py's CASES vs declared {declared}"
    shared = {"__init__", "harness", "adversarial"}
    modules, generators = {p.stem for p in GOLDEN_SCRIPTS.glob("*.py")} - shared, {g for _, g in goldens}
    assert modules == generators, f"generator modules no family declares: {sorted(modules - generators)}"
    for name in names:
        for directory in (GOLDEN_ASSETS / name, GOLDEN_ASSETS / "adversarial" / name):
            assert (directory / "config.json").is_file() and (directory / "golden.safetensors").is_file(), directory
    for model in (m for family in families.values() for m in family.row_models):
        assert (PACKAGE / "config" / "presets" / f"{model}.yml").is_file(), model


def test_no_golden_generator_or_test_table_lists_a_family() -> None:
    """The generators and the tables iterate over the registry's declarations (``Family.goldens``,
    ``Family.strategy_rows``): they name no decoder block, golden, generator module or row preset."""
    families = declared_families()
    generators = {g for family in families.values() for _, g in family.goldens}
    names = set(families) | generators
    names |= {n for family in families.values() for n, _ in family.goldens} | {m for f in families.values() for m in f.row_models}
    bad = listed_in_shared_files(names, generators)
    assert not bad, f"per-family tables outside the families (declare them in the family's module): {bad}"


def test_adding_a_family_touches_at_most_three_files_outside_it() -> None:
    """For every family, the files outside its own modules that list it — its decoder block in src/nnxtron;
    its decoder block, goldens, generator modules or row presets in the golden scripts serving every family
    and the test tables — plus the registry that imports its module are ``ALLOWED`` ones: what adding a
    family edits besides the new files it brings (its modules, golden generator module, presets, goldens)."""
    families = declared_families()
    generators = {g for family in families.values() for _, g in family.goldens}
    modules = family_modules()
    in_package: dict[str, set[str]] = {}  # decoder block -> the package files listing it
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if not is_family_own(relative, modules):
            for _, block in block_names_branched_on(path.read_text(), families):
                in_package.setdefault(block, set()).add(relative)
    own_names = {
        f.name: {f.name, *(g for _, g in f.goldens), *(n for n, _ in f.goldens), *f.row_models} for f in families.values()
    }
    shared = listed_in_shared_files(set().union(*own_names.values()), generators)
    touched: dict[str, set[str]] = {}
    for name, names in own_names.items():
        touched[name] = {"models/registry.py"} | in_package.get(name, set())  # the registry imports its module
        touched[name] |= {path for path, listed in shared.items() if listed & names}
    over = {name: sorted(files - set(ALLOWED)) for name, files in touched.items() if not files <= set(ALLOWED)}
    assert not over, f"files outside a family that list it, beyond {ALLOWED}: {over}"
    assert touched["llama2"] == {"config/options.py", "config/families.py", "models/registry.py"}  # the check sees them
    assert touched["qwen3"] == {"config/options.py", "models/registry.py"}  # no FamilyRules row


def test_the_check_sees_golden_and_test_tables_and_generator_imports() -> None:
    """Negative control: a module-level table of cases or presets, a name compared in a shared golden
    script and an import of a generator module are found; a name inside a test function is not."""
    table = """
CASES = ("llama2", "llama31")
FAMILY_MODELS = {"gemma3-tiny": {}}
ROWS = [("qwen3-tiny", object())]
def test_x(model):
    assert model in ("gemma3-tiny",)
"""
    trees = module_level(table)
    assert sorted({name for _, name in _listed(trees, ["llama2", "llama31", "gemma3-tiny", "qwen3-tiny"])}) == [
        "gemma3-tiny",
        "llama2",
        "llama31",
        "qwen3-tiny",
    ]
    assert [line for line, _ in _listed(trees, ["gemma3-tiny"])] == [3]  # not line 6, in a test function
    assert sorted({line for line, _ in _listed([ast.parse(table)], ["gemma3-tiny"])}) == [3, 6]
    script = """
from goldens.llama4 import router_check
import goldens.deepseek4
from goldens.harness import Case
seq_len = 157 if case.name == "deepseek4" else 37
"""
    assert generator_imports(script, ["llama4", "deepseek4"]) == [(2, "goldens.llama4"), (3, "goldens.deepseek4")]
    assert block_names_branched_on(script, ["deepseek4"]) == [(5, "deepseek4")]


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
