"""Weights & Biases logging (enable_wandb=true), offline: what W&B recorded equals metrics.jsonl,
a resumed run continues the same W&B run, a missing package and stray wandb_* keys fail early.

W&B's offline run files (``<run>/wandb/offline-run-*/run-<id>.wandb``) are read back with a
small reader below: the files are a LevelDB-style log of W&B's own protobuf ``Record``s
(``wandb.proto.wandb_internal_pb2``); wandb >= 0.2x ships no Python reader for them."""

import json
import re
import struct
import subprocess
import sys
import types
from pathlib import Path

import pytest

from nnxtron.config import load_config, options
from nnxtron.errors import ConfigError
from nnxtron.train import wandb_logger
from nnxtron.train.loop import Trainer
from tests.integration.conftest import assert_user_error, metric_records, run_cli, train_overrides

wandb = pytest.importorskip("wandb")  # the test extra installs it; a bare install skips these tests
from wandb.proto import wandb_internal_pb2  # noqa: E402

BLOCK = 32768  # the log's block size; a record header is crc32 (4) + length (2) + type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_records(path: Path) -> list:
    """The protobuf records of one ``.wandb`` file, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B log (header {data[:7]!r})"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is zero padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        assert kind in (FULL, FIRST, MIDDLE, LAST), f"{path}: record type {kind} at byte {pos}"
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _items(items) -> dict:
    """W&B's key/value items (a key is ``key`` or, split at "/", ``nested_key``)."""
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def logged(run_dir: Path) -> list[dict]:
    """One dict per offline W&B session of ``run_dir`` (oldest first): its run id, name, config
    and history rows ``{step: {key: value}}`` (W&B's own ``_step``/``_runtime``... left out)."""
    sessions = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        session = {"id": None, "name": None, "config": {}, "history": {}}
        for record in read_wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                session["id"], session["name"] = record.run.run_id, record.run.display_name
                session["config"].update(_items(record.run.config.update))
            elif kind == "config":
                session["config"].update(_items(record.config.update))
            elif kind == "history":
                row = {key: value for key, value in _items(record.history.item).items() if not key.startswith("_")}
                session["history"].setdefault(record.history.step.num, {}).update(row)
        sessions.append(session)
    return sessions


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    """Offline W&B with its settings and caches in a temporary directory; no key, no network."""
    for var in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    yield
    wandb.teardown()  # stop this process's wandb-core service


def _trainer(corpus, base, run, **extra):
    values = dict(enable_tensorboard=False, enable_wandb=True, learning_rate_schedule_steps=6) | extra
    return Trainer(load_config(overrides=train_overrides(corpus, base, run, **values)), progress=False)


def test_wandb_logs_the_metrics_and_a_resumed_run_continues_it(corpus, tmp_path, wandb_env, monkeypatch):
    base = str(tmp_path / "runs")
    _trainer(corpus, base, "wb", steps=3, wandb_project="nnx-test").run()  # wandb_mode "": WANDB_MODE=offline
    run_dir = Path(base) / "wb"
    run_id = (run_dir / wandb_logger.ID_FILE).read_text().strip()
    wandb.teardown()  # as in a new process: W&B reads its environment again
    monkeypatch.setenv("WANDB_MODE", "disabled")  # wandb_mode=offline overrides it: the resumed run still logs
    resumed = _trainer(corpus, base, "wb", wandb_project="nnx-test", wandb_mode="offline").run()
    assert resumed.start_step == 3 and resumed.end_step == 6

    first, second = logged(run_dir)
    assert first["id"] == second["id"] == run_id  # the same W&B run, continued
    assert first["name"] == "wb"  # wandb_run_name "" = the run directory's name
    assert first["config"]["learning_rate"] == 0.01 and first["config"]["wandb_project"] == "nnx-test"
    assert first["config"]["run_name"] == "wb" and first["config"]["steps"] == 3 and second["config"]["steps"] == 6

    history = {**first["history"], **second["history"]}
    assert sorted(first["history"]) == [1, 2, 3] and sorted(second["history"]) == [4, 5, 6]
    for record in metric_records(run_dir):  # every scalar of every record, at its step, bit for bit
        step = record.pop("step")
        assert {key: history[step][key] for key in record} == record, step
    assert [step for step, row in sorted(history.items()) if "eval_loss" in row] == [3, 6]


def test_missing_wandb_package_fails_before_the_run_directory(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    base = tmp_path / "runs"
    args = train_overrides(corpus, str(base), "nowb", enable_wandb=True, enable_tensorboard=False)
    with pytest.raises(ConfigError, match=r"pip install 'nnxtron\[wandb\]'"):
        Trainer(load_config(overrides=args), progress=False)
    code, _, err = run_cli(capsys, "train", *args, "--no-progress")
    assert_user_error(code, err, "enable_wandb=true needs the wandb package")
    assert "pip install 'nnxtron[wandb]'" in err
    assert not base.exists()


@pytest.mark.parametrize(
    "keys",
    [{"wandb_project": "p"}, {"wandb_entity": "me", "wandb_run_name": "r"}, {"wandb_mode": "offline"}],
    ids=["project", "entity-and-name", "mode"],
)
def test_wandb_keys_need_enable_wandb(keys):
    with pytest.raises(ConfigError, match="enable_wandb=false") as err:
        load_config(values={"model_name": "llama2-tiny", **keys})
    assert f"config: {', '.join(keys)} {'is' if len(keys) == 1 else 'are'} set but enable_wandb=false" in str(err.value)
    cfg = load_config(values={"model_name": "llama2-tiny", "enable_wandb": True, **keys})
    assert {key: getattr(cfg, key) for key in keys} == keys


def test_wandb_mode_is_a_closed_list():
    with pytest.raises(ConfigError, match="wandb_mode"):
        load_config(values={"model_name": "llama2-tiny", "enable_wandb": True, "wandb_mode": "disabled"})


@pytest.mark.parametrize("mode", options.WANDB_MODES)
def test_every_wandb_key_reaches_wandb_init(mode, tmp_path, monkeypatch):
    """Each key and each wandb_mode is passed on ("" = W&B's own default: not passed)."""
    calls = []
    fake = types.ModuleType("wandb")
    fake.Error = type("Error", (Exception,), {})
    fake.init = lambda **kwargs: calls.append(kwargs) or types.SimpleNamespace(finish=lambda: None)
    fake.Settings = lambda **kwargs: kwargs
    fake.setup = lambda settings: calls.append({"setup": settings})
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    cfg = load_config(values=dict(model_name="llama2-tiny", enable_wandb=True, wandb_mode=mode, wandb_project="proj",
                                  wandb_entity="team", wandb_run_name="name"))  # fmt: skip
    wandb_logger.WandbLogger(cfg, tmp_path)
    *setup, kwargs = calls
    assert kwargs["mode"] == (mode or None) and setup == ([{"setup": {"mode": mode}}] if mode else [])
    assert (kwargs["project"], kwargs["entity"], kwargs["name"]) == ("proj", "team", "name")
    assert (kwargs["resume"], kwargs["dir"]) == ("allow", str(tmp_path))
    assert re.fullmatch("[a-z0-9]{8}", kwargs["id"]) and (tmp_path / wandb_logger.ID_FILE).read_text() == kwargs["id"] + "\n"
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    wandb_logger.WandbLogger(cfg, tmp_path)
    assert calls[-1]["id"] == kwargs["id"] and calls[-1]["dir"] is None  # the stored id; WANDB_DIR is W&B's to read


def test_a_wandb_start_failure_is_one_line_with_the_fix(tmp_path, monkeypatch):
    fake = types.ModuleType("wandb")
    fake.Error = type("Error", (Exception,), {})

    def init(**kwargs):
        raise fake.Error("No API key configured. Use `wandb login` to log in.\nmore detail")

    fake.init = init
    fake.Settings = lambda **kwargs: kwargs
    fake.setup = lambda settings: None
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = load_config(values=dict(model_name="llama2-tiny", enable_wandb=True, wandb_mode="online"))
    with pytest.raises(ConfigError) as err:
        wandb_logger.WandbLogger(cfg, tmp_path)
    message = str(err.value)
    assert "No API key configured" in message and "wandb_mode=offline" in message and "\n" not in message


NO_NETWORK = """
import atexit, socket, sys
attempts = []
def refuse(host, *args, **kwargs):
    attempts.append(host)
    raise OSError("no network in this test")
socket.getaddrinfo = refuse
atexit.register(lambda: print("network attempts:", attempts, flush=True))  # runs after W&B's exit handlers
from nnxtron.config import load_config
from nnxtron.train.wandb_logger import WandbLogger
cfg = load_config(values=dict(model_name="llama2-tiny", enable_wandb=True, wandb_mode="offline"))
logger = WandbLogger(cfg, __import__("pathlib").Path(sys.argv[1]))
logger.log({"loss": 1.5}, 1)
logger.close()
"""


def test_offline_mode_reaches_no_network(tmp_path, wandb_env, monkeypatch):
    """wandb_mode=offline alone (no WANDB_MODE) keeps W&B off the network in the whole process,
    its analytics at exit included; a process without internet never waits on it."""
    monkeypatch.delenv("WANDB_MODE")
    proc = subprocess.run([sys.executable, "-c", NO_NETWORK, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "network attempts: []" in proc.stdout, proc.stdout + proc.stderr
    (session,) = logged(tmp_path)
    assert session["history"] == {1: {"loss": 1.5}}
