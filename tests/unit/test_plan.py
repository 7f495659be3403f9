"""`nnxtron plan`: counts, shardings and AOT memory of the train step, nothing allocated."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

import nnxtron.tools.plan
from nnxtron.cli import main
from nnxtron.config import load_config
from nnxtron.tools.plan import format_plan, make_plan, to_json_ready
from nnxtron.tools.plan_pipeline import format_pipeline, layer_ranges
from tests.conftest import tiny_config

SMALL = ["per_device_batch_size=1", "max_target_length=32"]  # keeps the AOT compile short
TINY = ["model_name=llama3.1-tiny", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", *SMALL]


@pytest.fixture(scope="module")
def cfg():
    return load_config(None, TINY)


@pytest.fixture(scope="module")
def plan(cfg) -> dict:
    return make_plan(cfg, device_memory_gib=1.0)


def llama_counts(cfg) -> tuple[int, int]:
    """Closed form, independent of the model code: (per layer, total) for a Llama block
    (attention q/k/v/o, SwiGLU, two norms) + embedding + final norm + untied head."""
    d, h, k, hd, f = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.resolved_head_dim, cfg.base_mlp_dim
    per_layer = d * (h + 2 * k) * hd + h * hd * d + 3 * d * f + 2 * d
    head = 0 if cfg.logits_via_embedding else d * cfg.vocab_size
    return per_layer, cfg.vocab_size * d + cfg.base_num_decoder_layers * per_layer + d + head


def test_counts_equal_the_model(cfg, plan):
    per_layer, total = llama_counts(cfg)
    counts = plan["params"]
    assert counts["total"] == total == sum(r["params"] for r in plan["table"])
    assert counts["embedding"] == cfg.vocab_size * cfg.base_emb_dim
    assert counts["output_head"] == 0 and counts["output_head_tied"]  # llama3.1-tiny ties the head
    (stack,) = counts["stacks"]
    assert stack["name"] == "layers/layers" and stack["scanned"] and stack["num_layers"] == cfg.base_num_decoder_layers
    assert stack["per_layer"] == per_layer and stack["total"] == per_layer * cfg.base_num_decoder_layers
    assert counts["other"] == cfg.base_emb_dim  # final norm
    untied_cfg = load_config(None, [*TINY, "logits_via_embedding=false"])
    untied = make_plan(untied_cfg, compile=False)["params"]
    assert untied["output_head"] == cfg.base_emb_dim * cfg.vocab_size and not untied["output_head_tied"]
    assert untied["total"] == llama_counts(untied_cfg)[1]


def test_counts_unrolled_layers_match_scanned(cfg, plan):
    unrolled = make_plan(load_config(None, [*TINY, "scan_layers=false"]), compile=False)
    assert unrolled["memory"] is None
    assert unrolled["params"]["total"] == plan["params"]["total"]
    assert unrolled["params"]["stacks"][0]["per_layer"] == plan["params"]["stacks"][0]["per_layer"]
    assert unrolled["params"]["stacks"][0]["scanned"] is False


def test_table_logical_axes_and_specs(plan):
    rows = {r["path"]: r for r in plan["table"]}
    emb = rows["embed/embedding"]
    assert emb["logical_axes"] == ["vocab", "embed"] and emb["spec"] == ["tensor", "fsdp"]
    assert emb["shard_shape"] == [emb["shape"][0] // 2, emb["shape"][1] // 4]
    query = rows["layers/layers/attention/query/kernel"]
    assert query["logical_axes"] == ["layers", "embed", "q_heads", "head_dim"]
    assert query["spec"] == [None, "fsdp", "tensor", None]
    assert rows["layers/layers/mlp/wo/kernel"]["spec"] == [None, "tensor", "fsdp"]
    assert (
        rows["final_norm/scale"]["spec"] == [None]
        and rows["final_norm/scale"]["shard_shape"] == rows["final_norm/scale"]["shape"]
    )


def test_per_device_bytes_from_shardings(plan):
    devices = jax.device_count()
    assert plan["devices"]["count"] == devices == 8 and plan["mesh"] == {
        "stage": 1,
        "data": 1,
        "fsdp": 4,
        "context": 1,
        "expert": 1,
        "tensor": 2,
    }
    for row in plan["table"]:
        full = math.prod(row["shape"]) * np.dtype(row["dtype"]).itemsize
        split = {a for e in row["spec"] if e for a in ([e] if isinstance(e, str) else e)}
        if split == {"fsdp", "tensor"}:
            assert row["bytes_per_device"] * devices == full, row["path"]
        elif not split:
            assert row["bytes_per_device"] == full, row["path"]
    state = plan["state_per_device"]
    assert state["params_bytes"] == sum(r["bytes_per_device"] for r in plan["table"])
    assert plan["state_unsharded"]["params_bytes"] == 4 * plan["params"]["total"]  # float32 weights
    # AdamW: two parameter-shaped moments, sharded like the parameters, plus scalar counts
    assert 2 * state["params_bytes"] <= state["optimizer_state_bytes"] <= 2 * state["params_bytes"] + 64


def test_the_peak_is_xla_tpu_s_own_on_a_tpu_and_the_buffer_sum_elsewhere(monkeypatch):
    """XLA:CPU's ``peak_memory_in_bytes`` counts the arguments only; XLA:TPU's is the step's peak."""
    from types import SimpleNamespace

    from nnxtron.tools.plan import PEAK_SOURCES, memory_stats

    stats = SimpleNamespace(
        argument_size_in_bytes=6, output_size_in_bytes=6, alias_size_in_bytes=6, temp_size_in_bytes=11,
        generated_code_size_in_bytes=0, peak_memory_in_bytes=14,
    )  # fmt: skip
    compiled = SimpleNamespace(memory_analysis=lambda: stats)
    cpu = memory_stats(compiled)
    assert (cpu["resident_bytes"], cpu["peak_bytes"], cpu["peak_source"]) == (6, 17, "buffers")
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    tpu = memory_stats(compiled)
    assert (tpu["peak_bytes"], tpu["peak_source"]) == (14, "xla:tpu") and tpu["peak_source"] in PEAK_SOURCES


def test_memory_analysis_and_flops(cfg, plan):
    mem = plan["memory"]
    for key in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes"):
        assert mem[key] > 0, key
    assert mem["argument_bytes"] >= plan["state_per_device"]["state_bytes"]  # train state + batch
    assert mem["alias_bytes"] <= min(mem["argument_bytes"], mem["output_bytes"])  # the state is donated
    assert mem["peak_bytes"] >= mem["argument_bytes"] + mem["temp_bytes"]
    assert mem["device_memory_bytes"] == 1024**3 and mem["fits"] is True
    flops = plan["flops"]
    assert flops["per_step"] == flops["per_token"] * plan["derived"]["tokens_per_step"]
    assert flops["xla_per_step_per_device"] > 0
    assert plan["derived"]["global_batch_size"] == 8 and plan["seq_len"] == 32
    assert 0 < plan["unsharded"]["fraction"] <= cfg.sharding_tolerance  # only the norm scales


def test_plan_is_json_and_text(plan):
    again = json.loads(json.dumps(to_json_ready(plan)))
    assert again["params"]["total"] == plan["params"]["total"]
    text = format_plan(plan)
    for needle in ("mesh: stage=1 x data=1 x fsdp=4 x context=1 x expert=1 x tensor=2", "embed/embedding", "P(tensor, fsdp)",
                   "P(None, fsdp, tensor, None)", "temporaries", "peak estimate", "fits: yes"):  # fmt: skip
        assert needle in text, needle


def test_cli_in_process(capsys, monkeypatch, plan):
    """The CLI glue in this process (8 devices already): devices=8 is stripped before the
    config is loaded, options reach make_plan, text and JSON are printed. make_plan is
    the fixture's result here (one AOT compile less); the subprocess test runs it for real."""
    seen = []

    def fake_make_plan(cfg, device_memory_gib=None):
        seen.append((cfg, device_memory_gib))
        return plan

    monkeypatch.setattr(nnxtron.tools.plan, "make_plan", fake_make_plan)
    assert main(["plan", *TINY, "devices=8", "--device-memory-gib", "2"]) == 0
    out = capsys.readouterr().out
    assert seen[0][0] == load_config(None, TINY) and seen[0][1] == 2.0
    assert "layers/layers/attention/query/kernel" in out and "P(None, fsdp, tensor, None)" in out
    assert "logical axes" in out and "bytes/device" in out
    assert main(["plan", *TINY, "--json"]) == 0  # no devices=: the real (8) devices
    assert json.loads(capsys.readouterr().out)["params"]["total"] == plan["params"]["total"]


def test_cli_other_device_count_runs_in_a_subprocess(capsys):
    """devices=4 while this process's jax has 8: the plan re-runs in a child process."""
    assert main(["plan", "model_name=llama3.1-tiny", "devices=4", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "devices: 4 x cpu" in out and "mesh: stage=1 x data=1 x fsdp=4 x context=1 x expert=1 x tensor=1" in out
    assert "embed/embedding" in out and "P(None, fsdp)" in out and "peak estimate" in out
    assert jax.device_count() == 8  # this process is untouched


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["devices=abc"], "devices='abc' is not an integer"),
        (["devices=0"], "devices=0 must be at least 1"),
        (["devices=8", "bogus_key=1"], "unknown config key 'bogus_key'"),
        (["devices=8", "ici_fsdp_parallelism=3"], "ici_"),
    ],
)
def test_cli_bad_input_is_one_line(capsys, args, needle):
    assert main(["plan", "model_name=llama3.1-tiny", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], captured.err


# ----------------------------------------------------------------------------- pipeline


def _pipeline_plan(model: str = "llama3.1-tiny", **overrides) -> dict:
    """make_plan without the AOT compile (the layout needs no XLA) over the 8 test devices."""
    return make_plan(tiny_config(model, **overrides), compile=False)


def test_plan_without_a_pipeline_has_no_pipeline_section(plan):
    assert plan["pipeline"] is None and "pipeline:" not in format_plan(plan)


def test_pipeline_circular_layout_and_bubble():
    """4 layers over 2 stages, one layer per stage: 2 repeats, stage s applies layer r * 2 + s."""
    plan = _pipeline_plan(base_num_decoder_layers=4, ici_pipeline_parallelism=2, num_pipeline_microbatches=4)
    p = plan["pipeline"]
    assert plan["mesh"]["stage"] == 2 and plan["mesh"]["fsdp"] == 4
    assert (p["stack"], p["stages"], p["repeats"], p["circular"], p["microbatches"]) == ("layers", 2, 2, True, 4)
    assert p["layers_per_stage"] == 1 and p["delay"] == 1 and p["pipelined_layers"] == 4
    assert p["layout"] == [[[0], [2]], [[1], [3]]]
    assert p["outside"] == []
    assert p["iterations"] == 2 * 4 + 1 == 9
    assert p["bubble_fraction"] == pytest.approx((2 - 1) / (2 * 4 + 2 - 1)) == pytest.approx(1 / 9)
    text = format_plan(plan)
    for needle in (
        "pipeline: 2 stages x 2 repeats (circular), 4 microbatches, 1 layer per stage, bubble 11.1% = (S-1)/(R*M+S-1) = 1/9",
        "  stack layers, layers 0-3; 9 iterations; schedule flags: scan_iterations, scan_repeats, remat_iterations\n",
        "  stage 0: repeat 0 layer 0 | repeat 1 layer 2\n",
        "  stage 1: repeat 0 layer 1 | repeat 1 layer 3\n",
    ):
        assert needle in text, needle
    assert "outside the pipeline" not in text
    assert json.loads(json.dumps(to_json_ready(plan)))["pipeline"]["layout"] == p["layout"]


def test_pipeline_gpipe_layout_and_bubble():
    """Two layers per stage over 4 layers: one repeat, contiguous slices (GPipe)."""
    p = _pipeline_plan(base_num_decoder_layers=4, ici_pipeline_parallelism=2, num_layers_per_pipeline_stage=2)["pipeline"]
    assert (p["stages"], p["repeats"], p["circular"], p["microbatches"], p["layers_per_stage"]) == (2, 1, False, 2, 2)
    assert p["layout"] == [[[0, 1]], [[2, 3]]]
    assert p["bubble_fraction"] == pytest.approx(1 / 3)  # (S-1)/(R*M+S-1) = 1/(1*2+1)
    lines = "\n".join(format_pipeline(p))
    assert "pipeline: 2 stages x 1 repeat (GPipe), 2 microbatches, 2 layers per stage, bubble 33.3%" in lines
    assert "  stage 0: repeat 0 layers 0-1\n  stage 1: repeat 0 layers 2-3" in lines


def test_pipeline_deepseek_dense_prefix_stays_outside():
    """DeepSeek: the dense layer 0 is its own stack; the moe_layers (1-4) are pipelined."""
    plan = _pipeline_plan("deepseek3-test", base_num_decoder_layers=5, ici_pipeline_parallelism=2)
    p = plan["pipeline"]
    assert p["stack"] == "moe_layers" and p["layout"] == [[[1], [3]], [[2], [4]]]
    assert p["outside"] == [{"stack": "dense_layers", "layers": [0]}]
    text = format_plan(plan)
    assert "  stack moe_layers, layers 1-4;" in text
    assert "  outside the pipeline, data-parallel over the stage axis: dense_layers layer 0\n" in text


def test_pipeline_partial_delayed_and_long_layouts():
    """pipeline_parallel_layers leaves the rest outside; delayed forwarding doubles the drain;
    many repeats are elided and consecutive layers compressed into ranges."""
    p = _pipeline_plan(
        base_num_decoder_layers=8,
        ici_pipeline_parallelism=2,
        pipeline_parallel_layers=4,
        num_pipeline_microbatches=4,
        pipeline_delay_activation_forwarding=True,
    )["pipeline"]
    assert p["layout"] == [[[0], [2]], [[1], [3]]] and p["delay"] == 2 and p["schedule"]["delayed_forwarding"]
    assert p["outside"] == [{"stack": "unpipelined_layers", "layers": [4, 5, 6, 7]}]
    assert p["bubble_fraction"] == pytest.approx(2 * (2 - 1) / (2 * 4 + 2 * (2 - 1)))
    text = "\n".join(format_pipeline(p))
    assert "bubble 20.0% = 2(S-1)/(R*M+2(S-1)) = 2/10" in text and "unpipelined_layers layers 4-7" in text

    long = _pipeline_plan(base_num_decoder_layers=24, ici_pipeline_parallelism=2, num_layers_per_pipeline_stage=2)
    p = long["pipeline"]
    assert p["repeats"] == 6 and p["layout"][1][5] == [22, 23]
    assert sorted(layer for stage in p["layout"] for repeat in stage for layer in repeat) == list(range(24))
    stage_1 = "  stage 1: repeat 0 layers 2-3 | repeat 1 layers 6-7 | repeat 2 layers 10-11 | ... | repeat 5 layers 22-23\n"
    assert stage_1 in format_plan(long)
    assert layer_ranges([0, 1, 2, 3, 8, 10, 11]) == "0-3, 8, 10-11" and layer_ranges([]) == ""


def test_quantization_line_names_mode_types_and_scope(plan):
    assert plan["quantization"] is None and "quantization" not in format_plan(plan)
    quantized = _pipeline_plan("llama3.1-tiny", use_qwix_quantization=True, quantization="fp8_full")
    line = quantized["quantization"]
    assert line.startswith("quantization fp8_full: float8_e4m3fn forward, float8_e5m2 backward; 7 weight matmuls per forward")
    assert "in 7 modules" in line and line in format_plan(quantized)
