"""The package is a one-way house (docs/architecture.md): each layer imports only from the
layers below it, siblings do not import each other, and no module imports itself back
through others. Imports are read with ``ast`` — every ``import`` statement, also those
inside functions and those under ``if TYPE_CHECKING:``: all of them must point down and
none may close a cycle (a type-only loop is still two modules that each need the other).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "nnxtron"

# bottom to top: (layer name, the packages / modules in it). Keep docs/architecture.md in step.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("leaf", ("nnxtron.errors", "nnxtron.params", "nnxtron.scoped")),
    ("config", ("nnxtron.config",)),
    ("services", ("nnxtron.runtime", "nnxtron.data")),
    ("parallel", ("nnxtron.parallel",)),
    ("layers", ("nnxtron.layers",)),
    ("models", ("nnxtron.models",)),
    ("engines", ("nnxtron.train", "nnxtron.infer")),
    ("convert", ("nnxtron.convert",)),
    ("tools", ("nnxtron.tools",)),
    ("serve", ("nnxtron.serve",)),
    ("cli", ("nnxtron.cli", "nnxtron")),
    ("entry", ("nnxtron.__main__",)),  # `python -m nnxtron`
)
# imports inside a function that are there on purpose (start-up time), never to dodge a cycle
LAZY_IMPORTS_ALLOWED = {
    "nnxtron": "`import nnxtron` stays light; from_hf/to_hf load JAX when called",
    "nnxtron.cli": "each command imports what it runs, so `nnxtron --help` and bad input answer fast",
    "nnxtron.__main__": "the start-up Ctrl-C handling is installed before the command line's modules load",
}


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module
    line: int
    lazy: bool  # inside a function
    type_only: bool  # under `if TYPE_CHECKING:`


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Name)
        and test.id == "TYPE_CHECKING"
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _imports(tree: ast.AST, source: str, is_package: bool, modules: set[str]) -> Iterator[Import]:
    top = source.split(".")[0]

    def visit(node: ast.AST, lazy: bool, type_only: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            child_lazy = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            child_type_only = type_only or (isinstance(child, ast.If) and _is_type_checking(child.test))
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = source.split(".") if is_package else source.split(".")[:-1]
                    base = base[: len(base) - child.level + 1]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                for alias in child.names:  # `from pkg import module` imports the module
                    candidate = f"{module}.{alias.name}"
                    target = candidate if candidate in modules else module
                    if target.split(".")[0] == top:
                        yield Import(source, target, child.lineno, lazy, child_type_only)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == top:
                        yield Import(source, alias.name, child.lineno, lazy, child_type_only)
            yield from visit(child, child_lazy, child_type_only)

    yield from visit(tree, False, False)


def read_imports(root: Path) -> tuple[set[str], list[Import]]:
    """Every module of the package at ``root`` and every import between them."""
    files = sorted(root.rglob("*.py"))
    modules = {module_name(path, root) for path in files}
    found = []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        found += list(_imports(tree, module_name(path, root), path.name == "__init__.py", modules))
    return modules, found


def layer_of(module: str, layers=LAYERS) -> tuple[int, str]:
    """(rank, package) of ``module``: the longest matching entry of ``layers``."""
    best = None
    for rank, (_, packages) in enumerate(layers):
        for package in packages:
            if (module == package or module.startswith(package + ".")) and (best is None or len(package) > len(best[1])):
                best = (rank, package)
    if best is None:
        raise AssertionError(f"module {module} belongs to no layer; add its package to LAYERS and docs/architecture.md")
    return best


def upward_imports(imports: list[Import], layers=LAYERS) -> list[str]:
    """Imports that point up the house, or sideways into a sibling package of the same layer."""
    bad = []
    for imp in imports:
        (rank_s, pkg_s), (rank_t, pkg_t) = layer_of(imp.source, layers), layer_of(imp.target, layers)
        if rank_t > rank_s or (rank_t == rank_s and pkg_t != pkg_s and pkg_t != "nnxtron"):
            bad.append(f"{imp.source}:{imp.line} imports {imp.target} ({layers[rank_s][0]} -> {layers[rank_t][0]})")
    return bad


def cycles(modules: set[str], imports: list[Import]) -> list[list[str]]:
    """The import cycles among ``modules``, counting every import: also those under
    ``if TYPE_CHECKING:`` and those inside functions."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        if imp.target in graph and imp.target != imp.source:
            graph[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


@pytest.fixture(scope="module")
def package() -> tuple[set[str], list[Import]]:
    return read_imports(PACKAGE)


def test_every_module_has_a_layer(package):
    modules, _ = package
    for module in modules:
        layer_of(module)


def test_no_import_points_up_or_sideways(package):
    _, imports = package
    assert upward_imports(imports) == []


def cycle_report(component: list[str], imports: list[Import]) -> str:
    """One line per import between the modules of a cycle, so the message names the loop."""
    inside = set(component)
    edges = sorted({
        f"  {imp.source}:{imp.line} imports {imp.target}"
        + (" (TYPE_CHECKING)" if imp.type_only else "")
        + (" (inside a function)" if imp.lazy else "")
        for imp in imports
        if imp.source in inside and imp.target in inside and imp.source != imp.target
    })  # fmt: skip
    return f"import cycle among {', '.join(component)}:\n" + "\n".join(edges)


def test_no_import_cycle(package):
    modules, imports = package
    found = cycles(modules, imports)
    assert found == [], "move the shared piece down (docs/architecture.md)\n" + "\n".join(
        cycle_report(component, imports) for component in found
    )


def test_imports_inside_functions_only_where_documented(package):
    _, imports = package
    lazy = sorted(
        f"{imp.source}:{imp.line} imports {imp.target}" for imp in imports if imp.lazy and imp.source not in LAZY_IMPORTS_ALLOWED
    )
    assert lazy == [], "import at the top of the module (a cycle is fixed by moving code down a layer, not by a late import)"


def test_config_layer_is_pure():
    """The config layer runs without JAX: its checks and layout arithmetic are plain Python."""
    for path in sorted((PACKAGE / "config").rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        names |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not names & {"jax", "jaxlib", "flax", "optax", "orbax", "qwix"}, f"{path.name} imports {sorted(names)}"


def test_docs_describe_every_layer():
    text = (ROOT / "docs" / "architecture.md").read_text()
    for name, packages in LAYERS:
        for package in packages:
            path = package.replace("nnxtron.", "").replace(".", "/") if package != "nnxtron" else "nnxtron"
            assert path in text, f"docs/architecture.md does not name {path} (layer {name})"


# --- the checker itself can fail: a throwaway package with today's old mistakes ----------


def _write(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "nnxtron"
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


def test_checker_finds_a_cycle_hidden_in_a_function(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "config/__init__.py": "",
        "config/schema.py": "def check():\n    from nnxtron.config.pipeline import spec\n",
        "config/pipeline.py": "from nnxtron.config.schema import check\n",
    })  # fmt: skip
    modules, imports = read_imports(pkg)
    assert cycles(modules, imports) == [["nnxtron.config.pipeline", "nnxtron.config.schema"]]
    assert [i.source for i in imports if i.lazy] == ["nnxtron.config.schema"]


def test_checker_finds_upward_and_sideways_imports_and_type_only_cycles(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "config/__init__.py": "",
        "config/schema.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nnxtron.config.checks import x\n",
        "config/checks.py": "from nnxtron.config.schema import Config\nfrom nnxtron.models import mtp\n",
        "models/__init__.py": "",
        "models/mtp.py": "from nnxtron.train import loss\n",
        "train/__init__.py": "",
        "train/loss.py": "from nnxtron.infer.cache import c\n",
        "infer/__init__.py": "",
        "infer/cache.py": "",
    })  # fmt: skip
    modules, imports = read_imports(pkg)
    assert cycles(modules, imports) == [["nnxtron.config.checks", "nnxtron.config.schema"]]  # type-only still counts
    report = cycle_report(["nnxtron.config.checks", "nnxtron.config.schema"], imports)
    assert "nnxtron.config.schema:3 imports nnxtron.config.checks (TYPE_CHECKING)" in report
    assert "nnxtron.config.checks:1 imports nnxtron.config.schema" in report
    assert upward_imports(imports) == [
        "nnxtron.config.checks:2 imports nnxtron.models.mtp (config -> models)",
        "nnxtron.models.mtp:1 imports nnxtron.train.loss (models -> engines)",
        "nnxtron.train.loss:1 imports nnxtron.infer.cache (engines -> engines)",
    ]
