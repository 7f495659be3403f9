"""Reliability: the non-finite guard (stop / skip) and resuming past unreadable checkpoints."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from nnxtron.config import load_config
from nnxtron.errors import CheckpointError, TrainingError
from nnxtron.params import flatten
from nnxtron.train.checkpoint import Checkpointer
from nnxtron.train.loop import Trainer
from tests.integration.conftest import train_overrides

POISONED = 2  # the batch (0-based) whose loss mask is NaN: step 3's loss and gradients are NaN


class _Poisoned:
    """A data iterator whose batch ``POISONED`` has a NaN loss mask."""

    def __init__(self, inner):
        self.inner, self.index = inner, 0

    def __next__(self):
        batch = next(self.inner)
        if self.index == POISONED:
            batch = {**batch, "loss_mask": np.full_like(batch["loss_mask"], np.nan)}
        self.index += 1
        return batch

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _trainer(corpus, base, run, monkeypatch=None, **extra) -> Trainer:
    values = dict(steps=4, checkpoint_period=1, eval_interval=-1, enable_tensorboard=False)
    trainer = Trainer(load_config(overrides=train_overrides(corpus, base, run, **{**values, **extra})), progress=False)
    if monkeypatch is not None:
        original = trainer._data
        monkeypatch.setattr(trainer, "_data", lambda source: _Poisoned(original(source)))
    return trainer


def _steps_logged(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _saved(trainer: Trainer, step: int) -> dict[str, np.ndarray]:
    ckpt = Checkpointer(trainer.run_dir / "checkpoints", 100, create=False)
    state, _ = ckpt.restore(step, trainer.setup.abstract_state, trainer.setup.state_shardings)
    return {k: np.asarray(v) for k, v in flatten(state).items()}


def test_non_finite_step_stops_and_keeps_the_last_checkpoint(corpus, tmp_path, monkeypatch):
    trainer = _trainer(corpus, str(tmp_path), "stop", monkeypatch)
    with pytest.raises(TrainingError) as err:
        trainer.run()
    message = str(err.value)
    assert "step 3:" in message and "last checkpoint: step 2" in message and "non_finite_policy=skip" in message
    first_param = message.split("first parameter with one: ")[1].split(")")[0]
    assert first_param in flatten(trainer.setup.abstract_state["params"])
    run = tmp_path / "stop"
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [1, 2]
    assert _steps_logged(run) == [1, 2]
    saved = _saved(trainer, 2)
    assert all(np.isfinite(v).all() for v in saved.values())


def test_non_finite_step_is_skipped_with_policy_skip(corpus, tmp_path, monkeypatch):
    trainer = _trainer(corpus, str(tmp_path), "skip", monkeypatch, non_finite_policy="skip")
    result = trainer.run()
    assert result.skipped_steps == [3]
    assert np.isnan(result.losses[2]) and np.isfinite([result.losses[i] for i in (0, 1, 3)]).all()
    run = tmp_path / "skip"
    before, after, later = (_saved(trainer, step) for step in (2, 3, 4))
    for key in before:  # step 3 changed nothing but the step counter
        if key != "step":
            np.testing.assert_array_equal(after[key], before[key], err_msg=key)
    assert int(after["step"]) == 3
    assert any(not np.array_equal(later[k], after[k]) for k in after if k.startswith("params"))  # step 4 trains
    assert all(np.isfinite(v).all() for v in later.values())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [0.0, 0.0, 1.0, 0.0]


def _corrupt(step_dir: Path) -> None:
    """Truncate the largest array file of a checkpoint step (a half-written disk block)."""
    files = sorted((p for p in (step_dir / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    files[-1].write_bytes(files[-1].read_bytes()[: files[-1].stat().st_size // 2])


# orbax leaves the coroutines of the failed reads to the garbage collector; collected here (below)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_resume_skips_an_unreadable_latest_checkpoint(corpus, tmp_path):
    base = str(tmp_path)
    _trainer(corpus, base, "crash", steps=4, checkpoint_period=2).run()
    run = tmp_path / "crash"
    _corrupt(run / "checkpoints" / "4")
    trainer = _trainer(corpus, base, "crash", steps=6, checkpoint_period=2)
    result = trainer.run()
    assert result.start_step == 2
    assert any("skipped checkpoint 4" in note and "4.unreadable" in note for note in trainer.notes)
    kept = run / "checkpoints" / "4.unreadable"
    assert kept.is_dir() and any(kept.rglob("*"))  # reported and set aside, never deleted
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4, 6]
    assert _steps_logged(run) == [1, 2, 3, 4, 5, 6]  # the records of the lost steps were replaced
    # nothing readable at all: one clear error, nothing renamed
    for step in (2, 4, 6):
        _corrupt(run / "checkpoints" / str(step))
    with pytest.raises(CheckpointError, match="none of the 3 checkpoints"):
        _trainer(corpus, base, "crash", steps=8, checkpoint_period=2).run()
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4", "6"]
    gc.collect()


def _exploding(make_optimizer, at_step: int):
    """``make_optimizer`` whose update is +inf on the parameters at step ``at_step`` (1-based):
    finite loss and gradients, a non-finite state (an overflowing update)."""
    import jax.numpy as jnp
    import optax

    def make(cfg, derived):
        tx, schedule = make_optimizer(cfg, derived)

        def init(params):
            return tx.init(params), jnp.zeros((), jnp.int32)

        def update(updates, state, params=None):
            inner, count = state
            out, inner = tx.update(updates, inner, params)
            blow = count + 1 == at_step
            return jax.tree.map(lambda u: jnp.where(blow, jnp.inf, u), out), (inner, count + 1)

        return optax.GradientTransformation(init, update), schedule

    return make


def test_an_update_that_makes_the_state_non_finite_is_caught(corpus, tmp_path, monkeypatch):
    """The guard checks the updated parameters and optimizer state, not only loss and
    gradients: the last checkpoint is always a finite one, and skip keeps the old state."""
    import nnxtron.train.loop as loop

    monkeypatch.setattr(loop, "make_optimizer", _exploding(loop.make_optimizer, 3))
    trainer = _trainer(corpus, str(tmp_path), "state-stop")
    with pytest.raises(TrainingError, match="step 3: the update made the parameters or optimizer state non-finite") as err:
        trainer.run()
    assert "last checkpoint: step 2" in str(err.value)
    assert all(np.isfinite(v).all() for v in _saved(trainer, 2).values())
    skipper = _trainer(corpus, str(tmp_path), "state-skip", non_finite_policy="skip")
    result = skipper.run()
    # skip keeps the old optimizer state, and with it the trigger's counter: steps 3 and 4 both overflow
    assert result.skipped_steps == [3, 4] and np.isfinite(result.losses).all()
    before = _saved(skipper, 2)
    for step in (3, 4):
        after = _saved(skipper, step)
        for key in before:
            if key != "step":
                np.testing.assert_array_equal(after[key], before[key], err_msg=f"{key} at step {step}")


def _flip_bytes(step_dir: Path) -> Path:
    """Flip 4 bytes in the middle of the largest parameter file (no length change)."""
    target = max((p for p in (step_dir / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
    target.write_bytes(bytes(data))
    return target


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["flipped-bytes", "deleted-metadata"])
def test_a_damaged_checkpoint_is_detected_and_the_run_stays_exact(corpus, tmp_path, damage):
    """Bytes flipped inside an array file (which used to load silently) or a deleted orbax
    _METADATA: the checkpoint is set aside, the run resumes from the previous one and ends
    bit for bit where an uninterrupted run ends."""
    base, schedule = str(tmp_path), dict(checkpoint_period=2, learning_rate_schedule_steps=6)  # one schedule for 4 and 6 steps
    reference = _trainer(corpus, base, "straight", steps=6, **schedule).run().state
    _trainer(corpus, base, "damaged", steps=4, **schedule).run()
    step_dir = tmp_path / "damaged" / "checkpoints" / "4"
    if damage == "flipped-bytes":
        _flip_bytes(step_dir)
    else:
        (step_dir / "params" / "_METADATA").unlink()
    trainer = _trainer(corpus, base, "damaged", steps=6, **schedule)
    result = trainer.run()
    assert result.start_step == 2, trainer.notes
    reason = "does not match its checksum" if damage == "flipped-bytes" else "no readable array metadata"
    assert any("skipped checkpoint 4" in note and reason in note for note in trainer.notes), trainer.notes
    ours = flatten(result.state)
    for key, value in flatten(reference).items():
        np.testing.assert_array_equal(np.asarray(ours[key]), np.asarray(value), err_msg=key)
    gc.collect()
