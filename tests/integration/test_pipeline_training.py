"""Pipeline parallelism end to end: `nnxtron train` learns and resumes, host offload and a
plain (non-pipelined) mesh train identically.

Numerics of the schedules themselves (loss, every gradient) are in tests/parity/test_pipeline.py;
here the whole train step (optimizer, metrics, checkpoints) runs with a pipelined stack.
"""

from pathlib import Path

import numpy as np
import pytest

from nnxtron.config import load_config
from nnxtron.params import flatten, layer_list_layout
from nnxtron.train.loop import Trainer
from tests.helpers import load_parameters
from tests.integration.conftest import cli_train, metric_records, train_overrides

# 4 layers on 2 stages: a circular schedule with 2 repeats
PIPELINE = dict(base_num_decoder_layers=4, ici_pipeline_parallelism=2)
COMPARED_METRICS = ("loss", "tokens", "grad_norm", "learning_rate")


def test_cli_trains_a_pipelined_model_and_resumes(corpus, tmp_path):
    """4 devices = 2 stages x fsdp 2: the loss falls over 10 steps, and a second invocation
    with more steps resumes from the step-10 checkpoint and keeps the learned loss."""
    base = str(tmp_path)
    common = dict(PIPELINE, ici_fsdp_parallelism=2, checkpoint_period=10, learning_rate_schedule_steps=15)
    first = cli_train(corpus, base, "pp", steps=10, **common)
    assert "'stage': 2" in first.stderr and "'fsdp': 2" in first.stderr and "new run" in first.stderr, first.stderr
    assert "trained steps 0..10" in first.stdout, first.stdout
    assert "pipeline: layers (layers 0-3) on 2 stages x 2 repeats (circular), 1 layer per stage" in first.stderr  # start-up log
    run = Path(base) / "pp"
    first_losses = [r["loss"] for r in metric_records(run) if "loss" in r]
    assert len(first_losses) == 10 and all(np.isfinite(first_losses))
    assert np.mean(first_losses[-3:]) < 0.5 * first_losses[0], first_losses

    second = cli_train(corpus, base, "pp", steps=15, **common)
    assert "resumed at step 10" in second.stderr, second.stderr
    assert "trained steps 10..15" in second.stdout, second.stdout
    records = [r for r in metric_records(run) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 16))  # steps 1-10 are not trained again
    resumed = [r["loss"] for r in records[10:]]
    # from scratch, step 11 would sit near the initial loss (~5.9); resumed, it continues
    # from where the first run ended (~1.2)
    assert resumed[0] < 1.5 * first_losses[-1] and resumed[0] < 0.4 * first_losses[0], (first_losses, resumed)
    assert np.mean(resumed[-3:]) < np.mean(first_losses[-3:]), (first_losses, resumed)
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [10, 15]

    # the 4-device pipelined checkpoint restores into this process's 8-device layouts, pipelined
    # (2 stages x fsdp 4) and plain scanned (fsdp 8), with the same paths, shapes and values
    restored = []
    for extra in (dict(ici_pipeline_parallelism=2), {}):
        cfg = load_config(overrides=train_overrides(corpus, base, "unused", base_num_decoder_layers=4, **extra))
        model_setup = Trainer(cfg).setup
        params = load_parameters(run, cfg, model_setup.abstract_state["params"], model_setup.state_shardings["params"])
        restored.append(flatten(params))
    assert restored[0].keys() == restored[1].keys()
    for key, value in restored[0].items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(restored[1][key]), err_msg=key)


def _train(corpus: str, base: str, run: str, steps: int = 3, **extra):
    overrides = train_overrides(
        corpus, base, run, steps=steps, eval_interval=-1, enable_checkpointing=False, enable_tensorboard=False,
        base_num_decoder_layers=4, **extra,
    )  # fmt: skip
    cfg = load_config(overrides=overrides)
    return cfg, Trainer(cfg, progress=False).run()


def _assert_close_states(a, b, rtol, atol):
    a, b = flatten(a), flatten(b)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].shape == b[key].shape, key
        np.testing.assert_allclose(np.asarray(a[key]), np.asarray(b[key]), rtol=rtol, atol=atol, err_msg=key)


def test_pipelined_training_with_host_offload_equals_plain_fsdp_training(corpus, tmp_path):
    """3 steps on 8 devices, same seed and data: a pipelined run (2 stages x fsdp 4) with its
    parameters in pinned host memory between steps, and a plain scanned run (fsdp 8).

    The whole train step (loss, gradient norm, optimizer) is unchanged by the pipeline and
    by the offload. The pipelined stack has the scanned stack's parameter paths and shapes;
    parameters agree to float32 reassociation: Adam turns a ~1e-7 difference in a tiny
    gradient into up to ~3e-5 on a parameter (measured), far below one step's update of ~1e-2."""
    base = str(tmp_path)
    cfg, pp = _train(corpus, base, "pp", ici_pipeline_parallelism=2, parameter_memory_host_offload=True)
    assert cfg.pipeline_stages == 2
    assert all(np.isfinite(pp.losses)) and pp.losses[-1] < pp.losses[0], pp.losses
    for key, value in flatten(pp.state["params"]).items():
        if value.ndim > 0:
            assert value.sharding.memory_kind == "pinned_host", key

    cfg, plain = _train(corpus, base, "plain")
    assert cfg.pipeline_stages == 1 and cfg.scan_layers
    np.testing.assert_allclose(pp.losses, plain.losses, rtol=1e-5)
    pp_records, plain_records = metric_records(pp.run_dir), metric_records(plain.run_dir)
    assert [r["step"] for r in pp_records] == [r["step"] for r in plain_records] == [1, 2, 3]
    for a, b in zip(pp_records, plain_records):
        for key in COMPARED_METRICS:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, err_msg=f"step {a['step']} {key}")
    _assert_close_states(pp.state, plain.state, rtol=1e-4, atol=1e-4)


def test_unscanned_pipeline_with_context_parallelism_trains_like_plain_unscanned_fsdp(corpus, tmp_path):
    """scan_layers=false under a pipeline (2 stages x context 2 x fsdp 2 on 8 devices): the
    stages apply their blocks in a loop, ring attention runs inside them, and 3 training
    steps give the losses and parameters of a plain unscanned run (fsdp 8). The pipelined
    stack keeps its parameters stacked (the stage axis shards them); in the layer-list layout
    they are the plain run's."""
    base = str(tmp_path)
    _, pp = _train(corpus, base, "pp", ici_pipeline_parallelism=2, ici_context_parallelism=2, scan_layers=False)
    _, plain = _train(corpus, base, "plain", scan_layers=False)
    assert all(np.isfinite(pp.losses)) and pp.losses[-1] < pp.losses[0], pp.losses
    np.testing.assert_allclose(pp.losses, plain.losses, rtol=1e-5)
    assert "layers/layers/mlp/wi_0/kernel" in flatten(pp.state["params"])  # stacked
    # parameters after 3 Adam steps: a gradient element near zero turns float-order noise into up to an
    # update's size (measured: 1 of 11,264 elements 1.6e-4 apart with docs/init.md's initialisers)
    _assert_close_states(layer_list_layout(pp.state["params"], 4), layer_list_layout(plain.state["params"], 4), 1e-4, 4e-4)


OFFLOAD_VARIANTS = {
    # the round loop unrolled, and gradients accumulated over 2 steps (host gradients join a device accumulator)
    "unrolled_repeats_accumulation": dict(scan_pipeline_repeats=False, gradient_accumulation_steps=2),
    # delayed forwarding (stage s is 2s iterations into the previous repeat) with weights gathered over fsdp once
    "delayed_fsdp_ag_once": dict(
        pipeline_delay_activation_forwarding=True, num_pipeline_microbatches=4, pipeline_fsdp_ag_once=True
    ),
    # no per-iteration remat: the round's backward pass recomputes what it needs from the saved iteration inputs
    "no_iteration_remat": dict(set_remat_policy_on_pipeline_iterations=False, scan_pipeline_iterations=False),
}


@pytest.mark.parametrize("variant", sorted(OFFLOAD_VARIANTS))
def test_per_stage_offload_trains_like_the_same_pipeline_on_device(corpus, tmp_path, variant):
    """parameter_memory_host_offload under a circular pipeline (2 stages x 2 repeats, fsdp 4):
    each repeat's weights come to the device for its round only. 2 steps give the losses,
    gradient norms and parameters of the same pipeline without offload (to float32
    reassociation, which Adam amplifies to up to ~4e-5 on single parameters with tiny gradients)."""
    flags = dict(ici_pipeline_parallelism=2, per_device_batch_size=2, steps=2, **OFFLOAD_VARIANTS[variant])
    base = str(tmp_path)
    _, offloaded = _train(corpus, base, "host", parameter_memory_host_offload=True, **flags)
    _, on_device = _train(corpus, base, "device", **flags)
    np.testing.assert_allclose(offloaded.losses, on_device.losses, rtol=1e-6)
    for a, b in zip(metric_records(offloaded.run_dir), metric_records(on_device.run_dir), strict=True):
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-5, err_msg=f"step {a['step']}")
    _assert_close_states(offloaded.state, on_device.state, rtol=1e-4, atol=1e-4)
