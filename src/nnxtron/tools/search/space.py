"""The configurations `nnxtron plan --search` considers, and the cheap rules that prune them.

A candidate is a set of ``key=value`` overrides over the user's config: the mesh
(``ici_{pipeline,data,fsdp,context,expert,tensor}_parallelism``), the pipeline microbatches,
``remat_policy``, ``gradient_accumulation_steps``, the host offload flags, the memory
knobs (``attention_query_block``, ``moe_token_chunks``: the same function, less memory, some
recompute; ``memory_saving``) and the layer layout (``scan_layers=false`` for a model of at
most ``UNROLL_MAX_LAYERS`` layers that does not fit scanned: unrolled, XLA keeps each saved
activation where it was made instead of in a stacked ``[layers, ...]`` buffer — on a v5e chip
the 552M model's temporaries with ``remat_policy=none`` fell from 19.0 to 5.2 GB). A key the user sets on the command line is pinned: the search
keeps it as given.

Cheap rules, applied before anything is compiled (each one a fact, not a preference):

- the axes multiply to the device count;
- ``tensor`` stays inside a node (``devices_per_node``) and divides the query heads and
  the MLP width; ``expert`` divides the experts (1 for a dense model); ``context``
  divides the sequence and leaves at least ``MIN_CONTEXT_SHARD`` tokens per shard;
- the global batch divides over the batch axes, per accumulation step and per pipeline
  microbatch (``config.derived.derive``'s checks); a pipeline schedule exists
  (``config.pipeline.pipeline_spec``);
- the train state alone (parameters + optimizer state, sharded as ``train.state.setup``
  shards them, minus what is offloaded) fits the device memory.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from nnxtron.config.derived import MESH_AXES, derive
from nnxtron.config.pipeline import main_stack, pipeline_spec
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError

AXIS_KEYS = {
    "stage": "ici_pipeline_parallelism",
    "data": "ici_data_parallelism",
    "fsdp": "ici_fsdp_parallelism",
    "context": "ici_context_parallelism",
    "expert": "ici_expert_parallelism",
    "tensor": "ici_tensor_parallelism",
}
REMAT_POLICIES = ("full", "save_dot_except_mlp", "minimal", "none")  # most to least recompute
ACCUMULATION_STEPS = (1, 2, 4, 8)
MICROBATCHES_PER_STAGE = (1, 2, 4)  # num_pipeline_microbatches = stages x this
OFFLOADS = ((False, False), (False, True), (True, True))  # (parameters, optimizer state) in host memory
OFFLOAD_KEYS = ("parameter_memory_host_offload", "optimizer_memory_host_offload")
MEMORY_KEYS = ("attention_query_block", "moe_token_chunks")
QUERY_BLOCK, TOKEN_CHUNKS = 512, 8  # the memory knobs' setting when a candidate does not fit
SEARCHED_KEYS = (
    *AXIS_KEYS.values(),
    "num_pipeline_microbatches",
    "num_layers_per_pipeline_stage",
    "remat_policy",
    "gradient_accumulation_steps",
    *OFFLOAD_KEYS,
    *MEMORY_KEYS,
    "scan_layers",
)
UNROLL_MAX_LAYERS = 16  # deeper stacks stay scanned: an unrolled compile grows with every layer
MIN_CONTEXT_SHARD = 2048  # tokens per context shard: below it the ring's exchanges outweigh the saving


@dataclass(frozen=True)
class Candidate:
    """One configuration: the overrides that select it, in ``SEARCHED_KEYS`` order."""

    overrides: tuple[tuple[str, Any], ...]
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def values(self) -> dict[str, Any]:
        return dict(self.overrides)

    @property
    def mesh(self) -> dict[str, int]:
        v = self.values
        return {axis: int(v[AXIS_KEYS[axis]]) for axis in MESH_AXES}

    def args(self, base: Config | None = None) -> list[str]:
        """The ``key=value`` words that select it (those ``base`` already has left out)."""
        return [
            f"{k}={str(v).lower() if isinstance(v, bool) else v}"
            for k, v in self.overrides
            if base is None or getattr(base, k) != v
        ]

    def with_values(self, **changes: Any) -> Candidate:
        return Candidate(tuple((k, changes.get(k, v)) for k, v in self.overrides))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def axis_problem(cfg: Config, axis: str, size: int, devices: int, devices_per_node: int) -> str | None:
    """Why ``size`` devices cannot form the ``axis`` axis of this model (a cheap rule), or None."""
    key = AXIS_KEYS[axis]
    if devices % size:
        return f"{key}={size} does not divide {devices} devices"
    if size == 1:
        return None
    if axis == "tensor":
        width = cfg.base_moe_mlp_dim if cfg.num_experts > 1 else cfg.base_mlp_dim
        if size > devices_per_node:
            return f"{key}={size} would leave a node of {devices_per_node} devices"
        if cfg.base_num_query_heads % size or width % size:
            return f"{key}={size} does not divide the {cfg.base_num_query_heads} query heads and the MLP width {width}"
    if axis == "expert" and (cfg.num_experts <= 1 or cfg.num_experts % size):
        return f"{key}={size} does not divide the model's {cfg.num_experts} experts"
    if axis == "context":
        seq = cfg.max_target_length
        if seq % size or seq // size < MIN_CONTEXT_SHARD:
            return f"{key}={size} leaves fewer than {MIN_CONTEXT_SHARD} of the {seq} tokens per shard"
    if axis == "stage" and size > max(cfg.base_num_decoder_layers // 2, 1):
        return f"{key}={size} leaves fewer than 2 of the {cfg.base_num_decoder_layers} layers per stage"
    return None


def meshes(cfg: Config, devices: int, devices_per_node: int, pinned: dict[str, int]) -> Iterator[dict[str, int]]:
    """Every factorisation of ``devices`` over ``MESH_AXES`` the cheap rules allow (a pinned
    axis keeps its size, if the rules allow it)."""
    choices = [
        [
            s
            for s in ([pinned[axis]] if axis in pinned else _divisors(devices))
            if not axis_problem(cfg, axis, s, devices, devices_per_node)
        ]
        for axis in MESH_AXES
    ]
    for sizes in itertools.product(*choices):
        product = 1
        for s in sizes:
            product *= s
        if product == devices:
            yield dict(zip(MESH_AXES, sizes))


def schedule_variants(cfg: Config, mesh: dict[str, int], pinned: dict[str, Any]) -> list[dict[str, Any]]:
    """Accumulation steps and the pipeline schedule of ``mesh``'s base candidates: with
    stages, ``MICROBATCHES_PER_STAGE`` microbatch counts, each circular (one layer per stage
    and repeat) and GPipe (one contiguous slice of the stack per stage)."""
    accumulation = pinned.get("gradient_accumulation_steps", 1)  # more steps: tried when a candidate does not fit
    scan = pinned.get("scan_layers", cfg.scan_layers)  # unrolled: tried when a candidate does not fit
    stages = mesh["stage"]
    if stages == 1:
        return [
            {
                "scan_layers": scan,
                "gradient_accumulation_steps": accumulation,
                "num_pipeline_microbatches": cfg.num_pipeline_microbatches,
                "num_layers_per_pipeline_stage": cfg.num_layers_per_pipeline_stage,
            }
        ]
    if "num_pipeline_microbatches" in pinned:
        microbatches = [pinned["num_pipeline_microbatches"]]
    else:
        microbatches = [stages * k for k in MICROBATCHES_PER_STAGE]
    if "num_layers_per_pipeline_stage" in pinned:
        per_stage = [pinned["num_layers_per_pipeline_stage"]]
    else:
        try:
            main = main_stack(cfg)
            blocks, per_block = main.num_layers, main.layers_per_block
        except ConfigError:  # no stack to pipeline: check() says so
            blocks, per_block = stages, 1
        per_stage = list(dict.fromkeys([per_block, max(blocks // stages, 1) * per_block]))  # circular, GPipe
    return [
        {
            "scan_layers": scan,
            "gradient_accumulation_steps": accumulation,
            "num_pipeline_microbatches": m,
            "num_layers_per_pipeline_stage": lps,
        }
        for m in microbatches
        for lps in per_stage
    ]


def check(cfg: Config, devices: int) -> str | None:
    """Why ``cfg`` cannot run on ``devices`` (``derive``'s and the pipeline's checks), or None."""
    try:
        derive(cfg, devices)
        pipeline_spec(cfg)
    except ConfigError as err:
        return str(err)
    return None


def candidate(
    mesh: dict[str, int], schedule: dict[str, Any], remat: str, offload: tuple[bool, bool], memory: tuple[int, int]
) -> Candidate:
    values = {AXIS_KEYS[axis]: size for axis, size in mesh.items()}
    values.update(schedule, remat_policy=remat, **dict(zip(OFFLOAD_KEYS, offload)), **dict(zip(MEMORY_KEYS, memory)))
    return Candidate(tuple((k, values[k]) for k in SEARCHED_KEYS))


def memory_saving(cfg: Config, mesh: dict[str, int], tokens_per_device: float) -> dict[str, int]:
    """The memory knobs that apply to ``cfg`` on ``mesh``, set to save memory: attention in
    blocks of ``QUERY_BLOCK`` queries (global or MLA attention, not cuDNN or splash, which are
    blockwise already, not ring attention, a sequence it divides) and the routed experts in ``TOKEN_CHUNKS`` pieces (grouped MoE,
    when the tokens a device routes divide). Empty when neither applies."""
    out = {}
    seq, context = cfg.max_target_length, mesh["context"]
    ring = context > 1 and cfg.context_parallel_strategy == "ring"
    if cfg.attention_type in ("global", "mla") and cfg.attention not in ("cudnn", "splash") and not ring:
        if seq > QUERY_BLOCK and seq % QUERY_BLOCK == 0 and QUERY_BLOCK % context == 0:
            out["attention_query_block"] = QUERY_BLOCK
    routed = tokens_per_device * mesh["expert"]
    if cfg.num_experts > 1 and cfg.moe_compute == "grouped" and routed % TOKEN_CHUNKS == 0:
        out["moe_token_chunks"] = TOKEN_CHUNKS
    return out


def pinned_values(cfg: Config, given: list[str]) -> dict[str, Any]:
    """The searched keys the user set on the command line, with their resolved values."""
    keys = {arg.partition("=")[0].strip() for arg in given}
    out: dict[str, Any] = {}
    for axis, key in AXIS_KEYS.items():
        if key in keys and getattr(cfg, key) != -1:
            out[axis] = getattr(cfg, key)
    for key in SEARCHED_KEYS[len(AXIS_KEYS) :]:
        if key in keys:
            out[key] = getattr(cfg, key)
    return out
