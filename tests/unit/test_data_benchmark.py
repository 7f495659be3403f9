"""benchmarks/data_pipeline.py runs end to end on a tiny corpus (no timing thresholds)."""

from __future__ import annotations

import json

from nnxtron.config.options import DATASET_FORMATS
from tests.scripts import load_script


def _module():
    return load_script("benchmarks/data_pipeline.py")


def test_data_pipeline_benchmark_reports_every_format(tmp_path, capsys):
    out = tmp_path / "out.json"
    args = ["--documents", "20", "--batches", "3", "--seq-len", "64", "--batch", "2", "--repeats", "1", "--json", str(out)]
    returned = _module().main(args)
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned))
    rows = result["rows"]
    assert {row["format"] for row in rows} == set(DATASET_FORMATS)
    assert all(row["tokens_per_s"] > 0 and row["ratio_vs_baseline"] > 0 for row in rows)
    baseline = [row for row in rows if row["baseline"]]
    assert len(baseline) == 1 and rows[0] is baseline[0]
    assert (baseline[0]["format"], baseline[0]["read_threads"], baseline[0]["prefetch"]) == ("text", 0, 0)
    assert baseline[0]["ratio_vs_baseline"] == 1.0
    assert {row["read_threads"] for row in rows if row["format"] == "text"} == {0, 2, 4}
    assert result["corpus"]["documents"] == 20 and result["train"] is None
    assert all(row["ratio_vs_train"] is None for row in rows)
    printed = capsys.readouterr().out
    assert "| format | tokenizer | read threads | prefetch | tokens/s | ratio vs baseline |" in printed
    assert len([line for line in printed.splitlines() if line.startswith("| ")]) == len(rows) + 1
