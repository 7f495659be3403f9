"""Pipeline parity: every schedule computes the sequential model's function.

Each case runs the same weights on the same batch twice — pipelined over the ``stage``
mesh axis on 4 or 8 fake devices, and sequentially (no pipeline) — and compares the
loss, the input cotangent, every parameter gradient and the non-trainable state after
the batch (``nnxtron.tools.parity.assert_grad_parity``). Measured on this CPU in float32
(2026-11): every case agrees to <= 1e-6 relative (aggregate gradients ~8e-7, loss
~1e-7); the bounds leave headroom and are far below what a schedule bug produces (a
missed stage shift, a wrong circular order or a dropped microbatch changes the loss
and gradients by O(1) — see the pipeline mutants in tests/mutation/mutants.py).
"""

from __future__ import annotations

import functools

import jax
import pytest

from nnxtron.config.pipeline import pipeline_spec
from nnxtron.models.build import build_model
from nnxtron.parallel.mesh import make_mesh
from nnxtron.tools.parity import GradResult, assert_grad_parity, loss_and_grads, with_tail_stack_merged
from tests.helpers import random_batch, tiny_config

BOUNDS = dict(loss_rtol=2e-6, rel=1e-5, abs_frac=1e-6, aggregate_rel=5e-6)
PP2_FSDP2 = dict(ici_pipeline_parallelism=2, ici_fsdp_parallelism=2)

# case: (model, model overrides, pipeline overrides, devices)
CASES = {
    "gpipe_4_stages": (
        "llama3.1-tiny",
        dict(base_num_decoder_layers=4),
        dict(ici_pipeline_parallelism=4, ici_fsdp_parallelism=1),
        4,
    ),
    "gpipe_2_layers_per_stage_with_layer_remat": (
        "llama3.1-tiny",
        dict(base_num_decoder_layers=4),
        dict(PP2_FSDP2, num_layers_per_pipeline_stage=2, set_remat_policy_on_layers_per_stage=True),
        4,
    ),
    "circular_2_repeats": ("llama3.1-tiny", dict(base_num_decoder_layers=4), PP2_FSDP2, 4),
    "circular_microbatches_2x_stages_unrolled": (
        "llama3.1-tiny",
        dict(base_num_decoder_layers=4),
        dict(
            PP2_FSDP2,
            num_pipeline_microbatches=4,
            scan_pipeline_repeats=False,
            scan_pipeline_iterations=False,
            set_remat_policy_on_pipeline_iterations=False,
        ),
        4,
    ),
    "circular_delayed_forwarding_fsdp_ag_once": (
        "llama3.1-tiny",
        dict(base_num_decoder_layers=4),
        dict(PP2_FSDP2, num_pipeline_microbatches=4, pipeline_delay_activation_forwarding=True, pipeline_fsdp_ag_once=True),
        4,
    ),
    "circular_8_devices_4_stages_fsdp2": (
        "llama3.1-tiny",
        dict(base_num_decoder_layers=8),
        dict(ici_pipeline_parallelism=4, ici_fsdp_parallelism=2, num_pipeline_repeats=2),
        8,
    ),
    "moe_load_balance_loss": (
        "mixtral-tiny",
        dict(base_num_decoder_layers=2, load_balance_loss_weight=0.01, remat_policy="none"),
        dict(PP2_FSDP2),
        4,
    ),
    "moe_load_balance_loss_maxtext": (  # per row, mean over layers: the whole batch's value (no accumulation)
        "mixtral-tiny",
        dict(base_num_decoder_layers=2, load_balance_loss_weight=0.01, load_balance_convention="maxtext", remat_policy="none"),
        dict(PP2_FSDP2),
        4,
    ),
    "deepseek3_mtp_dense_prefix_outside": (
        "deepseek3-test",
        dict(base_num_decoder_layers=5, mtp_num_layers=1, remat_policy="none"),
        dict(PP2_FSDP2, scan_pipeline_iterations=False),
        4,
    ),
    "deepseek4_hash_prefix_outside": (
        "deepseek4-test",
        dict(base_num_decoder_layers=4, compress_ratios=[0, 8, 4, 4], remat_policy="none"),
        dict(PP2_FSDP2, scan_pipeline_iterations=False, scan_pipeline_repeats=False),
        4,
    ),
    # patterned models with the layout keys at their defaults (config/pipeline_layout.py): one cycle per stage
    "llama4_default_layout_one_cycle_per_stage": ("llama4-tiny", dict(remat_policy="none"), PP2_FSDP2, 4),
    "deepseek4_default_layout_hca_csa_cycles": (  # 2 hash layers outside, then 2 (HCA, CSA) blocks
        "deepseek4-test",
        dict(base_num_decoder_layers=6, compress_ratios=[0, 4, 8, 4, 8, 4], remat_policy="none"),
        PP2_FSDP2,
        4,
    ),
    "gemma3_default_layout_remainder_outside": (  # 2 cycles of 6 pipelined, the 2-layer remainder after
        "gemma3-tiny",
        dict(base_num_decoder_layers=14, remat_policy="none"),
        PP2_FSDP2,
        4,
    ),
    # Qwen2's query/key/value biases in the stages' weights (circular, 2 repeats)
    "qwen2_biases_in_stages": ("qwen2-tiny", dict(base_num_decoder_layers=4), PP2_FSDP2, 4),
    # Gemma's scaled embedding and zero-centred norms around the stages, multi-query heads in them
    "gemma_scaled_embedding_around_stages": ("gemma-tiny", dict(base_num_decoder_layers=4), PP2_FSDP2, 4),
    # Gemma 2's (sliding, global) pairs as stages, its attention soft cap inside them
    "gemma2_soft_capped_pairs_in_stages": ("gemma2-tiny", dict(remat_policy="none"), PP2_FSDP2, 4),
    # GPT-OSS's (sliding, global) pairs with sinks, biases and clamped MoE experts as stages
    "gpt_oss_pairs_in_stages": ("gpt-oss-tiny", dict(base_num_decoder_layers=4, remat_policy="none"), PP2_FSDP2, 4),
    # Qwen3-Next's (Gated DeltaNet, gated attention) cycles as stages (a cycle of 2 here: 1 linear + 1 full)
    "qwen3_next_cycles_in_stages": (
        "qwen3-next-tiny",
        dict(base_num_decoder_layers=4, inhomogeneous_layer_cycle_interval=2, remat_policy="none"),
        PP2_FSDP2,
        4,
    ),
    # Qwen3.5: the same cycles with HF Qwen3.5's split DeltaNet projections
    "qwen3_5_cycles_in_stages": (
        "qwen3.5-tiny",
        dict(base_num_decoder_layers=4, inhomogeneous_layer_cycle_interval=2, remat_policy="none"),
        PP2_FSDP2,
        4,
    ),
    # Gemma 4's (sliding, global) cycles as stages: the global layer of its own shape (values = keys' projection, its
    # proportional RoPE); dense (31B's layers: MoE in stages is the other MoE cases', and its experts half the time)
    "gemma4_cycles_in_stages": (
        "gemma4-tiny",
        dict(base_num_decoder_layers=4, num_experts=1, num_experts_per_tok=1, shared_experts=0, remat_policy="none"),
        PP2_FSDP2,
        4,
    ),
    # MaxText's toy blocks, which MaxText's own pipeline tests run: one matmul a layer, no residual (4 stages, gpipe)
    "simple_gpipe_4_stages": (
        "simple-tiny",
        dict(base_num_decoder_layers=4),
        dict(ici_pipeline_parallelism=4, ici_fsdp_parallelism=1),
        4,
    ),
    # two matmuls a layer, circular (2 repeats), under remat full
    "simple_mlp_circular_2_repeats": ("simple_mlp-tiny", dict(base_num_decoder_layers=4, remat_policy="full"), PP2_FSDP2, 4),
}


def _batch(cfg) -> dict:
    return random_batch(cfg, batch=8, seq=16, packed=True)


@functools.cache
def _sequential(model: str, overrides: tuple, accumulation: int, devices: int) -> GradResult:
    """The reference: no pipeline, fsdp over the same devices (with ``accumulation``
    microbatches: the load-balance loss is a per-microbatch quantity, as in the pipeline).
    Sharded and single-device gradients agree to ~5e-7 (tests/parity/test_matrix.py);
    the sharded reference compiles faster for the MoE models."""
    cfg = tiny_config(model, **dict(overrides), gradient_accumulation_steps=accumulation, ici_fsdp_parallelism=devices)
    mesh = make_mesh(cfg, jax.devices()[:devices])
    return loss_and_grads(build_model(cfg), _batch(cfg), mesh=mesh, accumulation_steps=accumulation)


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_equals_the_sequential_model(case):
    model, overrides, pipeline, devices = CASES[case]
    cfg = tiny_config(model, **overrides, **pipeline)
    pooled = cfg.load_balance_loss_weight > 0 and cfg.load_balance_convention == "nnxtron"  # a product of batch statistics
    accumulation = pipeline_spec(cfg).microbatches if pooled else 1
    frozen = tuple((key, tuple(v) if isinstance(v, list) else v) for key, v in sorted(overrides.items()))
    reference = _sequential(model, frozen, accumulation, devices)
    result = loss_and_grads(build_model(cfg), _batch(cfg), mesh=make_mesh(cfg, jax.devices()[:devices]))
    assert_grad_parity(result, reference, **BOUNDS)


def test_bf16_pipeline_equals_the_bf16_sequential_model():
    """bfloat16 activations, float32 weights (the bf16 slice of test_matrix.py, its bounds): a circular
    pipeline against the sequential model in bfloat16 (measured: loss and input cotangent equal,
    aggregate 2.3e-3) and in float32 (aggregate 1.2e-2)."""
    from tests.parity.test_matrix import BF16, BF16_BOUNDS, BF16_VS_FLOAT32_BOUNDS

    model, overrides, pipeline, devices = CASES["circular_2_repeats"]
    overrides = dict(overrides, **dict(BF16))
    cfg = tiny_config(model, **overrides, **pipeline)
    result = loss_and_grads(build_model(cfg), _batch(cfg), mesh=make_mesh(cfg, jax.devices()[:devices]))
    assert_grad_parity(result, _sequential(model, tuple(sorted(overrides.items())), 1, devices), **BF16_BOUNDS)
    float32 = tuple(sorted(CASES["circular_2_repeats"][1].items()))
    assert_grad_parity(result, _sequential(model, float32, 1, devices), **BF16_VS_FLOAT32_BOUNDS)


def test_partial_pipeline_runs_the_other_layers_after_it():
    """pipeline_parallel_layers=2 of 4: two blocks pipelined, two in ``unpipelined_layers``
    (built with the weights the unsplit stack has there)."""
    overrides = dict(base_num_decoder_layers=4)
    cfg = tiny_config(**overrides, **PP2_FSDP2, pipeline_parallel_layers=2)
    model = build_model(cfg)
    assert model.layers.num_layers == 2 and model.unpipelined_layers.num_layers == 2
    result = loss_and_grads(model, _batch(cfg), mesh=make_mesh(cfg, jax.devices()[:4]))
    result = with_tail_stack_merged(result, first_block=2)
    assert_grad_parity(result, _sequential("llama3.1-tiny", tuple(overrides.items()), 1, 4), **BOUNDS)


def test_default_layout_pipelines_whole_cycles_and_runs_the_rest_after():
    """gemma3-tiny with 20 layers = 3 cycles + a 2-layer remainder on 2 stages, layout keys at
    their defaults: 2 cycles pipelined, the third (``unpipelined_layers``, the unsplit stack's
    weights) and the remainder after the pipeline."""
    overrides = dict(base_num_decoder_layers=20, remat_policy="none")
    cfg = tiny_config("gemma3-tiny", **overrides, **PP2_FSDP2)
    model = build_model(cfg)
    assert (model.layers.num_layers, model.unpipelined_layers.num_layers, model.remainder_layers.num_layers) == (2, 1, 1)
    result = loss_and_grads(model, _batch(cfg), mesh=make_mesh(cfg, jax.devices()[:4]))
    result = with_tail_stack_merged(result, first_block=2)
    assert_grad_parity(result, _sequential("gemma3-tiny", tuple(overrides.items()), 1, 4), **BOUNDS)
