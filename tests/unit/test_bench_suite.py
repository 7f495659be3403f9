"""benchmarks/suite.py (the one-command benchmark suite) and benchmarks/accelerator_mfu.py: they run
and report consistent ratios; no timing threshold."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from nnxtron.config import load_config
from nnxtron.models.build import build_model
from tests.scripts import load_script


def _suite():
    return load_script("benchmarks/suite.py")


def test_compile_case_reports_trace_and_compile_apart_and_their_ratio():
    (row,) = _suite().case_compile(quick=True)
    small, large = (row["detail"][n] for n in (2, 6))
    for run in (small, large):
        assert run["compile_seconds"] == pytest.approx(run["trace_lower_seconds"] + run["xla_compile_seconds"])
        assert run["trace_lower_seconds"] > 0 and run["xla_compile_seconds"] > 0
    assert row["ratio"] == pytest.approx(large["compile_seconds"] / small["compile_seconds"])
    assert row["target"] == "<= 1.3" and "6 layers vs 2" in row["case"]


def test_decode_case_reports_each_batch_and_the_scaling_against_the_bytes_bound():
    *batches, scaling, paged_1, paged_16 = _suite().case_decode(quick=True)
    assert [row["detail"]["decode_batch"] for row in batches] == [1, 16]
    for batch, paged, dense in ((1, paged_1, batches[0]), (16, paged_16, batches[1])):  # the engine's paged cache, same shapes
        assert paged["detail"]["decode_batch"] == batch and "paged" in paged["case"]
        assert paged["ratio"] == pytest.approx(paged["detail"]["decode_tokens_per_s"] / dense["detail"]["decode_tokens_per_s"])
    rates = scaling["detail"]["tokens_per_s"]
    assert rates == {b: row["detail"]["decode_tokens_per_s"] for b, row in zip((1, 16), batches, strict=True)}
    assert scaling["ratio"] == pytest.approx(rates[16] / rates[1]) and scaling["target"] == ">= 8 (issue 27)"
    assert 1 < scaling["detail"]["bytes_bound_speedup"] < 16  # the cache a row reads costs something


def test_suite_command_writes_the_table_and_the_raw_numbers(tmp_path, capsys):
    out = tmp_path / "suite.md"
    rows = _suite().main(["--quick", "--only", "accelerator_mfu", "--out", str(out)])
    table = out.read_text()
    assert capsys.readouterr().out == table
    assert "| case | measured | baseline (same run) | ratio | target |" in table
    assert table.startswith("Machine: ") and f"backend {jax.default_backend()}" in table
    (row,) = rows
    if jax.default_backend() == "cpu":  # said in the table, not silently left out
        assert row["ratio"] is None and "not run: no GPU or TPU" in row["measured"]
        assert (
            "| accelerator MFU, llama-style 1B (GPU) / 552M (TPU) | not run: no GPU or TPU (cpu backend) | - | - | "
            ">= 0.5 (GPU), >= 0.55 (TPU) |" in table
        )
    raw = json.loads(out.with_suffix(".json").read_text())
    assert raw["rows"] == json.loads(json.dumps(rows)) and raw["machine"]["backend"] == jax.default_backend()


def test_render_formats_ratios_with_their_names():
    about = {"cpu": "X", "usable_cpus": 2, "memory_gib": 1.0, "backend": "cpu", "device_kind": "cpu", "devices": 1,
             "jax": "0", "python": "3"}  # fmt: skip
    rows = [{"case": "c", "measured": "2 s", "baseline": "1 s", "ratio": 2.0, "ratio_name": "time ratio", "target": "<= 1.3"}]
    assert "| c | 2 s | 1 s | time ratio 2 | <= 1.3 |" in _suite().render(rows, about)


@pytest.mark.parametrize(
    "backend, count, batch, remat, scanned", [("gpu", 1_235_814_400, 8, "none", True), ("tpu", 552_110_080, 4, "none", False)]
)
def test_accelerator_mfu_models_and_it_refuses_a_cpu(backend, count, batch, remat, scanned):
    """Llama 3.2 1B (tied) on a GPU; issue 46's 552M model on a TPU (its count as the chip reported it)."""
    mfu = load_script("benchmarks/accelerator_mfu.py")
    cfg = load_config(None, mfu.overrides(mfu.build_parser().parse_args([]), backend))
    params = jax.eval_shape(lambda: nnx.state(build_model(cfg), nnx.Param))
    assert sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params)) == count
    assert (cfg.dtype, cfg.weight_dtype, cfg.dataset_type) == ("bfloat16", "float32", "synthetic")
    assert (cfg.per_device_batch_size, cfg.remat_policy, cfg.scan_layers) == (batch, remat, scanned)
    if jax.default_backend() == "cpu":
        with pytest.raises(SystemExit, match="measures a GPU or a TPU"):
            mfu.main(["--out", "-"])
