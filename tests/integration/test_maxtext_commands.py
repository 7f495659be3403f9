"""MaxText's reference commands (issue 24), verbatim apart from the program name, run through the
real CLI with MaxText's own base.yml: the MTP run of its MTP/qwix fix trains all 20 steps (and its
fp8_full variant), its Linen variant is one error line, its MoE pipeline-change config resolves.

The training runs are child processes on one CPU device, as MaxText's command runs on one host
device (``per_device_batch_size=1``: one row of 128 tokens). Each is a full deepseek3-tiny (61
layers, 58 of them MoE with 16 experts, top-8) in bfloat16: about 35 s of XLA compile and 20 steps
of ~3 s on 2 CPU cores, two thirds of each step in the routed experts — ``jax.lax.ragged_dot`` has
no grouped kernel on CPU, and JAX's fallback multiplies every expanded (token, slot) row by every
expert (16x the dropless FLOPs; 27 ms vs 3.5 ms for a dense all-experts einsum per layer fwd+bwd).
The durations are printed (``pytest -s``).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from nnxtron.config.loader import load_config_report
from nnxtron.runtime.fake_devices import fake_device_env
from tests.conftest import COMPILE_SPEED_FLAGS
from tests.integration.conftest import assert_user_error, metric_records, run_cli
from tests.unit.test_maxtext_config import BASE, REFERENCE

STEPS = 20
# tests/conftest.py's flags (faster compiles of tiny models): 20 steps of this model run ~2x slower without
# LLVM optimisation (measured: 9.2 s vs 3-5 s a step), so the child processes here drop them
FP8_FULL = ["use_qwix_quantization=true", "quantization=fp8_full"]
LINEN = ["enable_nnx=false", "pure_nnx_decoder=false", "pure_nnx=false"]
# the MoE test config of MaxText's pipeline change (its use_ring_of_experts / use_ragged_sort / ragged_buffer_factor row)
MOE_PIPELINE = (
    "model_name=mixtral-8x7b override_model_config=True base_emb_dim=2048 base_mlp_dim=256 base_moe_mlp_dim=256 "
    "dtype=bfloat16 megablox=True sparse_matmul=True ici_expert_parallelism=2 use_ring_of_experts=false "
    "use_ragged_sort=true ragged_buffer_factor=-1"
).split()


def maxtext_command(tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    """``nnxtron train base.yml base_output_directory=OUT run_name=nnx_mtp REFERENCE... EXTRA...``
    in a child process on one CPU device: (the finished process, its wall time in seconds)."""
    args = ["train", str(BASE), f"base_output_directory={tmp_path}", "run_name=nnx_mtp", *REFERENCE, *extra]
    env = {**os.environ, **fake_device_env(1)}
    env["XLA_FLAGS"] = " ".join(f for f in env["XLA_FLAGS"].split() if f not in COMPILE_SPEED_FLAGS)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "nnxtron", *args], capture_output=True, text=True, env=env, timeout=900, check=False
    )  # fmt: skip
    return proc, time.perf_counter() - start


def assert_trained_with_mtp(proc: subprocess.CompletedProcess, run_dir) -> list[float]:
    """All 20 steps ran, every loss and MTP loss is finite, the loss falls; returns the losses."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = metric_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    losses, mtp = [r["loss"] for r in records], [r["aux/mtp"] for r in records]
    assert all(math.isfinite(v) for v in losses + mtp), (losses, mtp)
    assert sum(losses[-5:]) < sum(losses[:5]), losses  # learning: the last five steps below the first five
    assert all(0 < v < 5 for v in mtp), mtp  # mtp_loss_scaling_factor=0.1 times a cross-entropy near ln(129280)
    text = proc.stdout + proc.stderr
    assert f"step {STEPS}: loss" in text and "| mtp " in text, text[-2000:]
    return losses


@pytest.mark.parametrize("variant", ["bf16", "fp8_full"])
def test_maxtext_mtp_reference_command_trains_20_steps(tmp_path, variant):
    proc, seconds = maxtext_command(tmp_path, *(FP8_FULL if variant == "fp8_full" else []))
    losses = assert_trained_with_mtp(proc, tmp_path / "nnx_mtp")
    print(f"\n{variant}: {seconds:.1f} s, losses {' '.join(f'{v:.4f}' for v in losses)}")
    stored = (tmp_path / "nnx_mtp" / "config.yml").read_text()
    assert ("quantization: fp8_full" in stored) == (variant == "fp8_full")


def test_maxtext_linen_variant_is_one_error_line(capsys, tmp_path):
    args = ["train", str(BASE), f"base_output_directory={tmp_path}", "run_name=nnx_mtp", *REFERENCE, *LINEN]
    code, _, err = run_cli(capsys, *args)
    assert_user_error(code, err, "MaxText key enable_nnx=False is refused: nnxtron has only the NNX path")
    assert not (tmp_path / "nnx_mtp").exists()


def test_maxtext_moe_pipeline_config_resolves(capsys):
    code, out, err = run_cli(capsys, "config", "show", str(BASE), *MOE_PIPELINE)  # 8 fake devices: expert=2 x fsdp=4
    assert code == 0, err
    for line in ("num_experts: 8", "num_experts_per_tok: 2", "base_emb_dim: 2048", "base_moe_mlp_dim: 256",
                 "dtype: bfloat16", "ici_expert_parallelism: 2", "capacity_factor: -1.0"):  # fmt: skip
        assert f"\n{line}\n" in out, line
    assert "use_ragged_sort=True" in out  # listed as ignored: a sort kernel (the drops are ragged_buffer_factor's, -1 here)
    cfg, report = load_config_report(BASE, MOE_PIPELINE)
    assert "sparse_matmul=True megablox=True capacity_factor=-1.0 — nnxtron computes the routed experts dropless" in (
        report.moe_line(cfg)
    )
