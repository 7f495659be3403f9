"""`nnxtron plan`: what a config costs, without allocating a single weight.

Everything here is computed from abstract shapes: the model is traced with
``nnx.eval_shape`` (``abstract_model``), the train state's shardings come from
``train.state.setup`` (the function the Trainer uses), and the real jitted train step
(``train.step.make_train_step``) is lowered and compiled ahead of time from
``jax.ShapeDtypeStruct`` leaves that carry their shardings. XLA then reports the
per-device memory of the compiled program (arguments, outputs, temporaries) and its
FLOPs, so even the largest presets can be planned on a laptop over fake CPU devices
(``nnxtron plan model_name=llama3.1-405b devices=8 ici_fsdp_parallelism=8``).

``make_plan`` returns a JSON-serialisable dict; ``format_plan`` renders it as text.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnxtron.config.derived import derive
from nnxtron.config.flops import training_flops_per_token
from nnxtron.config.schema import Config
from nnxtron.data.packing import BATCH_KEYS
from nnxtron.layers.lora import with_adapters
from nnxtron.models.build import abstract_model
from nnxtron.models.quant import summary
from nnxtron.models.stack import CycleBlock
from nnxtron.parallel.mesh import make_mesh
from nnxtron.parallel.scan import LayerStack
from nnxtron.parallel.sharding import unsharded_report, variable_names
from nnxtron.params import flatten, path_str
from nnxtron.tools.plan_lora import format_lora, lora_plan
from nnxtron.tools.plan_pipeline import format_pipeline, pipeline_plan
from nnxtron.train.optimizer import make_optimizer
from nnxtron.train.state import setup
from nnxtron.train.step import abstract_extras, batch_sharding, make_train_step

GIB = 1024**3

# dtypes of the packed batch rows (data/packing.py): int32 ids/positions/segments, float32 mask
_BATCH_DTYPES = {
    "inputs": jnp.int32,
    "targets": jnp.int32,
    "positions": jnp.int32,
    "segment_ids": jnp.int32,
    "loss_mask": jnp.float32,
}

XLA_FLOPS_NOTE = (
    "XLA's count differs from the formula: it includes the remat recompute of the forward pass, "
    "softmax/norm/elementwise and optimizer work, and counts the body of a loop once rather than "
    "once per iteration (the scanned layers when scan_layers=true, the microbatches when "
    "gradient_accumulation_steps > 1)"
)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _size(shape: tuple[int, ...]) -> int:
    return int(math.prod(shape))


def _spec_entries(spec: PartitionSpec, rank: int) -> list:
    """A PartitionSpec as a JSON list of length ``rank`` (None | axis | [axes])."""
    entries = list(spec) + [None] * (rank - len(spec))
    return [e if e is None or isinstance(e, str) else list(e) for e in entries]


def _shard_bytes(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> int:
    return _size(sharding.shard_shape(tuple(shape))) * jnp.dtype(dtype).itemsize


def tree_shard_bytes(abstract: Any, shardings: Any) -> int:
    leaves = jax.tree.leaves(abstract)
    sh = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    if len(leaves) != len(sh):
        raise ValueError(f"state and shardings differ in structure ({len(leaves)} vs {len(sh)} leaves)")
    return int(sum(_shard_bytes(a.shape, a.dtype, s) for a, s in zip(leaves, sh)))


def _tree_count(abstract: Any) -> int:
    return sum(_size(leaf.shape) for leaf in jax.tree.leaves(abstract))


def _tree_bytes(abstract: Any) -> int:
    return int(sum(_size(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(abstract)))


def _param_table(model: nnx.Module, param_shardings: dict) -> list[dict[str, Any]]:
    """One row per parameter: path, shape, dtype, logical axes, PartitionSpec, shard shape."""
    _, params, _ = nnx.split(model, nnx.Param, ...)
    shardings = flatten(param_shardings)
    rows = []
    for path, variable in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]:
        name = path_str(path)
        shape = tuple(int(d) for d in variable.shape)
        sharding = shardings[name]
        names = variable_names(variable)
        rows.append(
            {
                "path": name,
                "shape": list(shape),
                "dtype": str(jnp.dtype(variable.dtype)),
                "logical_axes": None if names is None else list(names),
                "spec": _spec_entries(sharding.spec, len(shape)),
                "shard_shape": list(sharding.shard_shape(shape)),
                "params": _size(shape),
                "bytes_per_device": _shard_bytes(shape, variable.dtype, sharding),
            }
        )
    return rows


def _block_count(stack: dict[str, Any]) -> str:
    """``"32 layers"`` or, for cycle blocks, ``"5 blocks of 6 layers"``."""
    if stack["layers_per_block"] == 1:
        return f"{stack['num_layers']} layers"
    return f"{stack['num_layers']} block{'s' if stack['num_layers'] > 1 else ''} of {stack['layers_per_block']} layers"


def _stacks(model: nnx.Module, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every LayerStack in the model: its parameters in total and per layer.

    Scanned stacks hold ``<stack>/layers/<param>`` with a leading layer axis; unrolled
    ones hold ``<stack>/layers/<i>/<param>``.
    """
    stacks = []
    for path, module in nnx.iter_modules(model):
        if not isinstance(module, LayerStack):
            continue
        prefix = "/".join(map(str, path)) + "/layers/" if path else "layers/"
        mine = [r for r in rows if r["path"].startswith(prefix)]
        n = module.num_layers
        block = module.layers if module.scan else module.layers[0]
        per_block = len(block.cycle) if isinstance(block, CycleBlock) else 1  # layers in one scanned block
        per_layer = [0] * n
        for r in mine:
            if module.scan:
                for i in range(n):
                    per_layer[i] += r["params"] // n
            else:
                per_layer[int(r["path"][len(prefix) :].split("/")[0])] += r["params"]
        stacks.append(
            {
                "name": prefix.rstrip("/"),
                "axis_name": module.axis_name,
                "num_layers": n,
                "layers_per_block": per_block,
                "scanned": bool(module.scan),
                "total": sum(r["params"] for r in mine),
                "per_layer": per_layer[0] if len(set(per_layer)) <= 1 else per_layer,
            }
        )
    return stacks


def _param_counts(cfg: Config, model: nnx.Module, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Total, embedding, output head, each layer stack (total and per layer), the rest."""
    total = sum(r["params"] for r in rows)
    embedding = sum(r["params"] for r in rows if r["path"].startswith("embed/"))
    head = sum(r["params"] for r in rows if r["path"].startswith("logits/"))
    stacks = _stacks(model, rows)
    return {
        "total": total,
        "embedding": embedding,
        "output_head": head,
        "output_head_tied": bool(cfg.logits_via_embedding),
        "stacks": stacks,
        "other": total - embedding - head - sum(s["total"] for s in stacks),  # final norm, MTP depths
    }


def lower_train_step(cfg: Config, model_setup: Any, tx: Any, schedule: Any, derived: Any) -> jax.stages.Lowered:
    """The real train step of ``cfg`` lowered on abstract state and batch (``ShapeDtypeStruct``
    leaves with their shardings): nothing is allocated on the devices."""
    return trace_train_step(cfg, model_setup, tx, schedule, derived).lower()


def trace_train_step(cfg: Config, model_setup: Any, tx: Any, schedule: Any, derived: Any) -> jax.stages.Traced:
    """The real train step of ``cfg`` traced on abstract state and batch (its jaxpr)."""
    return make_train_step(cfg, model_setup, tx, schedule).trace(*abstract_step_inputs(cfg, model_setup, derived))


def abstract_step_inputs(cfg: Config, model_setup: Any, derived: Any) -> tuple:
    """The train and eval steps' arguments as shapes, dtypes and shardings: ``(state, batch,
    *extras)`` of one global batch (nothing is allocated on the devices)."""
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), model_setup.abstract_state, model_setup.state_shardings
    )
    batch_sh = batch_sharding(cfg, model_setup)
    shape = (derived.global_batch_size, cfg.max_target_length)
    batch = {k: jax.ShapeDtypeStruct(shape, _BATCH_DTYPES[k], sharding=batch_sh[k]) for k in BATCH_KEYS}
    return (state, batch, *abstract_extras(cfg, model_setup))


def prepare_train_step(cfg: Config) -> tuple[Any, Mesh, Any, Any, Any]:
    """What lowering ``cfg``'s train step on ``jax.devices()`` needs: ``(derived, mesh,
    optimizer, schedule, model_setup)``; ``setup`` raises ConfigError on an indivisible or
    unsharded layout."""
    derived = derive(cfg, jax.device_count())
    mesh = make_mesh(cfg)
    tx, schedule = make_optimizer(cfg, derived)
    return derived, mesh, tx, schedule, setup(cfg, mesh, tx)


PEAK_SOURCES = {"buffers": "arguments + outputs - aliased + temporaries + code", "xla:tpu": "XLA:TPU's peak of the step"}


def memory_stats(compiled: Any) -> dict[str, Any] | None:
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    fields = ("argument", "output", "alias", "temp", "generated_code")
    out = {f"{f}_bytes": int(getattr(stats, f"{f}_size_in_bytes", 0) or 0) for f in fields}
    for f in fields:  # host (pinned) memory, used by parameter/optimizer host offload
        out[f"host_{f}_bytes"] = int(getattr(stats, f"host_{f}_size_in_bytes", 0) or 0)
    # donated inputs alias outputs: their buffers are counted once
    out["resident_bytes"] = out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["generated_code_bytes"]
    out["peak_bytes"] = out["resident_bytes"] + out["temp_bytes"]
    xla_peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    out["peak_source"] = "buffers"
    if jax.default_backend() == "tpu" and xla_peak:  # XLA:TPU's own peak (XLA:CPU's counts the arguments only)
        out["peak_bytes"], out["peak_source"] = xla_peak, "xla:tpu"
    return out


def _xla_flops(compiled: Any) -> float | None:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    if not analysis or "flops" not in analysis:
        return None
    return float(analysis["flops"])


def _device_memory_bytes(device_memory_gib: float | None) -> tuple[int | None, str | None]:
    if device_memory_gib is not None:
        return int(device_memory_gib * GIB), "--device-memory-gib"
    device = jax.devices()[0]
    if device.platform == "cpu":
        return None, None
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - not every backend reports memory
        limit = None
    return (int(limit), f"{device.device_kind} bytes_limit") if limit else (None, None)


def _quantization(cfg: Config) -> str | None:
    if not cfg.use_qwix_quantization:
        return None
    return summary(cfg)


def make_plan(cfg: Config, device_memory_gib: float | None = None, compile: bool = True) -> dict[str, Any]:
    """The plan of ``cfg`` on the current devices (``jax.devices()``), as a JSON-ready dict.

    Nothing is allocated on the devices: shapes come from ``abstract_model`` and
    ``setup``, and (``compile=True``) the real train step is compiled ahead of time from
    ``ShapeDtypeStruct`` leaves to read XLA's per-device memory and FLOP estimates.
    """
    num_devices = jax.device_count()
    derived, mesh, tx, schedule, model_setup = prepare_train_step(cfg)
    shardings, abstract = model_setup.state_shardings, model_setup.abstract_state

    model = abstract_model(cfg)  # shapes and logical-axis metadata only
    frozen, frozen_sh = model_setup.abstract_frozen, model_setup.frozen_shardings  # LoRA's base (None without)
    every_sh = shardings["params"] if frozen is None else with_adapters(frozen_sh, shardings["params"])
    rows = _param_table(model, every_sh)
    counts = {**_param_counts(cfg, model, rows), "trained": _tree_count(abstract["params"])}
    checked, checked_sh = (abstract["params"], shardings["params"]) if frozen is None else (frozen, frozen_sh)
    fraction, offenders = unsharded_report(checked, checked_sh, mesh)

    per_device = {
        "params_bytes": tree_shard_bytes(abstract["params"], shardings["params"]),
        **({} if frozen is None else {"frozen_base_bytes": tree_shard_bytes(frozen, frozen_sh)}),
        "optimizer_state_bytes": tree_shard_bytes(abstract["opt_state"], shardings["opt_state"]),
        "other_state_bytes": tree_shard_bytes(abstract["rest"], shardings["rest"])
        + tree_shard_bytes(abstract["step"], shardings["step"]),
    }
    per_device["state_bytes"] = sum(per_device.values())
    unsharded_totals = {
        "params_bytes": _tree_bytes(abstract["params"]),
        "optimizer_state_bytes": _tree_bytes(abstract["opt_state"]),
    }

    flops_per_token = training_flops_per_token(cfg)
    flops = {
        "per_token": flops_per_token,
        "per_step": flops_per_token * derived.tokens_per_step,
        "per_step_per_device": flops_per_token * derived.tokens_per_step / num_devices,
        "xla_per_step_per_device": None,
        "xla_note": XLA_FLOPS_NOTE,
    }

    device = jax.devices()[0]
    plan: dict[str, Any] = {
        "model_name": cfg.model_name,
        "decoder_block": cfg.decoder_block,
        "dtype": cfg.dtype,
        "weight_dtype": cfg.weight_dtype,
        "scan_layers": cfg.scan_layers,
        "remat_policy": cfg.remat_policy,
        "devices": {"count": num_devices, "platform": device.platform, "kind": getattr(device, "device_kind", "")},
        "mesh": dict(mesh.shape),
        "derived": derived.as_dict(),
        "seq_len": cfg.max_target_length,
        "pipeline": pipeline_plan(cfg),  # None without a pipeline (plan_pipeline.py)
        "quantization": _quantization(cfg),
        "params": counts,
        "state_per_device": per_device,
        "dpo_reference": cfg.use_dpo,  # the train step also takes a frozen copy of the parameters and model state
        "state_unsharded": unsharded_totals,
        "flops": flops,
        "unsharded": {
            "fraction": fraction,
            "tolerance": cfg.sharding_tolerance,
            "largest": [{"path": p, "shape": list(s), "spec": spec, "params": n} for p, s, spec, n in offenders[:5]],
        },
        "table": rows,
        "memory": None,
        "compile_seconds": None,
    }
    if not compile:
        plan["lora"] = lora_plan(cfg, plan, lambda full: make_plan(full, device_memory_gib, compile))
        return plan

    start = time.perf_counter()
    lowered = lower_train_step(cfg, model_setup, tx, schedule, derived)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()

    memory = memory_stats(compiled)
    if memory is not None:
        limit, source = _device_memory_bytes(device_memory_gib)
        memory["device_memory_bytes"] = limit
        memory["device_memory_source"] = source
        memory["fits"] = None if limit is None else memory["peak_bytes"] <= limit
        memory["backend"] = jax.default_backend()
    plan["memory"] = memory
    flops["xla_per_step_per_device"] = _xla_flops(compiled)
    plan["compile_seconds"] = {"lower": lowered_at - start, "compile": compiled_at - lowered_at}
    plan["lora"] = lora_plan(cfg, plan, lambda full: make_plan(full, device_memory_gib, compile))
    return plan


# ----------------------------------------------------------------------------- text


def _count(n: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n:,} ({n / scale:.2f}{suffix})"
    return f"{n:,}"


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for scale, suffix in ((1024**4, "TiB"), (GIB, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n} B"


def _spec_text(entries: list) -> str:
    parts = ["None" if e is None else e if isinstance(e, str) else "(" + ", ".join(e) + ")" for e in entries]
    return "P(" + ", ".join(parts) + ")"


def text_table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as human-readable text (what ``nnxtron plan`` prints)."""
    d, p, m, f = plan["derived"], plan["params"], plan["memory"], plan["flops"]
    dev = plan["devices"]
    out = [
        f"plan: model_name={plan['model_name']} ({plan['decoder_block']} block), dtype={plan['dtype']}, "
        f"weight_dtype={plan['weight_dtype']}, scan_layers={str(plan['scan_layers']).lower()}, remat_policy={plan['remat_policy']}",
        f"devices: {dev['count']} x {dev['platform']} ({dev['kind']})",
        "mesh: " + " x ".join(f"{axis}={size}" for axis, size in plan["mesh"].items()),
        f"batch: global {d['global_batch_size']} x {plan['seq_len']} tokens = {d['tokens_per_step']:,} tokens/step; "
        f"microbatch {d['microbatch_size']}; head_dim {d['head_dim']}; kv groups {d['num_kv_groups']}; "
        f"schedule {d['schedule_steps']} steps ({d['warmup_steps']} warm-up)",
        *format_pipeline(plan.get("pipeline")),
        *([plan["quantization"]] if plan.get("quantization") else []),
        "",
        "parameters",
    ]
    total = max(p["total"], 1)
    count_rows = [
        ["total", _count(p["total"]), "100.0%"],
        ["embedding (embed/)", _count(p["embedding"]), f"{100 * p['embedding'] / total:.1f}%"],
    ]
    if p["output_head_tied"]:
        count_rows.append(["output head (logits/)", "tied to embedding", "-"])
    else:
        count_rows.append(["output head (logits/)", _count(p["output_head"]), f"{100 * p['output_head'] / total:.1f}%"])
    for s in p["stacks"]:
        per = s["per_layer"]
        count_rows.append(
            [
                f"stack {s['name']} ({_block_count(s)}{', scanned' if s['scanned'] else ''})",
                _count(s["total"]),
                f"{100 * s['total'] / total:.1f}%",
            ]
        )
        count_rows.append(
            [
                "  per layer" if s["layers_per_block"] == 1 else "  per block",
                _count(per) if isinstance(per, int) else ", ".join(map(str, per)),
                "",
            ]
        )
    count_rows.append(["other (final norm, MTP)", _count(p["other"]), f"{100 * p['other'] / total:.1f}%"])
    out += ["  " + line for line in text_table(["group", "parameters", "share"], count_rows, {1, 2})[2:]]

    u = plan["unsharded"]
    largest = "; ".join(f"{o['path']} {tuple(o['shape'])} {o['spec']}" for o in u["largest"][:3])
    out += [
        "",
        f"unsharded over model axes: {100 * u['fraction']:.3f}% of parameter elements (sharding_tolerance {u['tolerance']})"
        + (f"; largest: {largest}" if largest else ""),
        "",
        "FLOPs",
    ]
    flop_rows = [
        ["per token (model formula: 6 x matmul params + attention)", f"{f['per_token']:.4g}"],
        [f"per step, all devices (x {d['tokens_per_step']:,} tokens)", f"{f['per_step']:.4g}"],
        ["per step, per device (formula)", f"{f['per_step_per_device']:.4g}"],
    ]
    if f["xla_per_step_per_device"] is not None:
        flop_rows.append(["per step, per device (XLA cost analysis)", f"{f['xla_per_step_per_device']:.4g}"])
    out += ["  " + line for line in text_table(["", ""], flop_rows, {1})[2:]]
    if f["xla_per_step_per_device"] is not None:
        out.append(f"  note: {f['xla_note']}")

    s, su = plan["state_per_device"], plan["state_unsharded"]
    out += [
        "",
        "train state per device (from the shardings: shard shape x itemsize)",
        f"  parameters         {_bytes(s['params_bytes']):>12}   (unsharded total {_bytes(su['params_bytes'])})",
        f"  optimizer state    {_bytes(s['optimizer_state_bytes']):>12}   (unsharded total {_bytes(su['optimizer_state_bytes'])})",
        f"  other state        {_bytes(s['other_state_bytes']):>12}",
        *([f"  frozen base (LoRA) {_bytes(s['frozen_base_bytes']):>12}"] if "frozen_base_bytes" in s else []),
        f"  total              {_bytes(s['state_bytes']):>12}",
    ]
    if m is not None:
        fits = (
            "unknown (give --device-memory-gib)"
            if m["fits"] is None
            else f"{'yes' if m['fits'] else 'NO'} ({_bytes(m['device_memory_bytes'])}, {m['device_memory_source']})"
        )
        c = plan["compile_seconds"]
        out += [
            "",
            f"memory per device (XLA memory analysis of the compiled train step, {m['backend']} backend; "
            f"lowered in {c['lower']:.1f} s, compiled in {c['compile']:.1f} s)",
            f"  arguments          {_bytes(m['argument_bytes']):>12}   (train state + batch"
            f"{' + the frozen base (LoRA)' if plan.get('lora') else ''}"
            f"{' + the DPO reference: parameters and other state again' if plan.get('dpo_reference') else ''})",
            f"  outputs            {_bytes(m['output_bytes']):>12}",
            f"  aliased (donated)  {_bytes(m['alias_bytes']):>12}   (outputs written into donated arguments)",
            f"  temporaries        {_bytes(m['temp_bytes']):>12}   (gradients, activations, optimizer intermediates)",
            f"  generated code     {_bytes(m['generated_code_bytes']):>12}",
            f"  peak estimate      {_bytes(m['peak_bytes']):>12}   ({PEAK_SOURCES[m['peak_source']]})",
            f"  fits: {fits}",
        ]
        host = {k[5:-6]: v for k, v in m.items() if k.startswith("host_") and k.endswith("_bytes") and v}
        if host:
            out.append("  host (pinned) memory: " + ", ".join(f"{k} {_bytes(v)}" for k, v in host.items()))
    elif plan["compile_seconds"] is None:
        out += ["", "memory per device: not compiled"]
    else:
        out += ["", "memory per device: this backend reports no memory analysis"]

    out += format_lora(plan.get("lora"), _bytes)
    rows = plan["table"]
    out += ["", f"parameters ({len(rows)} arrays)"]
    table_rows = [
        [
            r["path"],
            str(tuple(r["shape"])),
            r["dtype"],
            "-" if r["logical_axes"] is None else "(" + ", ".join("None" if a is None else a for a in r["logical_axes"]) + ")",
            _spec_text(r["spec"]),
            str(tuple(r["shard_shape"])),
            _bytes(r["bytes_per_device"]),
        ]
        for r in rows
    ]
    headers = ["path", "shape", "dtype", "logical axes", "spec", "shard shape", "bytes/device"]
    out += ["  " + line for line in text_table(headers, table_rows, {6})]
    return "\n".join(out) + "\n"


def to_json_ready(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan with numpy scalars turned into Python numbers (json.dumps-safe)."""

    def fix(x: Any) -> Any:
        if isinstance(x, dict):
            return {str(k): fix(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [fix(v) for v in x]
        if isinstance(x, np.generic):
            return x.item()
        return x

    return fix(plan)
