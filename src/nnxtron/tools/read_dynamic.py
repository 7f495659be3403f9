"""The keys a ``getattr(cfg, name)`` can read, where the AST says: ``name`` runs over a collection of
string literals — in the function (``for key in ("use_sft", "use_dpo")``, ``[k for k, off in
D.items()]``), a module constant (``ACTIVATIONS``), or one imported from another module of the
package (``options.MOE_OPTIONS_OFF``). Anything else (a value computed at run time, a
collection built by calls) leaves the read unresolved: ``None``, and the scan lists it under key
``*``. Used by ``tools/read_scan.py``."""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence

Strings = frozenset[str] | None  # None: not resolved
LEAVES = ("tuple", "list", "set", "frozenset", "sorted")


class Resolver:
    def __init__(self, modules: Mapping[str, ast.Module]):
        self.modules = modules
        self.by_module = {path.removeprefix("src/").removesuffix(".py").replace("/", "."): path for path in modules}

    def keys(self, name: ast.expr, scopes: Sequence[ast.AST], path: str) -> Strings:
        """The strings ``name`` may hold at its ``getattr``; ``scopes``: the enclosing functions, innermost last."""
        return self.strings(name, [*scopes[::-1], self.modules[path]], path, 0)

    # a name's definitions

    def bound(self, name: str, scopes: list[ast.AST], path: str, depth: int, at: tuple[int, int] | None = None) -> list:
        """(collection or value, position, kind) of the bindings of ``name`` that reach ``at`` in the
        innermost scope that binds it: kind "value" (name = expr), "each" (for name in expr: one
        element; position: in a tuple target). Of the bindings that dominate ``at`` (an earlier
        statement of an enclosing block, an enclosing loop) the last counts, with any later one in
        a branch; without one, every binding."""
        if depth > 12:  # (a cycle of imports)
            return []
        for scope in scopes:
            found = []  # (where it takes effect, dominates at, binding)
            blocks = _blocks(scope)
            for node in _own(scope):
                if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                        found.append((_end(node), _dominates(node, at, blocks), (node.value, None, "value")))
                elif isinstance(node, ast.For | ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
                    for loop in node.generators if not isinstance(node, ast.For) else [node]:
                        names = [loop.target] if isinstance(loop.target, ast.Name) else getattr(loop.target, "elts", [])
                        for i, t in enumerate(names):
                            if isinstance(t, ast.Name) and t.id == name:
                                position = None if isinstance(loop.target, ast.Name) else i
                                found.append((_end(loop.iter), _within(node, at), (loop.iter, position, "each")))
                elif isinstance(node, ast.ImportFrom) and node.module and scope is scopes[-1]:
                    for alias in node.names:
                        if (alias.asname or alias.name) == name and node.module in self.by_module:
                            other = self.by_module[node.module]
                            found += [((0, 0), False, b) for b in self.bound(alias.name, [self.modules[other]], other, depth + 1)]
            if found:
                return [b for _, _, b in _reaching(found, at)]
        return []

    def module_of(self, expr: ast.expr, scopes: list[ast.AST]) -> str | None:
        """The path of a module ``expr`` names (``from nnxtron.config import options``: ``options``)."""
        if not isinstance(expr, ast.Name):
            return None
        for node in ast.walk(scopes[-1]):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    if (alias.asname or alias.name) == expr.id:
                        return self.by_module.get(f"{node.module}.{alias.name}")
        return None

    # the strings of an expression: "each" of a collection (a dict's keys), or its values

    def strings(self, expr: ast.expr | None, scopes: list[ast.AST], path: str, depth: int, values: bool = False) -> Strings:
        if expr is None or depth > 12:
            return None
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str) and not values:
            return frozenset({expr.value})
        if isinstance(expr, ast.Name):
            found = self.bound(expr.id, scopes, path, depth, (expr.lineno, expr.col_offset))
            return self.union(self.from_binding(b, scopes, path, depth, values) for b in found) if found else None
        if isinstance(expr, ast.Attribute) and (module := self.module_of(expr.value, scopes)):
            tree = self.modules[module]
            found = self.bound(expr.attr, [tree], module, depth)
            return self.union(self.from_binding(b, [tree], module, depth, values) for b in found) if found else None
        if isinstance(expr, ast.Tuple | ast.List | ast.Set) and not values:
            return self.union(
                self.strings(e.value if isinstance(e, ast.Starred) else e, scopes, path, depth + 1) for e in expr.elts
            )
        if isinstance(expr, ast.Dict):
            parts = [self.strings(v if values else k, scopes, path, depth + 1) for k, v in zip(expr.keys, expr.values) if k]
            spread = [self.strings(v, scopes, path, depth + 1, values) for k, v in zip(expr.keys, expr.values) if k is None]
            return self.union([*parts, *spread])
        if isinstance(expr, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            inner = [expr, *scopes]  # the comprehension binds its targets
            elt = expr.value if isinstance(expr, ast.DictComp) and values else getattr(expr, "key", getattr(expr, "elt", None))
            return None if values and not isinstance(expr, ast.DictComp) else self.strings(elt, inner, path, depth + 1)
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr | ast.Add):
            return self.union([self.strings(s, scopes, path, depth + 1, values) for s in (expr.left, expr.right)])
        if isinstance(expr, ast.Subscript) and not values:  # d[k]: a value of d; xs[0], xs[1:]: elements of xs
            of_dict = not isinstance(expr.slice, ast.Slice | ast.Constant) or not isinstance(getattr(expr.slice, "value", 0), int)
            return self.strings(expr.value, scopes, path, depth + 1, values=of_dict)
        if isinstance(expr, ast.Call) and not values:
            func = expr.func
            if isinstance(func, ast.Attribute) and func.attr in ("keys", "items", "values") and not expr.args:
                return self.strings(func.value, scopes, path, depth + 1, values=func.attr == "values")
            if ast.unparse(func) in (*LEAVES, "dict.fromkeys") and expr.args:
                return self.strings(expr.args[0], scopes, path, depth + 1)
        if isinstance(expr, ast.JoinedStr) and not values:
            return self.formatted(expr, scopes, path, depth)
        return None

    def from_binding(self, binding, scopes: list[ast.AST], path: str, depth: int, values: bool) -> Strings:
        expr, position, kind = binding
        if kind == "value":
            return self.strings(expr, scopes, path, depth + 1, values)
        if position is None:  # an element of expr (nested collections are flattened: every string in it)
            return None if values else self.strings(expr, scopes, path, depth + 1)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "items" and position < 2:
            return None if values else self.strings(expr.func.value, scopes, path, depth + 1, values=position == 1)
        if isinstance(expr, ast.Tuple | ast.List) and all(isinstance(e, ast.Tuple) and len(e.elts) > position for e in expr.elts):
            return self.union([self.strings(e.elts[position], scopes, path, depth + 1, values) for e in expr.elts])
        return None

    def formatted(self, expr: ast.JoinedStr, scopes: list[ast.AST], path: str, depth: int) -> Strings:
        out = {""}
        for part in expr.values:
            if isinstance(part, ast.Constant):
                options: Strings = frozenset({str(part.value)})
            else:
                options = self.strings(part.value, scopes, path, depth + 1) if isinstance(part, ast.FormattedValue) else None
            if options is None or getattr(part, "format_spec", None) or getattr(part, "conversion", -1) != -1:
                return None
            out = {a + b for a in out for b in options}
        return frozenset(out)

    @staticmethod
    def union(parts) -> Strings:
        parts = list(parts)
        if any(p is None for p in parts):  # (an empty literal holds no strings: resolved)
            return None
        return frozenset().union(*parts)


def _own(scope: ast.AST):
    """The nodes of ``scope`` outside nested functions and classes (a comprehension: itself)."""
    if isinstance(scope, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
        yield scope
        return
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            todo.extend(ast.iter_child_nodes(node))


def _end(node: ast.AST) -> tuple[int, int]:
    return (node.end_lineno or 0, node.end_col_offset or 0)


def _within(node: ast.AST, at: tuple[int, int] | None) -> bool:
    return at is not None and (node.lineno, node.col_offset) <= at <= _end(node)


def _blocks(scope: ast.AST) -> dict[int, tuple[list, int]]:
    """Each statement of ``scope`` -> (the statement list holding it, its index there)."""
    out = {}
    for node in [scope, *_own(scope)]:
        for value in ast.iter_fields(node):
            if isinstance(value[1], list):
                out.update({id(s): (value[1], i) for i, s in enumerate(value[1]) if isinstance(s, ast.stmt)})
    return out


def _dominates(stmt: ast.stmt, at: tuple[int, int] | None, blocks: dict[int, tuple[list, int]]) -> bool:
    """Whether ``stmt`` runs before ``at`` on every path: a later statement of its block holds ``at``."""
    block, index = blocks.get(id(stmt), ([], 0))
    return at is not None and any(_within(later, at) for later in block[index + 1 :])


def _reaching(found: list, at: tuple[int, int] | None) -> list:
    """The last dominating binding and any later one before ``at``; all of them where none dominates."""
    found = sorted(found, key=lambda f: f[0])
    last = max((i for i, (_, dominates, _) in enumerate(found) if dominates), default=None)
    if last is None or at is None:
        return found
    return [found[last], *(f for f in found[last + 1 :] if f[0] < at)]
