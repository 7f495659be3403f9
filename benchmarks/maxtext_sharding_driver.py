"""MaxText's side of ``benchmarks/sharding_vs_maxtext.py``; runs inside MaxText 0.2.5's own environment.

    DECOUPLE_GCLOUD=TRUE JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        <maxtext env>/bin/python benchmarks/maxtext_sharding_driver.py OUT.json [--no-compile] \\
        <maxtext site-packages>/maxtext/configs/base.yml model_name=llama3.1-8b key=value ...

It does what MaxText's ``maxtext.trainers.pre_train.train_compile`` does for its ahead-of-time
compile, on the process's own (fake CPU) devices instead of a TPU topology description:
``pyconfig.initialize`` -> ``maxtext_utils.get_mesh_from_config`` (the base.yml mesh, ``ici_fsdp_parallelism=-1``
filled in) -> ``train_compile.get_shaped_inputs`` (``maxtext_utils.get_abstract_state``: the NNX train
state traced with ``nnx.eval_shape``, nothing allocated, every leaf a ``ShapeDtypeStruct`` carrying the
``NamedSharding`` MaxText's logical axis rules give) -> ``sharding.maybe_update_params_sharding_with_opt``,
``build_zero1_input_state_mesh_shardings`` -> ``maxtext_utils.get_functional_train_with_signature(train.train_step, ...)``
-> ``train_compile.jit_and_compile`` -> ``compiled.memory_analysis()``.

Writes OUT.json: the mesh, every parameter (path, shape, dtype, logical axes, PartitionSpec, shard shape,
bytes per device), the train state's bytes per device from the shardings (parameters, optimizer state,
other), and, unless ``--no-compile``, XLA's memory analysis of the compiled train step with the lower and
compile times (or the error and the time it took to fail). MaxText is imported only here.
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback


def spec_list(spec) -> list:
    """A PartitionSpec as JSON: one entry per dimension, None, an axis name or a list of axis names."""
    out = []
    for entry in spec:
        if entry is None or isinstance(entry, str):
            out.append(entry)
        else:
            out.append(list(entry))
    return out


def shard_bytes(leaf) -> tuple[list[int], int]:
    """The per-device shard shape of a ShapeDtypeStruct with a sharding, and its bytes."""
    shape = tuple(leaf.shape)
    sharding = getattr(leaf, "sharding", None)
    shard = tuple(sharding.shard_shape(shape)) if sharding is not None else shape
    return list(shard), int(math.prod(shard)) * leaf.dtype.itemsize


def main() -> None:
    out_path = sys.argv[1]
    argv = sys.argv[2:]
    compile_step = "--no-compile" not in argv
    argv = [a for a in argv if a != "--no-compile"]
    result: dict = {"argv": argv}
    t_start = time.perf_counter()

    import jax  # pylint: disable=import-outside-toplevel
    from flax import nnx  # pylint: disable=import-outside-toplevel
    from flax.core.spmd import logical_axis_rules as axis_rules  # pylint: disable=import-outside-toplevel
    from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
    from maxtext.trainers.pre_train import train, train_compile  # pylint: disable=import-outside-toplevel
    from maxtext.utils import maxtext_utils, sharding  # pylint: disable=import-outside-toplevel

    # as train_compile.main does before it compiles
    jax.config.update("jax_default_prng_impl", "unsafe_rbg")
    config = pyconfig.initialize(["maxtext_sharding_driver", *argv])
    jax.config.update("jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type)
    mesh = maxtext_utils.get_mesh_from_config(config)
    result["devices"] = {"count": jax.device_count(), "platform": jax.devices()[0].platform}
    result["mesh"] = {name: int(size) for name, size in mesh.shape.items()}
    result["versions"] = {"jax": jax.__version__, "flax": __import__("flax").__version__}
    result["config"] = {
      k: str(getattr(config, k, None))
      for k in ("model_name", "dtype", "weight_dtype", "scan_layers", "param_scan_axis", "remat_policy",
                "per_device_batch_size", "max_target_length", "megablox", "sparse_matmul", "opt_type",
                "shard_optimizer_over_data", "logical_axis_rules")
  }  # fmt: skip

    t0 = time.perf_counter()
    shaped_args, shaped_kwargs, state_mesh_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
    result["abstract_state_seconds"] = time.perf_counter() - t0
    abstract_state = shaped_args[0]

    # every leaf of the abstract train state with its variable type; the logical axis names are the
    # `sharding` metadata of the abstract model's variables
    rows = []
    for path, var in nnx.to_flat_state(abstract_state):
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        if not hasattr(value, "shape"):
            continue
        meta = var.get_metadata() if isinstance(var, nnx.Variable) else {}
        logical = meta.get("sharding") or meta.get("sharding_names") or meta.get("out_sharding")
        shard, nbytes = shard_bytes(value)
        spec = value.sharding.spec if getattr(value, "sharding", None) is not None else None
        rows.append(
            {
                "path": "/".join(str(p) for p in path),
                "type": type(var).__name__,
                "shape": list(value.shape),
                "dtype": str(value.dtype),
                "logical_axes": [a if a is None or isinstance(a, str) else list(a) for a in logical] if logical else None,
                "spec": spec_list(spec) if spec is not None else None,
                "shard_shape": shard,
                "bytes_per_device": nbytes,
                "bytes_unsharded": int(math.prod(value.shape)) * value.dtype.itemsize,
            }
        )

    def model_var(r):
        return r["path"].startswith("model/") and "/rngs/" not in r["path"] and not r["path"].startswith("model/rngs/")

    for r in rows:
        if r["path"].startswith("optimizer/"):
            r["category"] = "optimizer"
        elif model_var(r):
            r["category"] = "param" if r["type"] == "Param" else "model_state"  # e.g. DeepSeek's router bias
        else:
            r["category"] = "other"  # rng keys and counts, the step
    params = [r for r in rows if r["category"] == "param"]
    model_state = [r for r in rows if r["category"] == "model_state"]
    optimizer = [r for r in rows if r["category"] == "optimizer"]
    other = [r for r in rows if r["category"] == "other"]
    result["parameters"] = params
    result["model_state"] = model_state
    result["state_per_device"] = {
        "params_bytes": sum(r["bytes_per_device"] for r in params),
        "model_state_bytes": sum(r["bytes_per_device"] for r in model_state),
        "optimizer_state_bytes": sum(r["bytes_per_device"] for r in optimizer),
        "other_state_bytes": sum(r["bytes_per_device"] for r in other),
        "total_bytes": sum(r["bytes_per_device"] for r in rows),
    }
    result["state_unsharded"] = {
        "params_bytes": sum(r["bytes_unsharded"] for r in params),
        "optimizer_state_bytes": sum(r["bytes_unsharded"] for r in optimizer),
    }
    result["param_count"] = sum(math.prod(r["shape"]) for r in params)
    result["optimizer_leaves"] = [{k: r[k] for k in ("path", "shape", "spec")} for r in optimizer[:4]]
    result["other_leaves"] = [{k: r[k] for k in ("path", "type", "shape", "dtype", "spec", "bytes_per_device")} for r in other]
    _flush(out_path, result)

    if not compile_step:
        result["compile"] = {"status": "skipped (--no-compile)"}
        _flush(out_path, result)
        return

    t0 = time.perf_counter()
    try:
        params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_mesh_shardings)
        input_state_mesh_shardings = sharding.build_zero1_input_state_mesh_shardings(
            config, state_mesh_shardings, params_shardings
        )
        data_sharding = sharding.get_input_data_sharding(config, mesh)
        func, in_shard, out_shard, static_argnums, donate_argnums = maxtext_utils.get_functional_train_with_signature(
            train.train_step, data_sharding, input_state_mesh_shardings, model, config, params_shardings
        )
        with jax.set_mesh(mesh), axis_rules(config.logical_axis_rules):
            jitted = jax.jit(func, in_shardings=in_shard, out_shardings=out_shard, static_argnums=static_argnums,
                       donate_argnums=donate_argnums)  # fmt: skip
            lowered = jitted.lower(*shaped_args, **shaped_kwargs)
        t_lower = time.perf_counter() - t0
        result["compile"] = {"status": "lowered", "lower_seconds": t_lower}
        _flush(out_path, result)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t_compile = time.perf_counter() - t1
        mem = compiled.memory_analysis()
        fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes", "host_argument_size_in_bytes", "host_output_size_in_bytes",
              "host_alias_size_in_bytes", "host_temp_size_in_bytes")  # fmt: skip
        memory = {f: int(getattr(mem, f)) for f in fields if hasattr(mem, f)}
        memory["peak_bytes"] = (memory["argument_size_in_bytes"] + memory["output_size_in_bytes"]
                            - memory["alias_size_in_bytes"] + memory["temp_size_in_bytes"]
                            + memory.get("generated_code_size_in_bytes", 0))  # fmt: skip
        result["compile"] = {"status": "compiled", "lower_seconds": t_lower, "compile_seconds": t_compile}
        result["memory"] = memory
    except Exception as e:  # noqa: BLE001 -- recorded, not hidden
        result["compile"] = {
            "status": "failed",
            "seconds": time.perf_counter() - t0,
            "error": f"{type(e).__name__}: {str(e)[:2000]}",
            "traceback": traceback.format_exc()[-4000:],
        }
    result["total_seconds"] = time.perf_counter() - t_start
    _flush(out_path, result)


def _flush(path: str, result: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
