"""AdamW with linear warmup + cosine decay, global-norm clipping and a weight-decay mask."""

from __future__ import annotations

import functools

import jax
import optax
from flax import nnx

from nnxtron.config.derived import Derived
from nnxtron.config.schema import Config
from nnxtron.models.build import abstract_model
from nnxtron.parallel.scan import is_stack_axis
from nnxtron.parallel.sharding import variable_names


def learning_rate_schedule(cfg: Config, derived: Derived) -> optax.Schedule:
    """Linear warmup to learning_rate, then cosine decay to final_fraction * learning_rate."""
    warmup = derived.warmup_steps
    decay_steps = max(derived.schedule_steps - warmup, 1)
    cosine = optax.cosine_decay_schedule(cfg.learning_rate, decay_steps, alpha=cfg.cosine_learning_rate_final_fraction)
    if warmup == 0:
        return cosine
    ramp = optax.linear_schedule(0.0, cfg.learning_rate, warmup)
    return optax.join_schedules([ramp, cosine], [warmup])


@functools.lru_cache(maxsize=16)
def decay_mask(cfg: Config) -> dict:
    """Weight decay on matrices only, as a pure dict matching the parameters: a parameter
    is decayed when its logical axes (without the layer stacking axis) have rank >= 2;
    norm scales and other vectors are not. Read from the abstract model's annotations."""

    def one(variable: nnx.Variable) -> bool:
        names = variable_names(variable) or ()
        return len([n for n in names if not is_stack_axis(n)]) >= 2

    params = nnx.state(abstract_model(cfg), nnx.Param)
    return nnx.to_pure_dict(jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def make_optimizer(cfg: Config, derived: Derived) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = learning_rate_schedule(cfg, derived)
    parts = []
    if cfg.gradient_clipping_threshold > 0:
        parts.append(optax.clip_by_global_norm(cfg.gradient_clipping_threshold))
    parts.append(
        optax.adamw(
            schedule,
            b1=cfg.adam_b1,
            b2=cfg.adam_b2,
            eps=cfg.adam_eps,
            weight_decay=cfg.adam_weight_decay,
            mask=lambda params: decay_mask(cfg),
        )
    )
    return optax.chain(*parts), schedule
