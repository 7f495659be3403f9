"""benchmarks/vs_maxtext.py's arithmetic (MaxText is not run here): which of MaxText's logged
steps count, and how runs become medians, best steps and ratios. No timing threshold."""

from __future__ import annotations

import pytest

from tests.scripts import load_script

LOG = """I1202 02:13:19 metric_logger.py:265] completed step: 0, seconds: 0.124, TFLOP/s/device: 0.627, Tokens/s/device: 8265.130, total_weights: 1024, loss: 10.880
W1202 unrelated line
I1202 02:13:22 metric_logger.py:265] completed step: 1, seconds: 0.858, TFLOP/s/device: 0.091, Tokens/s/device: 1193.546, total_weights: 1024, loss: 10.798
I1202 02:13:25 metric_logger.py:265] completed step: 2, seconds: 2.000, TFLOP/s/device: 0.043, Tokens/s/device: 512.000, total_weights: 1024, loss: 10.727
I1202 02:13:27 metric_logger.py:265] completed step: 3, seconds: 4.000, TFLOP/s/device: 0.023, Tokens/s/device: 256.000, total_weights: 1024, loss: 10.682
I1202 02:13:30 metric_logger.py:265] completed step: 4, seconds: 1.000, TFLOP/s/device: 0.029, Tokens/s/device: 1024.000, total_weights: 1024, loss: 10.663
"""


def _vs():
    return load_script("benchmarks/vs_maxtext.py")


def test_maxtext_log_skips_the_warm_up_steps():
    parsed = _vs().parse_maxtext_log(LOG, devices=2)
    assert parsed["step_seconds_all"] == [2.0, 4.0, 1.0]  # steps 0 and 1 (compile, fill) skipped
    assert parsed["step_seconds"] == 2.0 and parsed["step_seconds_min"] == 1.0
    assert parsed["tokens_per_step_estimate"] == pytest.approx(2048)  # tokens/s/device x s x devices


def test_maxtext_log_without_timed_steps_is_an_error():
    with pytest.raises(RuntimeError, match="no timed 'completed step'"):
        _vs().parse_maxtext_log(LOG.split("completed step: 2")[0], devices=1)


def _run(system, variant, median, best, **extra):
    return {"system": system, "variant": variant, "step_seconds": median, "step_seconds_min": best, **extra}


def test_summary_takes_each_systems_best_variant_and_the_ratio_of_tokens_per_second():
    runs = [
        _run("nnxtron", "", 1.0, 0.9, tokens_per_step=1000),
        _run("maxtext", "true", 3.0, 1.5, tokens_per_step_estimate=1001),
        _run("nnxtron", "", 2.0, 0.8, tokens_per_step=1000),
        _run("maxtext", "false", 2.4, 2.0, tokens_per_step_estimate=999),
        _run("maxtext", "false", 2.6, 2.2, tokens_per_step_estimate=1000),
        {"system": "maxtext", "variant": "true", "error": "failed"},  # left out, not a zero
    ]
    s = _vs().summarize_runs(runs)
    assert s["tokens_per_step"] == 1000 and "warning" not in s
    assert s["nnxtron"]["median_s"] == 1.5 and s["nnxtron"]["best_s"] == 0.8
    mt = s["maxtext"]
    assert (mt["median_variant"], mt["median_s"]) == ("false", 2.5)  # median of the runs' medians
    assert (mt["best_variant"], mt["best_s"]) == ("true", 1.5)
    assert s["ratio_median"] == pytest.approx(2.5 / 1.5)
    assert s["ratio_best"] == pytest.approx(1.5 / 0.8)
    assert mt["median_tokens_per_s"] == pytest.approx(400)


def test_summary_reports_a_tokens_mismatch_and_a_system_that_failed():
    s = _vs().summarize_runs(
        [_run("nnxtron", "", 1.0, 1.0, tokens_per_step=1000), _run("maxtext", "", 1.0, 1.0, tokens_per_step_estimate=500)]
    )
    assert "differ" in s["warning"]
    failed = _vs().summarize_runs(
        [_run("nnxtron", "", 1.0, 1.0, tokens_per_step=1000), {"system": "maxtext", "variant": "", "error": "x"}]
    )
    assert failed["maxtext"] is None and "ratio_median" not in failed


def test_both_systems_get_the_same_model_keys_and_the_none_case_names_maxtexts_cheapest_policy():
    vs = _vs()
    for quick in (False, True):
        for name, case in vs.cases(quick).items():
            for system in vs.SYSTEMS:
                for extra in case.runs(system).values():
                    assert not any(k.split("=")[0] in {e.split("=")[0] for e in extra} for k in case.shared), name
    none = vs.cases(False)["dense-none"]
    assert none.runs("nnxtron") == {"none": ("remat_policy=none",)}
    assert none.runs("maxtext") == {"minimal_with_context": ("remat_policy=minimal_with_context",)}
    assert "remat_policy=minimal" in vs.cases(False)["dense-minimal"].shared
