"""Pipeline parity for patterns split across stages: one-layer blocks whose attention kind is data.

Gemma 3's 8-layer tiny model has one whole 6-layer cycle, too few for 2 stages; its layers
share one structure (sliding or global attention differ only in the mask's window and the
RoPE table), so the pipeline runs one-layer blocks of kind ``selected`` and each reads its
kind per layer at run time (``config/layout.selected_stacks``, ``parallel/layer_kind.py``).
Each case copies the sequential model's weights (cycle layout: a 6-layer block and a 2-layer
remainder) into the pipelined one layer by layer, runs both on the same batch and compares
the loss, the input cotangent, every parameter gradient (named as the sequential model
names them) with the bounds of ``tests/parity/test_pipeline.py``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from nnxtron.config.layout import LayerKind
from nnxtron.config.pipeline import pipeline_spec
from nnxtron.config.stacks import layer_stacks
from nnxtron.errors import ConfigError
from nnxtron.infer.decode import unrolled
from nnxtron.models.build import build_model
from nnxtron.models.stack import check_selectable
from nnxtron.parallel.mesh import make_mesh
from nnxtron.params import flatten
from nnxtron.tools.parity import assert_grad_parity, copy_weights, loss_and_grads, with_layers_of
from tests.helpers import tiny_config
from tests.parity.test_pipeline import BOUNDS, PP2_FSDP2, _batch, _sequential

GEMMA3 = dict(remat_policy="none")

# case: (pipeline overrides, (stages, repeats, layers per stage))
CASES = {
    # the layout keys at their defaults: one layer per stage, 8 layers = 2 stages x 4 repeats (circular)
    "default_layout_circular_4_repeats": (PP2_FSDP2, (2, 4, 1)),
    # GPipe on layers 0-5, each stage scanning 3 layers (stage 1 holds the global layer 5), then
    # layers 6-7 in unpipelined_layers (a scanned stack reading the kinds of blocks 6 and 7)
    "gpipe_3_layers_per_stage_2_unpipelined": (
        dict(PP2_FSDP2, num_layers_per_pipeline_stage=3, pipeline_parallel_layers=6),
        (2, 1, 3),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_selected_kind_pipeline_equals_the_sequential_cycles(case):
    pipeline, shape = CASES[case]
    cfg = tiny_config("gemma3-tiny", **GEMMA3, **pipeline)
    spec = pipeline_spec(cfg)
    assert (spec.stages, spec.repeats, spec.layers_per_stage, spec.layers_per_block) == (*shape, 1)
    for stack in layer_stacks(cfg):
        assert stack.kinds[0].attention == "selected" and stack.global_layers == (False,) * 5 + (True, False, False)
    reference_cfg = tiny_config("gemma3-tiny", **GEMMA3, gradient_accumulation_steps=1, ici_fsdp_parallelism=4)
    model = build_model(cfg)
    copy_weights(build_model(reference_cfg), model)  # _sequential's model: the same config, the same init
    result = loss_and_grads(model, _batch(cfg), mesh=make_mesh(cfg, jax.devices()[:4]))
    reference = _sequential("gemma3-tiny", tuple(sorted(GEMMA3.items())), 1, 4)
    assert_grad_parity(with_layers_of(result, cfg, reference_cfg), reference, **BOUNDS)


def test_olmo3_one_cycle_split_across_two_stages():
    """OLMo 3's 4-layer tiny model is one (sliding x 3, global) cycle with whole-projection query/key norms: on 2
    stages its layers run as one-layer blocks of kind ``selected`` (2 stages x 2 repeats) = the sequential cycle."""
    overrides = dict(remat_policy="none")
    cfg = tiny_config("olmo3-tiny", **overrides, **PP2_FSDP2)
    spec = pipeline_spec(cfg)
    assert (spec.stages, spec.repeats, spec.layers_per_stage, spec.layers_per_block) == (2, 2, 1, 1)
    assert layer_stacks(cfg)[0].global_layers == (False, False, False, True)
    reference_cfg = tiny_config("olmo3-tiny", **overrides, gradient_accumulation_steps=1, ici_fsdp_parallelism=4)
    model = build_model(cfg)
    copy_weights(build_model(reference_cfg), model)
    result = loss_and_grads(model, _batch(cfg), mesh=make_mesh(cfg, jax.devices()[:4]))
    reference = _sequential("olmo3-tiny", tuple(sorted(overrides.items())), 1, 4)
    assert_grad_parity(with_layers_of(result, cfg, reference_cfg), reference, **BOUNDS)


def test_the_decoding_copy_of_a_selected_kind_pipeline_is_the_sequential_model():
    """Decoding runs ``infer.decode.unrolled``: the pipeline's one-layer blocks go back into the
    cycles of the unpipelined layout (``params.restack``), the same arrays as the sequential model's."""
    reference = build_model(tiny_config("gemma3-tiny"))
    model = build_model(tiny_config("gemma3-tiny", **PP2_FSDP2))
    copy_weights(reference, model)
    a, b = flatten(nnx.state(unrolled(model))), flatten(nnx.state(unrolled(reference)))
    assert a.keys() == b.keys() and "remainder_layers/layers/0/cycle/1/attention/query/kernel" in a
    assert all(np.array_equal(a[key], b[key]) for key in b)


def test_a_selected_layer_must_hold_what_both_kinds_hold():
    """``models/stack.check_selectable``: a family whose sliding and global layers differ in
    variables cannot run them as one-layer blocks whose kind is data."""

    def make_layer(rngs, kind):
        width = 4 if kind.attention == "global" else 2
        return nnx.Linear(2, width, rngs=rngs)

    with pytest.raises(ConfigError, match="the global layer's variables differ"):
        check_selectable(make_layer, LayerKind(attention="selected"))
    check_selectable(lambda rngs, kind: nnx.Linear(2, 2, rngs=rngs), LayerKind(attention="selected"))
