"""Values derived from the config and the device count, computed in one place."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from nnxtron.config.pipeline import pipeline_spec
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError

MESH_AXES = ("stage", "data", "fsdp", "context", "expert", "tensor")  # stage outermost (pipeline, across hosts)
BATCH_AXES = ("stage", "data", "fsdp", "expert")  # activation_batch splits over these (see logical_axis_rules)
PIPELINE_BATCH_AXES = ("data", "fsdp", "expert")  # a pipeline microbatch splits over these (not the stage axis)


@dataclass(frozen=True)
class Derived:
    num_devices: int
    mesh_shape: dict[str, int]  # axis name -> size, in MESH_AXES order
    head_dim: int
    num_kv_groups: int  # query heads per kv head
    global_batch_size: int
    microbatch_size: int  # rows per gradient-accumulation microbatch (= global batch without accumulation)
    schedule_steps: int
    warmup_steps: int
    tokens_per_step: int

    def as_dict(self) -> dict:
        return asdict(self)


def mesh_shape(cfg: Config, num_devices: int) -> dict[str, int]:
    """Resolve ici_*_parallelism (one -1 fills the remaining devices)."""
    requested = {
        "stage": cfg.pipeline_stages,
        "data": cfg.ici_data_parallelism,
        "fsdp": cfg.ici_fsdp_parallelism,
        "context": cfg.ici_context_parallelism,
        "expert": cfg.ici_expert_parallelism,
        "tensor": cfg.ici_tensor_parallelism,
    }
    keys = {axis: f"ici_{axis}_parallelism" for axis in MESH_AXES} | {"stage": "ici_pipeline_parallelism"}
    fill = [axis for axis, size in requested.items() if size == -1]
    if any(size == 0 for size in requested.values()):
        zero = next(axis for axis, size in requested.items() if size == 0)
        raise ConfigError(f"{keys[zero]}=0 is invalid; use a positive size or -1 to fill the remaining devices")
    if len(fill) > 1:
        raise ConfigError(f"only one of {', '.join(keys[a] for a in fill)} may be -1; set the others explicitly")
    fixed = math.prod(size for size in requested.values() if size != -1)
    if fill:
        if num_devices % fixed:
            raise ConfigError(
                f"the mesh ({_describe(requested)}) cannot fill {num_devices} devices: {num_devices} is not a "
                f"multiple of {fixed}; change the ici_*_parallelism sizes"
            )
        requested[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ConfigError(
            f"the mesh ({_describe(requested)}) has {fixed} devices but {num_devices} are available; "
            "make the product of ici_*_parallelism equal the device count, or set one of them to -1"
        )
    return requested


def _describe(shape: dict[str, int]) -> str:
    return " x ".join(f"{axis}={size}" for axis, size in shape.items())


def derive(cfg: Config, num_devices: int, processes: int = 1) -> Derived:
    """The sizes a config implies on ``num_devices`` devices (``processes``: the processes that read the data)."""
    shape = mesh_shape(cfg, num_devices)
    global_batch = cfg.per_device_batch_size * num_devices
    if global_batch != int(global_batch) or global_batch < 1:
        raise ConfigError(
            f"per_device_batch_size={cfg.per_device_batch_size} x {num_devices} devices is not a whole batch "
            f"({global_batch}); choose per_device_batch_size so the global batch is a positive integer"
        )
    global_batch = int(global_batch)
    batch_shards = math.prod(shape[axis] for axis in BATCH_AXES)
    if global_batch % batch_shards:
        raise ConfigError(
            f"global batch {global_batch} (per_device_batch_size x devices) does not divide over the "
            f"stage x data x fsdp x expert mesh axes ({batch_shards}); change per_device_batch_size or the ici_* sizes"
        )
    accumulation = cfg.gradient_accumulation_steps
    if global_batch % (accumulation * batch_shards):
        raise ConfigError(
            f"gradient_accumulation_steps={accumulation} does not divide the global batch {global_batch} into "
            f"microbatches that divide over the data x fsdp x expert mesh axes ({batch_shards}); choose a divisor of "
            f"{global_batch // batch_shards} or change per_device_batch_size"
        )
    pair_rows = 2 * accumulation * processes
    if cfg.use_dpo and global_batch % pair_rows:
        raise ConfigError(
            f"use_dpo=true keeps each pair's two rows in one microbatch of one process: the global batch {global_batch} "
            f"must be a multiple of 2 x gradient_accumulation_steps x processes = {pair_rows}; change per_device_batch_size"
        )
    spec = pipeline_spec(cfg)
    if spec is not None:
        rows = global_batch // accumulation
        shards = math.prod(shape[axis] for axis in PIPELINE_BATCH_AXES)
        if rows % (spec.microbatches * shards):
            raise ConfigError(
                f"num_pipeline_microbatches={spec.microbatches} does not split the {rows}-row batch"
                f"{' (per accumulation step)' if accumulation > 1 else ''} into microbatches that divide over the "
                f"data x fsdp x expert mesh axes ({shards}); change per_device_batch_size or num_pipeline_microbatches"
            )
    if cfg.max_target_length % shape["context"]:
        raise ConfigError(
            f"max_target_length={cfg.max_target_length} does not divide over ici_context_parallelism="
            f"{shape['context']}; choose a sequence length that is a multiple of it"
        )
    if shape["context"] > 1 and cfg.context_parallel_strategy == "ring" and cfg.context_parallel_load_balance:
        if cfg.max_target_length % (2 * shape["context"]):
            raise ConfigError(
                f"context_parallel_load_balance splits the sequence into 2 x ici_context_parallelism = "
                f"{2 * shape['context']} chunks; max_target_length={cfg.max_target_length} does not divide into them: "
                "choose a multiple, or context_parallel_load_balance=false"
            )
    schedule = cfg.steps if cfg.learning_rate_schedule_steps == -1 else cfg.learning_rate_schedule_steps
    return Derived(
        num_devices=num_devices,
        mesh_shape=shape,
        head_dim=cfg.resolved_head_dim,
        num_kv_groups=cfg.base_num_query_heads // cfg.base_num_kv_heads,
        global_batch_size=global_batch,
        microbatch_size=global_batch // accumulation,
        schedule_steps=schedule,
        warmup_steps=int(round(cfg.warmup_steps_fraction * schedule)),
        tokens_per_step=global_batch * cfg.max_target_length,
    )
