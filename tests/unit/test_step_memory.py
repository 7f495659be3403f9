"""Train-step memory, from XLA's memory analysis of the compiled step (``nnxtron plan``'s
``make_plan`` on the 8 fake test devices): the update holds no parameter-sized temporary it
does not need, and the state is donated. Measured values: docs/plan.md, "Train-step memory"."""

import pytest

from nnxtron.tools.plan import make_plan
from tests.conftest import tiny_config

# Parameters replicated over 8 data-parallel devices (a parameter-sized tree is the whole
# per-device parameter state) and one 8-token row per device, so that parameter-sized trees,
# not activations, make the temporaries.
PARAMETER_BOUND = dict(
    ici_data_parallelism=8,
    ici_fsdp_parallelism=1,
    per_device_batch_size=1,
    max_target_length=8,
)


def _memory(**values) -> tuple[dict, dict]:
    plan = make_plan(tiny_config("llama2-tiny", **{**PARAMETER_BOUND, **values}))
    return plan["memory"], plan["state_per_device"]


@pytest.fixture(scope="module")
def clipped():
    return _memory(gradient_clipping_threshold=1.0)


def test_temporaries_hold_fewer_than_two_parameter_trees(clipped):
    """The gradients are one float32 tree; the clipped gradients, Adam's moments and the new
    parameters are computed leaf by leaf into it and into the donated state. A clipped copy of
    the gradients next to them (optax.clip_by_global_norm: 2.00 trees here; ours: 1.57) fails."""
    memory, state = clipped
    trees = memory["temp_bytes"] / state["params_bytes"]
    assert trees < 1.8, f"{trees:.2f} parameter-sized trees of temporaries"


@pytest.mark.parametrize("accumulation", [1, 2])
def test_clipping_adds_no_parameter_sized_temporary(accumulation):
    """Clipping costs a norm and a scalar factor, not a tree: the temporaries with
    gradient_clipping_threshold=1 are within a tenth of a parameter tree of those without.
    Measured here (k = gradient_accumulation_steps): optax's clip +0.41 trees at k=1 (+0 at
    k=2); ours +0.005 at k=1 and +0 at k=2, where without the optimization barrier on the
    accumulated gradients (train/step.py) it costs +0.25."""
    steps = dict(gradient_accumulation_steps=accumulation, per_device_batch_size=2)
    with_clip, state = _memory(gradient_clipping_threshold=1.0, **steps)
    without_clip, _ = _memory(gradient_clipping_threshold=0.0, **steps)
    extra = (with_clip["temp_bytes"] - without_clip["temp_bytes"]) / state["params_bytes"]
    assert extra < 0.1, f"clipping adds {extra:.2f} parameter-sized trees of temporaries"


def test_the_state_is_donated(clipped):
    """The new parameters, optimizer state and step are written into the donated input state:
    XLA aliases every byte of it (without donate_argnums the alias is 0)."""
    memory, state = clipped
    assert memory["alias_bytes"] >= state["state_bytes"] > 0
