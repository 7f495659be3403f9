"""`nnxtron plan --search` without compiling: the space, the cheap rules, the cost model."""

import math
from collections import Counter
from dataclasses import replace

import jax
import pytest

from nnxtron.config.derived import MESH_AXES
from nnxtron.config.flops import training_flops_per_token
from nnxtron.errors import UserError
from nnxtron.tools.search.cost import (
    _group_flops,
    _spans_nodes,
    analytic_collectives,
    estimate_peak_bytes,
    matmul_roofline,
    recompute_flops_per_token,
    step_cost,
    update_bytes,
)
from nnxtron.tools.search.hlo import Collective
from nnxtron.tools.search.hlo_cost import ProgramCost
from nnxtron.tools.search.orchestrator import STATE_REASON, Search, SearchRequest, state_totals
from nnxtron.tools.search.presets import PRESETS, DevicePreset, preset, with_memory
from nnxtron.tools.search.space import (
    AXIS_KEYS,
    QUERY_BLOCK,
    TOKEN_CHUNKS,
    axis_problem,
    candidate,
    check,
    memory_saving,
    meshes,
    pinned_values,
)
from tests.conftest import tiny_config

# a device whose roofline never binds: compute time is flops / (peak x efficiency)
FLAT = DevicePreset("flat", 1e12, 80e9, 1e18, 100e9, 10e9, 1e9, 4)


def _mesh(**sizes):
    return {axis: sizes.get(axis, 1) for axis in MESH_AXES}


def test_meshes_factor_the_devices_over_the_axes_the_model_can_split():
    cfg = tiny_config("llama3.1-8b")  # 32 query heads, 8 kv heads, MLP 14336, dense
    found = list(meshes(cfg, 64, devices_per_node=8, pinned={}))
    assert found and all(math.prod(m.values()) == 64 for m in found)
    assert all(m["expert"] == 1 for m in found)  # a dense model has no expert axis
    assert all(m["context"] == 1 for m in found)  # 128 tokens: no shard reaches MIN_CONTEXT_SHARD
    assert {m["tensor"] for m in found} == {1, 2, 4, 8}  # within the 8-device node
    assert all(m["stage"] <= 16 for m in found)  # at least two layers per stage
    assert len(found) == len({tuple(m.values()) for m in found})
    pinned = list(meshes(cfg, 64, devices_per_node=8, pinned={"tensor": 4, "stage": 2}))
    assert pinned and all(m["tensor"] == 4 and m["stage"] == 2 for m in pinned)


def test_expert_and_context_axes_appear_only_where_the_model_allows():
    moe = tiny_config("mixtral-8x7b", max_target_length=8192)
    found = list(meshes(moe, 16, devices_per_node=8, pinned={}))
    assert {m["expert"] for m in found} == {1, 2, 4, 8}  # divides the 8 experts
    assert {m["context"] for m in found} == {1, 2, 4}  # 8192 / 4 = 2048 tokens per shard, the least allowed


def test_axis_problem_names_the_axis_and_what_it_cannot_divide():
    cfg = tiny_config("llama3.1-8b")
    assert "ici_tensor_parallelism=3 does not divide the 32 query heads" in axis_problem(cfg, "tensor", 3, 3, 8)
    assert "would leave a node of 8 devices" in axis_problem(cfg, "tensor", 16, 16, 8)
    assert "does not divide the model's 1 experts" in axis_problem(cfg, "expert", 2, 8, 8)
    assert "does not divide 8 devices" in axis_problem(cfg, "fsdp", 3, 8, 8)
    assert axis_problem(cfg, "fsdp", 8, 8, 8) is None


def test_candidate_overrides_select_it_and_leave_out_what_the_base_has():
    base = tiny_config()
    schedule = {
        "scan_layers": True,
        "gradient_accumulation_steps": 2,
        "num_pipeline_microbatches": -1,
        "num_layers_per_pipeline_stage": 1,
    }
    cand = candidate(_mesh(fsdp=4, tensor=2), schedule, "minimal", (False, True), (0, 1))
    args = cand.args(base)
    assert "ici_tensor_parallelism=2" in args and "remat_policy=minimal" in args
    assert "optimizer_memory_host_offload=true" in args and "gradient_accumulation_steps=2" in args
    assert not any(a.startswith("parameter_memory_host_offload") for a in args)  # base's value: left out
    cfg = tiny_config(**dict(cand.overrides))
    assert check(cfg, 8) is None
    assert cand.mesh == _mesh(fsdp=4, tensor=2)


def test_check_reports_a_batch_that_does_not_divide():
    cfg = tiny_config(per_device_batch_size=0.25, ici_fsdp_parallelism=8, ici_data_parallelism=1)
    assert "does not divide over the stage x data x fsdp x expert" in check(cfg, 8)


def test_pinned_values_are_the_searched_keys_given_on_the_command_line():
    cfg = tiny_config(ici_tensor_parallelism=2, remat_policy="minimal")
    pinned = pinned_values(cfg, ["ici_tensor_parallelism=2", "remat_policy=minimal", "steps=3"])
    assert pinned == {"tensor": 2, "remat_policy": "minimal"}
    assert pinned_values(cfg, ["ici_fsdp_parallelism=-1"]) == {}  # -1 = fill: searched


def test_remat_recompute_follows_what_each_policy_saves():
    cfg = tiny_config("llama3.1-8b", max_target_length=4096)
    groups = _group_flops(cfg)
    forward = sum(groups.values())
    # the matmul groups add up to the forward third of the model formula, less the output head
    head = 2 * cfg.base_emb_dim * cfg.vocab_size
    assert forward == pytest.approx(training_flops_per_token(cfg) / 3 - head, rel=1e-9)
    by_policy = {
        p: recompute_flops_per_token(cfg.model_copy(update={"remat_policy": p}))
        for p in ("none", "minimal", "save_dot_except_mlp", "full")
    }
    assert by_policy["none"] == 0
    assert by_policy["minimal"] == groups["scores"]
    assert by_policy["save_dot_except_mlp"] == pytest.approx(groups["scores"] + groups["mlpwi"] + groups["mlpwo"])
    assert by_policy["full"] == pytest.approx(forward)
    assert by_policy["none"] < by_policy["minimal"] < by_policy["save_dot_except_mlp"] < by_policy["full"]


def test_memory_knobs_recompute_the_scores_and_the_moe_feed_forward_whatever_the_policy():
    cfg = tiny_config("mixtral-8x7b", max_target_length=4096)
    groups = _group_flops(cfg)
    for policy in ("none", "full"):
        plain = cfg.model_copy(update={"remat_policy": policy})
        base = recompute_flops_per_token(plain)
        blocked = recompute_flops_per_token(plain.model_copy(update={"attention_query_block": 512}))
        assert blocked - base == pytest.approx(groups["scores"])
        chunked = recompute_flops_per_token(plain.model_copy(update={"moe_token_chunks": 8}))
        assert chunked - base == pytest.approx(groups["mlpwi"] + groups["mlpwo"])  # every mixtral layer is MoE


def test_memory_saving_sets_the_knobs_that_apply():
    moe = tiny_config("mixtral-8x7b", max_target_length=4096)
    assert memory_saving(moe, _mesh(fsdp=8), 4096) == {"attention_query_block": QUERY_BLOCK, "moe_token_chunks": TOKEN_CHUNKS}
    assert memory_saving(moe, _mesh(fsdp=8), 4092) == {"attention_query_block": QUERY_BLOCK}  # pieces would not divide
    ring = moe.model_copy(update={"context_parallel_strategy": "ring"})
    assert "attention_query_block" not in memory_saving(ring, _mesh(fsdp=4, context=2), 4096)
    assert memory_saving(tiny_config("llama3.1-8b", max_target_length=512), _mesh(fsdp=8), 512) == {}  # one block, dense
    assert memory_saving(tiny_config("deepseek4-test", max_target_length=1024), _mesh(fsdp=8), 1024) == {
        "moe_token_chunks": TOKEN_CHUNKS
    }  # compressed attention has no query blocks


def test_step_cost_compute_is_model_flops_plus_recompute_at_peak_times_efficiency():
    cfg = tiny_config("llama3.1-8b", remat_policy="full")
    mesh = _mesh(fsdp=8)
    cost = step_cost(cfg, mesh, FLAT, [], efficiency=0.5)
    tokens = cfg.per_device_batch_size * 8 * cfg.max_target_length
    flops = (training_flops_per_token(cfg) + recompute_flops_per_token(cfg)) * tokens / 8
    assert cost.compute_s == pytest.approx(flops / 0.5e12)
    assert cost.step_s == cost.compute_s and cost.exposed_comm_s == 0
    assert cost.mfu == pytest.approx(training_flops_per_token(cfg) * tokens / 8 / cost.step_s / 1e12)


def test_collectives_over_data_and_fsdp_hide_behind_compute_and_tensor_ones_do_not():
    cfg = tiny_config("llama3.1-8b")
    mesh = _mesh(fsdp=4, tensor=2)
    compute = step_cost(cfg, mesh, FLAT, []).compute_s
    gather = Collective("all-gather", int(compute * 100e9 * 2), 4, 1, ("fsdp",), False)  # 2x compute on the wire
    tensor = Collective("all-reduce", int(compute * 100e9), 2, 1, ("tensor",), False)
    cost = step_cost(cfg, mesh, FLAT, [gather], overlap=0.8)
    wire = 3 / 4 * gather.array_bytes / 100e9 + 10e-6
    assert cost.hidden_comm_s == pytest.approx(0.8 * compute)
    assert cost.exposed_comm_s == pytest.approx(wire - 0.8 * compute)
    cost = step_cost(cfg, mesh, FLAT, [tensor], overlap=0.8)
    assert cost.hidden_comm_s == 0 and cost.exposed_comm_s == pytest.approx(tensor.wire_bytes / 100e9 + 10e-6)
    inter = Collective("all-reduce", tensor.array_bytes, 2, 3, ("tensor",), True)  # leaves the node: the slow links
    assert step_cost(cfg, mesh, FLAT, [inter]).exposed_comm_s == pytest.approx(3 * (inter.wire_bytes / 10e9 + 10e-6))


def test_pipeline_bubble_and_offload_add_to_the_step():
    cfg = tiny_config("llama3.1-8b", ici_pipeline_parallelism=2, num_pipeline_microbatches=2, ici_fsdp_parallelism=4)
    mesh = _mesh(stage=2, fsdp=4)
    cost = step_cost(cfg, mesh, FLAT, [], offloaded_bytes=10**9)
    assert cost.bubble_fraction == pytest.approx(1 / 33)  # (S - 1) / (R M + S - 1): 16 repeats x 2 microbatches
    plain = step_cost(cfg.model_copy(update={"ici_pipeline_parallelism": 1, "ici_fsdp_parallelism": 8}), _mesh(fsdp=8), FLAT, [])
    assert cost.compute_s == pytest.approx(plain.compute_s / (1 - 1 / 33))
    assert cost.offload_s == pytest.approx(2 * 10**9 / 1e9)
    assert cost.step_s == pytest.approx(cost.compute_s + cost.offload_s)
    with_update = step_cost(cfg, mesh, FLAT, [], update_bytes=update_bytes(3e9, 1e9))
    assert with_update.memory_s == pytest.approx(7e9 / FLAT.memory_bytes_per_s)  # read state + gradients, write state
    assert with_update.step_s == pytest.approx(cost.compute_s + with_update.memory_s)


def test_a_compiled_program_on_the_host_adds_its_memory_traffic_and_fresh_temporaries():
    cfg = tiny_config("llama3.1-8b", remat_policy="full")
    mesh = _mesh(fsdp=8)
    program = ProgramCost(dot_flops=3e12, dot_bytes=5e9, other_bytes=2e9)
    analytic = step_cost(cfg, mesh, FLAT, [], update_bytes=7e9)
    compiled = step_cost(cfg, mesh, FLAT, [], update_bytes=7e9, program=program, temp_bytes=10**9)
    assert compiled == analytic  # an accelerator: the model's FLOPs and the update's traffic, not the CPU program's
    assert compiled.memory_s == pytest.approx(7e9 / FLAT.memory_bytes_per_s) and compiled.fresh_temp_s == 0
    host = replace(FLAT, runs_compiled_program=True, fresh_temp_seconds_per_byte=1e-9, efficiency=1.0)
    on_host = step_cost(cfg, mesh, host, [], update_bytes=7e9, program=program, temp_bytes=10**9)
    assert on_host.compute_s == pytest.approx(3e12 / 1e12)  # the compiled dots at the measured peak
    assert on_host.memory_s == pytest.approx(2e9 / FLAT.memory_bytes_per_s)  # the update is in the program's traffic
    assert on_host.fresh_temp_s == pytest.approx(1.0)
    assert on_host.step_s == pytest.approx(3.0 + 2e9 / FLAT.memory_bytes_per_s + 1.0)
    piped = tiny_config("llama3.1-8b", ici_pipeline_parallelism=2, num_pipeline_microbatches=2, ici_fsdp_parallelism=4)
    assert step_cost(piped, _mesh(stage=2, fsdp=4), host, [], program=program).compute_s == pytest.approx(3.0)  # bubble inside


def test_the_cpu_preset_is_measured_and_runs_its_compiled_program():
    cpu = preset("cpu", 1)
    assert cpu.peak_flops > 1e8 and cpu.memory_bytes_per_s > 1e7 and cpu.collective_latency_s > 0
    assert cpu.fresh_temp_seconds_per_byte > 0  # a fresh page costs more to write than a faulted one
    assert cpu.runs_compiled_program and cpu.efficiency == 1.0 and cpu.overlap == 0.0
    assert not any(p.runs_compiled_program or p.fresh_temp_seconds_per_byte for p in PRESETS.values())


def test_roofline_slows_a_thin_microbatch():
    cfg = tiny_config("llama3.1-8b", per_device_batch_size=1, max_target_length=4096)
    h100 = PRESETS["h100"]
    assert matmul_roofline(cfg, _mesh(fsdp=8), h100) == 1.0  # 4096 tokens: compute-bound
    thin = cfg.model_copy(update={"max_target_length": 64})
    assert matmul_roofline(thin, _mesh(fsdp=8), h100) < 0.3  # 64 tokens x 4096 x 14336: bound by the weights


def test_analytic_collectives_follow_the_mesh():
    cfg = tiny_config("llama3.1-8b", gradient_accumulation_steps=2)
    kinds = {(c.kind, c.axes) for c in analytic_collectives(cfg, _mesh(data=2, fsdp=4), 10**9, FLAT)}
    assert kinds == {("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",)), ("all-reduce", ("data",))}
    gathers = [c for c in analytic_collectives(cfg, _mesh(data=2, fsdp=4), 10**9, FLAT) if c.kind == "all-gather"]
    assert gathers[0].count == 4  # forward + backward, per accumulation step
    assert analytic_collectives(cfg, _mesh(fsdp=8), 10**9, FLAT)[0].spans_nodes  # 8 devices, nodes of 4
    tensor = analytic_collectives(cfg, _mesh(fsdp=4, tensor=2), 10**9, FLAT)
    assert any(c.axes == ("tensor",) and not c.spans_nodes for c in tensor)


def test_a_group_spans_nodes_when_its_devices_are_further_apart_than_a_node():
    mesh = _mesh(data=2, fsdp=4, tensor=2)  # row-major: tensor innermost
    assert not _spans_nodes(mesh, "tensor", 8) and not _spans_nodes(mesh, "fsdp", 8)
    assert _spans_nodes(mesh, "data", 8) and _spans_nodes(mesh, "fsdp", 4)


def test_presets_hold_vendor_figures_and_unknown_names_are_refused():
    assert set(PRESETS) == {"h100", "h200", "b200", "tpu-v5e", "tpu-v5p", "tpu-v6e"}
    for p in PRESETS.values():
        assert p.peak_flops > 1e14 and p.memory_bytes > 1e10 and p.intra_node_bytes_per_s > p.inter_node_bytes_per_s
    assert PRESETS["h200"].memory_bytes == 141e9 and PRESETS["tpu-v5p"].peak_flops == 459e12
    with pytest.raises(ValueError, match="--device 'a100' is not a known preset; choose one of h100"):
        preset("a100")
    assert with_memory(PRESETS["h100"], 40).memory_bytes == 40 * 1024**3
    assert preset("H100") is PRESETS["h100"]


def test_axis_keys_name_every_mesh_axis():
    assert list(AXIS_KEYS) == list(MESH_AXES)


def _search(memory_gib: float, *overrides: str) -> Search:
    request = SearchRequest(None, ["model_name=llama2-tiny", *overrides], 8, with_memory(PRESETS["h100"], memory_gib))
    s = Search(request)
    s.totals = state_totals(None, request.overrides)
    s.enumerate()
    return s


PLAIN_SCHEDULE = {  # scanned, no accumulation, no pipeline
    "scan_layers": True,
    "gradient_accumulation_steps": 1,
    "num_pipeline_microbatches": -1,
    "num_layers_per_pipeline_stage": 1,
}


def test_a_tpu_search_compiles_attention_auto_as_the_chip_runs_it():
    """On a TPU preset ``auto`` is splash (xla with the sequence sharded), never the fake CPU
    devices' xla; the query blocks splash refuses are not offered; a GPU preset keeps ``auto``."""
    request = SearchRequest(None, ["model_name=llama2-tiny"], 8, with_memory(PRESETS["tpu-v5e"], 16))
    tpu = Search(request)
    plain = candidate(_mesh(fsdp=8), PLAIN_SCHEDULE, "full", (False, False), (0, 1))
    context = candidate(_mesh(fsdp=4, context=2), PLAIN_SCHEDULE, "full", (False, False), (0, 1))
    assert tpu._args(plain)[-1] == "attention=splash" and tpu._config(plain).attention == "splash"
    assert tpu._args(context)[-1] == "attention=xla"
    assert "attention_query_block" not in memory_saving(
        tiny_config("llama3.1-8b", attention="splash", max_target_length=4096), _mesh(fsdp=8), 4096
    )
    pinned = Search(replace(request, overrides=["model_name=llama2-tiny", "attention=xla"]))
    assert pinned._args(plain) == ["model_name=llama2-tiny", "attention=xla", *plain.args()]  # the user's choice stands
    gpu = Search(replace(request, device=with_memory(PRESETS["h100"], 16)))
    assert gpu._args(plain) == ["model_name=llama2-tiny", *plain.args()]
    assert [p.backend for p in (PRESETS["tpu-v6e"], PRESETS["b200"])] == ["tpu", "gpu"]


def _queued(s: Search, **values) -> list:
    return [q for q in s.queue if all(q.candidate.values[k] == v for k, v in values.items())]


def test_enumeration_queues_one_base_candidate_per_mesh_and_schedule():
    s = _search(80.0)
    assert s.queue and all(q.candidate.values["remat_policy"] == "full" for q in s.queue)
    assert all(q.candidate.values["gradient_accumulation_steps"] == 1 for q in s.queue)
    assert len({q.candidate for q in s.queue}) == len(s.queue)
    meshes_seen = {tuple(q.candidate.mesh.values()) for q in s.queue}
    assert (1, 1, 8, 1, 1, 1) in meshes_seen and (1, 8, 1, 1, 1, 1) in meshes_seen and (1, 1, 4, 1, 1, 2) in meshes_seen
    pinned = _search(80.0, "ici_tensor_parallelism=2", "remat_policy=minimal")
    assert all(q.candidate.mesh["tensor"] == 2 and q.candidate.values["remat_policy"] == "minimal" for q in pinned.queue)


def test_a_candidate_that_does_not_fit_scanned_tries_its_layers_unrolled_first():
    s = _search(80.0, "per_device_batch_size=2")
    (item,) = _queued(s, ici_data_parallelism=8)
    assert item.candidate.values["scan_layers"] is True
    s.queue.clear()
    s._expand(item.candidate, item.cfg, False, [])
    (unrolled,) = s.queue
    assert unrolled.candidate.values["scan_layers"] is False and unrolled.cfg.scan_layers is False
    assert unrolled.candidate.values["gradient_accumulation_steps"] == 1 and "scan_layers=false" in unrolled.candidate.args(
        s.base
    )
    s.queue.clear()
    s._expand(unrolled.candidate, unrolled.cfg, False, [])  # unrolled already: next comes accumulation
    assert [(q.candidate.values["scan_layers"], q.candidate.values["gradient_accumulation_steps"]) for q in s.queue] == [
        (False, 2)
    ]
    s.queue.clear()
    s._expand(item.candidate, item.cfg, True, [])  # a scanned candidate that fits stays scanned
    assert [q.candidate.values["scan_layers"] for q in s.queue] == [True]
    for pinned in (
        _search(80.0, "per_device_batch_size=2", "scan_layers=true"),
        _search(80.0, "per_device_batch_size=2", "base_num_decoder_layers=17"),
    ):
        (item,) = _queued(pinned, ici_data_parallelism=8)
        pinned.queue.clear()
        pinned._expand(item.candidate, item.cfg, False, [])  # pinned, or too deep to unroll: accumulation
        assert [(q.candidate.values["scan_layers"], q.candidate.values["gradient_accumulation_steps"]) for q in pinned.queue] == [
            (True, 2)
        ]


def test_the_fit_test_is_xla_tpu_s_on_a_tpu_and_the_buffer_sum_elsewhere():
    """The 552M model's chip figures (GiB): resident 6.17 + temporaries 11.38 ran on the chip's
    15.75 (its own peak: 14.71); temporaries of 18.97 were refused by XLA:TPU."""
    tpu, gpu = PRESETS["tpu-v5e"], PRESETS["h100"]
    assert tpu.required_bytes(6.17, 11.38) == 11.38 and tpu.required_bytes(6.17, 18.97) == 18.97
    assert tpu.required_bytes(9.0, 2.0) == 9.0
    assert gpu.required_bytes(6.17, 11.38) == pytest.approx(17.55)
    s = Search(SearchRequest(None, ["model_name=llama2-tiny"], 8, with_memory(tpu, 1 / 1024)))  # 1 MiB
    s.totals = state_totals(None, s.req.overrides)
    s.enumerate()
    result = {"temp_bytes": 0.9 * 2**20, "host_bytes": 0, "state_bytes": 1, "param_bytes": 1, "collectives": [],
              "program": {"dot_flops": 1.0, "dot_bytes": 1.0, "other_bytes": 1.0}, "compile_seconds": 1.0}  # fmt: skip
    s._record(s._pop(), {"id": 0, "resident_bytes": 0.5 * 2**20, **result}, Counter())
    assert s.results[-1]["fits"] and s.results[-1]["peak_bytes"] == 0.9 * 2**20  # the sum, 1.4 MiB, is not the test
    s._record(s._pop(), {"id": 1, "resident_bytes": 1.1 * 2**20, **result}, Counter())
    assert not s.results[-1]["fits"]


def test_a_candidate_that_fits_tries_lighter_remat_and_one_that_does_not_tries_smaller_microbatches():
    s = _search(80.0, "per_device_batch_size=2", "scan_layers=false")  # unrolled already (the test above)
    (item,) = _queued(s, ici_data_parallelism=8)
    s.queue.clear()
    s._expand(item.candidate, item.cfg, True, [])
    assert [q.candidate.values["remat_policy"] for q in s.queue] == ["save_dot_except_mlp"]
    s.queue.clear()
    s._expand(item.candidate, item.cfg, False, [])
    assert [(q.candidate.values["gradient_accumulation_steps"], q.candidate.values["remat_policy"]) for q in s.queue] == [
        (2, "full")
    ]
    # 16 rows over 8 batch shards: 4 accumulation steps cannot split them; the optimizer state goes to the host
    big = s.queue.pop().candidate
    s._expand(big, s._config(big), False, [])
    (offloaded,) = s.queue
    assert (
        offloaded.candidate.values["optimizer_memory_host_offload"]
        and not offloaded.candidate.values["parameter_memory_host_offload"]
    )
    assert offloaded.candidate.values["gradient_accumulation_steps"] == 2
    assert any("gradient_accumulation_steps=4 does not divide" in reason for reason in s.pruned)
    s.queue.clear()
    s._expand(offloaded.candidate, offloaded.cfg, False, [])
    assert [q.candidate.values["parameter_memory_host_offload"] for q in s.queue] == [True]


def test_the_peak_estimate_sees_what_the_memory_knobs_save():
    cfg = tiny_config("deepseek3-671b", max_target_length=4096, dtype="bfloat16", per_device_batch_size=1)
    mesh = _mesh(fsdp=8, expert=32)
    plain = estimate_peak_bytes(cfg, mesh, 0)
    blocked = estimate_peak_bytes(cfg.model_copy(update={"attention_query_block": 512}), mesh, 0)
    both = estimate_peak_bytes(cfg.model_copy(update={"attention_query_block": 512, "moe_token_chunks": 8}), mesh, 0)
    # 3 copies of one sequence's [128, 4096, 4096] float32 scores, then of 512 queries' worth
    assert plain - blocked == pytest.approx(3 * 128 * (4096 - 512) * 4096 * 4)
    # the expert group's 32 x 4096 tokens, 8 slots each, 7168 wide, bf16 + 8 bytes: 7/8 of it saved
    assert blocked - both == pytest.approx(32 * 4096 * 8 * 7168 * 10 * 7 / 8)


def test_enumeration_also_queues_the_memory_knobs_where_the_estimate_does_not_fit():
    s = _search(0.1, "model_name=mixtral-tiny", "max_target_length=1024", "per_device_batch_size=2")  # estimates 111-135 MiB
    knobbed = [q for q in s.queue if q.candidate.values["moe_token_chunks"] == 8]
    assert knobbed and all(q.candidate.values["attention_query_block"] == 512 for q in knobbed)
    assert all(q.candidate.with_values(attention_query_block=0, moe_token_chunks=1) in s.seen for q in knobbed)
    assert not [
        q
        for q in _search(80.0, "model_name=mixtral-tiny", "max_target_length=1024").queue
        if q.candidate.values["moe_token_chunks"] > 1
    ]


def test_a_candidate_that_does_not_fit_tries_the_memory_knobs_first_unless_they_are_pinned():
    s = _search(80.0, "model_name=mixtral-tiny", "max_target_length=1024", "per_device_batch_size=2", "scan_layers=false")
    (item,) = _queued(s, ici_data_parallelism=8)
    s.queue.clear()
    s._expand(item.candidate, item.cfg, False, [])
    (knobs,) = s.queue
    assert (knobs.candidate.values["attention_query_block"], knobs.candidate.values["moe_token_chunks"]) == (512, 8)
    assert knobs.cfg.attention_query_block == 512 and knobs.candidate.values["gradient_accumulation_steps"] == 1
    s.queue.clear()
    s._expand(knobs.candidate, knobs.cfg, False, [])  # set once: next comes accumulation
    assert [q.candidate.values["gradient_accumulation_steps"] for q in s.queue] == [2]
    pinned = _search(
        80.0,
        "model_name=mixtral-tiny",
        "max_target_length=1024",
        "per_device_batch_size=2",
        "moe_token_chunks=1",
        "scan_layers=false",
    )
    (item,) = _queued(pinned, ici_data_parallelism=8)
    pinned.queue.clear()
    pinned._expand(item.candidate, item.cfg, False, [])
    assert [q.candidate.values["moe_token_chunks"] for q in pinned.queue] == [1]


def test_the_state_lower_bound_offloads_before_it_prunes_and_says_what_is_short():
    s = _search(80.0, "per_device_batch_size=2")
    assert all(not q.candidate.values["optimizer_memory_host_offload"] for q in s.queue)
    total = s.totals.on_device((False, False))
    assert total == 2 * s.totals.params + s.totals.optimizer + s.totals.other  # the gradients are a parameter tree
    tight = _search(total / 8 / 1024**3 * 0.99, "per_device_batch_size=2")  # fsdp 8 no longer fits on device
    assert tight.queue and all(q.candidate.values["optimizer_memory_host_offload"] for q in tight.queue)
    hopeless = _search(1e-9)
    assert not hopeless.queue and hopeless.pruned[STATE_REASON] > 0
    with pytest.raises(UserError, match=r"does not fit 8 x 0.0 GiB: its train state and gradients alone need at least"):
        raise UserError(hopeless._nothing_valid(1))


def test_candidates_expected_to_fit_are_compiled_first_and_the_estimate_is_calibrated():
    s = _search(80.0)
    first = s._pop()
    assert first.priority == min(q.priority for q in [first, *s.queue])
    s.memory = first.estimated_peak * 1.01  # only candidates at most this large are expected to fit
    expected = [q for q in s.queue if q.estimated_peak <= s.memory]
    assert s._pop() in expected or not expected
    s.results.append({"peak_bytes": 1e12, "estimated_peak_bytes": 1.0, "mesh": first.candidate.mesh})  # far above the estimate
    s.results.append({"peak_bytes": 3.0, "estimated_peak_bytes": 1.0, "mesh": {**first.candidate.mesh, "stage": 2}})
    assert s._calibration(first.candidate.mesh) == 1e12  # meshes of its kind (no pipeline, no context axis)
    assert s._calibration({**first.candidate.mesh, "stage": 4}) == 3.0  # pipelines
    assert s._calibration({**first.candidate.mesh, "context": 2}) == 1e12  # none of its kind yet: the median of all
    s.results.pop()
    nxt = s._pop()
    assert nxt.priority == min(q.priority for q in [nxt, *s.queue])  # now nothing is expected to fit: fastest first


def test_a_compiled_candidate_over_the_memory_is_recorded_as_not_fitting():
    s = _search(1 / 1024)  # 1 MiB
    item = s._pop()
    result = {
        "resident_bytes": 2 * 1024**2,
        "temp_bytes": 0,
        "host_bytes": 0,
        "state_bytes": 1,
        "param_bytes": 1,
        "collectives": [],
        "program": {"dot_flops": 1.0, "dot_bytes": 1.0, "other_bytes": 1.0},
        "compile_seconds": 1.0,
    }
    stats = Counter()
    s._record(item, {"id": 0, **result}, stats)
    (entry,) = s.results
    assert not entry["fits"] and entry["headroom_bytes"] == -(1024**2) and stats["compiled"] == 1
    s._record(s._pop(), {"id": 1, "error": "boom"}, stats)
    assert s.results[-1]["error"] == "boom" and stats["compile failed"] == 1


def test_the_table_header_names_the_cpu_peak_as_measured():
    from dataclasses import asdict

    from nnxtron.tools.search.format import _peak

    assert _peak(asdict(PRESETS["h200"])) == "989 TFLOP/s bf16"
    host = replace(FLAT, peak_flops=28.6e9, runs_compiled_program=True)
    assert _peak(asdict(host)) == "28.6 GFLOP/s measured per device"


def test_an_accelerator_search_compiles_its_candidates_as_a_memory_estimate(monkeypatch):
    """On an accelerator preset the worker compiles with XLA:CPU's memory-optimized scheduler
    (``worker.ACCELERATOR_ESTIMATE_OPTIONS``: the chip schedules for memory); on the cpu preset,
    whose compiled program is what runs, with the default one."""
    from nnxtron.tools.search import worker

    plain = candidate(_mesh(fsdp=8), PLAIN_SCHEDULE, "full", (False, False), (0, 1))
    tpu = Search(SearchRequest(None, ["model_name=llama2-tiny"], 8, with_memory(PRESETS["tpu-v5e"], 16)))
    runs_it = replace(PRESETS["tpu-v5e"], runs_compiled_program=True)  # as the cpu preset (measured: slow to make)
    cpu = Search(SearchRequest(None, ["model_name=llama2-tiny"], 8, with_memory(runs_it, 16)))
    assert tpu._job(3, plain)["accelerator"] and not cpu._job(3, plain)["accelerator"]
    seen = []
    real_compile = jax.stages.Lowered.compile
    monkeypatch.setattr(
        jax.stages.Lowered,
        "compile",
        lambda self, compiler_options=None: seen.append(compiler_options) or real_compile(self, compiler_options),
    )
    for job in (tpu._job(1, plain), cpu._job(2, plain)):
        assert "error" not in worker.run_job({**job, "overrides": [*job["overrides"], "attention=xla"]})
    assert seen == [worker.ACCELERATOR_ESTIMATE_OPTIONS, None]
