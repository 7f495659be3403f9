"""`nnxtron bench`: compile and time the real train step of a config.

Builds the mesh, optimizer, sharded state and jitted step exactly as the Trainer does
(the same functions, no copy of the step logic), compiles the step ahead of time, then
times ``steps`` steps after two warm-up steps. No checkpoints, metrics files or eval.

With a pipeline (``ici_pipeline_parallelism`` > 1) the result also holds the schedule's
bubble model (``config.pipeline``): the idle fraction ``d(S-1)/(R*M+d(S-1))`` and
``step_seconds_without_bubble`` = measured step time x (1 - bubble), the step time the
same work would take with no idle stage-iterations (treating the whole step as pipelined).

The persistent compilation cache (``compilation_cache_dir``) is on as in training: when it
already holds the step, ``xla_compile_seconds`` is the time to load it
(``xla_compile_cache_hit`` says which); ``compilation_cache_dir=`` measures a real compile.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from nnxtron.config.derived import derive
from nnxtron.config.flops import training_flops_per_token
from nnxtron.config.loader import load_config
from nnxtron.config.pipeline import pipeline_spec
from nnxtron.config.schema import Config
from nnxtron.data.sources import make_sources
from nnxtron.errors import UserError
from nnxtron.infer.paging import Paging
from nnxtron.layers.attention import attention_in_use
from nnxtron.models.build import build_model
from nnxtron.parallel.mesh import make_mesh
from nnxtron.runtime.compile_cache import count_cache_events, enable_compilation_cache
from nnxtron.runtime.peak import peak_flops_total
from nnxtron.tools.decode_timing import time_decoding
from nnxtron.tools.step_profile import profile_directory, read_profile, write_profile
from nnxtron.train.optimizer import make_optimizer
from nnxtron.train.state import init_frozen, init_state, setup
from nnxtron.train.step import Extras, batch_sharding, device_batch, make_train_step, reference_from

WARMUP_STEPS = 2
MAX_DISTINCT_BATCHES = 8  # held on device at once


def count_params(params: Any) -> int:
    """Number of scalars in a parameter tree (nnx.State or any pytree of arrays)."""
    return int(sum(np.prod(np.shape(leaf), dtype=np.int64) for leaf in jax.tree.leaves(params)))


def pipeline_fields(cfg: Config, step_seconds: float) -> dict[str, Any]:
    """The pipeline's bubble model next to the measured step time (None values without a pipeline)."""
    spec = pipeline_spec(cfg)
    if spec is None:
        return {
            "pipeline_stages": 1,
            "pipeline_repeats": None,
            "pipeline_microbatches": None,
            "pipeline_bubble_fraction": None,
            "step_seconds_without_bubble": None,
        }
    return {
        "pipeline_stages": spec.stages,
        "pipeline_repeats": spec.repeats,
        "pipeline_microbatches": spec.microbatches,
        "pipeline_bubble_fraction": spec.bubble_fraction,
        "step_seconds_without_bubble": step_seconds * (1 - spec.bubble_fraction),
    }


def run_bench(file: str | None, overrides: Sequence[str], steps: int = 10, profile: str | None = None) -> dict[str, Any]:
    """Compile and time the train step of the config ``file`` + ``overrides``.

    Returns one flat dict (JSON-serialisable): timings in seconds, throughput, model
    TFLOP/s and MFU, the pipeline bubble model (``pipeline_fields``), plus fields that
    identify the model and the machine. ``steps`` is the number of timed steps (the
    config's ``steps`` is ignored). ``profile``: a directory for a profiler trace of
    further steps and the step's HLO (``tools/step_profile.py``); the result then holds
    their per-step breakdown (``profile_breakdown``).
    """
    if steps < 1:
        raise UserError(f"--steps must be at least 1, got {steps}")
    if profile:
        profile = str(profile_directory(profile))
    cfg = load_config(file, list(overrides))
    cache_dir = enable_compilation_cache(cfg)
    derived = derive(cfg, jax.device_count())
    mesh = make_mesh(cfg)
    tx, schedule = make_optimizer(cfg, derived)
    model_setup = setup(cfg, mesh, tx)
    train_source, _ = make_sources(cfg, derived.global_batch_size)
    shardings = batch_sharding(cfg, model_setup)
    step_fn = make_train_step(cfg, model_setup, tx, schedule)

    state = init_state(cfg, model_setup, tx)
    params = count_params(state["params"])
    data = train_source.iterator(jax.process_index(), jax.process_count())
    try:  # on device before timing (data loading is not part of a step), then cycled
        batches = [device_batch(next(data), shardings) for _ in range(min(WARMUP_STEPS + steps, MAX_DISTINCT_BATCHES))]
    finally:
        data.close()
    frozen = init_frozen(cfg, model_setup.frozen_shardings) if cfg.lora_rank else None  # LoRA's seeded base
    reference = reference_from(state, model_setup) if cfg.use_dpo else None  # DPO's frozen reference model
    extra = (Extras(frozen, reference),) if frozen is not None or reference is not None else ()
    jax.block_until_ready((state, batches, extra))

    start = time.perf_counter()
    lowered = step_fn.lower(state, batches[0], *extra)
    lowered_at = time.perf_counter()
    with count_cache_events() as cache_events:
        compiled = lowered.compile()
    compiled_at = time.perf_counter()

    times: list[float] = []
    loss = float("nan")
    for i in range(WARMUP_STEPS + steps):
        batch = batches[i % len(batches)]
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch, *extra)  # the input state is donated
        jax.block_until_ready((state, metrics))
        elapsed = time.perf_counter() - t0
        if i >= WARMUP_STEPS:
            times.append(elapsed)
        loss = float(metrics["loss"])

    profiled: dict[str, Any] = {}
    if profile:

        def one_step() -> None:
            nonlocal state
            state, metrics = compiled(state, batches[0], *extra)
            jax.block_until_ready((state, metrics))

        write_profile(profile, compiled, one_step)
        profiled = {"profile_dir": profile, "profile_breakdown": read_profile(profile, cfg.vocab_size)}

    step_seconds = statistics.median(times)
    tokens_per_step = derived.tokens_per_step
    flops_per_token = training_flops_per_token(cfg)
    tflops = flops_per_token * tokens_per_step / step_seconds / 1e12
    peak, peak_source = peak_flops_total(cfg)
    return {
        **_identity(cfg),
        "params": params,
        "global_batch": derived.global_batch_size,
        "seq_len": cfg.max_target_length,
        "tokens_per_step": tokens_per_step,
        "weight_dtype": cfg.weight_dtype,
        "scan_layers": cfg.scan_layers,
        "remat_policy": cfg.remat_policy,
        "dataset_type": cfg.dataset_type,
        "devices": jax.device_count(),
        "mesh_shape": derived.mesh_shape,
        "trace_lower_seconds": lowered_at - start,
        "xla_compile_seconds": compiled_at - lowered_at,
        "compile_seconds": compiled_at - start,
        "compilation_cache_dir": cache_dir,  # None = off
        "xla_compile_cache_hit": cache_events["hits"] > 0,  # true: xla_compile_seconds was a load from the cache
        "timed_steps": steps,
        "step_seconds": step_seconds,
        "step_seconds_min": min(times),
        "tokens_per_s": tokens_per_step / step_seconds,
        "flops_per_token": flops_per_token,
        "model_tflops_per_s": tflops,
        "peak_tflops": peak / 1e12,
        "peak_source": peak_source,
        "mfu": tflops * 1e12 / peak,
        **pipeline_fields(cfg, step_seconds),
        **memory_fields(compiled),
        "loss": loss,
        **profiled,
    }


def memory_fields(compiled: Any) -> dict[str, Any]:
    """What XLA's memory analysis of the compiled step says (bytes; None where the backend
    does not say), and the device's peak bytes in use so far (TPU and GPU report it)."""
    analysis = compiled.memory_analysis()
    read = lambda name: getattr(analysis, name, None) if analysis is not None else None  # noqa: E731
    stats = jax.local_devices()[0].memory_stats() or {}
    return {
        "memory_temp_bytes": read("temp_size_in_bytes"),
        "memory_argument_bytes": read("argument_size_in_bytes"),
        "memory_output_bytes": read("output_size_in_bytes"),
        "memory_alias_bytes": read("alias_size_in_bytes"),
        "device_peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "device_bytes_limit": stats.get("bytes_limit"),
    }


def run_decode_bench(file: str | None, overrides: Sequence[str], steps: int = 3, paging: Paging | None = None) -> dict[str, Any]:
    """Time KV-cached decoding (``tools.decode_timing``) of the config's model at its initial
    weights: prefill of ``per_device_batch_size x devices`` prompts of ``max_target_length`` tokens (median of
    ``steps``), then ``max_new_tokens`` one-token steps. Decoding runs on one device; with
    ``paging``, over the serving engine's paged cache."""
    if steps < 1:
        raise UserError(f"--steps must be at least 1, got {steps}")

    cfg = load_config(file, list(overrides))
    enable_compilation_cache(cfg)
    batch = max(1, int(cfg.per_device_batch_size * jax.device_count()))  # the global batch, without a mesh
    model = build_model(cfg)
    result = time_decoding(model, batch, cfg.max_target_length, cfg.max_new_tokens, repeats=steps, paging=paging)
    return {**_identity(cfg), "params": count_params(nnx.state(model, nnx.Param)), **result}


def _identity(cfg: Config) -> dict[str, Any]:
    """The fields that say which model ran where (both benchmarks report them)."""
    return {
        "model_name": cfg.model_name,
        "decoder_block": cfg.decoder_block,
        "attention": attention_in_use(cfg),
        "dtype": cfg.dtype,
        "quantization": cfg.quantization if cfg.use_qwix_quantization else None,
        "backend": jax.default_backend(),
        "device_kind": getattr(jax.devices()[0], "device_kind", ""),
    }
