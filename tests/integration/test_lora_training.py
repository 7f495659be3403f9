"""LoRA end to end on a tiny model: instruction fine-tuning from an nnxtron run (``init_from``)
with ``lora_rank`` set; the loss falls and the held-out answers improve; the checkpoints hold
the adapters only; a resumed run re-reads and checks its base and continues exactly; the
merged model (``load_model``, ``convert to-hf``) computes what the adapted one does; the
strategies compute the same steps; LoRA with DPO learns the preference."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from nnxtron.config import load_config
from nnxtron.convert.hf import from_hf, to_hf
from nnxtron.convert.runs import init_params, load_model
from nnxtron.errors import CheckpointError, ConfigError
from nnxtron.train.checkpoint import Checkpointer
from nnxtron.train.checksum import LORA_BASE_FILE
from nnxtron.train.loop import Trainer
from tests.integration.conftest import assert_user_error, run_cli
from tests.integration.test_dpo_training import STRATEGIES, dpo_data, dpo_overrides  # noqa: F401 - the fixture
from tests.integration.test_sft_training import sft_data, sft_overrides  # noqa: F401 - the fixture

LORA = dict(lora_rank=8, lora_alpha=16.0)


def trainer(cfg_overrides: list[str]) -> Trainer:
    cfg = load_config(overrides=cfg_overrides)
    return Trainer(cfg, progress=False, init_params=init_params(cfg))


def run(cfg_overrides: list[str]):
    return trainer(cfg_overrides).run()


@pytest.fixture(scope="module")
def base_run(sft_data, tmp_path_factory):  # noqa: F811
    """A trained base model: 6 steps of full instruction fine-tuning."""
    root = tmp_path_factory.mktemp("lora_base")
    run(sft_overrides(sft_data, str(root), "base", steps=6, eval_interval=-1, checkpoint_period=6))
    return root / "base"


def lora_overrides(sft_data, base_run, out, name, **extra):  # noqa: F811
    return sft_overrides(sft_data, str(out), name, **{**LORA, "init_from": str(base_run), **extra})


def test_lora_learns_and_its_checkpoints_hold_the_adapters_only(sft_data, base_run, tmp_path, capsys):  # noqa: F811
    result = run(lora_overrides(sft_data, base_run, tmp_path, "lora", steps=40, eval_interval=10, checkpoint_period=40,
                                learning_rate=0.01))  # fmt: skip
    first, last = float(np.mean(result.losses[:3])), float(np.mean(result.losses[-5:]))
    assert last < 0.6 * first, (first, last)
    assert result.eval_losses[40] < 0.8 * result.eval_losses[10], result.eval_losses
    ckpt = Checkpointer(result.run_dir / "checkpoints", 1, create=False)
    stored = ckpt.read_meta(40)["checksums"]["params"]
    assert stored and all(name.endswith(("lora_a", "lora_b")) for name in stored), sorted(stored)[:4]
    base_stored = Checkpointer(base_run / "checkpoints", 1, create=False).read_meta(6)["checksums"]["params"]
    assert len(base_stored) > 0 and not set(stored) & set(base_stored)
    assert json.loads((result.run_dir / LORA_BASE_FILE).read_text())["checksum"]

    # the merged model (kernels + scale A @ B) computes what the adapted model does
    merged = load_model(result.run_dir)
    assert merged.config.lora_rank == 0
    adapted = load_model(result.run_dir, ["lora_rank=8"])  # the run's config: still LoRA, so again merged
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 300, (2, 24)), jnp.int32)
    resumed = trainer(lora_overrides(sft_data, base_run, tmp_path, "lora", steps=40))
    weights = resumed.read_weights()
    state = resumed.initial_state(Checkpointer(result.run_dir / "checkpoints", 1, create=False), weights)[0]
    live = nnx.merge(resumed.setup.graphdef, state["params"], resumed.lora_base(weights), state["rest"])
    np.testing.assert_allclose(np.asarray(merged(tokens).logits), np.asarray(live(tokens).logits), atol=1e-4)
    np.testing.assert_array_equal(np.asarray(adapted(tokens).logits), np.asarray(merged(tokens).logits))
    base_logits = np.asarray(load_model(base_run)(tokens).logits)
    assert np.max(np.abs(base_logits - np.asarray(merged(tokens).logits))) > 1e-2  # the adapters were trained
    exported = to_hf(merged, tmp_path / "hf")
    np.testing.assert_allclose(np.asarray(from_hf(exported)(tokens).logits), np.asarray(merged(tokens).logits), atol=1e-4)

    # the adapters alone, for PEFT: base + alpha / r * B @ A in HF's layout is the merged export
    code, out, err = run_cli(capsys, "convert", "to-hf", str(result.run_dir), str(tmp_path / "adapter"), "--adapter-only")
    assert code == 0, err
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 16.0)
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(adapter) == 2 * 7 * 2  # A and B of 7 layers in each of 2 decoder layers
    base_hf = load_file(str(to_hf(load_model(base_run), tmp_path / "base_hf") / "model.safetensors"))
    merged_hf = load_file(str(exported / "model.safetensors"))
    for key in base_hf:
        module = "base_model.model." + key[: -len(".weight")]
        if module + ".lora_A.weight" in adapter:
            update = 2.0 * adapter[module + ".lora_B.weight"] @ adapter[module + ".lora_A.weight"]
            np.testing.assert_allclose(base_hf[key] + update, merged_hf[key], atol=1e-5, err_msg=key)
        else:
            np.testing.assert_array_equal(base_hf[key], merged_hf[key], err_msg=key)
    code, _, err = run_cli(capsys, "convert", "to-hf", str(base_run), str(tmp_path / "not_lora"), "--adapter-only")
    assert_user_error(code, err, "is not a LoRA run (lora_rank is 0)")


def test_the_lora_command_samples_from_the_merged_model_after_training(sft_data, base_run, tmp_path, capsys):  # noqa: F811
    """`nnxtron train init_from=RUN lora_rank=8 ...` sampling after training (the other tests set
    sample_after_training=0): the sample comes from the base with the trained adapters merged."""
    model_keys = ("sample_after", "model_name", "vocab_size", "base_num_decoder")  # init_from brings the model
    args = [o for o in lora_overrides(sft_data, base_run, tmp_path, "lora_cli", steps=2) if not o.startswith(model_keys)]
    code, out, err = run_cli(capsys, "train", *args, "sample_after_training=16", "--no-progress")
    assert code == 0 and "Traceback" not in err, out + err
    assert "--- sample (" in out, out


def test_a_resumed_lora_run_continues_exactly_and_checks_its_base(sft_data, base_run, tmp_path):  # noqa: F811
    common = dict(eval_interval=-1, checkpoint_period=2, learning_rate=0.003, learning_rate_schedule_steps=6)
    whole = run(lora_overrides(sft_data, base_run, tmp_path, "whole", steps=4, **common))
    run(lora_overrides(sft_data, base_run, tmp_path, "parts", steps=2, **common))
    resumed = run(lora_overrides(sft_data, base_run, tmp_path, "parts", steps=4, **common))
    assert resumed.start_step == 2
    assert resumed.losses == pytest.approx(whole.losses[2:], rel=1e-6, abs=1e-7)
    record = resumed.run_dir / LORA_BASE_FILE
    record.write_text(json.dumps({"checksum": "0123456789abcdef", "step": 0}))  # another base than the start's
    with pytest.raises(CheckpointError, match="the frozen base weights read now .* are not the ones run"):
        run(lora_overrides(sft_data, base_run, tmp_path, "parts", steps=6, **common))
    with pytest.raises(CheckpointError, match="the base weights read now"):
        load_model(resumed.run_dir)
    with pytest.raises(ConfigError, match="is a LoRA run .* `nnxtron convert to-hf"):
        init_params(load_config(overrides=sft_overrides(sft_data, str(tmp_path), "again", init_from=str(whole.run_dir))))


def test_lora_strategies_compute_the_same_steps(sft_data, base_run, tmp_path):  # noqa: F811
    """Step 1's gradient norm and step 2's loss (after an update of the adapters) agree over
    meshes, remat/unrolled layers, accumulation and a pipeline (2 stages), with dropout on the
    adapters' input (its masks are the same whatever the layout; that they act is checked
    against a run without them). Without dropout the same steps run minus the masks, so a
    second pass of the strategies without it would prove nothing more (it cost 22 s)."""
    runs = {}
    for name, extra in STRATEGIES.items():
        overrides = lora_overrides(sft_data, base_run, tmp_path, name, steps=2, eval_interval=-1, enable_checkpointing=False,
                                   learning_rate=0.003, lora_dropout=0.3, **extra)  # fmt: skip
        run(overrides)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [json.loads(line) for line in lines if '"loss"' in line]
    reference = runs["fsdp8"]
    assert reference[0]["grad_norm"] > 0 and reference[1]["loss"] < reference[0]["loss"]
    # the masks act: without them step 1's gradient is another
    run(lora_overrides(sft_data, base_run, tmp_path, "no_dropout", steps=1, eval_interval=-1, enable_checkpointing=False))
    lines = (tmp_path / "no_dropout" / "metrics.jsonl").read_text().splitlines()
    plain = [json.loads(line) for line in lines if '"loss"' in line][0]
    assert abs(plain["grad_norm"] - reference[0]["grad_norm"]) > 1e-3 * plain["grad_norm"]
    for name, records in runs.items():
        assert records[0]["grad_norm"] == pytest.approx(reference[0]["grad_norm"], rel=1e-4), name
        assert records[1]["loss"] == pytest.approx(reference[1]["loss"], rel=1e-4), name


def test_lora_with_dpo_learns_the_preference(dpo_data, tmp_path):  # noqa: F811
    """DPO on LoRA adapters: the reference is the base with the starting adapters (B = 0)."""
    cfg = load_config(overrides=dpo_overrides(dpo_data, str(tmp_path), "dpo_lora", steps=12, eval_interval=-1,
                                              enable_checkpointing=False, learning_rate=0.003, **LORA))  # fmt: skip
    result = Trainer(cfg, progress=False).run()
    assert result.losses[0] == pytest.approx(np.log(2), abs=1e-6)  # the policy is the reference
    assert float(np.mean(result.losses[-3:])) < 0.3, result.losses
