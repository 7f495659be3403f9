"""tests/flags/read_coverage.py, the read-site coverage of the flag-sensitivity matrix (issue 54):
the recorder sees the read sites of its key that run (and only those), the report names every
read site that no case ran and no listing names and every listing that names no site, and the
session fails on them once the whole matrix has run."""

from __future__ import annotations

import json
import threading
import types

import pytest

from nnxtron.config.derived import derive
from nnxtron.config.schema import Config
from nnxtron.train.optimizer import make_optimizer
from tests.conftest import tiny_config
from tests.flags import read_coverage


def _site_ids(key: str, function: str) -> set[str]:
    return {s.id for s in read_coverage._sites() if s.key == key and s.function == function}


def test_the_recorder_sees_the_reads_of_its_key_that_run():
    cfg = tiny_config("llama2-tiny", adam_eps=1e-6)
    adam_eps = _site_ids("adam_eps", "base_optimizer")
    assert adam_eps, "train/optimizer.py base_optimizer reads adam_eps"
    with read_coverage.Recorder("adam_eps") as recorder:
        make_optimizer(cfg, derive(cfg, 1))
    assert recorder.traced and adam_eps <= recorder.hit
    assert all(site.endswith(":adam_eps") for site in recorder.hit)
    with read_coverage.Recorder("lion_b1") as other:  # lion's reads do not run for adamw
        make_optimizer(cfg, derive(cfg, 1))
    assert not other.hit


def _eps_of(configs) -> list[float]:
    return [c.adam_eps for c in configs]  # the read the next test watches


def test_the_recorder_counts_reads_that_run_in_any_thread_and_leaves_no_hook():
    """A line that starts without its read running (a comprehension over nothing) is no read;
    a read in another thread is; the classes are as before once the block ends."""
    code = _eps_of.__code__
    recorder = read_coverage.Recorder("adam_eps")
    recorder.lines = {code.co_filename: {code.co_firstlineno + 1: {"the read"}}}
    with recorder:
        _eps_of(())
    assert not recorder.hit
    with recorder:
        thread = threading.Thread(target=_eps_of, args=([tiny_config("llama2-tiny")],))
        thread.start()
        thread.join()
    assert recorder.hit == {"the read"}
    assert all("__getattribute__" not in vars(cls) for cls in read_coverage._read_classes())
    assert Config in read_coverage._read_classes()


def test_the_report_names_unproven_sites_and_stale_listings(monkeypatch):
    every = [{"hit": sorted(s.id for s in read_coverage._sites())}]
    assert read_coverage.report(every) == []
    missing = next(s for s in read_coverage._sites() if read_coverage.listing(s) is None)
    without_one = [{"hit": sorted(s.id for s in read_coverage._sites() if s.id != missing.id)}]
    assert [p.split(" ")[0] for p in read_coverage.report(without_one)] == [missing.id]
    monkeypatch.setitem(read_coverage.NOT_PROVEN, ("src/nnxtron/nowhere.py", "f", "*"), "gone")
    assert read_coverage.report(every) == [
        "NOT_PROVEN names ('src/nnxtron/nowhere.py', 'f', '*'), which is no read site now: drop it"
    ]


class _Writer:
    def __init__(self):
        self.lines: list[str] = []

    def line(self, text: str = "", **_) -> None:
        self.lines.append(text)


@pytest.mark.parametrize("complete", [True, False])
def test_the_session_fails_on_an_unproven_site_once_the_whole_matrix_ran(tmp_path, monkeypatch, complete):
    monkeypatch.setenv(read_coverage.ENV, str(tmp_path))
    missing = next(s for s in read_coverage._sites() if read_coverage.listing(s) is None)
    hit = sorted(s.id for s in read_coverage._sites() if s.id != missing.id)
    records = [{"case": "a", "key": "k", "hit": hit, "cases": 2 if complete else 3, "traced": True},
               {"case": "b", "key": "k", "hit": [], "cases": 2 if complete else 3, "traced": True}]  # fmt: skip
    (tmp_path / "gw0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    writer = _Writer()
    config = types.SimpleNamespace(get_terminal_writer=lambda: writer)
    session = types.SimpleNamespace(config=config, exitstatus=0)
    read_coverage.finish(session)
    assert session.exitstatus == (1 if complete else 0)  # a part of the matrix judges nothing
    assert any(line.startswith(missing.id) for line in writer.lines) == complete
