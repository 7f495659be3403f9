"""`nnxtron bench` (run_bench) and the host-overhead benchmark's plain-JAX twin."""

from __future__ import annotations

import collections
import json
import math

import jax
import pytest
from flax import nnx

from nnxtron.cli import main
from nnxtron.config import load_config
from nnxtron.config.flops import training_flops_per_token
from nnxtron.errors import UserError
from nnxtron.models.decoder import Decoder
from nnxtron.tools.bench import pipeline_fields, run_bench
from nnxtron.tools.step_profile import HLO_FILE, _tpu_op_times, hlo_ops, summarize
from tests.scripts import load_script

OVERRIDES = [
    "model_name=llama2-tiny",
    "dataset_type=synthetic",
    "vocab_size=256",
    "per_device_batch_size=2",
    "max_target_length=32",
]
KEYS = {
    "compile_seconds", "trace_lower_seconds", "xla_compile_seconds", "step_seconds", "step_seconds_min", "tokens_per_s",
    "model_tflops_per_s", "mfu", "peak_tflops", "model_name", "decoder_block", "params", "global_batch", "seq_len",
    "dtype", "scan_layers", "remat_policy", "quantization", "devices", "backend", "loss",
}  # fmt: skip


def llama_param_count(cfg) -> int:
    """Closed form: embedding + layers (attention, SwiGLU, two norms) + final norm + head."""
    d, h, k, hd, f = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.resolved_head_dim, cfg.base_mlp_dim
    per_layer = d * (h + 2 * k) * hd + h * hd * d + 3 * d * f + 2 * d
    head = 0 if cfg.logits_via_embedding else d * cfg.vocab_size
    return cfg.vocab_size * d + cfg.base_num_decoder_layers * per_layer + d + head


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> dict:
    return run_bench(None, OVERRIDES, steps=2, profile=str(tmp_path_factory.mktemp("profile")))


def test_bench_reports_every_field(bench):
    assert KEYS <= set(bench)
    json.dumps(bench)  # one JSON line on the CLI
    cfg = load_config(None, OVERRIDES)
    assert bench["model_name"] == "llama2-tiny" and bench["decoder_block"] == "llama2"
    assert (bench["dtype"], bench["scan_layers"], bench["remat_policy"]) == (cfg.dtype, cfg.scan_layers, cfg.remat_policy)
    assert bench["quantization"] is None
    assert bench["devices"] == jax.device_count() and bench["backend"] == jax.default_backend()
    assert bench["global_batch"] == 2 * jax.device_count() and bench["seq_len"] == 32
    assert bench["timed_steps"] == 2
    assert math.isfinite(bench["loss"])


def test_bench_profile_breaks_the_step_down(bench):
    """``--profile``: the trace and the HLO are written, and the step's op time is split by place,
    pass and kind — the layers' forward, remat recompute (remat_policy=full) and backward matmuls,
    the output layer (``[.., vocab]`` results) and the optimizer's update all show up."""
    from pathlib import Path

    directory = Path(bench["profile_dir"])
    assert (directory / HLO_FILE).is_file() and list(directory.rglob("*.xplane.pb"))
    found = bench["profile_breakdown"]
    groups = found["groups"]
    for group in ("layers / forward / matmul", "layers / recompute / matmul", "layers / backward / matmul",
                  "logits + loss / forward / matmul", "update / update / other"):  # fmt: skip
        assert groups[group]["ms"] > 0 and groups[group]["ops"] >= 1, (group, groups)
    assert found["ms"] == pytest.approx(sum(g["ms"] for g in groups.values()))
    assert 0 < found["ms"] / 1e3 < 50 * bench["step_seconds"]  # op time per step: within reach of the step's wall time
    by_pass = summarize(groups, [1])
    assert set(by_pass) <= {"forward", "recompute", "backward", "update"}, by_pass
    assert summarize(groups, [])[""]["ops"] == pytest.approx(found["ops"])


def test_hlo_ops_names_what_xla_left_unnamed():
    """An op without ``op_name`` metadata takes its fused computation's, else its operands';
    a tuple-shaped op (a sort) is read; a fusion around a dot is a matmul."""
    text = """HloModule jit_train_step

%fused_dot (p0: f32[4,8], p1: f32[8,2]) -> f32[4,2] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,2]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,2]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,2]{1,0} parameter(1)
  %neg.2 = f32[4,8]{1,0} negate(%a), metadata={op_name="jit(train_step)/transpose(jvp())/while/body/neg"}
  %sort.3 = (f32[4,8]{1,0}, s32[4,8]{1,0}) sort(%neg.2, %a), dimensions={1}, to_apply=%cmp
  ROOT %ynn_fusion.4 = f32[4,2]{1,0} fusion(%neg.2, %b), kind=kCustom, calls=%fused_dot
}
"""
    ops = hlo_ops(text)
    assert ops["ynn_fusion.4"].matmul and ops["ynn_fusion.4"].op_name.endswith("while/body/neg")
    assert ops["sort.3"].opcode == "sort" and ops["sort.3"].op_name == ops["neg.2"].op_name
    assert not ops["neg.2"].matmul


def test_tpu_device_plane_ops_are_timed_inside_the_modules_asked_for():
    """A TPU's device plane names its ops by their instruction text and its module executions on a
    line of their own (no ``hlo_op`` stats: before, a TPU profile's breakdown was empty): each op
    counts for the module execution it falls within, and only for accepted modules."""
    from types import SimpleNamespace as Event

    def event(name: str, start: float, end: float) -> Event:
        return Event(name=name, start_ns=start, end_ns=end, duration_ns=end - start)

    modules = Event(events=[event("jit_train_step(123)", 0, 100), event("jit_eval_step(9)", 200, 300),
                            event("jit_train_step(123)", 400, 500)])  # fmt: skip
    ops = Event(events=[
        event("%fusion.3 = (f32[4,2048]{1,0}, bf16[4,2048]{1,0}) fusion(%a, %b), kind=kLoop", 10, 40),
        event("%fusion.3 = (f32[4,2048]{1,0}, bf16[4,2048]{1,0}) fusion(%a, %b), kind=kLoop", 410, 430),
        event("%splash_mha_fwd.1 = f32[4] custom-call(%q)", 50, 60),
        event("%fusion.3 = f32[2] fusion(%c)", 210, 290),  # the eval step's
        event("%copy.7 = f32[2] copy(%d)", 150, 160),  # between executions
    ])  # fmt: skip
    totals = collections.defaultdict(lambda: [0.0, 0])
    _tpu_op_times(modules, ops, lambda name: "train_step" in name, totals)
    assert {k: tuple(v) for k, v in totals.items()} == {"fusion.3": (50e-9, 2), "splash_mha_fwd.1": (10e-9, 1)}


def test_bench_profile_is_for_the_train_step(capsys):
    assert main(["bench", "model_name=llama2-tiny", "--decode", "--profile", "/nonexistent"]) == 2
    assert "--profile traces the train step" in capsys.readouterr().err


def test_bench_profile_needs_a_directory(tmp_path, capsys):
    """A file where the directory should be: one line, exit 2, before any work; the file is kept."""
    taken = tmp_path / "taken"
    taken.write_text("kept")
    assert main(["bench", *OVERRIDES, "--profile", str(taken)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--profile {taken}: cannot make that directory" in err, err
    assert taken.read_text() == "kept"


def test_bench_numbers_are_consistent(bench):
    cfg = load_config(None, OVERRIDES)
    step = bench["step_seconds"]
    assert step > 0 and 0 < bench["step_seconds_min"] <= step
    assert 0 < bench["trace_lower_seconds"] <= bench["compile_seconds"]
    assert bench["compile_seconds"] == pytest.approx(bench["trace_lower_seconds"] + bench["xla_compile_seconds"], rel=1e-9)
    tokens = bench["global_batch"] * bench["seq_len"]
    assert bench["tokens_per_s"] == pytest.approx(tokens / step, rel=1e-6)
    assert bench["model_tflops_per_s"] == pytest.approx(training_flops_per_token(cfg) * tokens / step / 1e12, rel=1e-6)
    assert bench["peak_tflops"] > 0
    assert bench["mfu"] == pytest.approx(bench["model_tflops_per_s"] / bench["peak_tflops"], rel=1e-6)


def test_bench_param_count_is_the_model_size(bench):
    cfg = load_config(None, OVERRIDES)
    with nnx.use_eager_sharding(False):
        abstract = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    assert bench["params"] == llama_param_count(cfg) == sum(x.size for x in jax.tree.leaves(abstract))


def test_bench_rejects_zero_steps():
    with pytest.raises(UserError, match="--steps"):
        run_bench(None, OVERRIDES, steps=0)


def _host_overhead_module():
    return load_script("benchmarks/host_overhead.py")


def test_host_overhead_plain_step_matches_nnxtron():
    ho = _host_overhead_module()
    args = ho.build_parser().parse_args(
        ["--emb", "32", "--heads", "4", "--kv-heads", "2", "--mlp", "64", "--layers", "1", "--seq", "16", "--remat", "none"]
    )
    parity = ho.check_parity(ho.Pair(ho.bench_config(args)), steps=2)  # asserts losses, metrics, params, moments
    assert parity["loss_first"] == pytest.approx(parity["loss_first_plain"], rel=1e-5)
    assert parity["max_param_rel_diff"] <= 1e-5


def test_pipeline_fields_are_the_bubble_model():
    """(S-1)/(R*M+S-1) and the measured time scaled by (1 - bubble); None without a pipeline."""
    assert pipeline_fields(load_config(None, OVERRIDES), 2.0) == {
        "pipeline_stages": 1,
        "pipeline_repeats": None,
        "pipeline_microbatches": None,
        "pipeline_bubble_fraction": None,
        "step_seconds_without_bubble": None,
    }
    circular = load_config(None, ["model_name=llama3.1-tiny", "base_num_decoder_layers=8", "ici_pipeline_parallelism=2",
                                  "num_pipeline_microbatches=3"])  # fmt: skip
    fields = pipeline_fields(circular, 2.0)
    bubble = (2 - 1) / (4 * 3 + 2 - 1)  # S=2, R=4 (8 layers / 2 stages), M=3
    assert (fields["pipeline_stages"], fields["pipeline_repeats"], fields["pipeline_microbatches"]) == (2, 4, 3)
    assert fields["pipeline_bubble_fraction"] == pytest.approx(bubble) == pytest.approx(1 / 13)
    assert fields["step_seconds_without_bubble"] == pytest.approx(2.0 * 12 / 13)


def test_decode_bench_reports_prefill_and_decode_throughput():
    from nnxtron.tools.bench import run_decode_bench

    overrides = ["model_name=llama2-tiny", "per_device_batch_size=0.25", "max_target_length=16", "max_new_tokens=4"]
    result = run_decode_bench(None, overrides, steps=2)
    assert (result["decode_batch"], result["prompt_length"], result["new_tokens"]) == (2, 16, 4)
    assert result["prefill_tokens_per_s"] > 0 and result["decode_tokens_per_s"] > 0
    assert result["prefill_seconds"] > 0 and result["decode_compile_seconds"] > 0 and result["params"] > 0
    assert result["generate_tokens_per_s"] == pytest.approx(2 / result["generate_token_seconds"])  # generate's device loop


def test_tpu_smoke_refuses_a_check_without_the_run_it_reads(capsys):
    """``scripts/tpu_smoke.py --only to_hf_round_trip`` alone failed on the chip after minutes (no
    default run to convert); a check chosen without its prerequisite before it is refused first,
    with one line and exit 2, on any machine."""
    smoke = load_script("scripts/tpu_smoke.py")
    assert smoke.main(["--only", "to_hf_round_trip"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: to_hf_round_trip reads the run train_default makes; put train_default before it in --only"
    ]
    assert smoke.missing_prerequisites(["generate", "train_default"]) != []
    assert smoke.missing_prerequisites(["train_default", "generate", "to_hf_round_trip"]) == []
    assert smoke.missing_prerequisites(list(smoke.CHECKS)) == []
