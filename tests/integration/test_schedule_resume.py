"""Resuming with more steps: the schedule moves (and a start-up note says how), unless
learning_rate_schedule_steps pins it, in which case the learning rates are those of an
uninterrupted run. (Field report: a steps=200 run resumed with steps=400 went from 3.05e-4 at
step 40 to 1.04e-3 at step 41 without a word.)"""

import shutil
from pathlib import Path

import pytest

from nnxtron.config import derive, load_config
from nnxtron.train.loop import Trainer
from nnxtron.train.schedules import learning_rate_schedule
from tests.integration.conftest import metric_records, train_overrides

FAST = dict(base_num_decoder_layers=1, scan_layers=False, max_target_length=16, eval_interval=-1, enable_tensorboard=False,
            checkpoint_period=4, warmup_steps_fraction=0.25, learning_rate=0.01)  # fmt: skip


def _trainer(corpus, base, run, **extra):
    return Trainer(load_config(overrides=train_overrides(corpus, base, run, **FAST, **extra)), progress=False)


def _learning_rates(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["learning_rate"] for r in metric_records(run_dir) if "learning_rate" in r}


@pytest.fixture(scope="module")
def four_steps(corpus, tmp_path_factory):
    """A run of steps=4 (so its schedule is 4 steps long), checkpointed at step 4."""
    base = tmp_path_factory.mktemp("schedule_resume")
    _trainer(corpus, str(base), "first", steps=4).run()
    return corpus, base


def _resume(four_steps, name, **extra):
    corpus, base = four_steps
    shutil.copytree(base / "first", base / name)
    trainer = _trainer(corpus, str(base), name, steps=8, **extra)
    result = trainer.run()
    assert result.start_step == 4
    return trainer, _learning_rates(base / name)


def test_more_steps_moves_the_schedule_and_says_so(four_steps):
    trainer, rates = _resume(four_steps, "longer")
    notes = [n for n in trainer.notes if n.startswith("learning-rate schedule changed")]
    assert len(notes) == 1, trainer.notes
    cfg = trainer.cfg
    old_cfg = load_config(overrides=train_overrides(four_steps[0], str(four_steps[1]), "first", **FAST, steps=4))
    was = float(learning_rate_schedule(old_cfg, derive(old_cfg, 8))(4))
    now = float(learning_rate_schedule(cfg, derive(cfg, 8))(4))
    assert rates[5] == pytest.approx(now, rel=1e-6) and abs(now - was) > 0.1 * now  # the jump the note announces
    assert notes[0] == (
        f"learning-rate schedule changed: step 5 runs at {now:.3g} (cosine over 8 steps, 2 warm-up, peak 0.01); "
        f"the run's config.yml gave {was:.3g} (cosine over 4 steps, 1 warm-up, peak 0.01); "
        "to extend the run without moving the schedule, set learning_rate_schedule_steps=4"
    )


def test_pinning_the_schedule_steps_continues_the_uninterrupted_schedule(four_steps):
    corpus, base = four_steps
    trainer, rates = _resume(four_steps, "pinned", learning_rate_schedule_steps=4)
    assert not [n for n in trainer.notes if n.startswith("learning-rate schedule")], trainer.notes
    straight = _trainer(corpus, str(base), "straight", steps=8, learning_rate_schedule_steps=4)
    straight.run()
    assert rates == _learning_rates(base / "straight")  # steps 1-4 from the first run, 5-8 resumed
    assert sorted(rates) == list(range(1, 9))
