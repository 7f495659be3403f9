"""The collectives of a compiled XLA program: bytes per device per step, and mesh axes.

``collectives(hlo_text, mesh_shape, devices_per_node)`` reads the optimized HLO text of an
SPMD program (``jax.jit(f).lower(...).compile().as_text()``) and returns one ``Collective``
per all-gather / reduce-scatter / all-reduce / all-to-all / collective-permute, with its
executions per step and the mesh axes its device groups span, for a cost model to turn
``wire_bytes * count`` into time on those axes' links.

Device ids in replica groups are partition ids, and partition ``i`` runs on
``mesh.devices.flat[i]``: an id is a row-major flat mesh index (``np.unravel_index``),
whatever the ``device.id``. Verified on 8 fake CPU devices (jax 0.10.2): with
``jax.make_mesh((1,1,2,1,1,4), MESH_AXES)`` psum over "tensor" gives
``{{0,1,2,3},{4,5,6,7}}`` and over "fsdp" ``{{0,4},{1,5},{2,6},{3,7}}``, and a ``Mesh`` of
permuted devices (ids 7,2,5,0,3,6,1,4) gives the same groups. A node holds flat indices
``i // devices_per_node`` (host-major meshes, as ``jax.make_mesh`` builds on GPU hosts).

Replica groups read: explicit ``{{0,1},{2,3}}``, ``{}`` (all devices), iota ``[2,4]<=[8]``
and ``[4,2]<=[2,4]T(1,0)``, and XLA's mesh-axes form ``mesh['axis_0'=4,'axis_1'=2],
device_ids=([2,4]T(1,0)) {'axis_0'}`` with sub-axes ``{'axis_0':(2)2}``, expanded as
XLA's ``MeshAxesReplicaGroupList::flattened_replica_groups`` does (a non-iota
``device_ids`` list is read as its last ``prod(sizes)`` integers: unverified).

Counts: ENTRY runs once; a computation runs the sum over its call sites of the caller's
count times the known trip count for a while body (trip count + 1 for its condition), once
for other calls. A while loop without ``known_trip_count`` counts one trip (underestimate).
Async collectives count at their start (``all-gather-start``, ``async-start`` calls);
single-device groups and self-sends move nothing and are dropped.

XLA:CPU differs from the GPU/TPU pipelines in two ways, which ``as_accelerator=True`` (the
default) undoes so that a program compiled for fake CPU devices predicts an accelerator's
collectives (verified on jax 0.10.2's XLA:CPU):

* No reduce-scatter from GSPMD: ``jax.jit`` with shardings gives an all-reduce whose users
  dynamic-slice it by partition id (the slice fused into a kLoop fusion, behind a bf16
  ``convert`` fusion when promoted), where XLA:GPU's ``ReduceScatterCreator`` forms a
  reduce-scatter (only shard_map's ``psum_scatter`` gives one on CPU). An all-reduce whose
  every use, through convert / bitcast / copy / reshape and into fusions, is operand 0 of a
  dynamic-slice taking ``1 / group_size`` of its elements counts as a reduce-scatter over the
  same groups (``array_bytes``: the full operand). Slices of another size, which XLA's
  matcher (offset ``j * shard`` for the ``j``-th group member) would not take either, leave
  the all-reduce. XLA:CPU combines all-reduces into tuple ones (a train step's gradients
  come as a few): each element is judged through its get-tuple-elements, and a mixed one
  gives two ``Collective`` s, the sliced elements' reduce-scatter and the rest's all-reduce
  (XLA:GPU forms reduce-scatters before combining).
* bf16 widened to f32. ``AllReducePromotion({BF16, F32})`` rewrites a bf16 all-reduce or
  reduce-scatter as convert, f32 collective, convert, with a new reducer named
  ``<reducer>_promoted``: that name is the one reliable trace, since an explicit f32
  ``psum`` of bf16 data converted back (kept f32 on an accelerator too) prints the same
  convert - all-reduce - convert chain, and a GSPMD ``jnp.sum`` of bf16, which reduces in f32
  by jax's own upcast, feeds the all-reduce from a fusion of bf16 parameters. Such an
  all-reduce counts its f32 arrays at bf16 size. ``FloatNormalization`` widens bf16
  all-gathers, all-to-alls and collective-permutes (no arithmetic) with a convert from bf16
  before (a ``convert`` instruction or the root of a fusion, possibly after an
  f32 -> bf16 -> f32 round trip) and a convert to bf16 after (alone or first in each user
  fusion): one whose every f32 operand ends in a convert from bf16 (through layout ops) and
  whose every use, through layout / slice ops, get-tuple-element and into fusions, is a
  convert to bf16 counts those operands at bf16 size. An explicit ``astype(f32)``, moved,
  then ``astype(bf16)`` reads the same and is halved too (the values fit in bf16); one whose
  f32 result is used as f32 is not.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from nnxtron.config.derived import MESH_AXES

__all__ = ["MESH_AXES", "Collective", "collectives"]

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_BITS = {"pred": 8, "token": 0, "bf16": 16, "f16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128}
_BITS.update({f"{p}{b}": b for p in "su" for b in (2, 4, 8, 16, 32, 64)})  # f8e4m3fn etc.: shape_bytes
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_ARRAY = re.compile(r"([a-z]\w*)\[([^\]]*)\]")
_CALL = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_CALL_LIST = re.compile(r"\b(branch_computations|called_computations|calls)=\{([^}]*)\}")
_PROMOTED = re.compile(r"\bto_apply=%?[\w.\-]*_promoted(?:\.\d+)?(?=[,\s]|$)")  # XLA's AllReducePromotion reducer
_LAYOUT = ("bitcast", "copy", "reshape", "transpose")  # ops that keep every value (one operand)
_SLICES = ("slice", "dynamic-slice", "get-tuple-element", "all-gather-done", "collective-permute-done", "all-reduce-done")


@dataclass(frozen=True)
class Collective:
    """One collective instruction: its payload, device groups and executions per step."""

    kind: str  # one of KINDS
    array_bytes: int  # the full array over the group (all-gather output, reduce-scatter input, else the operand)
    group_size: int  # devices per replica group (collective-permute: 2)
    count: int  # executions per step
    axes: tuple[str, ...]  # mesh axes along which the devices of one group differ
    spans_nodes: bool  # some group holds devices of more than one node

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends per execution (ring algorithm)."""
        n = self.group_size
        if self.kind == "collective-permute":
            return float(self.array_bytes)
        factor = 2 * (n - 1) / n if self.kind == "all-reduce" else (n - 1) / n
        return factor * self.array_bytes


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (``bf16[8,128]{1,0}``, ``f32[]``, tuples summed)."""
    total = 0
    for dtype, dims in _ARRAY.findall(re.sub(r"/\*.*?\*/", "", shape)):
        bits = _BITS.get(dtype) or (int(dtype[1]) if re.fullmatch(r"f[468]e\w+", dtype) else None)
        if bits is None:
            raise ValueError(f"unknown HLO element type {dtype!r} in {shape!r}")
        elements = math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())
        total += -(-elements * bits // 8)
    return total


def _balanced(text: str, start: int) -> int:
    """The index just past the bracket group opening at ``text[start]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        if text[i] in pairs:
            stack.append(pairs[text[i]])
        elif stack and text[i] == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO: {text[start : start + 80]!r}")


@dataclass
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    root: bool = False


def _parse_instruction(line: str) -> _Instruction | None:
    """``%name = shape opcode(operands), attrs`` split into its parts (comments removed)."""
    line = re.sub(r"/\*.*?\*/", "", line)
    head = _INSTRUCTION.match(line)
    if head is None:
        return None
    pos = head.end()
    shape_end = _balanced(line, pos) if line[pos] == "(" else line.index(" ", pos)
    op = _OPCODE.match(line, shape_end)
    if op is None:
        return None
    args_end = _balanced(line, op.end() - 1)
    args = line[op.end() : args_end - 1]
    operands, depth, token = [], 0, ""
    for ch in args + ",":
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            operands.append(token.strip())
            token = ""
        else:
            token += ch
    operands = [o for o in operands if o]
    root = re.match(r"\s*ROOT\s", line) is not None
    return _Instruction(head.group(1), line[pos:shape_end], op.group(1), operands, line[args_end:], root)


def _unquoted(attrs: str) -> str:
    """Attributes with their string values (metadata, backend_config) emptied."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', attrs)


def _name(operand: str) -> str:
    """The instruction an operand names (``%x`` or ``f32[4]{0} %x``)."""
    return operand.split()[-1].lstrip("%")


def _operand_shape(operand: str, shapes: dict[str, str]) -> str:
    """The shape of an operand: its defining instruction's, else the one printed inline."""
    name = _name(operand)
    if name in shapes:
        return shapes[name]
    if _ARRAY.search(operand) is None:
        raise ValueError(f"no shape for operand {operand!r}")
    return operand.rsplit(" ", 1)[0]


def _operand_bytes(operand: str, shapes: dict[str, str], f32_as_bf16: bool = False) -> int:
    """Bytes of an operand; ``f32_as_bf16`` counts its f32 arrays at bf16 size."""
    shape = _operand_shape(operand, shapes)
    return shape_bytes(re.sub(r"\bf32\[", "bf16[", shape) if f32_as_bf16 else shape)


def _dtype(shape: str) -> str:
    found = _ARRAY.search(shape)
    return found.group(1) if found else ""


def _dims(shape: str) -> list[int] | None:
    """The dimensions of the shape's first array, None without one."""
    found = _ARRAY.search(shape)
    return [int(d.lstrip("<=")) for d in found.group(2).split(",") if d.strip()] if found else None


def _elements(shape: str) -> int:
    dims = _dims(shape)
    return 0 if dims is None else math.prod(dims)


def _iota(dims: list[int], reshape: list[int], perm: list[int] | None) -> np.ndarray:
    devices = np.arange(math.prod(reshape)).reshape(reshape)
    return (devices.transpose(perm) if perm else devices).reshape(dims)


def _ints(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"\d+", text)]


def _mesh_groups(text: str) -> np.ndarray:
    """Groups of ``mesh[...], device_ids=(...) {axes}`` (XLA's MeshAxesReplicaGroupList)."""
    mesh = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*(?:\([^)]*\))?)\))?\s*\{([^}]*)\}", text)
    if mesh is None:
        raise ValueError(f"unreadable mesh replica groups: {text[:120]!r}")
    axes = re.findall(r"'?([^'=,\s]+)'?\s*=\s*(\d+)", mesh.group(1))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    ids = mesh.group(2)
    if ids is None:
        devices = np.arange(math.prod(sizes)).reshape(sizes)
    elif iota := re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", ids):
        devices = _iota(sizes, _ints(iota.group(1)), _ints(iota.group(2)) if iota.group(2) else None)
    else:
        devices = np.array(_ints(ids)[-math.prod(sizes) :]).reshape(sizes)
    refs = defaultdict(list)  # mesh dim -> [(order in the group list, pre_size, size)]
    for order, ref in enumerate(re.findall(r"'?([^':,\s]+)'?(?::\((\d+)\)(\d+))?", mesh.group(3))):
        dim = names.index(ref[0])
        refs[dim].append((order, int(ref[1]), int(ref[2])) if ref[1] else (order, 1, sizes[dim]))
    split, grouped = [], {}  # factor dims of the reshaped mesh; group-list order -> factor index
    for dim, size in enumerate(sizes):
        prefix = 1
        for order, pre, sub in sorted(refs.get(dim, []), key=lambda r: r[1]):
            if pre != prefix:
                split.append(pre // prefix)
            grouped[order] = len(split)
            split.append(sub)
            prefix = pre * sub
        if prefix != size or not refs.get(dim):
            split.append(size // prefix)
    last = [grouped[o] for o in sorted(grouped)]
    first = [i for i in range(len(split)) if i not in last]
    group_size = math.prod(split[i] for i in last)
    return devices.reshape(split).transpose(first + last).reshape(-1, group_size)


def replica_groups(attrs: str, num_devices: int) -> np.ndarray | None:
    """The device groups (rows) of a collective's ``replica_groups=``, or None without one."""
    found = re.search(r"replica_groups=", attrs)
    if found is None:
        return None
    text = attrs[found.end() :]
    if text.startswith("mesh["):
        return _mesh_groups(text)
    if text.startswith("maximal_mesh["):
        return np.array([[_ints(text[: text.index("]")])[0]]])
    if text.startswith("{"):
        body = text[1 : _balanced(text, 0) - 1].strip()
        rows = [_ints(g) for g in re.findall(r"\{([^}]*)\}", body)]
        return np.array(rows) if rows else np.arange(num_devices)[None, :]
    iota = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if iota is None:
        raise ValueError(f"unreadable replica groups: {text[:120]!r}")
    perm = _ints(iota.group(3)) if iota.group(3) else None
    return _iota(_ints(iota.group(1)), _ints(iota.group(2)), perm)


def _device_groups(kind: str, attrs: str, num_devices: int) -> np.ndarray:
    """Rows of devices that communicate: replica groups, or a permute's (source, target) pairs
    that move data (self-sends dropped)."""
    if kind != "collective-permute":
        groups = replica_groups(attrs, num_devices)
        return np.arange(num_devices)[None, :] if groups is None else groups
    pairs = re.search(r"source_target_pairs=(\{\{.*?\}\}|\{\})", attrs)
    found = re.findall(r"\{(\d+),(\d+)\}", pairs.group(1)) if pairs else []
    return np.array([[int(s), int(t)] for s, t in found if s != t], int).reshape(-1, 2)


def _computations(hlo_text: str) -> tuple[dict[str, list[_Instruction]], str]:
    """Instructions per computation, and the ENTRY computation's name."""
    computations: dict[str, list[_Instruction]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header is not None and not line.startswith("HloModule"):
            current = computations.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None and (parsed := _parse_instruction(line)) is not None:
            current.append(parsed)
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def _counts(computations: dict[str, list[_Instruction]], entry: str) -> dict[str, int]:
    """Executions per step of every computation (see the module docstring)."""
    callers: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for caller, instructions in computations.items():
        for ins in instructions:
            if ins.opcode in ("async-done", "async-update"):
                continue  # they repeat their start's calls=
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
            trips = int(trip.group(1)) if trip else 1
            attrs = _unquoted(ins.attrs)  # no calls hidden in metadata strings
            calls = [(m.group(1), m.group(2)) for m in _CALL.finditer(attrs)]
            calls += [(m.group(1), c.strip().lstrip("%")) for m in _CALL_LIST.finditer(attrs) for c in m.group(2).split(",")]
            for key, callee in calls:
                factor = trips if key == "body" and ins.opcode == "while" else 1
                factor = trips + 1 if key == "condition" and trip else factor
                callers[callee].append((caller, factor))
    counts: dict[str, int] = {}

    def count(name: str) -> int:
        if name not in counts:
            counts[name] = 0  # a call cycle (none in valid HLO) stops here
            counts[name] = 1 if name == entry else sum(count(c) * f for c, f in callers[name])
        return counts[name]

    return {name: count(name) for name in computations}


class _Graph:
    """Definitions and uses of the instructions of a module, across fusion boundaries."""

    def __init__(self, computations: dict[str, list[_Instruction]]):
        self.defs = {ins.name: ins for instructions in computations.values() for ins in instructions}
        self.users: dict[str, list[tuple[_Instruction, int]]] = defaultdict(list)
        self.roots: dict[str, str] = {}  # instruction name -> its computation, for roots only
        self.params: dict[str, dict[int, str]] = defaultdict(dict)  # computation -> number -> name
        self.fusions: dict[str, list[_Instruction]] = defaultdict(list)  # fused computation -> callers
        self.root_of: dict[str, str] = {}  # computation -> its root's name
        for computation, instructions in computations.items():
            for ins in instructions:
                for index, operand in enumerate(ins.operands):
                    self.users[_name(operand)].append((ins, index))
                if ins.root:
                    self.roots[ins.name] = computation
                    self.root_of[computation] = ins.name
                if ins.opcode == "parameter" and ins.operands and ins.operands[0].isdigit():
                    self.params[computation][int(ins.operands[0])] = ins.name
                if ins.opcode == "fusion" and (called := self.called(ins)):
                    self.fusions[called].append(ins)

    @staticmethod
    def called(fusion: _Instruction) -> str | None:
        found = re.search(r"\bcalls=%?([\w.\-]+)", _unquoted(fusion.attrs))
        return found.group(1) if found else None

    def uses(self, name: str, through: tuple[str, ...]) -> list[_Instruction | None]:
        """The instructions that use ``name``'s value, looking through the ``through`` ops
        (as their operand 0) and into and out of fusions; None: it leaves a non-fusion
        computation (a program output, a loop's carry...)."""
        found: list[_Instruction | None] = []
        stack, seen = [name], set()
        while stack:
            value = stack.pop()
            if value in seen:
                continue
            seen.add(value)
            if value in self.roots:
                callers = self.fusions.get(self.roots[value])
                if callers:
                    stack.extend(f.name for f in callers)
                else:
                    found.append(None)
            for user, index in self.users.get(value, []):
                called = self.called(user) if user.opcode == "fusion" else None
                if called is not None and index in self.params.get(called, {}):
                    stack.append(self.params[called][index])
                elif user.opcode in through and index == 0:
                    stack.append(user.name)
                else:
                    found.append(user)
        return found

    def from_bf16(self, name: str) -> bool:
        """Whether ``name`` is a convert from bf16 (through layout ops and fusion roots)."""
        ins = self.defs.get(name)
        while ins is not None:
            if ins.opcode == "convert":
                source = self.defs.get(_name(ins.operands[0]))
                return _dtype(source.shape if source else ins.operands[0]) == "bf16"
            if ins.opcode in _LAYOUT:
                ins = self.defs.get(_name(ins.operands[0]))
            elif ins.opcode == "fusion" and (called := self.called(ins)) in self.root_of:
                ins = self.defs.get(self.root_of[called])
            else:
                return False
        return False

    def to_bf16(self, name: str) -> bool:
        """Whether every use of ``name`` first converts it to bf16 (through layout and slice ops)."""
        uses = self.uses(name, _LAYOUT + _SLICES)
        return bool(uses) and all(u is not None and u.opcode == "convert" and _dtype(u.shape) == "bf16" for u in uses)

    def scattered(self, ins: _Instruction, group_size: int) -> list[bool]:
        """Per operand of the all-reduce ``ins`` (tuple elements: through their
        get-tuple-elements), whether every use of its result dynamic-slices ``1 / group_size``
        of it."""
        if not ins.shape.lstrip().startswith("("):
            results = {0: [ins.name]}
        else:
            results = defaultdict(list)
            for user, _ in self.users.get(ins.name, []):
                index = re.search(r"\bindex=(\d+)", user.attrs) if user.opcode == "get-tuple-element" else None
                if index is None:
                    return [False] * len(ins.operands)  # the tuple itself is used
                results[int(index.group(1))].append(user.name)
        flags = []
        for i, operand in enumerate(ins.operands):
            source = self.defs.get(_name(operand))
            full = _elements(source.shape if source else operand)
            uses = [u for name in results.get(i, []) for u in self.uses(name, ("convert", "bitcast", "copy", "reshape"))]
            flags.append(
                full > 0
                and bool(uses)
                and all(u is not None and u.opcode == "dynamic-slice" and _elements(u.shape) * group_size == full for u in uses)
            )
        return flags


def collectives(
    hlo_text: str, mesh_shape: dict[str, int], devices_per_node: int, as_accelerator: bool = True
) -> list[Collective]:
    """The collectives of a compiled SPMD program, in program text order.

    ``mesh_shape`` is the ordered axis -> size mapping of the mesh the program was compiled
    for (size-1 axes included); device ids are row-major flat indices into it.
    ``as_accelerator`` reads a CPU-compiled program as XLA:GPU/TPU would run it: GSPMD's
    all-reduce + dynamic-slice as a reduce-scatter, and collectives XLA:CPU widened from bf16
    to f32 at bf16 size (see the module docstring); False gives the HLO's own collectives.
    """
    names, sizes = tuple(mesh_shape), tuple(mesh_shape.values())
    num_devices = math.prod(sizes)
    partitions = re.search(r"num_partitions=(\d+)", hlo_text)
    if partitions and int(partitions.group(1)) not in (1, num_devices):
        raise ValueError(f"the program has {partitions.group(1)} partitions but the mesh {mesh_shape} has {num_devices}")
    computations, entry = _computations(hlo_text)
    counts = _counts(computations, entry)
    shapes = {ins.name: ins.shape for instructions in computations.values() for ins in instructions}
    graph = _Graph(computations) if as_accelerator else None
    found = []
    for name, instructions in computations.items():
        for ins in instructions:
            kind = ins.opcode.removesuffix("-start")
            if kind not in KINDS or counts[name] == 0:
                continue
            attrs = _unquoted(ins.attrs)
            operands = ins.operands[:1] if kind == "collective-permute" and "slice_sizes=" in attrs else ins.operands
            groups = _device_groups(kind, attrs, num_devices)
            if groups.size == 0 or groups.shape[1] < 2:
                continue
            narrow, scattered = False, [False] * len(operands)
            if graph is not None:
                if kind in ("all-reduce", "reduce-scatter"):
                    narrow = _PROMOTED.search(attrs) is not None
                else:
                    widened = [_dtype(_operand_shape(o, shapes)) != "f32" or graph.from_bf16(_name(o)) for o in operands]
                    narrow = all(widened) and graph.to_bf16(ins.name)
                if kind == "all-reduce":
                    scattered = graph.scattered(ins, int(groups.shape[1]))
            each = [_operand_bytes(o, shapes, narrow) for o in operands]
            parts = {kind: sum(each) * (groups.shape[1] if kind == "all-gather" else 1)}
            if any(scattered):  # the sliced elements as a reduce-scatter, the rest stay an all-reduce
                parts = {"reduce-scatter": sum(b for b, f in zip(each, scattered, strict=True) if f)}
                if not all(scattered):
                    parts["all-reduce"] = sum(b for b, f in zip(each, scattered, strict=True) if not f)
            if groups.max() >= num_devices:
                raise ValueError(f"device id {groups.max()} of {ins.name} is outside the mesh {mesh_shape}")
            coords = np.stack(np.unravel_index(groups, sizes), axis=-1)  # [group, member, axis]
            varies = (coords != coords[:, :1]).any(axis=(0, 1))
            nodes = groups // devices_per_node
            found += [
                Collective(
                    kind=part,
                    array_bytes=nbytes,
                    group_size=int(groups.shape[1]),
                    count=counts[name],
                    axes=tuple(a for a, v in zip(names, varies, strict=True) if v),
                    spans_nodes=bool((nodes != nodes[:, :1]).any()),
                )
                for part, nbytes in parts.items()
            ]
    return found
