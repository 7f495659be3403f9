"""A worker process of `nnxtron plan --search`: compiles candidates on fake CPU devices.

``python -m nnxtron.tools.search.worker`` reads one JSON job per line on stdin
(``{"id", "file", "overrides", "devices_per_node", "accelerator"}``), compiles the real train step of that
config ahead of time on the process's devices (``tools.plan``'s lowering: nothing is
allocated), and writes one JSON line per job on stdout: the XLA memory analysis, the
train state per device, every collective of the compiled program
(``hlo.collectives``) and its matmul FLOPs and memory traffic
(``hlo_cost.program_cost``). A job that cannot be set up or compiled answers with its
error instead. The parent starts it with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``
and replaces it after a few jobs, so the memory mappings of compiled programs never pile
up in one process (Linux allows 65,530).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

import jax

from nnxtron.config import load_config
from nnxtron.errors import ConfigError
from nnxtron.tools.plan import lower_train_step, memory_stats, prepare_train_step, tree_shard_bytes
from nnxtron.tools.search.hlo import collectives
from nnxtron.tools.search.hlo_cost import program_cost

# An accelerator's XLA schedules a step for memory; XLA:CPU's default scheduler, for its threads,
# keeps far more alive at once where layers are unrolled. Measured against one v5e chip (the 552M
# model of benchmarks/accelerator_mfu.py, batch 6, unrolled, minimal_with_context): XLA:CPU 17.8 GiB
# of temporaries by default, 11.8 with its memory-optimized scheduler, the chip 7.5 GiB (it ran;
# the default's estimate called it out of memory). The two rows that ran out of memory on the chip
# stay over 15.75 GiB with it (22.1, 17.6), the scanned rows move by 1 GiB at most.
ACCELERATOR_ESTIMATE_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def compile_candidate(cfg: Any, devices_per_node: int, accelerator: bool = False) -> dict[str, Any]:
    """Memory, state and collectives of ``cfg``'s compiled train step on ``jax.devices()``;
    ``accelerator``: compiled as the estimate of an accelerator's memory (``ACCELERATOR_ESTIMATE_OPTIONS``),
    not as the CPU would run it."""
    start = time.perf_counter()
    derived, mesh, tx, schedule, model_setup = prepare_train_step(cfg)
    options = ACCELERATOR_ESTIMATE_OPTIONS if accelerator else None
    compiled = lower_train_step(cfg, model_setup, tx, schedule, derived).compile(compiler_options=options)
    memory = memory_stats(compiled) or {}
    hlo = compiled.as_text()
    state, shardings = model_setup.abstract_state, model_setup.state_shardings
    result = {
        "resident_bytes": memory.get("resident_bytes"),
        "temp_bytes": memory.get("temp_bytes"),
        "host_bytes": memory.get("host_argument_bytes", 0) + memory.get("host_temp_bytes", 0),
        "state_bytes": sum(tree_shard_bytes(state[k], shardings[k]) for k in state),
        "param_bytes": tree_shard_bytes(state["params"], shardings["params"]),
        "collectives": [
            {**dataclasses.asdict(c), "axes": list(c.axes)} for c in collectives(hlo, dict(mesh.shape), devices_per_node)
        ],
        "program": dataclasses.asdict(program_cost(hlo)),
        "compile_seconds": time.perf_counter() - start,
    }
    if model_setup.abstract_frozen is not None:  # LoRA: the frozen base lives on the devices too
        result["state_bytes"] += tree_shard_bytes(model_setup.abstract_frozen, model_setup.frozen_shardings)
    return result


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    try:
        cfg = load_config(job.get("file"), job["overrides"])
        out = compile_candidate(cfg, job["devices_per_node"], job.get("accelerator", False))
    except (ConfigError, ValueError) as err:
        out = {"error": " ".join(str(err).split())}
    except Exception as err:  # noqa: BLE001 - an XLA failure is this candidate's result, not the search's
        out = {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:500]}"}
    finally:
        jax.clear_caches()
    return {"id": job["id"], **out}


def main() -> int:
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(run_job(json.loads(line))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
