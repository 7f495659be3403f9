"""The work of a compiled XLA program per step: matmul FLOPs and memory traffic.

``program_cost(hlo_text)`` reads the optimized HLO text of a (per-device, SPMD-partitioned)
program and returns its ``dot`` FLOPs and the bytes its instructions read and write, with
every computation counted as often as it runs in one step (``hlo``'s loop trip
counts: a scanned layer stack counts its body once per layer, which XLA's own
``cost_analysis`` does not). The cost model of `nnxtron plan --search` turns the bytes into
time at the device's memory bandwidth.

Rules (XLA's ``HloCostAnalysis`` model of memory traffic, per executed instruction):

- **FLOPs**: every ``dot``, inside a fusion or not: 2 x output elements x the contracted size.
- **Bytes**: the instructions of computations that run as such (the entry, loop bodies and
  conditions, conditional branches, ``call`` targets; not fusion bodies or reducers): the
  bytes of the output plus those of each operand. Slices (``slice``, ``dynamic-slice``,
  ``gather``) read what they write; an in-place update (``dynamic-update-slice``,
  ``scatter``) reads and writes its update only. A fusion reads each operand whole, except
  one its body only slices (the slices' bytes) or updates in place (nothing), and writes its
  root, whose in-place updates count their update only.
- Not counted: collectives (the cost model times them over the links), host transfers
  (``copy-start`` / ``copy-done``: the offload term), tuples, parameters, constants,
  bitcasts and control flow. Bytes of fusions that contain a ``dot`` are kept apart
  (``dot_bytes``): a matmul's own traffic, which its roofline factor covers on an
  accelerator.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from nnxtron.tools.search.hlo import (
    KINDS,
    _computations,
    _counts,
    _dims,
    _elements,
    _Instruction,
    _name,
    _operand_shape,
    shape_bytes,
)

_NO_TRAFFIC = frozenset(
    {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional", "after-all",
     "partition-id", "replica-id", "opt-barrier", "add-dependency", "copy-start", "copy-done", "send", "send-done",
     "recv", "recv-done", "async-start", "async-update", "async-done", "iota"}
    | set(KINDS) | {f"{k}-{s}" for k in KINDS for s in ("start", "done")}
)  # fmt: skip
_SLICES = ("slice", "dynamic-slice", "gather")
_UPDATES = {"dynamic-update-slice": 1, "scatter": 2}  # in-place update: the operand holding the update
_TOP_LEVEL_CALLS = re.compile(r"\b(body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_FUSION_BODY = re.compile(r"\bcalls=%?([\w.\-]+)")


@dataclass(frozen=True)
class ProgramCost:
    """Per device per step: matmul FLOPs, and bytes read + written by the fusions that
    hold a matmul (``dot_bytes``) and by every other instruction (``other_bytes``)."""

    dot_flops: float
    dot_bytes: float
    other_bytes: float


def dot_flops(ins: _Instruction, shapes: dict[str, str]) -> float:
    """2 x output elements x contracted size of one ``dot``."""
    lhs = _dims(_operand_shape(ins.operands[0], shapes)) or []
    found = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
    contracted = [int(d) for d in found.group(1).split(",") if d] if found else []
    return 2.0 * _elements(ins.shape) * math.prod(lhs[d] for d in contracted)


def _top_level(computations: dict[str, list[_Instruction]], entry: str) -> set[str]:
    """Computations that run as such: the entry and what control flow calls."""
    names = {entry}
    for instructions in computations.values():
        for ins in instructions:
            names.update(m.group(2) for m in _TOP_LEVEL_CALLS.finditer(ins.attrs))
            for branches in _BRANCHES.finditer(ins.attrs):
                names.update(b.strip().lstrip("%") for b in branches.group(1).split(","))
            if ins.opcode == "call" and (target := re.search(r"\bto_apply=%?([\w.\-]+)", ins.attrs)):
                names.add(target.group(1))
    return names


def _update_bytes(ins: _Instruction, shapes: dict[str, str]) -> int:
    """What an in-place update writes (and reads): its update operand."""
    return shape_bytes(_operand_shape(ins.operands[_UPDATES[ins.opcode]], shapes))


class _Fusions:
    """Bytes a fusion reads and writes, from what its body does with each parameter."""

    def __init__(self, computations: dict[str, list[_Instruction]]):
        self.computations = computations
        self.shapes = {c: {i.name: i.shape for i in ins} for c, ins in computations.items()}

    def written(self, body: str) -> int:
        """The root's bytes; an in-place update (alone or in a tuple) counts its update."""
        instructions = self.computations[body]
        by_name = {i.name: i for i in instructions}
        root = next(i for i in instructions if i.root)
        parts = [by_name.get(_name(o)) for o in root.operands] if root.opcode == "tuple" else [root]
        total = 0
        for part in parts:
            if part is not None and part.opcode in _UPDATES:
                total += _update_bytes(part, self.shapes[body])
            elif part is not None:
                total += shape_bytes(part.shape)
        return total

    def read(self, body: str, index: int, whole: int) -> int:
        """Bytes read of parameter ``index``: its slices only when every use slices it,
        nothing when it is only updated in place, else ``whole``."""
        instructions = self.computations[body]
        param = next((i for i in instructions if i.opcode == "parameter" and i.operands == [str(index)]), None)
        if param is None:
            return whole
        total = 0
        for ins in instructions:
            for position, operand in enumerate(ins.operands):
                if _name(operand) != param.name:
                    continue
                if ins.opcode in _SLICES and position == 0:
                    total += shape_bytes(ins.shape)
                elif not (ins.opcode in _UPDATES and position == 0):
                    return whole
        return total

    def contains_dot(self, body: str) -> bool:
        return any(i.opcode == "dot" for i in self.computations[body])


def _traffic(ins: _Instruction, shapes: dict[str, str], fusions: _Fusions) -> int:
    """Bytes one execution of a top-level instruction reads and writes."""
    if ins.opcode in _SLICES:
        return 2 * shape_bytes(ins.shape) + sum(shape_bytes(_operand_shape(o, shapes)) for o in ins.operands[1:])
    if ins.opcode in _UPDATES:
        return 2 * _update_bytes(ins, shapes)
    operands = [shape_bytes(_operand_shape(o, shapes)) for o in ins.operands]
    if ins.opcode == "fusion" and (body := _FUSION_BODY.search(ins.attrs)):
        name = body.group(1)
        return fusions.written(name) + sum(fusions.read(name, k, b) for k, b in enumerate(operands))
    return shape_bytes(ins.shape) + sum(operands)


def program_cost(hlo_text: str) -> ProgramCost:
    """Matmul FLOPs and memory traffic of one step of the program (see the module docstring)."""
    computations, entry = _computations(hlo_text)
    counts = _counts(computations, entry)
    top = _top_level(computations, entry)
    fusions = _Fusions(computations)
    flops = dot = other = 0.0
    for name, instructions in computations.items():
        runs = counts.get(name, 0)
        if not runs:
            continue
        shapes = fusions.shapes[name]
        for ins in instructions:
            if ins.opcode == "dot":
                flops += runs * dot_flops(ins, shapes)
            if name not in top or ins.opcode in _NO_TRAFFIC:
                continue
            traffic = runs * _traffic(ins, shapes, fusions)
            body = _FUSION_BODY.search(ins.attrs) if ins.opcode == "fusion" else None
            if ins.opcode == "dot" or (body is not None and fusions.contains_dot(body.group(1))):
                dot += traffic
            else:
                other += traffic
    return ProgramCost(flops, dot, other)
