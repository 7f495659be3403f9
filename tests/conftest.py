"""Test setup: 8 fake CPU devices (set before jax is imported) and shared helpers."""

import gc
import os

# The tiny test models spend their time in XLA's compiler, not in their kernels: these flags
# make it compile them faster (tests/integration/test_maxtext_commands.py drops them for its
# 20-step runs, whose steps they slow). LLVM optimisation level 0 cuts compilation ~35%
# (machine-code optimisation of the generated kernels skipped); XLA's older loop emitters
# instead of its MLIR fusion emitters cut a train step's compile 2-2.5x more (measured
# 2026-12-06: llama3.1-tiny 1.07 -> 0.39 s, deepseek3-test 2.36 -> 1.14 s, mixtral-tiny
# 1.60 -> 0.63 s; losses bit-identical). HLO passes, fusion decisions and buffer assignment are unchanged.
COMPILE_SPEED_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = " ".join(
    [*os.environ.get("XLA_FLAGS", "").split(), "--xla_force_host_platform_device_count=8", *COMPILE_SPEED_FLAGS]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# persistent compilation cache off unless this variable is set: the default directory is in the
# home directory. The config loader takes it as the default of compilation_cache_dir ("" = off);
# tests/integration/test_compile_cache.py and test_kill_resume.py give a directory of their own.
# Opt in for re-runs: JAX_COMPILATION_CACHE_DIR=/tmp/nnxtron-test-cache (tests/integration -n 2:
# 410-450 s off, 410-620 s on a cold cache, 233 s on a warm one; CI starts cold, so it stays off).
# A cache made empty for each session and shared by both workers (every compile kept) measured
# 404 -> 370 s over test_hf_golden + test_kv_cache + test_matrix and 236 -> 244 s over the pipeline
# and MaxText-checkpoint files (2026-12-07): no gain beyond the machine's noise, so none is made.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "")
# no test reaches the network: HF datasets (the lm-eval harness's local tasks) and the hub read local files only
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

from tests.helpers import random_batch, tiny_config  # noqa: E402, F401  (the tests import them from here too)

assert jax.device_count() == 8, "tests expect 8 fake CPU devices (XLA_FLAGS set too late?)"


def lower_train_step(cfg, devices: int):
    """The train step of ``cfg`` on the first ``devices`` fake devices, lowered on abstract
    (sharded) state and batch (``nnxtron plan``'s lowering): ``(model_setup, lowered)``."""
    model_setup, traced = trace_train_step(cfg, devices)
    return model_setup, traced.lower()


def sub_jaxprs(eqn) -> list:
    """The jaxprs (closed or open) an equation holds in its parameters (scan and cond
    bodies, checkpoints, pjits, custom derivatives...)."""
    found = []
    for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else [value]:
            if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                found.append(sub)
    return found


def setup_train_state(cfg, devices: int):
    """The abstract, sharded train state of ``cfg`` on the first ``devices`` fake devices:
    ``(model_setup, optimizer, schedule, derived)``; raises when parameters are left unsharded."""
    from nnxtron.config.derived import derive
    from nnxtron.parallel.mesh import make_mesh
    from nnxtron.train.optimizer import make_optimizer
    from nnxtron.train.state import setup

    chosen = jax.devices()[:devices]
    derived = derive(cfg, len(chosen))
    tx, schedule = make_optimizer(cfg, derived)
    return setup(cfg, make_mesh(cfg, devices=chosen), tx), tx, schedule, derived


def trace_train_step(cfg, devices: int):
    """As ``lower_train_step``, traced only: ``(model_setup, traced)`` (``traced.jaxpr``)."""
    from nnxtron.tools import plan

    model_setup, tx, schedule, derived = setup_train_state(cfg, devices)
    return model_setup, plan.trace_train_step(cfg, model_setup, tx, schedule, derived)


def pytest_configure(config):
    from tests.flags import read_coverage

    read_coverage.configure(config)


def pytest_sessionfinish(session, exitstatus):
    from tests.flags import read_coverage

    read_coverage.finish(session)


@pytest.fixture
def tmp_run_base(tmp_path):
    return str(tmp_path / "runs")


# Every program XLA compiles for the CPU is JIT-loaded into memory mappings of its own (code,
# read-only data, data: three per object file), kept while jax's caches hold the executable.
# A test process that compiles the whole suite's programs passes Linux's default limit of
# 65,530 mappings per process (vm.max_map_count) and the next compilation segfaults inside
# XLA (a CI worker did at ~2,000 tests). Past this many mappings the caches are dropped,
# which frees them; programs still needed are compiled again.
MAX_MEMORY_MAPPINGS = 30_000
_MAPS = "/proc/self/maps"


def memory_mappings() -> int:
    """This process's memory mappings (0 where /proc is missing)."""
    if not os.path.exists(_MAPS):
        return 0
    with open(_MAPS, "rb") as maps:
        return sum(1 for _ in maps)


def release_compiled_programs(limit: int = MAX_MEMORY_MAPPINGS) -> bool:
    """Drop jax's caches (and the executables they hold) when the process has more than
    ``limit`` memory mappings; True when it did."""
    if memory_mappings() <= limit:
        return False
    jax.clear_caches()
    gc.collect()
    return True


@pytest.fixture(autouse=True)
def _release_compiled_programs_near_the_mapping_limit():
    yield
    release_compiled_programs()
