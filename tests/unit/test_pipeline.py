"""The pipeline schedule, its state handling, its remat structure and its config checks.

Value parity of real models (pipelined vs sequential) lives in tests/parity/test_pipeline.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src import ad_checkpoint

from nnxtron.config import load_config
from nnxtron.config.pipeline import PipelineSpec, pipeline_spec
from nnxtron.config.stacks import pipeline_summary
from nnxtron.errors import ConfigError
from nnxtron.models.build import abstract_model, build_model
from nnxtron.parallel.mesh import make_mesh
from nnxtron.parallel.pipeline import PipelinedStack
from nnxtron.parallel.remat import RematSpec
from nnxtron.parallel.sharding import activate, check_unsharded, logical_to_spec, state_shardings
from tests.conftest import random_batch, sub_jaxprs, tiny_config, trace_train_step

RULES = (("activation_batch", ("data",)), ("activation_length", ()), ("layers", ("stage",)), ("embed", ()))


class Calls(nnx.Variable):
    """A non-trainable counter."""


class CountingBlock(nnx.Module):
    """Adds 1 to its counter on every call, and its own bias to the activations."""

    def __init__(self, rngs: nnx.Rngs):
        self.bias = nnx.Param(jax.random.normal(rngs.params(), (8,)), out_sharding=("embed",))
        self.calls = Calls(jnp.zeros((), jnp.int32))

    def __call__(self, x, positions):
        self.calls[...] = self.calls[...] + 1
        return jnp.tanh(x + self.bias[...]) * (1.0 + 0.01 * positions[..., None])


def _mesh(stages: int):
    devices = np.asarray(jax.devices()[: 2 * stages]).reshape(stages, 2)
    return jax.sharding.Mesh(devices, ("stage", "data"))


def _spec(stages, repeats, microbatches, lps=1, **flags) -> PipelineSpec:
    return PipelineSpec("layers", 1, stages, microbatches, repeats, lps, **flags)


@pytest.mark.parametrize(
    "spec",
    [_spec(2, 1, 2, lps=2), _spec(2, 2, 3), _spec(4, 2, 4), _spec(2, 2, 4, delay=2, scan_repeats=False, scan_iterations=False)],
    ids=["gpipe", "circular", "circular_4_stages", "circular_delayed_unrolled"],
)
def test_non_trainable_state_mutated_in_a_stage_survives(spec):
    """The reference bug: a stage that adds 1 to a counter on every call ends with one count
    per microbatch in every block (bubbles do not count), and the output equals applying
    the blocks in order."""
    key = jax.random.key(0)
    with nnx.use_eager_sharding(False):
        stack, plain = (
            PipelinedStack(CountingBlock, spec.blocks, key=key, remat=RematSpec("full"), axis_name="layers", pipeline=spec)
            for _ in range(2)
        )
    rows = 2 * spec.microbatches
    x = jax.random.normal(jax.random.key(1), (rows, 4, 8))
    positions = jnp.broadcast_to(jnp.arange(4), (rows, 4))

    @nnx.jit
    def pipelined(stack, x, positions):
        with activate(_mesh(spec.stages), RULES):
            return stack(x, positions)[0]

    y = pipelined(stack, x, positions)
    expected = plain(x, positions)[0]  # no active mesh: the blocks in order, one call each
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(stack.layers.calls[...]), np.full(spec.blocks, spec.microbatches))
    np.testing.assert_array_equal(np.asarray(plain.layers.calls[...]), np.ones(spec.blocks))


def test_circular_placement_puts_block_r_times_stages_plus_s_on_stage_s():
    spec = _spec(4, 2, 4)
    assert spec.placement() == [[[0], [4]], [[1], [5]], [[2], [6]], [[3], [7]]]
    gpipe = _spec(2, 1, 2, lps=3)
    assert gpipe.placement() == [[[0, 1, 2]], [[3, 4, 5]]]
    assert gpipe.iterations == 2 + 1 and gpipe.bubble_fraction == pytest.approx(1 / 3)
    assert _spec(4, 2, 4).bubble_fraction == pytest.approx(3 / (2 * 4 + 3))
    assert _spec(2, 2, 4, delay=2).iterations == 8 + 2


def _all_eqns(jaxpr) -> list:
    """Every equation at any depth (inside scans, checkpoints, pjits...)."""
    found = []
    for eqn in jaxpr.eqns:
        found.append(eqn)
        for sub in sub_jaxprs(eqn):
            found.extend(_all_eqns(getattr(sub, "jaxpr", sub)))
    return found


def _remat_eqns(jaxpr) -> list:
    """Every checkpoint equation, found by primitive identity, at any depth."""
    return [eqn for eqn in _all_eqns(jaxpr) if eqn.primitive is ad_checkpoint.remat_p]


def _eqns(jaxpr, primitive_name: str) -> list:
    """Every equation of one primitive, found by name, at any depth."""
    return [eqn for eqn in _all_eqns(jaxpr) if eqn.primitive.name == primitive_name]


def _pipeline_jaxpr(**overrides):
    return _traced(tuple(sorted(overrides.items())))


@functools.cache
def _traced(overrides: tuple):
    """The jaxpr of the gradient of a pipelined llama (traced once per option set)."""
    overrides = dict(overrides)
    cfg = tiny_config(base_num_decoder_layers=4, ici_pipeline_parallelism=2, ici_fsdp_parallelism=2, **overrides)
    graphdef, state = nnx.split(build_model(cfg))
    batch = random_batch(cfg, batch=8, seq=8)
    mesh = make_mesh(cfg, jax.devices()[:4])

    def loss(state):
        with activate(mesh, cfg.logical_axis_rules):
            return nnx.merge(graphdef, state)(batch["inputs"]).logits.sum()

    return jax.make_jaxpr(jax.grad(loss))(state)


def test_per_stage_remat_is_in_the_program_only_when_enabled():
    """set_remat_policy_on_layers_per_stage adds a checkpoint around every layer of a
    stage (inside the iteration's); remat_policy=full is nothing_saveable."""
    off = _remat_eqns(_pipeline_jaxpr(set_remat_policy_on_pipeline_iterations=False).jaxpr)
    layers = _remat_eqns(
        _pipeline_jaxpr(set_remat_policy_on_pipeline_iterations=False, set_remat_policy_on_layers_per_stage=True).jaxpr
    )
    both = _remat_eqns(_pipeline_jaxpr(set_remat_policy_on_layers_per_stage=True).jaxpr)
    iterations = _remat_eqns(_pipeline_jaxpr().jaxpr)
    assert off == []
    assert layers and iterations
    assert len(both) > len(iterations) and len(both) > len(layers)
    policy = jax.checkpoint_policies.nothing_saveable
    assert all(eqn.params["policy"] is policy for eqn in layers + iterations)


def test_scanned_and_unrolled_repeats_are_different_programs():
    """The circular schedule here runs 2 repeats of 2 iterations and a 1-iteration drain: by default
    one scan over the 5 (the same weights every round, ``_Run.rounds``); with both loop flags off
    no scan over iterations or rounds is left, only each stage's scan over its one block."""
    lengths = lambda jaxpr: {eqn.params["length"] for eqn in _eqns(jaxpr, "scan")}  # noqa: E731
    scanned = lengths(_pipeline_jaxpr().jaxpr)
    unrolled = lengths(_pipeline_jaxpr(scan_pipeline_repeats=False, scan_pipeline_iterations=False).jaxpr)
    assert 5 in scanned and unrolled == {1}, (scanned, unrolled)


@pytest.mark.parametrize("flag", ["scan_pipeline_repeats", "scan_pipeline_iterations"])
def test_each_loop_flag_alone_unrolls_its_loop(flag):
    """Each flag is read on its own: turning only it off changes the program's loops (the
    circular schedule here has 2 repeats of 2 iterations and a 1-iteration drain: unrolled
    iterations remove their scans, unrolled repeats replace the one scan over all 5 by a scan
    per round and one for the drain)."""
    scans = lambda jaxpr: [(e.params["length"], len(_eqns(e.params["jaxpr"].jaxpr, "scan"))) for e in _eqns(jaxpr, "scan")]  # noqa: E731
    default, unrolled = scans(_pipeline_jaxpr().jaxpr), scans(_pipeline_jaxpr(**{flag: False}).jaxpr)
    assert sorted(default) != sorted(unrolled)
    assert 5 in {length for length, _ in default} and 5 not in {length for length, _ in unrolled}, (default, unrolled)


def test_unscanned_stages_apply_their_blocks_in_a_loop_with_per_layer_remat():
    """scan_layers=false under a pipeline: the scan over a stage's blocks is gone and the
    stage body holds each of its blocks (twice the matmuls for 2 layers per stage), one
    checkpoint per block with per-stage remat, and the weights are still stacked."""
    flags = dict(num_layers_per_pipeline_stage=2, set_remat_policy_on_pipeline_iterations=False)
    scanned = _pipeline_jaxpr(**flags).jaxpr
    unscanned = _pipeline_jaxpr(scan_layers=False, **flags).jaxpr
    assert len(_eqns(unscanned, "scan")) < len(_eqns(scanned, "scan"))
    assert len(_eqns(unscanned, "dot_general")) > len(_eqns(scanned, "dot_general"))
    per_layer = _remat_eqns(_pipeline_jaxpr(scan_layers=False, set_remat_policy_on_layers_per_stage=True, **flags).jaxpr)
    assert _remat_eqns(unscanned) == [] and len(per_layer) >= 2  # forward: one per block of a stage
    cfg = tiny_config(base_num_decoder_layers=4, ici_pipeline_parallelism=2, scan_layers=False)
    assert (
        cfg.stacked_layers and nnx.state(build_model(cfg), nnx.Param)["layers"]["layers"]["mlp"]["wi_0"]["kernel"].shape[0] == 4
    )


def test_fsdp_ag_once_gathers_stage_weights_before_the_iterations():
    """With pipeline_fsdp_ag_once the staged weights are constrained without the fsdp axis."""
    once, per_iteration = str(_pipeline_jaxpr(pipeline_fsdp_ag_once=True)), str(_pipeline_jaxpr())
    assert "'fsdp'" in per_iteration and once != per_iteration


def _host_to_device_shapes(eqns) -> list[tuple[int, ...]]:
    """Shapes that ``device_put`` equations among ``eqns`` move from host into device memory."""
    moved = []
    for eqn in eqns:
        if eqn.primitive.name == "device_put":
            for arg, out in zip(eqn.invars, eqn.outvars, strict=True):
                if "<host>" in str(arg.aval) and "<host>" not in str(out.aval):
                    moved.append(tuple(arg.aval.shape))
    return moved


def test_per_stage_offload_brings_one_repeat_of_stage_weights_at_a_time():
    """parameter_memory_host_offload under a circular pipeline (2 stages x 2 repeats): the
    stack's weights stay in host memory into the train step's forward pass; each round of the
    repeat scan moves [stages, layers per stage, ...] slices (its repeat and the previous one)
    to the device, and the backward scan fetches them again instead of keeping device copies
    of every repeat as residuals. Other parameters come to the device at the start of the step."""
    flags = dict(base_num_decoder_layers=4, ici_pipeline_parallelism=2, ici_fsdp_parallelism=2)
    cfg = tiny_config(parameter_memory_host_offload=True, **flags)
    _, traced = trace_train_step(cfg, 4)
    top = traced.jaxpr.jaxpr.eqns
    stack = nnx.to_flat_state(nnx.state(abstract_model(cfg), nnx.Param)["layers"])
    staged = {(2, 2, 1, *v.shape[1:]) for _, v in stack}  # [repeats, stages, lps, ...]
    one_repeat = {shape[1:] for shape in staged}
    rounds = [e for e in top if e.primitive.name == "scan" and e.params["length"] == 2]
    fetched = [set(_host_to_device_shapes(_all_eqns(e.params["jaxpr"].jaxpr))) for e in rounds]
    assert len(rounds) == 2 and all(shapes == one_repeat for shapes in fetched), fetched  # forward and backward
    forward = top.index(rounds[0])
    whole_stack = {(4, *v.shape[1:]) for _, v in stack}
    assert not whole_stack & set(_host_to_device_shapes(top[:forward]))  # not moved before its repeats
    assert _host_to_device_shapes(top[:forward])  # the other parameters are
    residuals = {tuple(v.aval.shape) for v in rounds[0].outvars if "<host>" not in str(v.aval)}
    assert not staged & residuals and not {(2, *s) for s in one_repeat} & residuals, residuals
    assert not _host_to_device_shapes(_all_eqns(trace_train_step(tiny_config(**flags), 4)[1].jaxpr.jaxpr))  # no offload


def test_unsharded_parameter_check_runs_under_a_pipeline():
    """The stage axis shards the pipelined stack; a rule that leaves it unsharded is caught."""
    cfg = tiny_config(base_num_decoder_layers=4, ici_pipeline_parallelism=4, ici_fsdp_parallelism=1)
    mesh = make_mesh(cfg, jax.devices()[:4])
    params = nnx.state(build_model(cfg), nnx.Param)
    shardings = state_shardings(params, mesh, cfg.logical_axis_rules)
    assert check_unsharded(params, shardings, mesh, 0.02) <= 0.02
    broken = tuple((name, () if name in ("layers", "embed") else axes) for name, axes in cfg.logical_axis_rules)
    with pytest.raises(ConfigError, match="not sharded over any model axis"):
        check_unsharded(params, state_shardings(params, mesh, broken), mesh, 0.02)


def test_spec_from_config():
    cfg = tiny_config(base_num_decoder_layers=8, ici_pipeline_parallelism=2, num_layers_per_pipeline_stage=2)
    spec = pipeline_spec(cfg)
    assert (spec.stack, spec.stages, spec.repeats, spec.layers_per_stage, spec.microbatches) == ("layers", 2, 2, 2, 2)
    flags = dict(
        num_pipeline_microbatches=6,
        pipeline_delay_activation_forwarding=True,
        scan_pipeline_iterations=False,
        scan_pipeline_repeats=False,
        set_remat_policy_on_pipeline_iterations=False,
        set_remat_policy_on_layers_per_stage=True,
        pipeline_fsdp_ag_once=True,
    )
    read = pipeline_spec(
        tiny_config(base_num_decoder_layers=8, ici_pipeline_parallelism=2, num_layers_per_pipeline_stage=2, **flags)
    )
    assert (read.microbatches, read.delay, read.scan_iterations, read.scan_repeats) == (6, 2, False, False)
    assert (read.remat_iterations, read.remat_layers, read.fsdp_ag_once, read.host_weights) == (False, True, True, False)
    offload = tiny_config(base_num_decoder_layers=8, ici_pipeline_parallelism=2, parameter_memory_host_offload=True)
    assert pipeline_spec(offload).host_weights and "one repeat at a time" in pipeline_summary(offload)[-1]
    ds3 = pipeline_spec(tiny_config("deepseek3-test", base_num_decoder_layers=5, ici_pipeline_parallelism=2))
    assert ds3.stack == "moe_layers" and ds3.blocks == 4
    assert pipeline_spec(tiny_config()) is None


BAD = [
    (dict(num_pipeline_microbatches=4), "read only by a pipeline"),
    (dict(pipeline_fsdp_ag_once=True), "read only by a pipeline"),
    (dict(scan_pipeline_repeats=False), "read only by a pipeline"),
    (dict(ici_pipeline_parallelism=2, base_num_decoder_layers=3), "do not divide into 2 stages"),
    (dict(ici_pipeline_parallelism=2, base_num_decoder_layers=4, num_pipeline_repeats=1), "num_pipeline_repeats=1"),
    (
        dict(ici_pipeline_parallelism=4, base_num_decoder_layers=8, num_pipeline_microbatches=2),
        "needs num_pipeline_microbatches >= 4",
    ),
    (
        dict(
            ici_pipeline_parallelism=2,
            base_num_decoder_layers=4,
            num_pipeline_microbatches=2,
            pipeline_delay_activation_forwarding=True,
        ),
        "needs num_pipeline_microbatches >= 3",
    ),
    (dict(ici_pipeline_parallelism=2, base_num_decoder_layers=4, pipeline_parallel_layers=6), "pipeline_parallel_layers=6"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[m for _, m in BAD])
def test_impossible_pipelines_fail_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(values={"model_name": "llama3.1-tiny", **overrides})


def test_cycle_blocks_need_whole_blocks_per_stage():
    with pytest.raises(ConfigError, match="whole number of the 2-layer blocks"):
        tiny_config(  # an explicit layout (the defaults choose whole blocks: tests/unit/test_pipeline_layout.py)
            "deepseek4-test",
            base_num_decoder_layers=6,
            compress_ratios=[0, 4, 8, 4, 8, 4],
            ici_pipeline_parallelism=2,
            num_layers_per_pipeline_stage=3,
        )


def test_microbatches_must_divide_the_batch_over_the_data_axes():
    from nnxtron.config.derived import derive

    cfg = tiny_config(base_num_decoder_layers=4, ici_pipeline_parallelism=2, num_pipeline_microbatches=4, per_device_batch_size=1)
    with pytest.raises(ConfigError, match="num_pipeline_microbatches=4 does not split the 8-row batch"):
        derive(cfg, 8)  # 8 rows / 4 microbatches = 2 rows, over fsdp=4


def test_layers_outside_the_pipeline_are_data_parallel_over_the_stage_axis():
    """DeepSeek-V3: the MoE stack is split over the stages; the dense prefix, embedding and
    head split their embed dimension over the stage axis too (fsdp-style), and the batch
    outside the pipeline is split over it — nothing is replicated over the stages."""
    from nnxtron.params import flatten

    cfg = tiny_config("deepseek3-test", base_num_decoder_layers=5, ici_pipeline_parallelism=2, ici_fsdp_parallelism=2)
    mesh = make_mesh(cfg, jax.devices()[:4])
    params = nnx.state(abstract_model(cfg), nnx.Param)
    specs = {k: v.spec for k, v in flatten(state_shardings(params, mesh, cfg.logical_axis_rules)).items()}

    def axes(spec):
        return {a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}

    for path, spec in specs.items():
        if path.startswith("moe_layers/"):
            assert spec[0] == "stage", (path, spec)
        elif "fsdp" in axes(spec):  # weights split fsdp-style are split over the stages too
            assert "stage" in axes(spec), (path, spec)
    assert "stage" in axes(specs["embed/embedding"]) and "stage" in axes(specs["dense_layers/layers/mlp/wi_0/kernel"])
    batch = logical_to_spec(("activation_batch", "activation_length"), cfg.logical_axis_rules, mesh)
    assert "stage" in axes(batch)


def test_dcn_stages_multiply_the_stage_axis():
    cfg = tiny_config(base_num_decoder_layers=4, ici_pipeline_parallelism=2, dcn_pipeline_parallelism=2)
    assert cfg.pipeline_stages == 4 and pipeline_spec(cfg).stages == 4
    from nnxtron.config.derived import derive

    assert derive(cfg, 8).mesh_shape["stage"] == 4
