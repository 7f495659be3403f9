"""`nnxtron plan --search` end to end on 8 fake CPU devices: what it recommends fits, and
trains the same step as the plain run; bad input is one line.

One search (module fixture) of a tiny Llama with a memory limit that the data-parallel
meshes exceed (tests/unit/test_search.py covers what the search does with such a candidate).
The searches here pin every key but the data and fsdp axes (``PINNED``): three meshes to
compile, not the whole space (tests/unit/test_search.py covers the space and its expansions).
"""

import json

import numpy as np
import pytest

from nnxtron.config import load_config
from nnxtron.params import flatten
from nnxtron.tools.search import PRESETS, SearchRequest, search, with_memory
from nnxtron.train.loop import Trainer
from tests.integration.conftest import assert_user_error, run_cli, train_overrides

MEMORY_GIB = 2.5 / 1024  # 2.5 MiB: what the data-parallel meshes exceed (below)
SEARCHED = dict(base_num_decoder_layers=4, per_device_batch_size=2, steps=1, eval_interval=-1, enable_checkpointing=False)
PINNED = dict(
    ici_pipeline_parallelism=1,
    ici_context_parallelism=1,
    ici_tensor_parallelism=1,
    gradient_accumulation_steps=1,
    parameter_memory_host_offload=False,
    optimizer_memory_host_offload=False,
)


@pytest.fixture(scope="module")
def searched(corpus, tmp_path_factory):
    base = str(tmp_path_factory.mktemp("search"))
    # remat minimal, compiled as an H100's memory estimate (tools/search/worker.py): fsdp 8 and data 2 x fsdp 4
    # fit (1.7, 2.1 MiB), data 4 x fsdp 2 (3.0 MiB) does not
    overrides = train_overrides(corpus, base, "search", enable_tensorboard=False, remat_policy="minimal", **SEARCHED, **PINNED)
    request = SearchRequest(None, overrides, 8, with_memory(PRESETS["h100"], MEMORY_GIB), top=3, budget_seconds=100)
    return search(request), overrides, base


def test_every_recommended_configuration_fits_and_is_ranked_by_predicted_time(searched):
    result, _, _ = searched
    memory = MEMORY_GIB * 1024**3
    assert result["top"], result
    for entry in result["top"]:
        assert entry["fits"] and entry["peak_bytes"] <= memory and entry["headroom_bytes"] == memory - entry["peak_bytes"]
        assert entry["collectives"] > 0  # 8 devices: the prediction read the compiled program's collectives
        p = entry["predicted"]
        parts = p["compute_s"] + p["memory_s"] + p["fresh_temp_s"] + p["exposed_comm_s"] + p["offload_s"]
        assert p["step_s"] == pytest.approx(parts)
        assert p["memory_s"] > 0 and p["fresh_temp_s"] == 0  # the optimizer update's traffic; an H100 keeps its memory
        assert 0 < p["mfu"] < 1
    steps = [e["predicted"]["step_s"] for e in result["top"]]
    assert steps == sorted(steps)
    compiled = result["compiled"]
    assert result["compile"]["compiled"] == sum("error" not in r for r in compiled) >= len(result["top"])
    too_big = [r for r in compiled if r.get("peak_bytes", 0) > memory]
    assert too_big  # compiled, over the limit
    assert not any(r["fits"] for r in too_big)  # over the limit: never recommended
    assert all(set(r["overrides"]) not in [set(e["overrides"]) for e in result["top"]] for r in too_big)


def _train(overrides: list[str], run: str, extra: list[str]):
    cfg = load_config(overrides=[*overrides, f"run_name={run}", *extra])
    return cfg, Trainer(cfg, progress=False).run()


def test_the_best_configuration_trains_the_same_step_as_the_plain_run(searched):
    """One step with the recommended overrides against the default layout (fsdp over all
    8 devices), same seed and data, with SGD so that the updated parameters are the
    gradients seen through a fixed linear map (Adam's first step divides each gradient by
    its own size, so a rounding-level difference of a near-zero gradient becomes a whole
    update): the loss and every parameter agree to float32 reassociation."""
    result, overrides, _ = searched
    best = result["top"][0]["overrides"]
    sgd = ["opt_type=sgd", "gradient_clipping_threshold=0"]
    cfg, tuned = _train(overrides, "best", [*best, *sgd])
    assert {k: v for k, v in result["top"][0]["mesh"].items()} == {
        "stage": cfg.pipeline_stages,
        "data": cfg.ici_data_parallelism,
        "fsdp": cfg.ici_fsdp_parallelism,
        "context": cfg.ici_context_parallelism,
        "expert": cfg.ici_expert_parallelism,
        "tensor": cfg.ici_tensor_parallelism,
    }
    _, plain = _train(overrides, "plain", sgd)
    np.testing.assert_allclose(tuned.losses, plain.losses, rtol=1e-5)
    a, b = flatten(tuned.state["params"]), flatten(plain.state["params"])
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(np.asarray(a[key]), np.asarray(b[key]), rtol=1e-5, atol=1e-6, err_msg=key)


def test_cli_prints_the_table_and_json(corpus, tmp_path, capsys):
    args = train_overrides(corpus, str(tmp_path), "cli", remat_policy="full", **SEARCHED, **PINNED)
    common = ["plan", "--search", *args, "devices=4", "--device", "h200", "--time-budget", "60", "--top", "2"]
    code, out, err = run_cli(capsys, *common)
    assert code == 0, err
    assert "plan --search: model_name=llama2-tiny on 4 x h200 (989 TFLOP/s bf16, 131.3 GiB, 8 per node" in out
    assert "run it (the overrides of each, after the model's own):" in out and "\n  1: " in out
    code, out, err = run_cli(capsys, *common, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["devices"] == 4 and 1 <= len(result["top"]) <= 2 and result["device"]["name"] == "h200"


def test_a_model_that_fits_nowhere_says_how_much_memory_is_short(capsys):
    code, _, err = run_cli(capsys, "plan", "--search", "model_name=llama3.1-8b", "devices=8", "--device-memory-gib", "2")
    assert_user_error(code, err, "plan --search: llama3.1-8b does not fit 8 x 2.0 GiB: its train state and gradients alone")
    assert "GiB more than the device memory" in err


def test_a_device_count_with_no_valid_mesh_names_the_axis(capsys):
    code, _, err = run_cli(capsys, "plan", "--search", "model_name=llama2-tiny", "ici_tensor_parallelism=3", "devices=6")
    assert_user_error(
        code, err, "no mesh of 6 devices for llama2-tiny: ici_tensor_parallelism=3 does not divide the 4 query heads"
    )


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--search", "model_name=llama2-tiny"], "plan --search needs devices=N"),
        (["--search", "model_name=llama2-tiny", "devices=8", "--device", "a100"], "--device 'a100' is not a known preset"),
        (["--search", "model_name=llama2-tiny", "devices=8", "--top", "0"], "argument --top: must be an integer >= 1, got '0'"),
        (
            ["--search", "model_name=llama2-tiny", "devices=8", "--device", "cpu"],
            "has no memory figure; give --device-memory-gib",
        ),
        (["model_name=llama2-tiny", "--top", "3"], "--top only apply to plan --search; add --search or drop them"),
        (["--search", "model_name=llama2-tiny", "remat_policy=custom", "devices=8"], "remat_policy=custom is not searched"),
    ],
)
def test_bad_search_input_is_one_line(capsys, args, fragment):
    code, _, err = run_cli(capsys, "plan", *args)
    assert_user_error(code, err, fragment)
