"""Host offload of parameters and optimizer state: where they live, and the same training."""

import numpy as np
import pytest

from nnxtron.config import load_config
from nnxtron.params import flatten
from nnxtron.train.loop import Trainer
from tests.integration.conftest import train_overrides


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    base = str(tmp_path_factory.mktemp("offload"))
    cfg = load_config(overrides=train_overrides(corpus, base, "ref", steps=3, enable_checkpointing=False, eval_interval=-1))
    return Trainer(cfg, progress=False).run(), corpus, base


@pytest.mark.parametrize("flags", [dict(parameter_memory_host_offload=True), dict(optimizer_memory_host_offload=True),
                                   dict(parameter_memory_host_offload=True, optimizer_memory_host_offload=True)])  # fmt: skip
def test_offloaded_state_lives_on_host_and_trains_identically(reference, flags):
    ref, corpus, base = reference
    cfg = load_config(
        overrides=train_overrides(corpus, base, "-".join(flags), steps=3, enable_checkpointing=False, eval_interval=-1, **flags)
    )
    result = Trainer(cfg, progress=False).run()
    assert result.losses == ref.losses  # bitwise: the same computation, only storage moves
    for key, value in flatten(result.state).items():
        part = key.split("/")[0]
        on_host = (part == "params" and cfg.parameter_memory_host_offload) or (
            part == "opt_state" and cfg.optimizer_memory_host_offload
        )
        if part in ("params", "opt_state") and value.ndim > 0:
            assert value.sharding.memory_kind == ("pinned_host" if on_host else "device"), key
    for key, value in flatten(ref.state["params"]).items():
        np.testing.assert_array_equal(np.asarray(flatten(result.state["params"])[key]), np.asarray(value))


def test_offloaded_runs_checkpoint_resume_and_sample(corpus, tmp_path, capsys):
    """Checkpoint checksums and the sample after training read host-offloaded arrays too."""
    from nnxtron.cli import main

    flags = ["parameter_memory_host_offload=true", "optimizer_memory_host_offload=true", "--no-progress"]
    args = train_overrides(corpus, str(tmp_path), "offloaded", steps=2, checkpoint_period=1, eval_interval=-1)
    assert main(["train", *args, *flags, "sample_after_training=4"]) == 0, capsys.readouterr().err
    assert "--- sample (" in capsys.readouterr().out
    assert main(["train", *args, *flags, "steps=3"]) == 0, capsys.readouterr().err
    assert "resumed at step 2" in capsys.readouterr().err
