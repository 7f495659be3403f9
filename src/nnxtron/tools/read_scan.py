"""The AST scan behind ``tools/read_sites.py``: which expressions hold a ``Config`` or an object
built from one (a :data:`~nnxtron.tools.read_carriers.CARRIERS` class), and the reads on them."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nnxtron.tools.read_carriers import CARRIERS, KEYS, carried_keys, config_properties
from nnxtron.tools.read_dynamic import Resolver

CONFIG = "Config"
OTHER = "?"  # the type of a name annotated with a type that is neither a Config nor a carrier
MODULE_NAMES = frozenset({"jax", "nnxtron", "flax", "np", "numpy", "uvicorn", "transformers"})  # X.config is no Config
WHOLE_CALLS = frozenset({"model_dump", "model_dump_json"})  # methods that read every key


@dataclass(frozen=True, order=True)
class Site:
    """One read of ``key`` (``*``: a read whose key the scan cannot name) at ``file:line:col``."""

    key: str
    file: str  # relative to the repository root (src/nnxtron/...), or as given to scan()
    line: int
    col: int
    function: str  # qualified enclosing function, <module> at top level
    kind: str  # attribute | getattr | property | derived | dynamic | whole
    via: str  # the property or carrier attribute (Config.pipeline_stages, PipelineSpec.scan_repeats), the getattr name
    expr: str  # the source of the read

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{self.col}:{self.key}"


def _sort_key(site: Site) -> tuple:
    return (site.key == "*", site.key, site.file, site.line, site.col, site.kind, site.via)


# ---- types of annotations and expressions ---------------------------------------------------------------------------

KNOWN = frozenset({CONFIG, *CARRIERS})


def annotation_type(node: ast.expr | None) -> str | None:
    """``Config`` / a carrier name for ``Config``, ``"Config"``, ``X | None``, ``Optional[X]``; else None."""
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return annotation_type(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return None
    if isinstance(node, ast.Name | ast.Attribute):
        name = node.id if isinstance(node, ast.Name) else node.attr
        return name if name in KNOWN else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        found = {annotation_type(node.left), annotation_type(node.right)} - {None}
        return found.pop() if len(found) == 1 else None
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name | ast.Attribute):
        outer = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
        return annotation_type(node.slice) if outer == "Optional" else None
    return None


def takes_config(node: ast.expr | None) -> bool:
    """Whether an annotation is ``Callable[[Config, ...], ...]`` (a lambda there gets a Config)."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and node.slice.elts):
        return False
    params = node.slice.elts[0]
    return isinstance(params, ast.List) and bool(params.elts) and annotation_type(params.elts[0]) == CONFIG


def _defs(tree: ast.AST) -> Iterable[ast.FunctionDef | ast.AsyncFunctionDef]:
    return (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))


@dataclass
class Index:
    """What every scanned module declares: functions' and methods' return types, classes' fields."""

    returns: dict[str, str | None]  # function name -> known return type (None: names disagree)
    methods: dict[tuple[str, str], str]  # (class, method) -> known return type
    fields: dict[str, list[tuple[str, ast.expr | None]]]  # class -> its annotated fields, in order

    @classmethod
    def of(cls, trees: Iterable[ast.Module]) -> Index:
        index = cls({}, {}, {})
        for tree in trees:
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    index.fields[node.name] = [
                        (s.target.id, s.annotation)
                        for s in node.body
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                    ]
                    for method in node.body:
                        if isinstance(method, ast.FunctionDef) and (kind := annotation_type(method.returns)):
                            index.methods[(node.name, method.name)] = kind
            for fn in _defs(tree):
                kind = annotation_type(fn.returns)
                if kind and index.returns.get(fn.name, kind) == kind:
                    index.returns[fn.name] = kind
                elif kind:
                    index.returns[fn.name] = None
        return index


# ---- the scan -------------------------------------------------------------------------------------------------------

NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _own_nodes(roots: Iterable[ast.AST]) -> Iterable[ast.AST]:
    """Every node under ``roots`` outside nested functions, lambdas and classes (which are nodes themselves)."""
    todo = list(roots)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, NESTED):
            todo.extend(ast.iter_child_nodes(node))


def _bindings(roots: Iterable[ast.AST]) -> list[tuple[str, ast.expr | None, ast.expr | None]]:
    """(name, value, annotation) of every assignment to a plain name; value None: bound to something unknown."""
    out: list[tuple[str, ast.expr | None, ast.expr | None]] = []

    def bind(target: ast.expr, value: ast.expr | None) -> None:
        if isinstance(target, ast.Name):
            out.append((target.id, value, None))
        elif isinstance(target, ast.Tuple | ast.List):
            pairs = isinstance(value, ast.Tuple | ast.List) and len(value.elts) == len(target.elts)
            for i, elt in enumerate(target.elts):
                bind(elt, value.elts[i] if pairs else None)  # type: ignore[union-attr]
        elif isinstance(target, ast.Starred):
            bind(target.value, None)

    for node in _own_nodes(roots):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                bind(target, node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.append((node.target.id, node.value, node.annotation))
        elif isinstance(node, ast.NamedExpr):
            bind(node.target, node.value)
        elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
            bind(node.target, None)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            bind(node.optional_vars, None)
    return out


@dataclass
class Scope:
    names: dict[str, str | None]  # name -> its type: a class name, OTHER, None (unknown)
    parent: Scope | None
    cls: str | None  # the class of ``self`` / ``cls`` in a method

    def lookup(self, name: str) -> str | None:
        scope: Scope | None = self
        while scope is not None:
            if name in scope.names:
                return scope.names[name]
            scope = scope.parent
        return None


def _convention(name: str, param: bool) -> str | None:
    """The type a name has by convention: ``cfg`` (and an unannotated ``config`` parameter), ``derived``."""
    if name == "cfg" or (param and name == "config"):
        return CONFIG
    return "Derived" if name == "derived" else None


class Scanner:
    """Scans parsed modules: :meth:`run` walks them twice, the first time to learn the types of
    ``self.X`` (fields, properties, assignments in methods), the second to record the reads."""

    def __init__(
        self, modules: Mapping[str, ast.Module], index: Index, properties: Mapping[str, frozenset[str]], resolver: Resolver
    ):
        self.resolver, self.functions = resolver, []  # the enclosing functions and lambdas, outermost first
        self.modules, self.index, self.properties = modules, index, properties
        self.attrs: dict[tuple[str, str], str | None] = {}  # (class, attribute) -> type, from self.X = ...
        self.sites: list[Site] = []
        self.lambdas: set[int] = set()  # ids of lambdas given where a Callable[[Config], ...] field is
        self.recording = False

    def run(self) -> list[Site]:
        for self.recording in (False, True):
            self.sites = []
            for path, tree in self.modules.items():
                self.path = path
                self.visit_body(tree.body, self.scope(tree.body, (), None, None), [], None)
        return sorted(set(self.sites), key=_sort_key)

    # types

    def scope(self, body, args, parent: Scope | None, cls: str | None, *, method=False, lam=False) -> Scope:
        scope = Scope({}, parent, cls)
        params: dict[str, str | None] = {}
        for i, arg in enumerate(args):
            kind = annotation_type(arg.annotation)
            plain = arg.annotation is None or ast.unparse(arg.annotation) == "Any"
            if method and i == 0 and cls:
                kind = f"cls:{cls}" if arg.arg == "cls" else cls
            elif lam and i == 0:
                kind = CONFIG
            elif kind is None:
                kind = _convention(arg.arg, param=True) if plain else OTHER
            params[arg.arg] = kind
        scope.names.update(params)
        bindings = _bindings(body)
        for _ in range(3):  # aliases of aliases
            for name, value, annotation in bindings:
                if params.get(name) is not None:
                    continue
                kind = annotation_type(annotation) or (self.infer(value, scope) if value is not None else None)
                if kind is not None or scope.names.get(name) is None:
                    scope.names[name] = kind or _convention(name, param=False)
        return scope

    def infer(self, node: ast.expr, scope: Scope) -> str | None:
        if isinstance(node, ast.Name):
            return scope.lookup(node.id)
        if isinstance(node, ast.Attribute):
            owner = self.infer(node.value, scope)
            if owner is not None and (owner, node.attr) in self.attrs:
                return self.attrs[(owner, node.attr)]
            module = isinstance(node.value, ast.Name) and node.value.id in MODULE_NAMES
            if node.attr in ("config", "cfg") and not module:
                return CONFIG
            return "Derived" if node.attr == "derived" and not module else None
        if isinstance(node, ast.Call):
            return self.infer_call(node, scope)
        if isinstance(node, ast.IfExp):
            return self.infer(node.body, scope) or self.infer(node.orelse, scope)
        if isinstance(node, ast.BoolOp):
            return next((k for v in node.values if (k := self.infer(v, scope))), None)
        if isinstance(node, ast.NamedExpr | ast.Await):
            return self.infer(node.value, scope)
        return None

    def infer_call(self, node: ast.Call, scope: Scope) -> str | None:
        func = node.func
        if isinstance(func, ast.Name):
            if func.id in KNOWN:
                return func.id
            kind = scope.lookup(func.id)
            if kind and kind.startswith("cls:"):
                return kind[4:]
            if func.id == "replace" and node.args:
                return self.infer(node.args[0], scope)
            return self.index.returns.get(func.id)
        if isinstance(func, ast.Attribute):
            owner = self.infer(func.value, scope)
            if func.attr == "replace" and node.args and ast.unparse(func.value) == "dataclasses":
                return self.infer(node.args[0], scope)
            if owner == CONFIG and func.attr == "model_copy":
                return CONFIG
            name = owner[4:] if owner and owner.startswith("cls:") else ast.unparse(func.value)
            return self.index.methods.get((name, func.attr))
        return None

    # the walk

    def visit_body(self, nodes: Iterable[ast.AST], scope: Scope, qual: list[str], cls: str | None) -> None:
        for node in nodes:
            self.visit(node, scope, qual, cls)

    def visit(self, node: ast.AST, scope: Scope, qual: list[str], cls: str | None) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            defaults = [d for d in (*node.args.defaults, *node.args.kw_defaults) if d is not None]
            self.visit_body([*node.decorator_list, *defaults], scope, qual, cls)
            args = [*node.args.posonlyargs, *node.args.args, node.args.vararg, *node.args.kwonlyargs, node.args.kwarg]
            static = any(ast.unparse(d) == "staticmethod" for d in node.decorator_list)
            inner = self.scope(node.body, [a for a in args if a], scope, cls, method=bool(cls) and not static)
            self.functions.append(node)
            self.visit_body(node.body, inner, [*qual, node.name], None)
            self.functions.pop()
            return
        if isinstance(node, ast.Lambda):
            args = [*node.args.posonlyargs, *node.args.args]
            inner = self.scope([node.body], args, scope, None, lam=id(node) in self.lambdas)
            self.functions.append(node)
            self.visit(node.body, inner, qual, None)
            self.functions.pop()
            return
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:  # fields (dataclass, annotated) and properties: the types of self.X
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    name, kind = stmt.target.id, annotation_type(stmt.annotation)
                elif isinstance(stmt, ast.FunctionDef) and any(ast.unparse(d) == "property" for d in stmt.decorator_list):
                    name, kind = stmt.name, annotation_type(stmt.returns)
                else:
                    continue
                if kind:
                    self.attrs.setdefault((node.name, name), kind)
            self.visit_body(node.body, scope, [*qual, node.name], node.name)  # methods see the enclosing scope
            return
        if isinstance(node, ast.Call):
            self.mark_lambdas(node)
            self.read_call(node, scope, qual)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            self.read_attribute(node, scope, qual)
        elif isinstance(node, ast.Assign | ast.AnnAssign) and not self.recording:
            self.learn_self(node, scope)
        for child in ast.iter_child_nodes(node):
            self.visit(child, scope, qual, cls)

    def learn_self(self, node: ast.Assign | ast.AnnAssign, scope: Scope) -> None:
        """``self.X = value`` in a method of class C: C's X has value's type."""
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            pairs = [(target, node.value)]
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) and len(target.elts) == len(node.value.elts):
                pairs = list(zip(target.elts, node.value.elts))
            for tgt, value in pairs:
                if not (isinstance(tgt, ast.Attribute) and isinstance(tgt.value, ast.Name)):
                    continue
                owner = scope.lookup(tgt.value.id)
                if owner is None or owner in (CONFIG, OTHER) or owner.startswith("cls:"):
                    continue
                annotation = node.annotation if isinstance(node, ast.AnnAssign) else None
                kind = annotation_type(annotation) or (self.infer(value, scope) if value is not None else None)
                if kind is not None:
                    self.attrs.setdefault((owner, tgt.attr), kind)

    def mark_lambdas(self, node: ast.Call) -> None:
        name = node.func.id if isinstance(node.func, ast.Name) else None
        fields = dict(self.index.fields.get(name or "", []))
        order = [f for f, _ in self.index.fields.get(name or "", [])]
        given = [*zip(order, node.args), *((k.arg, k.value) for k in node.keywords if k.arg)]
        for field, value in given:
            if isinstance(value, ast.Lambda) and takes_config(fields.get(field)):
                self.lambdas.add(id(value))

    def record(self, node: ast.AST, key: str, qual: list[str], kind: str, via: str = "") -> None:
        if self.recording:
            expr = ast.unparse(node)
            self.sites.append(Site(key, self.path, node.lineno, node.col_offset, ".".join(qual) or "<module>", kind, via, expr))

    def read_attribute(self, node: ast.Attribute, scope: Scope, qual: list[str]) -> None:
        owner = self.infer(node.value, scope)
        if owner == CONFIG:
            if node.attr in KEYS:
                self.record(node, node.attr, qual, "attribute")
            for key in sorted(self.properties.get(node.attr, ())):
                self.record(node, key, qual, "property", f"Config.{node.attr}")
        elif owner in CARRIERS:
            for key in carried_keys(owner, node.attr, self.properties):
                self.record(node, key, qual, "derived", f"{owner}.{node.attr}")

    def read_call(self, node: ast.Call, scope: Scope, qual: list[str]) -> None:
        func, args = node.func, node.args
        if isinstance(func, ast.Name) and func.id == "getattr" and len(args) >= 2 and self.infer(args[0], scope) == CONFIG:
            name = args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                if name.value in KEYS:
                    self.record(node, name.value, qual, "getattr")
                for key in sorted(self.properties.get(name.value, ())):
                    self.record(node, key, qual, "property", f"Config.{name.value}")
            else:
                names = self.resolver.keys(name, self.functions, self.path) if self.recording else None
                resolved = sorted({k for n in names or () for k in ({n} & KEYS) | self.properties.get(n, set())})
                for key in resolved or ["*"]:  # the keys the name runs over, where the AST says
                    self.record(node, key, qual, "dynamic", ast.unparse(name))
        elif isinstance(func, ast.Name) and func.id in ("dict", "vars") and args and self.infer(args[0], scope) == CONFIG:
            self.record(node, "*", qual, "whole", func.id)
        elif isinstance(func, ast.Attribute) and func.attr in WHOLE_CALLS and self.infer(func.value, scope) == CONFIG:
            self.record(node, "*", qual, "whole", func.attr)


def scan(sources: Mapping[str, str], context: Mapping[str, str] = {}) -> list[Site]:  # noqa: B006 - read only
    """The read sites of ``sources`` (path -> text); ``context``: more modules that only declare
    (return types, fields), e.g. the package for a snippet."""
    modules = {path: ast.parse(text, filename=path) for path, text in sources.items()}
    every = {**{p: ast.parse(t, filename=p) for p, t in context.items() if p not in modules}, **modules}
    schema = next((tree for path, tree in every.items() if path.endswith("config/schema.py")), None)
    properties = config_properties(schema) if schema is not None else {}
    return Scanner(modules, Index.of(every.values()), properties, Resolver(every)).run()
