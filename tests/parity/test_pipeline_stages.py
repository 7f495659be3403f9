"""Pipeline parity for what runs *inside* a stage: unscanned stage bodies, per-layer remat
in circular schedules, expert parallelism and context parallelism next to the ``stage``
axis — each against the sequential model on the same weights and batch (loss, input
cotangent, every parameter gradient and the non-trainable state after the batch), on 4
and 8 fake CPU devices, with the bounds of ``tests/parity/test_pipeline.py``.

Measured on this CPU in float32 (2026-12): every row agrees to <= 1e-6 relative, as the
scanned schedules do.
"""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from nnxtron.config.pipeline import pipeline_spec
from nnxtron.models.build import build_model
from nnxtron.parallel.mesh import make_mesh
from nnxtron.parallel.sharding import activate, spec_axes
from nnxtron.tools.parity import assert_grad_parity, loss_and_grads
from tests.conftest import tiny_config
from tests.parity.test_pipeline import BOUNDS, PP2_FSDP2, _batch, _sequential
from tests.unit.test_pipeline import _eqns

LLAMA4 = dict(base_num_decoder_layers=4)
STRATEGY = {"scan_layers", "remat_policy", "context_parallel_strategy", "context_parallel_load_balance"}
UNSCANNED = dict(scan_layers=False)

# case: (model, model overrides (the reference's too), pipeline overrides, devices)
CASES = {
    # scan_layers=false: each stage applies its blocks in a Python loop (MaxText's "sequential" stage body)
    "unscanned_gpipe_2_layers_per_stage_layer_remat": (
        "llama3.1-tiny",
        {**LLAMA4, **UNSCANNED},
        dict(PP2_FSDP2, num_layers_per_pipeline_stage=2, set_remat_policy_on_layers_per_stage=True),
        4,
    ),
    "unscanned_circular_iteration_remat_full": (
        "llama3.1-tiny",
        {**LLAMA4, **UNSCANNED, "remat_policy": "full"},
        dict(PP2_FSDP2, num_pipeline_microbatches=4),
        4,
    ),
    "unscanned_circular_both_remats_unrolled_loops": (
        "llama3.1-tiny",
        {**LLAMA4, **UNSCANNED},
        dict(
            PP2_FSDP2,
            num_pipeline_microbatches=4,
            set_remat_policy_on_layers_per_stage=True,
            scan_pipeline_iterations=False,
            scan_pipeline_repeats=False,
        ),
        4,
    ),
    "unscanned_deepseek3_dense_prefix_and_mtp": (
        "deepseek3-test",
        dict(base_num_decoder_layers=5, mtp_num_layers=1, remat_policy="none", **UNSCANNED),
        dict(PP2_FSDP2, scan_pipeline_iterations=False),
        4,
    ),
    # circular schedules with per-layer remat (scanned), with and without iteration remat
    "circular_layer_remat_minimal": (
        "llama3.1-tiny",
        {**LLAMA4, "remat_policy": "minimal"},
        dict(PP2_FSDP2, num_pipeline_microbatches=4, set_remat_policy_on_layers_per_stage=True),
        4,
    ),
    "circular_layer_remat_only_2_layers_per_stage": (
        "llama3.1-tiny",
        dict(base_num_decoder_layers=8, remat_policy="full"),
        dict(
            PP2_FSDP2,
            num_layers_per_pipeline_stage=2,
            set_remat_policy_on_layers_per_stage=True,
            set_remat_policy_on_pipeline_iterations=False,
        ),
        4,
    ),
    # expert parallelism inside the stages (the expert axis next to stage)
    "expert_2_mixtral": (
        "mixtral-tiny",
        dict(base_num_decoder_layers=2, remat_policy="none"),
        dict(ici_pipeline_parallelism=2, ici_expert_parallelism=2),
        4,
    ),
    "expert_2_qwen3_moe_fsdp_2_8_devices": (
        "qwen3-moe-tiny",
        dict(base_num_decoder_layers=4, remat_policy="none"),
        dict(ici_pipeline_parallelism=2, ici_expert_parallelism=2, ici_fsdp_parallelism=2),
        8,
    ),
    "expert_2_deepseek3_dense_prefix_and_mtp": (
        "deepseek3-test",
        dict(base_num_decoder_layers=5, mtp_num_layers=1, remat_policy="none"),
        dict(ici_pipeline_parallelism=2, ici_expert_parallelism=2, scan_pipeline_iterations=False),
        4,
    ),
    "expert_4_mixtral_unscanned": (
        "mixtral-tiny",
        dict(base_num_decoder_layers=2, remat_policy="none", **UNSCANNED),
        dict(ici_pipeline_parallelism=2, ici_expert_parallelism=4),
        8,
    ),
    # context parallelism inside the stages (ring attention's shard_map is manual over stage too)
    "context_2_ring": ("llama3.1-tiny", LLAMA4, dict(ici_pipeline_parallelism=2, ici_context_parallelism=2), 4),
    "context_2_all_gather_fsdp_2_8_devices": (
        "llama3.1-tiny",
        {**LLAMA4, "context_parallel_strategy": "all_gather"},
        dict(ici_pipeline_parallelism=2, ici_context_parallelism=2, ici_fsdp_parallelism=2),
        8,
    ),
    "context_2_ring_load_balanced_unscanned": (
        "llama3.1-tiny",
        {**LLAMA4, **UNSCANNED, "context_parallel_load_balance": True},
        dict(ici_pipeline_parallelism=2, ici_context_parallelism=2, num_pipeline_microbatches=4),
        4,
    ),
    "context_2_expert_2_deepseek3_8_devices": (
        "deepseek3-test",
        dict(base_num_decoder_layers=5, remat_policy="none"),
        dict(ici_pipeline_parallelism=2, ici_expert_parallelism=2, ici_context_parallelism=2),
        8,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_stage_body_equals_the_sequential_model(case):
    model, overrides, pipeline, devices = CASES[case]
    cfg = tiny_config(model, **overrides, **pipeline)
    pooled = cfg.load_balance_loss_weight > 0 and cfg.load_balance_convention == "nnxtron"
    accumulation = pipeline_spec(cfg).microbatches if pooled else 1
    # strategy keys change how, not what, is computed: rows share the reference's compiled program
    frozen = tuple((key, tuple(v) if isinstance(v, list) else v) for key, v in sorted(overrides.items()) if key not in STRATEGY)
    reference = _sequential(model, frozen, accumulation, devices)
    result = loss_and_grads(build_model(cfg), _batch(cfg), mesh=make_mesh(cfg, jax.devices()[:devices]))
    assert_grad_parity(result, reference, **BOUNDS)


@pytest.mark.parametrize("case,axis", [("expert_2_mixtral", "expert"), ("context_2_ring", "context")], ids=["expert", "context"])
def test_the_parallel_axis_is_used_inside_the_stages(case, axis):
    """The rows above would pass if the pipeline quietly dropped the expert or context axis
    inside the stages (the same function, computed unsharded); the traced forward shows the
    expert dispatch / ring attention as a shard_map manual over stage whose inputs are split
    over that axis."""
    model, overrides, pipeline, devices = CASES[case]
    cfg = tiny_config(model, **overrides, **pipeline)
    graphdef, state = nnx.split(build_model(cfg))
    mesh = make_mesh(cfg, jax.devices()[:devices])

    def forward(state):
        with activate(mesh, cfg.logical_axis_rules):
            return nnx.merge(graphdef, state)(_batch(cfg)["inputs"]).logits

    maps = _eqns(jax.make_jaxpr(forward)(state).jaxpr, "shard_map")
    assert maps and all({axis, "stage"} <= set(eqn.params["newly_manual_axes"]) for eqn in maps)
    split = [{a for spec in eqn.params["in_specs"] for entry in spec for a in spec_axes(entry)} for eqn in maps]
    assert all({axis, "stage"} <= axes for axes in split), split
