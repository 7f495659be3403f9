"""The logic behind issue 47's small frictions, without timing anything: the live progress line
fitted to a width, the matmul peak kept as the highest measured, the keys `train --help` names,
and the MaxText ignored-keys listing. The commands themselves: tests/integration/test_cli_frictions.py."""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import pytest
from rich.console import Console

from nnxtron.cli import TRAIN_KEYS_HELP
from nnxtron.config import options
from nnxtron.config.loader import load_config, load_config_report
from nnxtron.config.maxtext import REPORT_WIDTH
from nnxtron.config.schema import Config
from nnxtron.runtime import peak
from nnxtron.train.metrics import FIELD_GAP, ProgressBar, fit_line, line_fields

BASE = Path(__file__).resolve().parents[1] / "assets" / "maxtext" / "base.yml"
RECORD = {"loss": 3.1234, "aux/moe_lb": 0.0123, "tokens_per_s": 12345.6, "tflops": 0.0123, "mfu": 0.123}
ESSENTIAL = ["37/100", "loss 3.1234", "12,346 tok/s", "ETA 0:01:23"]


def _rendered(width: int) -> str:
    """The progress bar's live line as a console of ``width`` columns draws it."""
    bar = ProgressBar(100, 0, enabled=True)
    bar.update(37, RECORD)
    buffer = io.StringIO()
    Console(file=buffer, width=width, force_terminal=True, color_system=None).print(bar.progress.get_renderable())
    return buffer.getvalue().rstrip("\n")


@pytest.mark.parametrize("width", [200, 120, 100, 80, 72, 60, 40, 20, 10, 5])
def test_progress_line_fits_its_width_with_whole_fields(width):
    fields = line_fields(37, 100, RECORD, elapsed=12.0, remaining=83.0)
    line = fit_line(fields, width, 0.37).plain
    assert len(line) <= width
    texts = {text for _, text in fields}
    parts = [part for part in line.split(FIELD_GAP) if part]
    assert all(part in texts or set(part) == {"━"} for part in parts), parts  # no field cut
    shown = [text for _, text in sorted(fields) if text in parts]
    ranked = [text for _, text in sorted(fields)]
    assert shown == ranked[: len(shown)]  # fields kept by priority: a prefix of the ranking
    if width >= 60:
        assert all(field in parts for field in [*ESSENTIAL, "MFU 12.3%"]), line
    if width >= 150:
        assert all(text in parts for text in texts) and "━" in line


def test_progress_bar_renders_the_fitted_line_at_80_columns():
    """The ProgressBar draws ``fit_line`` at the console's width (rich's fixed columns cut the
    step count and the ETA at 80: ``train   … loss 3.1234 ... MFU 12.3%  -…``)."""
    line = _rendered(80)
    assert len(line) <= 80 and "\n" not in line and "…" not in line
    assert re.search(r"37/100  loss 3\.1234  12,346 tok/s  MFU 12\.3%  ETA -:--:--$", line), line
    assert _rendered(200).startswith("train  ━")


def test_peak_is_the_highest_measured():
    cache, value = peak.remember_peak({"a": 5.0, "b": 1.0}, "a", 3.0)
    assert (cache, value) == ({"a": 5.0, "b": 1.0}, 5.0)  # a reading under load does not lower it
    cache, value = peak.remember_peak({"a": 5.0}, "a", 7.0)
    assert (cache, value) == ({"a": 7.0}, 7.0)
    for stored in ([1.0], {"a": "fast"}, {"a": -1.0}, {"a": math.nan}, {"a": True}, {"a": math.inf}, None):
        cache, value = peak.remember_peak(stored, "a", 3.0)
        assert value == 3.0 and cache["a"] == 3.0, stored


def test_the_probe_runs_every_time_for_the_steps_dtype(monkeypatch, tmp_path):
    """The probe is measured on every call with the config's dtype and long enough; the cache
    keeps the higher value (the old code returned any cached value without measuring)."""
    calls = []
    measured = iter([2e11, 1e11, 3e11])

    def fake_probe(dtype, size, repeats, min_seconds):
        calls.append((dtype, size, repeats, min_seconds))
        return next(measured)

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(peak, "measure_matmul_flops", fake_probe)
    cache = tmp_path / "nnxtron" / "peak_flops.json"
    cfg = load_config(None, ["dtype=bfloat16"])
    assert peak.peak_flops_per_device(cfg)[0] == 2e11
    assert peak.peak_flops_per_device(cfg)[0] == 2e11  # measured 1e11: the higher stays
    assert list(json.loads(cache.read_text()).values()) == [2e11]
    value, source = peak.peak_flops_per_device(cfg)
    assert value == 3e11 and list(json.loads(cache.read_text()).values()) == [3e11] and "highest measured" in source
    assert calls == [("bfloat16", peak.PROBE_SIZE, peak.PROBE_REPEATS, peak.PROBE_SECONDS)] * 3
    assert peak.PROBE_SECONDS > 0 and peak.PROBE_REPEATS >= 10
    assert peak.peak_flops_per_device(load_config(None, ["peak_tflops=2"])) == (2e12, "config peak_tflops")
    assert len(calls) == 3


def test_train_help_names_real_keys():
    named = set(re.findall(r"\b([a-z_0-9]+)=", TRAIN_KEYS_HELP)) - {"key"}  # "key=value"
    assert {"model_name", "steps", "per_device_batch_size", "max_target_length", "learning_rate", "dataset_type",
            "dataset_path", "run_name", "init_from"} <= named  # fmt: skip
    assert named <= set(Config.model_fields), named - set(Config.model_fields)
    for key, values in (("dataset_type", options.DATASET_TYPES), ("tokenizer_type", options.TOKENIZER_TYPES)):
        listed = re.search(rf"{key}=TYPE +(.*)", TRAIN_KEYS_HELP).group(1).split(",")[0]
        assert listed.split(" | ") == sorted(values, key=listed.find), key
    assert max(len(line) for line in TRAIN_KEYS_HELP.splitlines()) < 80


def test_ignored_maxtext_keys_are_named_once_grouped_and_wrapped():
    cfg, report = load_config_report(str(BASE), ["profiler=xplane"])
    lines = report.startup_lines(cfg)
    assert all(len(line) <= REPORT_WIDTH for line in lines), [line for line in lines if len(line) > REPORT_WIDTH]
    counts = [int(count) for count in re.findall(r"\((\d+)\):", "\n".join(lines))]
    assert len(counts) == 11 and sum(counts) == 372  # one group per reason (config/maxtext_keys.py)
    named = re.findall(r"[a-z_0-9]+", " ".join(line for line in lines if line.startswith("    ")))
    assert sorted(named) == sorted(report.ignored) and len(named) == 372 == len(set(named))
    assert "  371 at MaxText's default values; set otherwise: profiler='xplane'" in lines
    block = report.comment_block()
    assert all(line.startswith("#") and len(line) <= REPORT_WIDTH for line in block)
    assert "profiler='xplane'" in " ".join(block)
