"""Where a train step's time goes, op by op: a profiler trace of the step read against its HLO.

``nnxtron bench --profile DIR`` writes both (``write_profile``): a ``jax.profiler`` trace of
``PROFILE_STEPS`` steps after the timed ones, and the compiled step's HLO text
(``train_step.hlo.txt``). ``breakdown`` reads them back and sums the executed ops' time per
step into groups that hold for any JAX train step (nnxtron's or MaxText's, whose HLO dump
``benchmarks/step_breakdown.py`` reads the same way), from the HLO alone:

* **where**: inside the layer loop (the op's ``op_name`` metadata passes ``while/body``) or
  outside it; a ``[.., vocab]``-shaped op is ``logits + loss`` (the output layer, the loss
  and their gradients); what no autodiff pass holds (no ``jvp`` in the name) is the
  ``update`` (optimizer, clipping, metrics);
* **pass**: ``forward`` (``jvp``), ``backward`` (``transpose(jvp``) and, inside it,
  ``recompute`` (``rematted_computation``: remat's second forward);
* **kind**: ``matmul`` (a dot, or a fusion around one), ``copy`` (copies and transposes:
  layout changes), ``sort``, ``other`` (elementwise and reduction fusions, slices, ...).

The XLA:CPU runtime records each executed op (thunk) with its name (``hlo_op``); its time is
the op's own, whichever thread ran it, so the sums can exceed the step's wall time when ops
run side by side. A TPU records its ops on the device plane's ``XLA Ops`` line, one after
another (``op_times`` reads both).
"""

from __future__ import annotations

import bisect
import collections
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from nnxtron.errors import UserError

PROFILE_STEPS = 3  # steps traced after the timed ones
HLO_FILE = "train_step.hlo.txt"
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\(")  # tuple shapes hold spaces
_COMPUTATION = re.compile(r"^%?([\w.\-]+)\s.*\{\s*$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OPERAND = re.compile(r"%([\w.\-]+)")
MATMULS = ("dot", "convolution", "ragged-dot")


@dataclass(frozen=True)
class Op:
    """One instruction of the HLO: its result shape text, opcode, ``op_name`` metadata and
    whether it is (or fuses) a dot."""

    shape: str
    opcode: str
    op_name: str
    matmul: bool


def hlo_ops(text: str) -> dict[str, Op]:
    """The instructions of an HLO module's text by name. An op that XLA left without
    ``op_name`` metadata takes its fused computation's (the root's, else the first named),
    else its first named operand's (a few producers up): the pass and place of its inputs."""
    dots: set[str] = set()  # computations that hold a dot
    named: dict[str, str] = {}  # computation -> the op_name it stands for
    current = None
    raw: dict[str, tuple[str, str, str, str | None, list[str]]] = {}
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head and "=" not in line.split("{")[0]:
            current = head[1]
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        root, name, shape, opcode = m[1], m[2], m[3], m[4]
        op_name = _OP_NAME.search(line)
        calls = _CALLS.search(line)
        if current:
            if opcode in MATMULS:
                dots.add(current)
            if op_name and (root or current not in named):
                named[current] = op_name[1]
        operands = _OPERAND.findall(line[m.end() : line.find(")", m.end())])
        raw[name] = (shape, opcode, op_name[1] if op_name else "", calls[1] if calls else None, operands)
    names = {name: op_name or named.get(calls or "", "") for name, (_, _, op_name, calls, _) in raw.items()}
    for _ in range(3):  # inherit from producers
        for name, (*_, operands) in raw.items():
            if not names[name]:
                names[name] = next((names[o] for o in operands if names.get(o)), "")
    return {
        name: Op(shape, opcode, names[name], opcode in MATMULS or calls in dots)
        for name, (shape, opcode, _, calls, _) in raw.items()
    }


def op_times(trace_dir: str | Path, module: Callable[[str], bool]) -> dict[str, tuple[float, int]]:
    """Seconds and executions of each op of the modules ``module`` accepts, summed over the
    trace (the ``*.xplane.pb`` under ``trace_dir``). XLA:CPU (and GPU) events name their op and
    module in stats (``hlo_op``, ``hlo_module``); a TPU's device plane does not: its ``XLA Ops``
    line names each event by the instruction's text (``%fusion.3 = ...``) and its ``XLA Modules``
    line holds the executions of the modules, which the ops fall within (:func:`_tpu_op_times`)."""
    from jax.profiler import ProfileData

    files = sorted(Path(trace_dir).rglob("*.xplane.pb"))
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for plane in ProfileData.from_file(str(files[-1])).planes:
        lines = {line.name: line for line in plane.lines}
        if "XLA Ops" in lines and "XLA Modules" in lines:
            _tpu_op_times(lines["XLA Modules"], lines["XLA Ops"], module, totals)
            continue
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                name, owner = stats.get("hlo_op"), stats.get("hlo_module")
                if name and owner and module(str(owner)):
                    totals[str(name)][0] += event.duration_ns / 1e9
                    totals[str(name)][1] += 1
    return {name: (seconds, int(count)) for name, (seconds, count) in totals.items()}


_TPU_OP = re.compile(r"^%?([\w.\-]+)\s*=")


def _tpu_op_times(modules: Any, ops: Any, accept: Callable[[str], bool], totals: dict[str, list[float]]) -> None:
    """Add the ops of a TPU device plane (``ops``: its ``XLA Ops`` line) that ran inside an
    execution of an accepted module (``modules``: its ``XLA Modules`` line) to ``totals``."""
    spans = sorted((event.start_ns, event.end_ns) for event in modules.events if accept(event.name))
    starts = [start for start, _ in spans]
    for event in ops.events:
        i = bisect.bisect_right(starts, event.start_ns) - 1
        named = _TPU_OP.match(event.name)
        if i >= 0 and event.start_ns < spans[i][1] and named:
            totals[named.group(1)][0] += event.duration_ns / 1e9
            totals[named.group(1)][1] += 1


def _kind(op: Op) -> str:
    """matmul, sort, copy (a copy or transpose, or a fusion named after one) or other."""
    if op.matmul:
        return "matmul"
    if op.opcode == "sort":
        return "sort"
    if op.opcode.startswith(("copy", "transpose")) or (
        op.opcode == "fusion" and re.match(r"(copy|transpose)", op.op_name.rsplit("/", 1)[-1])
    ):
        return "copy"
    return "other"


def classify(op: Op | None, vocab: int) -> tuple[str, str, str]:
    """(where, pass, kind) of an op (module docstring); an op the HLO does not name is ``other``."""
    if op is None:
        return "outside layers", "other", "other"
    name = op.op_name
    kind = _kind(op)
    backward = "transpose(jvp" in name
    step_pass = (
        "recompute" if "rematted_computation" in name else "backward" if backward else "forward" if "jvp" in name else "update"
    )
    if step_pass == "update":
        where = "update"
    elif re.search(rf"[\[,]{vocab}[\],]", op.shape):
        where = "logits + loss"
    else:
        where = "layers" if "while/body" in name else "outside layers"
    return where, step_pass, kind


def breakdown(times: dict[str, tuple[float, int]], ops: dict[str, Op], vocab: int, steps: int) -> dict[str, Any]:
    """Milliseconds and executed ops per step by (where, pass, kind), and their totals."""
    groups: dict[tuple[str, str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for name, (seconds, count) in times.items():
        key = classify(ops.get(name), vocab)
        groups[key][0] += seconds * 1e3 / steps
        groups[key][1] += count / steps
    return {
        "groups": {" / ".join(key): {"ms": ms, "ops": n} for key, (ms, n) in sorted(groups.items())},
        "ms": sum(ms for ms, _ in groups.values()),
        "ops": sum(n for _, n in groups.values()),
    }


def summarize(groups: dict[str, dict[str, float]], levels: Iterable[int]) -> dict[str, dict[str, float]]:
    """``breakdown``'s groups summed over the key parts not in ``levels`` (0 where, 1 pass, 2 kind)."""
    keep = tuple(levels)
    out: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"ms": 0.0, "ops": 0.0})
    for key, value in groups.items():
        parts = key.split(" / ")
        short = " / ".join(parts[i] for i in keep)
        out[short]["ms"] += value["ms"]
        out[short]["ops"] += value["ops"]
    return dict(out)


def profile_directory(path: str | Path) -> Path:
    """``path`` as a directory for a profile (made if missing), before any work; one clear error
    (``UserError``) where it cannot be one."""
    directory = Path(path).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--profile {path}: cannot make that directory ({err.strerror}); give a writable directory") from None
    return directory


def write_profile(directory: str | Path, compiled: Any, run_step: Callable[[], Any]) -> Path:
    """Trace ``PROFILE_STEPS`` calls of ``run_step`` (each blocks until done) into
    ``directory`` (``profile_directory``) and write the compiled step's HLO text beside the trace."""
    directory = Path(directory)
    (directory / HLO_FILE).write_text(compiled.as_text())
    jax.profiler.start_trace(str(directory))
    try:
        for _ in range(PROFILE_STEPS):
            run_step()
    finally:
        jax.profiler.stop_trace()
    return directory


def read_profile(
    directory: str | Path, vocab: int, hlo_file: str | Path | None = None, steps: int = PROFILE_STEPS
) -> dict[str, Any]:
    """``breakdown`` of a profile directory (``write_profile``'s, or a trace with ``hlo_file``)."""
    ops = hlo_ops(Path(hlo_file or Path(directory) / HLO_FILE).read_text())
    return breakdown(op_times(directory, lambda module: "train_step" in module), ops, vocab, steps)
