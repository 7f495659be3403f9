"""Parameter shardings and per-device memory of ``nnxtron plan`` next to MaxText 0.2.5's AOT compile.

    python benchmarks/sharding_vs_maxtext.py                                   # every case
    python benchmarks/sharding_vs_maxtext.py --models llama3.1-8b --devices 8  # one case
    python benchmarks/sharding_vs_maxtext.py --devices 64 256 --timeout 900    # more fake devices
    python benchmarks/sharding_vs_maxtext.py --report                          # only re-write the .md from the .json

What it measures, for each (model, N fake CPU devices) of ``--models`` x ``--devices`` (default
llama3.1-8b, mixtral-8x7b, deepseek3-671b on 8, 64 and 256 devices), both systems in MaxText's
config world: MaxText 0.2.5's own ``base.yml`` (nnxtron reads it: ``tests/assets/maxtext/base.yml`` is
the same file) with ``model_name=M per_device_batch_size=1 max_target_length=2048 dtype=bfloat16
weight_dtype=float32 megablox=false``, i.e. base.yml's mesh (``ici_fsdp_parallelism=-1``: all N devices on
``fsdp``), logical axis rules, ``scan_layers=true``, ``remat_policy=full`` and AdamW:

- MaxText: ``benchmarks/maxtext_sharding_driver.py`` in MaxText's cached environment (that of
  ``scripts/maxtext_reference.py``; ``DECOUPLE_GCLOUD=TRUE JAX_PLATFORMS=cpu
  XLA_FLAGS=--xla_force_host_platform_device_count=N``): the abstract train state of
  ``train_compile.get_shaped_inputs`` (no weights allocated) with each parameter's ``NamedSharding``,
  then the train step compiled ahead of time as ``train_compile`` does and ``compiled.memory_analysis()``.
  ``megablox=false``: MaxText's Pallas grouped matmul runs in interpret mode on CPU (a MoE step takes
  minutes); ``sparse_matmul=true`` (``ragged_dot``) stays. nnxtron has no megablox kernel (the key is
  read and reported).
- nnxtron: ``python -m nnxtron plan <base.yml> ... devices=N --json`` with this interpreter: the
  per-parameter table (PartitionSpec, shard shape) and the compiled step's memory analysis.
- Per parameter: nnxtron's path <-> MaxText's (``nnxtron.convert.maxtext_tree.entries`` and ``scan``:
  the names nnxtron's MaxText checkpoint conversion uses; MaxText stacks scanned layers on axis 1,
  its ``MoEBiasVar`` state on axis 0, nnxtron on axis 0), each side's PartitionSpec reduced to the mesh
  axes of size > 1 that split each dimension of one layer (plus the layer axis), and whether they
  agree; the bytes per device of each array on each side.
- Per case: the train state per device from the shardings (parameters, optimizer state, other) and
  XLA's memory analysis of each compiled step (arguments, outputs, aliased, temporaries, peak =
  arguments + outputs - aliased + temporaries + code) on the CPU backend.

``--keys k=v ...`` adds keys to both sides (a variant, keyed ``model@devices+k=v``): the results hold
``gradient_clipping_threshold=0``, ``ici_tensor_parallelism=4``, ``ici_expert_parallelism=4`` (with and without
``sparse_matmul=false``) and ``sparse_matmul=false`` on 8 devices, next to the 9 default cases; docs/plan.md,
"Sharding and memory next to MaxText", reads them.

Not measured: nnxtron's PartitionSpec of DeepSeek's router bias (model state, not in plan's parameter
table; its bytes are in plan's other state); MaxText's step with ``ici_expert_parallelism`` > 1 and
``sparse_matmul=true`` (it emits ``ragged-all-to-all``, which XLA:CPU does not compile: recorded as the
error). The memory figures are XLA:CPU's; a TPU or GPU compile schedules and fuses otherwise.

Each run has ``--timeout`` seconds (default 900); a run that fails or times out is recorded with its
error and time, and the other side and the other cases go on. ``--no-compile`` skips MaxText's compile
(its shardings and state only; ``nnxtron plan`` always compiles). Results: ``benchmarks/results/sharding_vs_maxtext.json`` (raw; cases merge into what
is there, keyed by model and device count) and ``.md`` (the tables). Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from nnxtron.runtime.fake_devices import fake_device_env

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DRIVER = ROOT / "benchmarks" / "maxtext_sharding_driver.py"
sys.path.insert(0, str(ROOT / "scripts"))  # maxtext_reference: the MaxText environment

import maxtext_reference  # noqa: E402

MODELS = ("llama3.1-8b", "mixtral-8x7b", "deepseek3-671b")
DEVICES = (8, 64, 256)
SHARED = ("per_device_batch_size=1", "max_target_length=2048", "dtype=bfloat16", "weight_dtype=float32", "megablox=false")
MAXTEXT_RUN = ("run_name=sharding_vs_maxtext", "enable_checkpointing=false", "dataset_type=synthetic")
GIB = 1024**3


def child_env(devices: int, cache: str) -> dict[str, str]:
    """A child's environment on ``devices`` fake CPU devices, its caches in ``cache``."""
    return {**os.environ, **fake_device_env(devices), "XDG_CACHE_HOME": cache, "MPLCONFIGDIR": cache}


def run_timed(
    cmd: list[str], env: dict[str, str], cwd: str, timeout: int
) -> tuple[subprocess.CompletedProcess | None, float, str]:
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
        return done, time.perf_counter() - start, ""
    except subprocess.TimeoutExpired:
        return None, time.perf_counter() - start, f"timed out after {timeout} s"


def run_nnxtron(model: str, devices: int, timeout: int, cache: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "nnxtron", "plan", str(maxtext_reference.BASE_YML), f"model_name={model}", *SHARED, *extra,
           f"devices={devices}", "--json"]  # fmt: skip
    done, seconds, error = run_timed(cmd, child_env(devices, cache), cache, timeout)
    out: dict[str, Any] = {"command": " ".join(cmd[1:]), "wall_seconds": seconds}
    if done is None or done.returncode != 0:
        out["error"] = error or f"exit {done.returncode}: {(done.stderr or done.stdout)[-2000:]}"
        return out
    out["plan"] = json.loads(done.stdout)
    return out


def run_maxtext(interpreter: Path, base_yml: Path, model: str, devices: int, compile_step: bool, timeout: int,
                cache: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    result_file = Path(cache) / f"maxtext_{model}_{devices}.json"
    cmd = [
        str(interpreter),
        str(DRIVER),
        str(result_file),
        str(base_yml),
        f"model_name={model}",
        *SHARED,
        *extra,
        *MAXTEXT_RUN,
        f"base_output_directory={cache}/out",
        f"jax_cache_dir={cache}/jax_cache",
    ]  # jax_cache_dir: a fresh compile each time (base.yml caches in ~/jax_cache)
    if not compile_step:
        cmd.append("--no-compile")
    env = {**child_env(devices, cache), "DECOUPLE_GCLOUD": "TRUE"}
    env.pop("PYTHONPATH", None)  # MaxText's interpreter must not see nnxtron's
    done, seconds, error = run_timed(cmd, env, cache, timeout)
    out: dict[str, Any] = {"command": " ".join(cmd[1:]), "wall_seconds": seconds}
    if result_file.exists():  # the driver writes as it goes: what it got before a timeout or a failure counts
        out["result"] = json.loads(result_file.read_text())
    if done is None or done.returncode != 0:
        out["error"] = error or f"exit {done.returncode}: {(done.stderr or done.stdout)[-2000:]}"
    return out


# ---------------------------------------------------------------------------------------------
# the per-parameter comparison


def name_map(model: str, extra: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """MaxText's scanned name (below ``model/``) -> nnxtron's path, and where each stacks its layers."""
    from nnxtron.config.loader import load_config  # the nnxtron that this interpreter imports
    from nnxtron.convert import maxtext_tree
    from nnxtron.models.maxtext_map import BIAS_COLLECTION

    cfg = load_config(maxtext_reference.BASE_YML, [f"model_name={model}", *SHARED, *extra])
    entries = list(maxtext_tree.entries(cfg))
    # scan() on arrays that carry each entry's index tells which unscanned names make each scanned one
    flat = {e.maxtext: np.full((1, 1), i) for i, e in enumerate(entries)}
    out: dict[str, dict[str, Any]] = {}
    for key, value in maxtext_tree.scan(flat, cfg).items():
        members = {entries[int(i)].path for i in np.unique(value)}
        state = key.startswith(f"{BIAS_COLLECTION}/")
        name = key.removeprefix(f"{BIAS_COLLECTION}/")
        scanned = value.size > 1 or entries[int(value.flat[0])].block is not None
        out[name] = {
            "nnxtron": sorted(members),
            "state": state,
            "maxtext_layer_axis": (maxtext_tree.STATE_SCAN_AXIS if state else maxtext_tree.PARAM_SCAN_AXIS) if scanned else None,
            "nnxtron_layer_axis": 0 if scanned else None,
        }
    return out


def mesh_axes(spec: list | None, mesh: dict[str, int], ndim: int) -> list[tuple[str, ...]]:
    """Per dimension, the mesh axes of size > 1 that split it (a spec may be shorter than the rank)."""
    spec = list(spec or [])
    spec += [None] * (ndim - len(spec))
    out = []
    for entry in spec:
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(tuple(n for n in names if mesh.get(n, 1) > 1))
    return out


def show_axes(axes: list[tuple[str, ...]]) -> str:
    return "(" + ", ".join("+".join(a) if a else "-" for a in axes) + ")"


def drop(seq: list, axis: int | None) -> list:
    return list(seq) if axis is None else [x for i, x in enumerate(seq) if i != axis]


def compare_params(model: str, nx_plan: dict[str, Any], mt: dict[str, Any], extra: tuple[str, ...] = ()) -> dict[str, Any]:
    names = name_map(model, extra)
    nx_rows = {r["path"]: r for r in nx_plan["table"]}
    mt_rows = {r["path"].removeprefix("model/"): r for r in mt["parameters"] + mt.get("model_state", [])}
    rows, seen_nx = [], set()
    for mt_name, mt_row in sorted(mt_rows.items()):
        m = names.get(mt_name)
        row: dict[str, Any] = {"maxtext": mt_name, "maxtext_type": mt_row["type"], "maxtext_shape": mt_row["shape"],
                               "maxtext_spec": mt_row["spec"], "maxtext_bytes_per_device": mt_row["bytes_per_device"]}  # fmt: skip
        if m is None or len(m["nnxtron"]) != 1:
            row["status"] = "no nnxtron name" if m is None else f"several nnxtron names: {m['nnxtron']}"
            rows.append(row)
            continue
        nx_name = m["nnxtron"][0]
        row["nnxtron"] = nx_name
        nx_row = nx_rows.get(nx_name)
        if nx_row is None:
            row["status"] = "not in nnxtron's plan table" + (" (model state: counted in its other state)" if m["state"] else "")
            rows.append(row)
            continue
        seen_nx.add(nx_name)
        mt_axes = mesh_axes(mt_row["spec"], mt["mesh"], len(mt_row["shape"]))
        nx_axes = mesh_axes(nx_row["spec"], nx_plan["mesh"], len(nx_row["shape"]))
        la_mt, la_nx = m["maxtext_layer_axis"], m["nnxtron_layer_axis"]
        row.update({
            "nnxtron_shape": nx_row["shape"], "nnxtron_spec": nx_row["spec"],
            "nnxtron_bytes_per_device": nx_row["bytes_per_device"],
            "layer_shape_maxtext": drop(mt_row["shape"], la_mt), "layer_shape_nnxtron": drop(nx_row["shape"], la_nx),
            "maxtext_axes": show_axes(drop(mt_axes, la_mt)), "nnxtron_axes": show_axes(drop(nx_axes, la_nx)),
            "maxtext_layer_axis_split": list(mt_axes[la_mt]) if la_mt is not None else None,
            "nnxtron_layer_axis_split": list(nx_axes[la_nx]) if la_nx is not None else None,
        })  # fmt: skip
        if row["layer_shape_maxtext"] != row["layer_shape_nnxtron"]:
            row["status"] = "layouts differ"
        elif (drop(mt_axes, la_mt), row["maxtext_layer_axis_split"]) == (drop(nx_axes, la_nx), row["nnxtron_layer_axis_split"]):
            row["status"] = "agree"
        else:
            row["status"] = "differ"
        rows.append(row)
    for nx_name in sorted(set(nx_rows) - seen_nx):
        rows.append({"nnxtron": nx_name, "nnxtron_shape": nx_rows[nx_name]["shape"], "nnxtron_spec": nx_rows[nx_name]["spec"],
                     "status": "no MaxText array"})  # fmt: skip
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    return {"counts": counts, "rows": rows}


def memory_summary(nx: dict[str, Any], mt: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"nnxtron": {}, "maxtext": {}}
    if "plan" in nx:
        p = nx["plan"]
        out["nnxtron"] = {"params_bytes": p["state_per_device"]["params_bytes"],
                          "optimizer_state_bytes": p["state_per_device"]["optimizer_state_bytes"],
                          "other_state_bytes": p["state_per_device"]["other_state_bytes"],
                          "state_bytes": p["state_per_device"]["state_bytes"],
                          "param_count": p["params"]["total"]}  # fmt: skip
        if p.get("memory"):
            m = p["memory"]
            out["nnxtron"].update({k: m[k] for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
                                                     "generated_code_bytes", "peak_bytes")})  # fmt: skip
            out["nnxtron"]["compile_seconds"] = p.get("compile_seconds")
    if "result" in mt:
        r = mt["result"]
        s = r.get("state_per_device", {})
        out["maxtext"] = {"params_bytes": s.get("params_bytes"), "optimizer_state_bytes": s.get("optimizer_state_bytes"),
                          "other_state_bytes": (s.get("model_state_bytes") or 0) + (s.get("other_state_bytes") or 0),
                          "state_bytes": s.get("total_bytes"), "param_count": r.get("param_count")}  # fmt: skip
        if r.get("memory"):
            m = r["memory"]
            out["maxtext"].update({"argument_bytes": m["argument_size_in_bytes"], "output_bytes": m["output_size_in_bytes"],
                                   "alias_bytes": m["alias_size_in_bytes"], "temp_bytes": m["temp_size_in_bytes"],
                                   "generated_code_bytes": m.get("generated_code_size_in_bytes", 0),
                                   "peak_bytes": m["peak_bytes"]})  # fmt: skip
        out["maxtext"]["compile"] = r.get("compile")
    return out


# ---------------------------------------------------------------------------------------------
# the report


def gib(x: Any) -> str:
    return "n/a" if x is None else f"{x / GIB:.2f}"


def spec_text(spec: list | None) -> str:
    if spec is None:
        return "n/a"
    return "P(" + ", ".join("None" if e is None else e if isinstance(e, str) else "(" + ", ".join(e) + ")" for e in spec) + ")"


def case_order(key: str) -> tuple:
    model, rest = key.split("@", 1)
    devices, _, extra = rest.partition("+")
    return (int(devices), MODELS.index(model) if model in MODELS else 99, extra)


def report(data: dict[str, Any]) -> str:
    lines = ["# Parameter shardings and per-device memory: `nnxtron plan` next to MaxText 0.2.5", ""]
    about = data.get("about", {})
    lines += [f"Written by `benchmarks/sharding_vs_maxtext.py` ({about.get('date', '?')}); CPU backend, fake devices. "
              f"Both systems: MaxText's base.yml with `{' '.join(SHARED)}` (all devices on `fsdp`, scanned layers, "
              "full remat, AdamW). MaxText: its own abstract train state and AOT-compiled train step "
              "(`benchmarks/maxtext_sharding_driver.py`); nnxtron: `nnxtron plan ... --json`. "
              "Axes: per dimension of one layer (the layer axis dropped), the mesh axes of size > 1 that split it "
              "(`-`: none). Memory: GiB per device; the step's figures are XLA:CPU's memory analysis "
              "(peak = arguments + outputs - aliased + temporaries). `other`: arrays paired on one side only "
        "(DeepSeek's router bias is model state in nnxtron, outside plan's parameter table). Cases with extra keys "
        "(`--keys`) list them after the model; `n/a` memory: that side's compile failed (its section says why).", ""]  # fmt: skip
    if about.get("versions"):
        nnx_versions = about.get("nnxtron_versions", "not recorded")
        lines += [f"Versions: MaxText's environment {about['versions']}; nnxtron's {nnx_versions}", ""]
    lines += ["## Summary", "",
              "| model | devices | parameters agree | differ | other | MaxText state/dev | nnxtron state/dev | MaxText peak | nnxtron peak | MaxText temp | nnxtron temp | MaxText compile s | nnxtron compile s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for key in sorted(data["cases"], key=case_order):
        case = data["cases"][key]
        counts = case.get("comparison", {}).get("counts", {})
        mem = case.get("memory", {})
        nxm, mtm = mem.get("nnxtron", {}), mem.get("maxtext", {})
        mt_compile = mtm.get("compile") or {}
        mt_cs = mt_compile.get("compile_seconds")
        nx_cs = (nxm.get("compile_seconds") or {}).get("compile")
        other = sum(v for k, v in counts.items() if k not in ("agree", "differ"))
        label = case["model"] + "".join(f" {k}" for k in case.get("keys", []))
        lines.append(f"| {label} | {case['devices']} | {counts.get('agree', 0) if counts else 'n/a'} | {counts.get('differ', 0) if counts else 'n/a'} | {other} | "
                     f"{gib(mtm.get('state_bytes'))} | {gib(nxm.get('state_bytes'))} | {gib(mtm.get('peak_bytes'))} | {gib(nxm.get('peak_bytes'))} | "
                     f"{gib(mtm.get('temp_bytes'))} | {gib(nxm.get('temp_bytes'))} | "
                     f"{'n/a' if mt_cs is None else f'{mt_cs:.1f}'} | {'n/a' if nx_cs is None else f'{nx_cs:.1f}'} |")  # fmt: skip
    for key in sorted(data["cases"], key=case_order):
        case = data["cases"][key]
        lines += ["", f"## {case['model']} on {case['devices']} devices" + "".join(f", `{k}`" for k in case.get("keys", [])), ""]
        for side in ("maxtext", "nnxtron"):
            run = case.get(side, {})
            msg = f"- {side}: {run.get('wall_seconds', 0):.0f} s wall"
            if side == "maxtext" and "result" in run:
                c = run["result"].get("compile", {})
                msg += f"; mesh { ({k: v for k, v in run['result']['mesh'].items() if v > 1}) }; compile: {c.get('status')}"
                if c.get("status") == "failed":
                    msg += f" after {c.get('seconds', 0):.0f} s: `{c.get('error', '')[:300]}`"
            if side == "nnxtron" and "plan" in run:
                msg += f"; mesh { ({k: v for k, v in run['plan']['mesh'].items() if v > 1}) }"
            if run.get("error"):
                msg += f"; error: `{run['error'][-400:]}`"
            lines.append(msg)
        comp = case.get("comparison")
        if comp:
            lines += ["", f"Parameters: {comp['counts']}", ""]
            lines += ["| MaxText array | nnxtron path | status | MaxText spec | nnxtron spec | MaxText axes | nnxtron axes | MaxText MiB/dev | nnxtron MiB/dev |",
                      "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
            for r in comp["rows"]:
                mb = lambda b: "n/a" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
                lines.append(f"| {r.get('maxtext', '-')} | {r.get('nnxtron', '-')} | {r['status']} | {spec_text(r.get('maxtext_spec'))} | "
                             f"{spec_text(r.get('nnxtron_spec'))} | {r.get('maxtext_axes', '')} | {r.get('nnxtron_axes', '')} | "
                             f"{mb(r.get('maxtext_bytes_per_device'))} | {mb(r.get('nnxtron_bytes_per_device'))} |")  # fmt: skip
        mem = case.get("memory")
        if mem:
            lines += ["", "| per device (GiB) | MaxText | nnxtron |", "|---|---|---|"]
            for k in ("params_bytes", "optimizer_state_bytes", "other_state_bytes", "state_bytes", "argument_bytes", "output_bytes",
                      "alias_bytes", "temp_bytes", "generated_code_bytes", "peak_bytes"):  # fmt: skip
                lines.append(f"| {k.removesuffix('_bytes')} | {gib(mem['maxtext'].get(k))} | {gib(mem['nnxtron'].get(k))} |")
            lines.append(f"| parameter count | {mem['maxtext'].get('param_count')} | {mem['nnxtron'].get('param_count')} |")
    for note in data.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--devices", nargs="+", type=int, default=list(DEVICES))
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run (each side of each case)")
    parser.add_argument("--no-compile", action="store_true", help="MaxText: shardings only (nnxtron plan always compiles)")
    parser.add_argument(
        "--keys",
        nargs="*",
        default=[],
        help="extra key=value for both systems (a variant: its cases are keyed model@devices+keys)",
    )
    parser.add_argument("--report", action="store_true", help="only re-write the Markdown from the JSON")
    parser.add_argument("--python", default="python3.12", help="a Python >= 3.12 to make the MaxText environment with")
    parser.add_argument("--env", type=Path, default=maxtext_reference.DEFAULT_ENV, help="the MaxText environment")
    parser.add_argument("--out", type=Path, default=RESULTS / "sharding_vs_maxtext.json")
    args = parser.parse_args(argv)

    data: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {"cases": {}}
    if not args.report:
        interpreter = maxtext_reference.ensure_env(args.env, args.python)
        base_yml = next((args.env / "lib").glob("python3*/site-packages/maxtext/configs/base.yml"))
        data["about"] = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "shared_keys": list(SHARED),
                         "versions": maxtext_reference.versions(interpreter),
                         "nnxtron_versions": {p: metadata.version(p) for p in ("nnxtron", "jax", "jaxlib", "flax", "optax")}}  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="sharding_vs_maxtext_") as cache:
            for devices in args.devices:
                for model in args.models:
                    extra = tuple(args.keys)
                    key = f"{model}@{devices}" + "".join(f"+{k}" for k in extra)
                    print(f"{key}: MaxText ...", file=sys.stderr, flush=True)
                    mt = run_maxtext(interpreter, base_yml, model, devices, not args.no_compile, args.timeout, cache, extra)
                    print(f"{key}: MaxText {mt['wall_seconds']:.0f} s{' (' + mt['error'][-200:] + ')' if mt.get('error') else ''}; nnxtron ...",
                          file=sys.stderr, flush=True)  # fmt: skip
                    nx = run_nnxtron(model, devices, args.timeout, cache, extra)  # plan always compiles
                    print(f"{key}: nnxtron {nx['wall_seconds']:.0f} s{' (' + nx['error'][-200:] + ')' if nx.get('error') else ''}",
                          file=sys.stderr, flush=True)  # fmt: skip
                    case: dict[str, Any] = {"model": model, "devices": devices, "keys": list(extra), "maxtext": mt, "nnxtron": nx}
                    if "plan" in nx and "result" in mt:
                        case["comparison"] = compare_params(model, nx["plan"], mt["result"], extra)
                    case["memory"] = memory_summary(nx, mt)
                    # the raw plan's large parts stay; the MaxText optimizer rows are summarised by the driver
                    data["cases"][key] = case
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(data, indent=1) + "\n")
                    args.out.with_suffix(".md").write_text(report(data))
    args.out.with_suffix(".md").write_text(report(data))
    print(report(data))


if __name__ == "__main__":
    main()
