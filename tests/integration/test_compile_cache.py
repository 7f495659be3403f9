"""The persistent compilation cache: a restarted run loads its train step instead of compiling
it, ``compilation_cache_dir=""`` stores nothing, a bad directory is one error line, and the
default is on (``~/.cache/nnxtron/jax_cache``, or JAX's own environment variable)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax._src import compilation_cache

from nnxtron.cli import main
from nnxtron.config import load_config
from nnxtron.errors import ConfigError
from nnxtron.runtime.compile_cache import count_cache_events, enable_compilation_cache
from nnxtron.runtime.fake_devices import fake_device_env
from tests.conftest import tiny_config

# A launch of a tiny training run in a fresh process, reporting which modules the persistent
# cache served (JAX logs hits and misses per module at DEBUG level) and the event counts.
CHILD = """
import json, logging, sys
from nnxtron.runtime.compile_cache import count_cache_events
from nnxtron.config import load_config
from nnxtron.train.loop import Trainer

seen = {"hit": [], "miss": []}
class Modules(logging.Handler):
    def emit(self, record):
        text = record.getMessage()
        if text.startswith("Persistent compilation cache hit for '"):
            seen["hit"].append(text.split("'")[1])
        elif text.startswith("PERSISTENT COMPILATION CACHE MISS for '"):
            seen["miss"].append(text.split("'")[1])
log = logging.getLogger("jax._src.compiler")
log.setLevel(logging.DEBUG)
log.propagate = False
log.addHandler(Modules())
with count_cache_events() as counts:
    result = Trainer(load_config(overrides=sys.argv[1:]), progress=False).run()
print(json.dumps({**counts, **seen, "losses": result.losses}))
"""

TRAIN = [
    "model_name=llama2-tiny", "base_num_decoder_layers=2", "dataset_type=synthetic", "vocab_size=256",
    "per_device_batch_size=1", "max_target_length=32", "steps=3", "eval_interval=-1", "enable_checkpointing=false",
    "enable_tensorboard=false", "log_period=1", "compilation_cache_min_compile_seconds=0", "sample_after_training=0",
]  # fmt: skip


def _launch(base: Path, run: str, cache: str, env: dict[str, str]) -> tuple[dict, str]:
    args = [*TRAIN, f"base_output_directory={base}", f"run_name={run}", f"compilation_cache_dir={cache}"]
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture
def jax_cache_restored():
    """Whatever a test points JAX's cache at, the next test finds it as it was."""
    directory = jax.config.jax_compilation_cache_dir
    min_seconds = jax.config.jax_persistent_cache_min_compile_time_secs
    yield
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_seconds)
    compilation_cache.reset_cache()


def test_a_restarted_run_loads_its_train_step_from_the_cache(tmp_path):
    env = {**os.environ, **fake_device_env(2)}
    cache = tmp_path / "cache"
    first, log = _launch(tmp_path, "first", str(cache), env)
    assert f"compilation cache: {cache} (compiles of 0 s or more are kept)" in log
    assert "jit_train_step" in first["miss"] and first["writes"] >= 1 and first["hits"] == 0, first
    stored = sorted(p.name for p in cache.iterdir())
    assert any(name.startswith("jit_train_step-") for name in stored), stored

    second, _ = _launch(tmp_path, "second", str(cache), env)
    assert "jit_train_step" in second["hit"] and second["miss"] == [], second
    assert second["writes"] == 0 and second["hits"] == second["requests"] >= 1, second
    assert sorted(p.name for p in cache.iterdir()) == stored  # nothing compiled, nothing written
    assert second["losses"] == first["losses"] and len(first["losses"]) == 3


def test_a_later_config_moves_or_stops_the_cache_of_this_process(tmp_path, jax_cache_restored):
    """Library use (several Trainers in one process): JAX builds its cache once, at the first
    compile; each config's directory is still the one written to, and "" stores nothing."""
    first, second = tmp_path / "a", tmp_path / "b"
    for directory, scale in ((first, 2.0), (second, 3.0), ("", 5.0)):
        assert enable_compilation_cache(
            tiny_config(compilation_cache_dir=str(directory), compilation_cache_min_compile_seconds=0)
        ) == (str(directory) or None)
        with count_cache_events() as counts:
            jax.jit(lambda x, s=scale: x * s + 1)(np.ones(3, np.float32)).block_until_ready()  # one compile
        assert counts["writes"] == (1 if directory else 0), (directory, counts)
    assert [len(list(d.glob("jit__lambda-*"))) for d in (first, second)] == [1, 1]
    assert jax.config.jax_compilation_cache_dir is None
    assert enable_compilation_cache(tiny_config(compilation_cache_dir=str(second))) == str(second)  # idempotent
    assert jax.config.jax_compilation_cache_dir == str(second)


GOLDEN = str(Path(__file__).parents[1] / "assets" / "golden" / "mistral")  # a tiny HF directory


@pytest.mark.parametrize(
    "command",
    [["train", *TRAIN], ["bench", *TRAIN, "--steps", "1"], ["generate", GOLDEN, "max_new_tokens=2", "tokenizer_type=byte"]],
)
def test_an_unwritable_cache_directory_is_one_error_line(tmp_path, capsys, command):
    (tmp_path / "file").write_text("not a directory")
    code = main([*command, f"base_output_directory={tmp_path}", f"compilation_cache_dir={tmp_path}/file/cache"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: compilation_cache_dir="), err
    assert "cannot write to" in lines[0] and "to '' to turn the cache off" in lines[0]


def test_the_cache_is_on_by_default(tmp_path, monkeypatch, jax_cache_restored):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config()
    assert (cfg.compilation_cache_dir, cfg.compilation_cache_min_compile_seconds) == ("~/.cache/nnxtron/jax_cache", 1.0)
    expected = tmp_path / ".cache" / "nnxtron" / "jax_cache"
    assert enable_compilation_cache(cfg) == str(expected) == jax.config.jax_compilation_cache_dir
    assert expected.is_dir() and jax.config.jax_persistent_cache_min_compile_time_secs == 1.0


def test_jax_environment_variables_replace_the_defaults_only(monkeypatch):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere/jax")
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    cfg = load_config()
    assert (cfg.compilation_cache_dir, cfg.compilation_cache_min_compile_seconds) == ("/somewhere/jax", 0.5)
    cfg = load_config(overrides=["compilation_cache_dir=/mine", "compilation_cache_min_compile_seconds=2"])
    assert (cfg.compilation_cache_dir, cfg.compilation_cache_min_compile_seconds) == ("/mine", 2.0)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "soon")
    with pytest.raises(ConfigError, match="JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='soon'"):
        load_config()
