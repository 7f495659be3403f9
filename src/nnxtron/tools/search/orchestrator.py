"""`nnxtron plan --search`: the parallel configuration that fits and runs fastest.

1. **Enumerate** (``space``): every mesh factorisation of the devices the cheap rules
   allow, with the pipeline microbatch counts; keys the user set are pinned.
2. **Prune cheaply**: ``derive``'s batch checks and the pipeline schedule; the train state's
   lower bound (parameters + optimizer state over every axis but ``data``) against the
   device memory, offloading it to the host when that is what makes it fit.
3. **Rank before compiling**: the cost model (``cost.step_cost``) with collectives
   estimated from the config (``cost.analytic_collectives``).
4. **Compile best-first** on fake CPU devices in ``workers`` parallel processes
   (``pool``) until the time budget is spent: each result gives the XLA memory
   peak and the compiled program's collectives, so its prediction uses the real
   communication. A candidate that fits spawns the next lighter remat policy; one that
   does not spawns the memory knobs (``space.memory_saving``: attention in query
   blocks, the experts in token pieces), then more gradient-accumulation steps, then host
   offload. A candidate whose
   compute alone is slower than the best prediction so far is not compiled.
5. **Report** the top K that fit: predicted step time, MFU, memory headroom, the overrides.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp

from nnxtron.config import load_config
from nnxtron.config.derived import MESH_AXES, derive
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError, UserError
from nnxtron.layers.attention import resolve_attention
from nnxtron.parallel.mesh import make_mesh
from nnxtron.tools.search.cost import (
    analytic_collectives,
    estimate_peak_bytes,
    microbatch_tokens_per_device,
    step_cost,
    update_bytes,
)
from nnxtron.tools.search.hlo import Collective
from nnxtron.tools.search.hlo_cost import ProgramCost
from nnxtron.tools.search.pool import WorkerPool
from nnxtron.tools.search.presets import DevicePreset
from nnxtron.tools.search.space import (
    ACCUMULATION_STEPS,
    AXIS_KEYS,
    MEMORY_KEYS,
    OFFLOAD_KEYS,
    OFFLOADS,
    REMAT_POLICIES,
    UNROLL_MAX_LAYERS,
    Candidate,
    axis_problem,
    candidate,
    check,
    memory_saving,
    meshes,
    pinned_values,
    schedule_variants,
)
from nnxtron.train.optimizer import make_optimizer
from nnxtron.train.state import setup

GIB = 1024**3
STATE_REASON = "train state and gradients alone exceed the device memory"


@dataclass
class SearchRequest:
    file: str | None
    overrides: list[str]
    devices: int
    device: DevicePreset
    top: int = 5
    budget_seconds: float = 600.0
    workers: int = 2
    efficiency: float | None = None  # the device preset's when None
    overlap: float | None = None


@dataclass(frozen=True)
class Totals:
    """Unsharded bytes of the train state (shapes only, on one device)."""

    params: int
    optimizer: int
    other: int
    param_count: int

    def on_device(self, offload: tuple[bool, bool]) -> int:
        """Bytes a step holds in device memory at least: the gradients (a parameter-sized
        tree), and the parameters and optimizer state unless they are offloaded."""
        return self.params + (0 if offload[0] else self.params) + (0 if offload[1] else self.optimizer) + self.other


@dataclass
class _Queued:
    priority: float  # the predicted step time (seconds)
    order: int
    candidate: Candidate
    cfg: Config
    estimated_peak: float  # cost.estimate_peak_bytes, before calibration


def state_totals(file: str | None, overrides: list[str]) -> Totals:
    """The train state of the config set up on a one-device mesh (abstract: nothing allocated)."""
    ones = ["ici_data_parallelism", "ici_fsdp_parallelism", "ici_context_parallelism", "ici_expert_parallelism"]
    ones += ["ici_tensor_parallelism", "ici_pipeline_parallelism", "dcn_pipeline_parallelism", "gradient_accumulation_steps"]
    single = [f"{k}=1" for k in ones] + ["num_pipeline_microbatches=-1"] + [f"{k}=false" for k in OFFLOAD_KEYS]
    cfg = load_config(file, [*overrides, *single])
    tx, _ = make_optimizer(cfg, derive(cfg, 1))
    model_setup = setup(cfg, make_mesh(cfg, jax.devices()[:1]), tx)
    state = model_setup.abstract_state

    def nbytes(tree: Any) -> int:
        return int(sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)))

    frozen = 0 if model_setup.abstract_frozen is None else nbytes(model_setup.abstract_frozen)
    count = sum(leaf.size for leaf in jax.tree.leaves(state["params"]))
    return Totals(nbytes(state["params"]), nbytes(state["opt_state"]), nbytes(state["rest"]) + frozen, int(count))


class Search:
    """One search (see the module docstring); ``run()`` returns the JSON-ready result."""

    def __init__(self, req: SearchRequest):
        self.req = req
        self.start = time.perf_counter()
        self.base = load_config(req.file, req.overrides)
        if self.base.remat_policy == "custom":
            raise ConfigError("plan --search: remat_policy=custom is not searched; pin a named remat_policy or leave it out")
        self.pinned = pinned_values(self.base, req.overrides)
        self.memory = req.device.memory_bytes
        if not self.memory:
            raise UserError(f"--device {req.device.name} has no memory figure; give --device-memory-gib")
        self.pruned: Counter[str] = Counter()
        self.queue: list[_Queued] = []
        self.order = itertools.count()
        self.results: list[dict[str, Any]] = []
        self.seen: set[Candidate] = set()
        self.smallest_state: tuple[int, str] | None = None  # (bytes, candidate) of the lightest pruned state

    # ---------------------------------------------------------------- candidates

    def _job(self, job_id: int, candidate: Candidate) -> dict[str, Any]:
        """The worker's job (``worker.run_job``) compiling ``candidate``: on an accelerator preset the
        compile estimates the accelerator's memory (``worker.ACCELERATOR_ESTIMATE_OPTIONS``)."""
        return {
            "id": job_id,
            "file": self.req.file,
            "overrides": self._args(candidate),
            "devices_per_node": self.req.device.devices_per_node,
            "accelerator": not self.req.device.runs_compiled_program,
        }

    def _args(self, cand: Candidate) -> list[str]:
        """The words of the candidate's config as it is compiled. ``attention=auto`` is compiled
        as the target device resolves it: on a TPU preset ``splash`` (``xla`` with the sequence
        sharded), where the fake CPU devices would pick ``xla``, whose ``[S, S]`` scores change
        the memory plan. On a GPU preset ``auto`` stays ``xla`` here (cuDNN does not compile on
        a CPU): its memory is then an upper bound."""
        words = [*self.req.overrides, *cand.args()]
        if self.base.attention == "auto" and self.req.device.backend == "tpu":
            sharded = cand.mesh["context"] > 1
            chosen = resolve_attention("auto", "tpu", self.base.dtype, self.base.resolved_head_dim, sequence_sharded=sharded)
            words.append(f"attention={chosen}")
        return words

    def _config(self, cand: Candidate) -> Config | str:
        """The candidate's config, or why it cannot run (a prune reason)."""
        try:
            cfg = load_config(self.req.file, self._args(cand))
        except ConfigError as err:
            return str(err)
        return check(cfg, self.req.devices) or cfg

    def _cost(self, cfg: Config, cand: Candidate, collectives: list[Collective], compiled: dict[str, Any] | None = None):
        """The predicted step: with ``compiled`` (a worker's result) its offloaded bytes and
        per-device state; before compiling, the state's lower bound."""
        r = self.req
        if compiled is None:
            shards = self.req.devices // cand.mesh["data"]
            t = self.totals
            state, params, offloaded = (t.params + t.optimizer + t.other) / shards, t.params / shards, 0
            program, temp = None, 0
        else:
            state, params, offloaded = compiled["state_bytes"], compiled["param_bytes"], compiled["host_bytes"]
            program, temp = ProgramCost(**compiled["program"]), compiled["temp_bytes"] or 0
        return step_cost(
            cfg, cand.mesh, r.device, collectives, offloaded, r.efficiency, r.overlap, update_bytes(state, params), program, temp
        )

    def _state_lower_bound(self, mesh: dict[str, int], offload: tuple[bool, bool]) -> int:
        """No axis but ``data`` shards the state more than its size: a lower bound per device."""
        return self.totals.on_device(offload) // (self.req.devices // mesh["data"])

    def _estimated_peak(self, cand: Candidate, cfg: Config) -> float:
        state = self.totals.on_device(_offload(cand)) / (self.req.devices // cand.mesh["data"])
        return estimate_peak_bytes(cfg, cand.mesh, state)

    def _push(self, cand: Candidate, cfg: Config, priority: float) -> None:
        if cand not in self.seen:
            self.seen.add(cand)
            self.queue.append(_Queued(priority, next(self.order), cand, cfg, self._estimated_peak(cand, cfg)))

    def _calibration(self, mesh: dict[str, int] | None = None) -> float:
        """Median of compiled peak / estimated peak so far, over the compiled meshes of the
        same kind as ``mesh`` (pipelined or not, context-parallel or not) when there are
        any, else over all (1 before any compile)."""
        seen = [r for r in self.results if r.get("peak_bytes")]
        alike = [r for r in seen if mesh is not None and _kind(r["mesh"]) == _kind(mesh)]
        ratios = sorted(r["peak_bytes"] / r["estimated_peak_bytes"] for r in alike or seen)
        return ratios[len(ratios) // 2] if ratios else 1.0

    def _pop(self) -> _Queued:
        """The next candidate to compile: those expected to fit first, fastest first."""
        kinds = {_kind(q.candidate.mesh): q.candidate.mesh for q in self.queue}
        scales = {kind: self._calibration(mesh) for kind, mesh in kinds.items()}

        def key(q: _Queued) -> tuple[bool, float, int]:
            return (q.estimated_peak * scales[_kind(q.candidate.mesh)] > self.memory, q.priority, q.order)

        best = min(self.queue, key=key)
        self.queue.remove(best)
        return best

    def enumerate(self) -> int:
        """Queue the base candidate of every mesh and schedule; return how many were considered."""
        considered = 0
        remat = self.pinned.get("remat_policy", "full")
        memory = (self.base.attention_query_block, self.base.moe_token_chunks)
        offloads = [tuple(self.pinned.get(k, v) for k, v in zip(OFFLOAD_KEYS, o)) for o in OFFLOADS]
        offloads = list(dict.fromkeys(offloads))
        for mesh in meshes(self.base, self.req.devices, self.req.device.devices_per_node, self.pinned):
            for schedule in schedule_variants(self.base, mesh, self.pinned):
                considered += 1
                cfg = self._config(candidate(mesh, schedule, remat, offloads[0], memory))
                if isinstance(cfg, str):
                    self.pruned[_reason(cfg)] += 1
                    continue
                state_ok = next((o for o in offloads if self._state_lower_bound(mesh, o) <= self.memory), None)
                if state_ok is None:
                    need = self._state_lower_bound(mesh, offloads[-1])
                    if self.smallest_state is None or need < self.smallest_state[0]:
                        self.smallest_state = (
                            need,
                            " ".join(candidate(mesh, schedule, remat, offloads[-1], memory).args(self.base)),
                        )
                    self.pruned[STATE_REASON] += 1
                    continue
                cand = candidate(mesh, schedule, remat, state_ok, memory)
                if state_ok != offloads[0]:
                    cfg = self._config(cand)
                    if isinstance(cfg, str):
                        self.pruned[_reason(cfg)] += 1
                        continue
                estimate = self._cost(cfg, cand, analytic_collectives(cfg, cand.mesh, self.totals.param_count, self.req.device))
                self._push(cand, cfg, estimate.step_s)
                self._push_memory_knobs(cand, cfg)
        return considered

    def _push_memory_knobs(self, cand: Candidate, cfg: Config) -> None:
        """Also queue ``cand`` with the memory knobs set when its rough peak does not fit:
        the estimate sees what they save, so it can be tried first."""
        if self._estimated_peak(cand, cfg) > self.memory:
            collectives = analytic_collectives(cfg, cand.mesh, self.totals.param_count, self.req.device)
            self._push_first(cand, self._memory_step(cand, cfg), collectives)

    def _memory_step(self, cand: Candidate, cfg: Config) -> list[dict[str, Any]]:
        """The memory knobs as one change of ``cand`` (``memory_saving``), unless the user
        pinned one of them or ``cand`` already has them: a list of zero or one change."""
        if any(k in self.pinned for k in MEMORY_KEYS):
            return []
        saving = memory_saving(cfg, cand.mesh, microbatch_tokens_per_device(cfg, cand.mesh))
        return [saving] if any(cand.values[k] != value for k, value in saving.items()) else []

    def _expand(self, cand: Candidate, cfg: Config, fits: bool, collectives: list[Collective]) -> None:
        """Queue what a compiled candidate suggests: the next lighter remat policy if it fits;
        else the layers unrolled (a scanned stack of at most ``UNROLL_MAX_LAYERS``), else the
        memory knobs (once), else the next accumulation count that divides the batch, else the
        next offload step."""
        v = cand.values
        options: list[dict[str, Any]] = []
        if fits and "remat_policy" not in self.pinned:
            options = [{"remat_policy": p} for p in REMAT_POLICIES[REMAT_POLICIES.index(v["remat_policy"]) + 1 :][:1]]
        if (
            not fits
            and v["scan_layers"]
            and "scan_layers" not in self.pinned
            and cfg.base_num_decoder_layers <= UNROLL_MAX_LAYERS
        ):
            options = [{"scan_layers": False}]
        if not fits:
            options += self._memory_step(cand, cfg)
        if not fits and "gradient_accumulation_steps" not in self.pinned:
            options += [{"gradient_accumulation_steps": a} for a in ACCUMULATION_STEPS if a > v["gradient_accumulation_steps"]]
        if not fits and all(k not in self.pinned for k in OFFLOAD_KEYS):
            options += [dict(zip(OFFLOAD_KEYS, o)) for o in OFFLOADS[OFFLOADS.index(_offload(cand)) + 1 :]]
        self._push_first(cand, options, collectives)

    def _push_first(self, cand: Candidate, changes: list[dict[str, Any]], collectives: list[Collective]) -> None:
        """Queue ``cand`` with the first of ``changes`` whose config is valid (the others are
        counted as pruned), predicted with ``collectives``."""
        for change in changes:
            nxt = cand.with_values(**change)
            nxt_cfg = self._config(nxt)
            if isinstance(nxt_cfg, str):
                self.pruned[_reason(nxt_cfg)] += 1
                continue
            self._push(nxt, nxt_cfg, self._cost(nxt_cfg, nxt, collectives).step_s)
            return

    # ---------------------------------------------------------------- compile loop

    def _elapsed(self) -> float:
        return time.perf_counter() - self.start

    def _compute_floor(self, item: _Queued) -> float:
        """The compute time of the fastest candidate ``item`` can lead to: with the lightest
        remat policy its expansions may reach (no communication, no offload)."""
        cfg = item.cfg
        if "remat_policy" not in self.pinned:
            cfg = cfg.model_copy(update={"remat_policy": REMAT_POLICIES[-1]})
        return self._cost(cfg, item.candidate, []).compute_s

    def _best_fitting(self) -> float:
        fitting = [r["predicted"]["step_s"] for r in self.results if r.get("fits")]
        return min(fitting, default=float("inf"))

    def compile_all(self) -> dict[str, int]:
        """Compile queued candidates best-first until the queue or the budget runs out."""
        stats = Counter()
        pool = WorkerPool(self.req.devices, self.req.workers)
        running: dict[int, _Queued] = {}
        try:
            while self.queue or running:
                left = self.req.budget_seconds - self._elapsed()
                if left <= 0:
                    break
                while self.queue and pool.idle:
                    item = self._pop()
                    if self._compute_floor(item) >= self._best_fitting():  # even its compute is slower than a known fit
                        stats["not compiled: compute alone slower than the best fit"] += 1
                        continue
                    job_id = next(self.order)
                    running[job_id] = item
                    pool.submit(self._job(job_id, item.candidate))
                if not running:
                    continue
                result = pool.next_result(timeout=left)
                if result is None:
                    break
                self._record(running.pop(result["id"]), result, stats)
        finally:
            stats["not compiled: time budget"] += len(self.queue) + len(running)
            pool.close()
        return dict(stats)

    def _record(self, item: _Queued, result: dict[str, Any], stats: Counter) -> None:
        cand = item.candidate
        entry: dict[str, Any] = {
            "overrides": cand.args(self.base),
            "mesh": cand.mesh,
            "values": cand.values,
            "estimated_peak_bytes": item.estimated_peak,
        }
        if "error" in result:
            stats["compile failed"] += 1
            self.results.append({**entry, "error": result["error"], "fits": False})
            return
        stats["compiled"] += 1
        collectives = [Collective(**{**c, "axes": tuple(c["axes"])}) for c in result["collectives"]]
        cost = self._cost(item.cfg, cand, collectives, result)
        resident, temp = result["resident_bytes"], result["temp_bytes"]
        peak = None if resident is None or temp is None else self.req.device.required_bytes(resident, temp)
        fits = peak is not None and peak <= self.memory
        self.results.append(
            {
                **entry,
                "fits": fits,
                "peak_bytes": peak,
                "headroom_bytes": None if peak is None else self.memory - peak,
                "state_bytes": result["state_bytes"],
                "host_bytes": result["host_bytes"],
                "compile_seconds": result["compile_seconds"],
                "collectives": len(collectives),
                "predicted": cost.as_dict(),
            }
        )
        self._expand(cand, item.cfg, fits, collectives)

    # ---------------------------------------------------------------- result

    def run(self) -> dict[str, Any]:
        self.totals = state_totals(self.req.file, self.req.overrides)
        considered = self.enumerate()
        queued = len(self.queue)
        if not queued:
            raise UserError(self._nothing_valid(considered))
        stats = self.compile_all()
        fitting = sorted((r for r in self.results if r["fits"]), key=_rank_key)
        if not fitting:
            raise UserError(self._nothing_fits(stats))
        return {
            "model_name": self.base.model_name,
            "devices": self.req.devices,
            "device": asdict(self.req.device),
            "memory_bytes": self.memory,
            "efficiency": self.req.device.efficiency if self.req.efficiency is None else self.req.efficiency,
            "overlap": self.req.device.overlap if self.req.overlap is None else self.req.overlap,
            "pinned": {k: v for k, v in self.pinned.items()},
            "considered": considered,
            "pruned": dict(self.pruned),
            "queued": queued,
            "compile": stats,
            "seconds": self._elapsed(),
            "budget_seconds": self.req.budget_seconds,
            "top": fitting[: self.req.top],
            "compiled": self.results,
        }

    def _nothing_valid(self, considered: int) -> str:
        n = self.req.devices
        if not considered:
            dpn = self.req.device.devices_per_node
            pinned = {a: v for a, v in self.pinned.items() if a in MESH_AXES}
            problems = [axis_problem(self.base, a, v, n, dpn) for a, v in pinned.items()]
            problem = next((p for p in problems if p), None)
            if problem is None:
                product = math.prod(pinned.values())
                problem = (
                    f"the pinned axes ({', '.join(f'{AXIS_KEYS[a]}={v}' for a, v in pinned.items())}) multiply to "
                    f"{product}, and no sizes of the other axes make {n} devices"
                )
            return f"plan --search: no mesh of {n} devices for {self.base.model_name}: {problem}"
        if self.pruned[STATE_REASON]:
            return self._short_of_memory()
        reason = self.pruned.most_common(1)[0][0]
        return f"plan --search: no configuration of {n} devices is valid for {self.base.model_name}: {reason}"

    def _short_of_memory(self) -> str:
        need, args = self.smallest_state  # type: ignore[misc]
        return (
            f"plan --search: {self.base.model_name} does not fit {self.req.devices} x {self.memory / GIB:.1f} GiB: "
            f"its train state and gradients alone need at least {need / GIB:.1f} GiB per device ({args}), "
            f"{(need - self.memory) / GIB:.1f} GiB more than the device memory; use more devices, "
            "a smaller weight_dtype, or more device memory"
        )

    def _nothing_fits(self, stats: dict[str, int]) -> str:
        peaks = [r for r in self.results if r.get("peak_bytes")]
        if not peaks:
            first = next((r["error"] for r in self.results if "error" in r), "nothing was compiled within the budget")
            return f"plan --search: no candidate compiled within {self.req.budget_seconds:.0f} s ({first}); raise --time-budget"
        best = min(peaks, key=lambda r: r["peak_bytes"])
        short = (best["peak_bytes"] - self.memory) / GIB
        return (
            f"plan --search: none of the {len(peaks)} compiled configurations fits {self.memory / GIB:.1f} GiB per device; "
            f"the smallest peak is {best['peak_bytes'] / GIB:.1f} GiB ({' '.join(best['overrides'])}), {short:.1f} GiB "
            "short; use more devices, a smaller weight_dtype or per_device_batch_size, or a longer --time-budget"
        )


def _rank_key(result: dict[str, Any]) -> tuple[float, float, float]:
    """Fastest first; on a tie, less communication, then more memory headroom."""
    p = result["predicted"]
    return (round(p["step_s"], 12), p["exposed_comm_s"] + p["hidden_comm_s"], -result["headroom_bytes"])


def _kind(mesh: dict[str, int]) -> tuple[bool, bool]:
    """What makes the memory estimate err alike: a pipeline, context parallelism."""
    return (mesh["stage"] > 1, mesh["context"] > 1)


def _offload(cand: Candidate) -> tuple[bool, bool]:
    v = cand.values
    return (v[OFFLOAD_KEYS[0]], v[OFFLOAD_KEYS[1]])


def _reason(message: str) -> str:
    """A prune reason without the numbers of one candidate (so reasons count together)."""
    return " ".join(message.split())


def search(req: SearchRequest) -> dict[str, Any]:
    return Search(req).run()
