"""Learning-rate schedules: a linear warm-up, then cosine, WSD, linear or constant
(``lr_schedule_type``; formulas in docs/optimizers.md), and the start-up note a resumed run
prints when the keys that shape its schedule changed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import optax

from nnxtron.config import options
from nnxtron.config.derived import Derived, derive
from nnxtron.config.loader import base_values
from nnxtron.config.schema import Config

# every key the schedule depends on (steps: through learning_rate_schedule_steps=-1)
SCHEDULE_SHAPING_KEYS = (
    "steps",
    "learning_rate_schedule_steps",
    "warmup_steps_fraction",
    "learning_rate",
    "lr_schedule_type",
    "cosine_learning_rate_final_fraction",
    "learning_rate_final_fraction",
    "wsd_decay_steps_fraction",
    "wsd_decay_style",
    "lr_schedule_convention",
)


def wsd_decay_steps(cfg: Config, derived: Derived) -> int:
    """The steps of WSD's final decay: ``wsd_decay_steps_fraction`` of the schedule, rounded
    like the warm-up, and never more than what the warm-up leaves."""
    decay = int(round(cfg.wsd_decay_steps_fraction * derived.schedule_steps))
    return min(decay, max(derived.schedule_steps - derived.warmup_steps, 0))


def learning_rate_schedule(cfg: Config, derived: Derived) -> optax.Schedule:
    """Linear warm-up from 0 to ``learning_rate`` over ``derived.warmup_steps``, then the
    ``lr_schedule_type`` part until ``derived.schedule_steps``; after that the final value stays."""
    if cfg.lr_schedule_convention == "maxtext":
        return maxtext_schedule(cfg, derived)
    lr, warmup, total = cfg.learning_rate, derived.warmup_steps, derived.schedule_steps
    after_warmup = max(total - warmup, 1)
    if cfg.lr_schedule_type == "cosine":
        main = optax.cosine_decay_schedule(lr, after_warmup, alpha=cfg.cosine_learning_rate_final_fraction)
    elif cfg.lr_schedule_type == "linear":
        main = optax.linear_schedule(lr, lr * cfg.learning_rate_final_fraction, after_warmup)
    elif cfg.lr_schedule_type == "constant":
        main = optax.constant_schedule(lr)
    elif cfg.lr_schedule_type == "wsd":
        main = _warmup_stable_decay(cfg, total - warmup, wsd_decay_steps(cfg, derived))
    else:
        raise AssertionError(f"lr_schedule_type {cfg.lr_schedule_type!r} has no schedule")  # options.LR_SCHEDULES
    if warmup == 0:
        return main
    ramp = optax.linear_schedule(0.0, lr, warmup)
    return optax.join_schedules([ramp, main], [warmup])


def _maxtext_cosine(init: float, final: float, length: int) -> optax.Schedule:
    """MaxText's cosine: ``final`` at step ``length - 1`` (optax's reaches it at ``length``)."""

    def schedule(step):
        pct = step / (length - 1) if length > 1 else 1.0
        a = 0.5 * (jnp.cos(jnp.pi * pct) + 1)
        return init * a + final * (1 - a)

    return schedule


def maxtext_schedule(cfg: Config, derived: Derived) -> optax.Schedule:
    """``lr_schedule_convention=maxtext``: MaxText 0.2.5's ``create_learning_rate_schedule``.
    Against nnxtron's: the warm-up is ``int(fraction * schedule_steps)`` steps (not rounded),
    the cosine / WSD decay reaches its final value at the schedule's last step (one step
    earlier), and the rate is 0 after ``learning_rate_schedule_steps`` (not the final value)."""
    lr, total = cfg.learning_rate, derived.schedule_steps
    warmup = int(total * cfg.warmup_steps_fraction)
    pieces: list[optax.Schedule] = []
    boundaries: list[int] = []
    if warmup > 0:
        pieces.append(optax.linear_schedule(0.0, lr, warmup))
        boundaries.append(warmup)
    if cfg.lr_schedule_type == "cosine":
        if total - warmup > 0:
            pieces.append(_maxtext_cosine(lr, lr * cfg.cosine_learning_rate_final_fraction, total - warmup))
            boundaries.append(total)
    else:  # wsd (config/checks.py refuses the others)
        final = lr * cfg.learning_rate_final_fraction
        decay = int(total * cfg.wsd_decay_steps_fraction)
        stable = total - warmup - decay
        if stable > 0:
            pieces.append(optax.constant_schedule(lr))
            boundaries.append(warmup + stable)
        if decay > 0:
            linear = cfg.wsd_decay_style == "linear"
            pieces.append(optax.linear_schedule(lr, final, decay - 1) if linear else _maxtext_cosine(lr, final, decay))
            boundaries.append(total)
    if cfg.steps > total:
        pieces.append(optax.constant_schedule(0.0))
        boundaries.append(total)
    return optax.join_schedules(pieces, boundaries[: len(pieces) - 1])


def _warmup_stable_decay(cfg: Config, length: int, decay: int) -> optax.Schedule:
    """WSD after the warm-up: ``learning_rate`` for ``length - decay`` steps, then a linear or
    cosine decay to ``learning_rate_final_fraction`` of it over ``decay`` steps."""
    lr, final = cfg.learning_rate, cfg.learning_rate_final_fraction
    if decay == 0:
        return optax.constant_schedule(lr)
    if cfg.wsd_decay_style == "linear":
        tail = optax.linear_schedule(lr, lr * final, decay)
    elif cfg.wsd_decay_style == "cosine":
        tail = optax.cosine_decay_schedule(lr, decay, alpha=final)
    else:
        raise AssertionError(f"wsd_decay_style {cfg.wsd_decay_style!r} has no decay")  # options.WSD_DECAY_STYLES
    stable = length - decay
    return optax.join_schedules([optax.constant_schedule(lr), tail], [stable]) if stable > 0 else tail


def _describe(cfg: Config, derived: Derived) -> str:
    return f"{cfg.lr_schedule_type} over {derived.schedule_steps} steps, {derived.warmup_steps} warm-up, peak {cfg.learning_rate:.3g}"


def schedule_change_note(stored: Mapping[str, Any], cfg: Config, derived: Derived, step: int) -> str | None:
    """The start-up line of a run resumed at ``step`` whose schedule differs from the one its
    ``config.yml`` (``stored``) describes: the rate the next update gets under each, and how to
    keep the old one. None when nothing was trained yet or the schedule is the same. Keys the
    stored config lacks (written before they existed) take their base.yml defaults."""
    if step <= 0:
        return None
    defaults = base_values()
    old_values = {key: stored.get(key, defaults[key]) for key in SCHEDULE_SHAPING_KEYS}
    old_cfg = cfg.model_copy(update=old_values)
    old_derived = derive(old_cfg, derived.num_devices)

    def shape(c: Config, d: Derived) -> tuple:
        keys = ("learning_rate", "lr_schedule_type", *options.SCHEDULE_KEYS[c.lr_schedule_type])
        return (d.schedule_steps, d.warmup_steps, *(getattr(c, key) for key in keys))

    if shape(old_cfg, old_derived) == shape(cfg, derived):
        return None
    was = float(learning_rate_schedule(old_cfg, old_derived)(step))
    now = float(learning_rate_schedule(cfg, derived)(step))
    note = (
        f"learning-rate schedule changed: step {step + 1} runs at {now:.3g} ({_describe(cfg, derived)}); "
        f"the run's config.yml gave {was:.3g} ({_describe(old_cfg, old_derived)})"
    )
    if old_derived.schedule_steps != derived.schedule_steps:
        note += f"; to extend the run without moving the schedule, set learning_rate_schedule_steps={old_derived.schedule_steps}"
    return note
