"""The cost model of `nnxtron plan --search`: a predicted step time from a compiled candidate.

``step_time`` = matmul time + memory traffic + fresh temporaries + exposed communication +
host offload traffic, per device:

- **matmul**: the model's FLOPs per step (``config.flops.training_flops_per_token``: 6 x
  active matmul parameters + causal attention) plus the forward work remat recomputes
  (``recompute_flops_per_token``: the matmul groups the policy does not save, and what the
  memory knobs ``attention_query_block`` / ``moe_token_chunks`` recompute), divided over
  the devices, at the preset's peak x ``efficiency`` x a roofline factor for the
  per-device matmul shape (``matmul_roofline``: a thin microbatch or a narrow tensor shard
  is bandwidth-bound, and runs below peak), over 1 - the pipeline bubble fraction (the
  idle stage-iterations of the schedule, ``config.pipeline``). On a device that runs the
  compiled program itself (the ``cpu`` preset) the compiled program's ``dot`` FLOPs
  replace that count (``hlo_cost``: recompute and bubble iterations included).
- **memory traffic**: on a device that runs the compiled program, the bytes its non-matmul
  instructions read and write per step (``hlo_cost.ProgramCost.other_bytes``:
  norms, activations, softmax, saved activations, the optimizer update ...), at the
  device's memory bandwidth. On an accelerator, only the optimizer update's traffic
  (``update_bytes``: state and gradients read, state written, after the backward pass):
  the rest of its non-matmul work is in ``efficiency``, calibrated on measured MFU, and
  the CPU compile's traffic is not an accelerator's (it materialises attention scores a
  flash kernel never writes, and fuses less).
- **fresh temporaries**: the compiled step's temporary bytes x the preset's
  ``fresh_temp_seconds_per_byte`` (XLA:CPU faults its temporaries in anew each step; 0 on
  accelerators).
- **communication**: every collective of the compiled step (``hlo.collectives``:
  kind, bytes, group, executions per step from the loop trip counts), each taking
  ``wire_bytes / bandwidth + latency`` (the preset's ``collective_latency_s``), over the intra-node links when its group stays in
  one node and the inter-node links when it does not.
- **overlap assumption**: collectives over the data, fsdp and stage axes only (weight
  all-gathers, gradient reductions, pipeline hand-offs) overlap with the matmuls, up to
  ``overlap`` x the matmul time (XLA's latency-hiding scheduler on GPU/TPU); those over
  tensor, context or expert are on the critical path (the next matmul reads their
  result) and are added whole. On fake CPU devices nothing overlaps (``overlap=0``).
- **offload**: offloaded parameters and optimizer state go to the device and back each
  step, offloaded activations likewise (the compiled step's host temporaries), over the
  host link, not overlapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from nnxtron.config import deepseek4
from nnxtron.config.derived import derive
from nnxtron.config.flops import _attention_params, _ffn_params, _keys_seen, training_flops_per_token
from nnxtron.config.layout import layer_kinds
from nnxtron.config.pipeline import pipeline_spec
from nnxtron.config.schema import Config
from nnxtron.tools.search.hlo import Collective
from nnxtron.tools.search.hlo_cost import ProgramCost
from nnxtron.tools.search.presets import DevicePreset

OVERLAPPABLE_AXES = frozenset({"data", "fsdp", "stage"})

# per remat policy: the forward matmul groups the backward pass recomputes (parallel/remat.py
# names what each policy saves; "scores" are q.k and p.v, recomputed unless the context is saved)
_ALL = ("qkv", "out", "scores", "mlpwi", "mlpwo")
RECOMPUTED = {
    "none": (),
    "full": _ALL,
    "minimal": ("scores",),
    "minimal_with_context": (),
    "minimal_offloaded": ("scores",),
    "save_dot_with_context_except_mlp": ("mlpwi", "mlpwo"),
    "save_dot_except_mlpwi": ("scores", "mlpwi"),
    "save_dot_except_mlp": ("scores", "mlpwi", "mlpwo"),
    "save_qkv_proj": ("out", "scores", "mlpwi", "mlpwo"),
    "save_out_proj": ("qkv", "scores", "mlpwi", "mlpwo"),
    "qkv_proj_offloaded": ("out", "scores", "mlpwi", "mlpwo"),
}


def _group_flops(cfg: Config) -> dict[str, float]:
    """Forward FLOPs per token of each matmul group, summed over the decoder layers."""
    d = cfg.base_emb_dim
    groups = dict.fromkeys(_ALL, 0.0)
    for kind in layer_kinds(cfg):
        attn_params, heads, width = _attention_params(cfg, kind)
        out_params = heads * (cfg.v_head_dim if cfg.attention_type == "mla" else width // 2) * d
        attention = deepseek4.attention_params(cfg, kind.attention) if cfg.attention_type == "compressed" else attn_params
        ffn = _ffn_params(cfg, kind.moe)
        groups["qkv"] += 2.0 * max(attention - out_params, 0)
        groups["out"] += 2.0 * min(out_params, attention)
        groups["scores"] += 2.0 * heads * width * _keys_seen(cfg, kind)
        wi_share = 2 / 3 if len(cfg.mlp_activations) > 1 else 1 / 2  # gated: wi_0, wi_1, wo
        groups["mlpwi"] += 2.0 * ffn * wi_share
        groups["mlpwo"] += 2.0 * ffn * (1 - wi_share)
    return groups


def recompute_flops_per_token(cfg: Config) -> float:
    """Forward FLOPs per token recomputed in the backward pass: the matmul groups the remat
    policy does not save, plus the attention scores under ``attention_query_block`` and the
    MoE layers' feed-forward under ``moe_token_chunks`` (each piece is checkpointed on its
    own, so it runs once more whatever the policy)."""
    if cfg.remat_policy == "custom":
        raise ValueError("remat_policy=custom is not searched; give a named policy")
    groups = _group_flops(cfg)
    flops = sum(groups[g] for g in RECOMPUTED[cfg.remat_policy])
    if cfg.attention_query_block:
        flops += groups["scores"]
    if cfg.moe_token_chunks > 1:
        flops += sum(2.0 * _ffn_params(cfg, True) for kind in layer_kinds(cfg) if kind.moe)
    return flops


def microbatch_tokens_per_device(cfg: Config, mesh: dict[str, int]) -> float:
    """Tokens one device's matmuls see at once: the rows of one (accumulation or pipeline)
    microbatch on that device, times the sequence length over the context axis."""
    derived = derive(cfg, _count(mesh))
    rows = derived.microbatch_size
    spec = pipeline_spec(cfg)
    if spec is not None:
        rows /= spec.microbatches
    batch_shards = mesh["data"] * mesh["fsdp"] * mesh["expert"] * (1 if spec is not None else mesh["stage"])
    return rows / batch_shards * cfg.max_target_length / mesh["context"]


def matmul_roofline(cfg: Config, mesh: dict[str, int], device: DevicePreset, weight_bytes: int = 2) -> float:
    """The fraction of peak a device's MLP matmul can reach: its arithmetic intensity (FLOPs
    per byte moved from memory) over the device's (peak FLOP/s / memory bandwidth), capped
    at 1. [m, d] x [d, f / tensor] with m tokens of one microbatch on the device."""
    m = microbatch_tokens_per_device(cfg, mesh)
    d = cfg.base_emb_dim
    f = max((cfg.base_moe_mlp_dim if cfg.num_experts > 1 else cfg.base_mlp_dim) / mesh["tensor"], 1)
    flops = 2.0 * m * d * f
    moved = weight_bytes * (m * d + d * f + m * f)
    ridge = device.peak_flops / device.memory_bytes_per_s
    return min(1.0, (flops / moved) / ridge)


@dataclass(frozen=True)
class StepCost:
    compute_s: float  # matmuls, with the pipeline bubble
    bubble_fraction: float
    memory_s: float  # non-matmul memory traffic (the optimizer update's before compiling)
    fresh_temp_s: float
    exposed_comm_s: float
    hidden_comm_s: float
    offload_s: float
    step_s: float
    mfu: float
    comm_by_axes: dict[str, float]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _count(mesh: dict[str, int]) -> int:
    n = 1
    for size in mesh.values():
        n *= size
    return n


def update_bytes(state_bytes: float, param_bytes: float) -> float:
    """Memory traffic of the optimizer update on one device: it reads the train state and
    the gradients (a parameter-sized tree) and writes the state back. Elementwise and
    bandwidth-bound; replicated state (``data``) is updated on every replica."""
    return 2.0 * state_bytes + param_bytes


def collective_seconds(c: Collective, device: DevicePreset) -> float:
    bandwidth = device.inter_node_bytes_per_s if c.spans_nodes else device.intra_node_bytes_per_s
    return c.count * (c.wire_bytes / bandwidth + device.collective_latency_s)


def step_cost(
    cfg: Config,
    mesh: dict[str, int],
    device: DevicePreset,
    collectives: list[Collective],
    offloaded_bytes: int = 0,
    efficiency: float | None = None,
    overlap: float | None = None,
    update_bytes: float = 0.0,
    program: ProgramCost | None = None,
    temp_bytes: int = 0,
) -> StepCost:
    """The predicted step of ``cfg`` on ``mesh`` (see the module docstring).
    ``offloaded_bytes``: per-device bytes that live in host memory (state and activations);
    ``update_bytes``: per-device bytes the optimizer update reads and writes, used when the
    compiled ``program``'s own work is not known; ``temp_bytes``: the compiled step's
    temporaries. ``efficiency`` and ``overlap`` default to the device's."""
    efficiency = device.efficiency if efficiency is None else efficiency
    overlap = device.overlap if overlap is None else overlap
    n = _count(mesh)
    tokens = derive(cfg, n).tokens_per_step
    model_flops = training_flops_per_token(cfg) * tokens / n
    rate = device.peak_flops * efficiency * matmul_roofline(cfg, mesh, device)
    spec = pipeline_spec(cfg)
    bubble = spec.bubble_fraction if spec is not None else 0.0
    if program is not None and device.runs_compiled_program:  # its dots (recompute, bubble) and its traffic
        compute = program.dot_flops / rate
        memory = program.other_bytes / device.memory_bytes_per_s
    else:
        compute = (model_flops + recompute_flops_per_token(cfg) * tokens / n) / rate / (1.0 - bubble)
        memory = update_bytes / device.memory_bytes_per_s
    fresh = temp_bytes * device.fresh_temp_seconds_per_byte
    hidden_candidates, exposed, by_axes = 0.0, 0.0, {}
    for c in collectives:
        seconds = collective_seconds(c, device)
        key = "+".join(c.axes) or "none"
        by_axes[key] = by_axes.get(key, 0.0) + seconds
        if set(c.axes) <= OVERLAPPABLE_AXES:
            hidden_candidates += seconds
        else:
            exposed += seconds
    hidden = min(hidden_candidates, overlap * compute)
    exposed += hidden_candidates - hidden
    offload = 2.0 * offloaded_bytes / device.host_bytes_per_s
    step = compute + memory + fresh + exposed + offload
    return StepCost(
        compute_s=compute,
        bubble_fraction=bubble,
        memory_s=memory,
        fresh_temp_s=fresh,
        exposed_comm_s=exposed,
        hidden_comm_s=hidden,
        offload_s=offload,
        step_s=step,
        mfu=model_flops / (step * device.peak_flops),
        comm_by_axes=by_axes,
    )


def _spans_nodes(mesh: dict[str, int], axis: str, devices_per_node: int) -> bool:
    """Whether a group along ``axis`` leaves a node: devices are numbered row-major over the
    mesh (the innermost axis fastest) and a node holds ``devices_per_node`` consecutive ones."""
    axes = list(mesh)
    stride = 1
    for inner in axes[axes.index(axis) + 1 :]:
        stride *= mesh[inner]
    return stride * mesh[axis] > devices_per_node


def analytic_collectives(cfg: Config, mesh: dict[str, int], param_count: int, device: DevicePreset) -> list[Collective]:
    """The collectives of a step estimated from the config alone, to order the candidates
    before any is compiled (the compiled program's own replace them): fsdp gathers the
    weights for the forward and the backward pass of every microbatch and reduce-scatters
    the gradients; data all-reduces the gradients; tensor all-reduces a layer's activations
    twice forward and twice backward (plus the recomputed forward); expert sends the routed
    tokens there and back; context gathers keys and values; stage hands activations on."""
    act, weight = jnp.dtype(cfg.dtype).itemsize, jnp.dtype(cfg.weight_dtype).itemsize
    spec = pipeline_spec(cfg)
    microbatches = cfg.gradient_accumulation_steps * (spec.microbatches if spec is not None else 1)
    tokens = microbatch_tokens_per_device(cfg, mesh)
    d, layers = cfg.base_emb_dim, cfg.base_num_decoder_layers
    moe_layers = sum(kind.moe for kind in layer_kinds(cfg))
    model_shards = mesh["tensor"] * mesh["stage"] * mesh["expert"]
    full_remat = "out" in RECOMPUTED.get(cfg.remat_policy, _ALL)
    out: list[Collective] = []

    def add(kind: str, nbytes: float, axis: str, count: int) -> None:
        if mesh[axis] > 1 and count > 0:
            spans = _spans_nodes(mesh, axis, device.devices_per_node)
            out.append(Collective(kind, int(nbytes), mesh[axis], count, (axis,), spans))

    add("all-gather", param_count * act / model_shards, "fsdp", 2 * microbatches)
    add("reduce-scatter", param_count * weight / model_shards, "fsdp", microbatches)
    add("all-reduce", param_count * weight / (model_shards * mesh["fsdp"]), "data", 1)
    add("all-reduce", tokens * d * act, "tensor", layers * (6 if full_remat else 4) * microbatches)
    add("all-to-all", tokens * d * cfg.num_experts_per_tok * act, "expert", moe_layers * 4 * microbatches)
    kv = 2 * cfg.base_num_kv_heads * cfg.resolved_head_dim * act
    add("all-gather", tokens * kv * mesh["context"], "context", layers * 3 * microbatches)
    if spec is not None:
        add("collective-permute", tokens * d * act, "stage", 2 * spec.iterations * cfg.gradient_accumulation_steps)
    return out


# per remat policy: activations a layer keeps for the backward pass, in units of
# (embed, q/k/v/out projections, MLP hidden) per token; "scores" keeps the attention probabilities
_SAVED = {
    "full": (1, 0, 0, False),
    "save_dot_except_mlp": (1, 1, 0, False),
    "save_dot_except_mlpwi": (2, 1, 0, False),
    "save_qkv_proj": (1, 1, 0, False),
    "save_out_proj": (2, 0, 0, False),
    "save_dot_with_context_except_mlp": (2, 1, 0, False),
    "minimal": (2, 1, 2, False),
    "minimal_with_context": (2, 1, 2, False),
    "qkv_proj_offloaded": (1, 0, 0, False),
    "minimal_offloaded": (1, 0, 0, False),
    "none": (2, 1, 3, True),
}


def estimate_peak_bytes(cfg: Config, mesh: dict[str, int], state_bytes: float) -> float:
    """A rough per-device peak, to try first the candidates likely to fit (the compile
    decides): the state and a gradient tree (``state_bytes``, already per device), the
    activations each layer keeps for its backward pass under the remat policy, one layer's
    working set (attention scores over the whole sequence, the MLP hidden) and the logits.
    The search scales it by what the compiles it has seen measured."""
    act = jnp.dtype(cfg.dtype).itemsize
    tokens = microbatch_tokens_per_device(cfg, mesh)
    rows = tokens / (cfg.max_target_length / mesh["context"])
    t = mesh["tensor"]
    heads = max(cfg.base_num_query_heads // t, 1)
    proj = (cfg.base_num_query_heads + 2 * cfg.base_num_kv_heads) * cfg.resolved_head_dim / t
    hidden = (cfg.base_moe_mlp_dim * cfg.num_experts_per_tok if cfg.num_experts > 1 else cfg.base_mlp_dim) / t
    embed_units, proj_units, hidden_units, keep_scores = _SAVED.get(cfg.remat_policy, _SAVED["full"])
    queries = (cfg.attention_query_block or cfg.max_target_length) / mesh["context"]  # at once, per sequence
    scores = rows * heads * queries * cfg.max_target_length * 4
    per_layer = tokens * act * (embed_units * cfg.base_emb_dim + proj_units * proj + hidden_units * hidden)
    layers = cfg.base_num_decoder_layers / mesh["stage"]
    saved = layers * (per_layer + (scores if keep_scores and not cfg.attention_query_block else 0))
    working = 3 * scores + 3 * tokens * hidden * 4 + _expert_rows_bytes(cfg, mesh, tokens, act)
    logits = 3 * tokens * cfg.vocab_size / t * 4
    return state_bytes + saved + working + logits


def _expert_rows_bytes(cfg: Config, mesh: dict[str, int], tokens: float, act: int) -> float:
    """The routed experts' grouped rows one device holds at once (``parallel/expert.py``):
    the tokens of its expert group, each with as many slots as can reach its local experts,
    over ``moe_token_chunks`` pieces; an activation-dtype and ~2 float32 copies of each."""
    if cfg.num_experts <= 1 or cfg.moe_compute != "grouped":
        return 0.0
    ep = mesh["expert"]
    slots = min(cfg.num_experts_per_tok, cfg.num_experts // ep)
    return tokens * ep * slots * cfg.base_emb_dim * (act + 8) / cfg.moe_token_chunks
