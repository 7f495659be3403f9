"""MaxText 0.2.5's configuration keys, each classified once: the one table nnxtron reads a MaxText
config with (``config/maxtext.py``) and ``docs/maxtext.md`` is generated from
(``scripts/maxtext_keys_table.py``; a test keeps them equal).

Every key of MaxText 0.2.5's ``base.yml`` (``tests/assets/maxtext/base.yml``) is one of:

* **honoured** — the same name and meaning in nnxtron: the value is passed on;
* **translated** — the value maps onto nnxtron key(s) (another name, or MaxText's sentinel
  such as ``-1`` / ``None`` / ``""`` for "off"), or is refused where it has no counterpart;
* **ignored** — MaxText infrastructure nnxtron does not have, or a kernel / sharding choice that
  computes the same function: accepted with any value and reported, never silently;
* **refused** — accepted only at values whose computation nnxtron matches (MaxText's default,
  the values in ``accept``, or any value while the ``gate`` key leaves it unread); any other
  value is one error line naming the key, why, and what to use.

``default`` is MaxText 0.2.5's ``base.yml`` value (a test compares them). Pure Python: no JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nnxtron.config import options
from nnxtron.config.families import rules_for
from nnxtron.config.schema import MAX_STEPS
from nnxtron.errors import ConfigError

MAXTEXT_VERSION = "0.2.5"
HONOURED, TRANSLATED, IGNORED, REFUSED = "honoured", "translated", "ignored", "refused"
KINDS = (HONOURED, TRANSLATED, IGNORED, REFUSED)
NOT_IN_BASE = object()  # default of a key MaxText 0.2.5's base.yml does not hold (enable_nnx ...)

Translate = Callable[[Any, Mapping[str, Any]], dict[str, Any]]  # (value, MaxText-level values) -> nnxtron values
Check = Callable[[Any, Mapping[str, Any]], bool]  # (value, MaxText-level values) -> accepted?


@dataclass(frozen=True)
class Key:
    kind: str
    default: Any
    note: str = ""  # translated: what it becomes; ignored / refused: why
    use: str = ""  # refused: what to use instead
    gate: tuple[str, tuple[Any, ...]] | None = None  # refused: any value is accepted while ctx[gate[0]] is in gate[1]
    accept: tuple[Any, ...] = ()  # refused: values accepted besides the default
    check: Check | None = None  # refused: replaces default / accept / gate
    to: Translate | None = None  # honoured: {name: value}; ignored, refused: {} unless given


KEYS: dict[str, Key] = {}


def is_none(value: Any) -> bool:
    """MaxText writes "no value" as null or the string None."""
    return value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null"))


def norm(value: Any) -> Any:
    """A value in a form where MaxText's spellings of the same value compare equal."""
    if is_none(value):
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [norm(v) for v in value]
    if isinstance(value, dict):
        return {k: norm(v) for k, v in value.items()}
    return value


def same(a: Any, b: Any) -> bool:
    return norm(a) == norm(b)


def number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"MaxText key {key}={value!r} is not a number; give a number")
    return float(value)


def refusal(key: str, value: Any, why: str, use: str) -> ConfigError:
    return ConfigError(f"MaxText key {key}={value!r} is refused: {why}; {use}")


def accepted(key: str, value: Any, ctx: Mapping[str, Any]) -> bool:
    """Whether a refused key's value is one nnxtron computes."""
    rule = KEYS[key]
    if rule.check is not None:
        return rule.check(value, ctx)
    if rule.default is not NOT_IN_BASE and same(value, rule.default):
        return True
    if any(same(value, a) for a in rule.accept):
        return True
    return rule.gate is not None and any(same(ctx.get(rule.gate[0]), v) for v in rule.gate[1])


def _add(key: str, rule: Key) -> None:
    if key in KEYS:
        raise ValueError(f"MaxText key {key} is classified twice")
    KEYS[key] = rule


def _honoured(**defaults: Any) -> None:
    for key, default in defaults.items():
        _add(key, Key(HONOURED, default, to=lambda value, ctx, key=key: {key: value}))


def _ignored(why: str, **defaults: Any) -> None:
    for key, default in defaults.items():
        _add(key, Key(IGNORED, default, why))


def _refused(why: str, use: str, gate: tuple[str, tuple[Any, ...]] | None = None, **defaults: Any) -> None:
    for key, default in defaults.items():
        _add(key, Key(REFUSED, default, why, use, gate=gate))


def _translated(key: str, default: Any, note: str, to: Translate) -> None:
    _add(key, Key(TRANSLATED, default, note, to=to))


# fmt: off
CHECKPOINT_IO = "MaxText's checkpoint storage and recovery machinery (Orbax, GCS, multi-tier, emergency); nnxtron writes its own verified checkpoints"
MONITORING = 'metrics upload, logging and monitoring services (GCS, Vertex, goodput, GCP, MLPerf); nnxtron logs to its run directory, TensorBoard and W&B'
PROFILING = 'profilers and compiler dumps nnxtron does not have in training (`nnxtron bench` times a step, `nnxtron bench --profile DIR` traces it beside its HLO)'
RUNTIME = 'process, compilation and cluster set-up of MaxText (hardware choice, AOT compiles, jax.distributed, Pathways, elastic slices); nnxtron uses the devices JAX finds and its own compilation_cache_dir'
MESH = "MaxText's mesh axes, logical sharding rules and collective scheduling: where values live, not what is computed; nnxtron lays out its mesh from its own ici_* keys and logical_axis_rules"
KERNELS = "a kernel, tiling or fusion choice that computes the same function (nnxtron's routed experts are a grouped matmul over the routed tokens with sparse_matmul=true — jax.lax.ragged_dot on TPU, padded row blocks at the routed FLOP count on CPU and GPU (grouped_matmul) — einsums over every expert with sparse_matmul=false (moe_compute), its attention the `attention` key's implementation)"
REMAT = 'remat choice for an activation nnxtron does not name (read only by remat_policy=custom); remat never changes the function'
INFERENCE = "read only by MaxText's serving, decoding benchmarks and RL rollout programs (MaxEngine, JetStream, vLLM); nnxtron's `generate` reads prompt, max_new_tokens and decode_sampling_*"
DATA_IO = "data-loader performance and order of MaxText's Grain pipeline (workers, buffers, threads, shuffle buffer); nnxtron's loader has data_read_threads, data_prefetch_batches and data_shuffle_seed"
DISTILL = "read only by MaxText's distillation trainer, not by pre-training"


_honoured(
    run_name='', model_name='default', normalization_layer_epsilon=1e-05, enable_checkpointing=True,
    checkpoint_period=10000, enable_wandb=False, wandb_run_name='', dtype='bfloat16', quantization='',
    use_qwix_quantization=False, weight_quantization_calibration_method='absmax', act_quantization_calibration_method='absmax',
    bwd_quantization_calibration_method='absmax', weight_dtype='float32',
    base_num_kv_heads=16, base_mlp_dim=7168,
    mlp_activations=['silu', 'linear'], logits_via_embedding=False, normalize_embedding_logits=True, mtp_num_layers=0, mtp_loss_scaling_factor=0.1,
    mtp_eval_target_module=0, num_experts=1, num_experts_per_tok=1, load_balance_loss_weight=0.0,
    first_num_dense_layers=0, shared_experts=0, routed_scaling_factor=1.0, routed_bias=False, routed_bias_update_rate=0.0,
    n_routing_groups=-1, first_num_hash_layers=0, topk_routing_group=-1, num_layers_per_pipeline_stage=1,
    num_pipeline_repeats=-1, pipeline_parallel_layers=-1, num_pipeline_microbatches=-1,
    pipeline_delay_activation_forwarding=False, pipeline_fsdp_ag_once=False, scan_pipeline_iterations=True,
    set_remat_policy_on_pipeline_iterations=True, set_remat_policy_on_layers_per_stage=False, remat_policy='full',
    decoder_layer_input='device', context='remat', mlpwi='remat', mlpwi_0='remat', mlpwi_1='remat', mlpwo='remat',
    query_proj='remat', key_proj='remat', value_proj='remat', qkv_proj='remat', out_proj='remat',
    optimizer_memory_host_offload=False, parameter_memory_host_offload=False, scan_layers=True, attention_type='global',
    sliding_window_size=0, chunk_attn_window_size=0, final_logits_soft_cap=0.0, attn_logits_soft_cap=0.0, indexer_head_dim=128, indexer_n_heads=64,
    indexer_topk=2048, q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    compress_ratios=[], compressed_rope_max_timescale=160000, sharding_tolerance=0.02,
    dcn_pipeline_parallelism=1, ici_data_parallelism=1, ici_fsdp_parallelism=-1, ici_context_parallelism=1,
    ici_tensor_parallelism=1, ici_pipeline_parallelism=1, ici_expert_parallelism=1, vocab_size=32000, tokenizer_path='',
    add_bos=True, add_eos=True, per_device_batch_size=12.0, grain_train_files='', steps=150001, log_period=100,
    learning_rate=3e-05, lr_schedule_type='cosine', wsd_decay_steps_fraction=0.1, wsd_decay_style='linear',
    warmup_steps_fraction=0.1, learning_rate_schedule_steps=-1, max_target_length=2048, prompt='I love to',
    data_shuffle_seed=0, init_weights_seed=0, gradient_clipping_threshold=1.0, gradient_accumulation_steps=1, opt_type='adamw',
    adam_b1=0.9, adam_b2=0.95, adam_eps=1e-08, adam_weight_decay=0.1, muon_beta=0.95, muon_weight_decay=0,
    max_position_embeddings=163840, beta_fast=32, beta_slow=1, mscale=1.0,
    decode_sampling_strategy='greedy', decode_sampling_temperature=1.0, eval_interval=-1, enable_tensorboard=True,
    use_qk_norm=False, interleave_moe_layer_step=1, temperature_tuning=False, mhc_expansion_rate=1, sinkhorn_iterations=20,
    attention_bias=False, attention_sink=False, mlp_bias=False, rope_truncate=True,
)
_ignored(
    CHECKPOINT_IO,
    save_checkpoint_on_start=True, save_checkpoint_on_completion=True, async_checkpointing=True,
    enable_continuous_checkpointing=False, enable_single_replica_ckpt_restoring=False, checkpoint_todelete_subdir='None',
    checkpoint_todelete_full_path='None', standalone_checkpointer_per_step_interval=0.0,
    standalone_checkpointer_drop_page_cache_before_restore=False, standalone_checkpointer_enable_restore_in_loop=True,
    standalone_checkpointer_start_from_checkpoint=False, force_unroll=False,
    checkpoint_storage_target_data_file_size_bytes=2147483648, checkpoint_storage_use_ocdbt=True,
    checkpoint_storage_use_zarr3=True, checkpoint_storage_concurrent_gb=96, checkpoint_storage_device_host_concurrent_gb=8,
    enable_orbax_v1=False, colocated_python_checkpointing=False, enable_autocheckpoint=False, param_scan_axis=1,
    enable_multi_tier_checkpointing=False, multi_tier_checkpointing_backup_interval_minutes=None,
    multi_tier_checkpointing_backup_interval_steps=None, mtc_data_parallelism=0, enable_emergency_checkpoint=False,
    local_checkpoint_directory='', local_checkpoint_period=0, enable_checkpoint_cloud_logger=False,
)
_ignored(
    MONITORING,
    metrics_file='', gcs_metrics=False, save_config_to_gcs=False, moe_log_max_load_ratio=False,
    log_required_ragged_buffer_factor=False, log_step_diagnostics=False, record_internal_nn_metrics=0, enable_mllog=False,
    mllog_file='', write_estimator_result=False, enable_goodput_recording=False, goodput_job_name='', monitor_goodput=False,
    goodput_upload_interval_seconds=30, enable_pathways_goodput=False, monitor_step_time_deviation=True,
    step_deviation_interval_seconds=30, enable_gcp_goodput_metrics=True, enable_gcp_step_deviation_metrics=True,
    report_heartbeat_metric_for_gcp_monitoring=False, heartbeat_reporting_interval_in_seconds=5,
    report_performance_metric_for_gcp_monitoring=False, use_vertex_tensorboard=False, vertex_tensorboard_project='',
    vertex_tensorboard_region='', max_checkify=False, log_config=True, debug_sharding=False,
)
_ignored(
    PROFILING,
    profiler='', upload_all_profiler_results=False, skip_first_n_steps_for_profiler=1, profiler_steps=5,
    hide_profiler_step_metric=False, profile_cleanly=True, profile_periodically_period=-1, enable_tpu_profiling_options=False,
    tpu_num_chips_to_profile_per_task=1, tpu_num_sparse_core_tiles_to_trace=1, tpu_num_sparse_cores_to_trace=2,
    managed_mldiagnostics=False, managed_mldiagnostics_on_demand_profiling=True, managed_mldiagnostics_run_group='',
    managed_mldiagnostics_region='', managed_mldiagnostics_storage_path='', dump_hlo=False, dump_step=-1,
    dump_hlo_local_dir='/tmp/xla_dump/', dump_hlo_delete_local_after=True, dump_hlo_gcs_dir='',
    dump_hlo_local_module_name='jit_train_step', dump_hlo_module_name='jit_train_step', dump_hlo_xla_flags='',
    dump_hlo_upload_all=False, dump_jaxpr=False, dump_jaxpr_local_dir='/tmp/jaxpr_dump/', dump_jaxpr_delete_local_after=True,
    dump_jaxpr_gcs_dir='', enable_jax_profiler=False, jax_profiler_port=9999, xprof_tpu_power_trace_level=0,
    xprof_e2e_enable_fw_throttle_event=False, xprof_e2e_enable_fw_power_level_event=False,
    xprof_e2e_enable_fw_thermal_event=False, profile_power_events=False,
)
_ignored(
    RUNTIME,
    warmup_programs_in_init=False, jax_cache_dir='~/jax_cache', hardware='tpu', internal_compile=False,
    internal_compile_num_devices=-1, expansion_factor_real_data=-1.0, hf_access_token='', colocated_python_data_input=False,
    max_inflight_computations=2, jax_distributed_initialization_timeout=300, jax_debug_log_modules='',
    skip_jax_distributed_system=False, block_state_before_run_start=False, warm_input_reshard_before_run_start=False,
    dcn_bandwidth_limit='', dcn_bandwidth_burst='10mb', dcn_bandwidth_latency='50ms', dcn_bandwidth_interface='eth0',
    compiled_trainstep_file='', compile_topology='', compile_topology_num_slices=-1, enable_single_controller=False,
    subslice_shape='', elastic_enabled=False, elastic_backup_kind='snapshot', elastic_timeout_seconds=300,
    elastic_max_retries=10, elastic_min_slice_count=-1,
)
_ignored(
    MESH,
    override_logical_axis_rules=False, replicate_quant_scale=False, te_comm_gemm_overlap='disabled', num_moe_token_chunks=1,
    moe_chunk_barrier=False, use_ring_of_experts=False, moe_topk_before_ep_all_gather=False, num_moe_emb_chunks=0,
    moe_dispatch_no_expert_sharding=False, moe_pin_sparse_core_all_gathers=False, moe_pin_sparse_core_ep_all_gathers=False,
    moe_pin_sparse_core_fsdp_all_gathers=False, moe_pin_sparse_core_fsdp_all_gathers_fwd_only=False,
    moe_fsdp_all_gather_sparse_core_id=0, moe_ep_all_gather_sparse_core_id=1, moe_fsdp_use_two_stage_all_gather=False,
    shard_exp_on_fsdp=False, shard_embed_moe_on_fsdp=False, use_2d_fsdp_sharding=False, defer_small_all_reduces=False,
    use_batch_split_schedule=False, batch_split_factor=1, pipeline_fsdp_ag_per_repeat=False, shard_mode='auto',
    custom_mesh_and_rule='',
    mesh_axes=['diloco', 'data', 'stage', 'fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'context_autoregressive', 'tensor', 'tensor_sequence', 'expert', 'autoregressive'],
    logical_axis_rules=[['circular_repeats', []], ['activation_embed_and_logits_batch', ['data', 'stage', 'fsdp', 'fsdp_transpose', 'expert']], ['activation_embed_and_logits_batch_sequence', ['data', 'stage', 'fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'expert']], ['activation_vocab', ['tensor', 'tensor_sequence']], ['activation_vocab', ['tensor']], ['activation_vocab', 'tensor_sequence'], ['vocab', ['tensor', 'tensor_sequence', 'autoregressive']], ['embed_vocab', ['fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'expert']], ['activation_batch_attn', ['data', 'fsdp', 'fsdp_transpose', 'expert']], ['activation_input_length_attn', ['tensor_sequence', 'context']], ['activation_heads', ['tensor', 'tensor_sequence', 'autoregressive']], ['activation_kv_heads', ['tensor', 'tensor_sequence']], ['activation_length_attn', ['context', 'context_usp_ulysses']], ['activation_q_length', ['context', 'context_usp_ulysses']], ['activation_kv_length', []], ['activation_embed_attn', ['tensor']], ['activation_kv', ['tensor', 'tensor_sequence']], ['activation_kv_batch', ['data', 'fsdp', 'fsdp_transpose', 'expert']], ['activation_kv_head_dim', ['tensor', 'tensor_sequence']], ['heads', ['tensor', 'tensor_sequence', 'autoregressive']], ['q_heads', ['tensor', 'tensor_sequence', 'autoregressive']], ['kv_heads', ['tensor', 'tensor_sequence', 'autoregressive']], ['qkv', []], ['kv', []], ['kv_head_dim', []], ['q_lora', ['fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'expert']], ['q_lora', ['fsdp', 'context', 'context_usp_ulysses', 'expert']], ['q_lora_up_proj', []], ['kv_lora', ['fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'expert']], ['kv_lora', ['fsdp', 'context', 'context_usp_ulysses', 'expert']], ['kv_lora_up_proj', []], ['embed_attn', ['fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'expert']], ['activation_batch_moe', ['data', 'fsdp', 'fsdp_transpose', 'expert']], ['activation_length_moe', ['context', 'context_usp_ulysses']], ['activation_norm_length_moe', ['tensor_sequence', 'context', 'context_usp_ulysses']], ['activation_embed_moe', ['tensor']], ['activation_mlp_moe', ['tensor', 'tensor_sequence']], ['activation_exp', ['expert']], ['exp', 'expert'], ['mlp_moe', ['fsdp_transpose', 'tensor', 'tensor_sequence', 'autoregressive']], ['embed_moe', ['fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses']], ['embed_moe', ['fsdp', 'context', 'context_usp_ulysses']], ['embed_router', ['fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses']], ['embed_router', ['fsdp', 'context', 'context_usp_ulysses']], ['segment_ids_batch', ['data', 'fsdp', 'fsdp_transpose', 'expert']], ['activation_mlp', ['tensor', 'tensor_sequence']], ['activation_batch', ['data', 'fsdp', 'fsdp_transpose', 'expert']], ['activation_length', ['context', 'context_usp_ulysses']], ['activation_norm_length', ['tensor_sequence', 'context', 'context_usp_ulysses']], ['activation_embed', ['tensor']], ['activation_stage', 'stage'], ['mlp', ['fsdp_transpose', 'tensor', 'tensor_sequence', 'autoregressive']], ['gdn_head', ['fsdp_transpose', 'tensor', 'tensor_sequence', 'autoregressive']], ['embed', ['fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'expert']], ['embed', ['fsdp', 'context', 'context_usp_ulysses', 'expert']], ['norm', ['tensor']], ['layers', 'stage'], ['diloco', 'diloco'], ['engram_dim', ['tensor']], ['dense_layers', []], ['moe_layers', []], ['local_layers', []], ['mhc', []], ['prefill_activation_length', ['context', 'context_usp_ulysses']], ['prefill_activation_norm_length', ['tensor_sequence', 'context', 'context_usp_ulysses']], ['activation_prefill_kv_batch', ['data', 'fsdp', 'fsdp_transpose', 'expert']], ['decode_batch', ['data', 'fsdp', 'fsdp_transpose', 'expert']], ['decode_length', []], ['cache_heads', ['autoregressive', 'tensor', 'tensor_sequence']], ['paged_kv_heads', ['tensor']], ['cache_batch_prefill', []], ['cache_batch', []], ['cache_heads_none', []], ['cache_kv', []], ['cache_sequence', []], ['num_pages', []], ['tokens_per_page', []], ['paged_kv_head_dim_size', []], ['mlp_no_fsdp', ['tensor', 'tensor_sequence', 'autoregressive']], ['exp_with_fsdp', 'fsdp']],
    data_sharding=[['data', 'stage', 'fsdp', 'fsdp_transpose', 'context', 'context_usp_ulysses', 'context_autoregressive', 'tensor', 'tensor_sequence', 'expert', 'autoregressive']],
    input_data_sharding_logical_axes=['activation_embed_and_logits_batch', 'activation_norm_length'],
    context_sharding='context', ulysses_context_sharding='context_usp_ulysses', custom_mesh_and_rule_for_eval='',
    logical_axis_rules_for_eval=[], dcn_diloco_parallelism=1, dcn_data_parallelism=-1, dcn_fsdp_parallelism=1,
    dcn_fsdp_transpose_parallelism=1, dcn_sequence_parallelism=1, dcn_context_parallelism=1,
    dcn_context_usp_ulysses_parallelism=1, dcn_context_autoregressive_parallelism=1, dcn_tensor_parallelism=1,
    dcn_tensor_sequence_parallelism=1, dcn_expert_parallelism=1, dcn_autoregressive_parallelism=1, ici_diloco_parallelism=1,
    ici_fsdp_transpose_parallelism=1, ici_sequence_parallelism=1, ici_context_usp_ulysses_parallelism=1,
    ici_context_autoregressive_parallelism=1, ici_tensor_sequence_parallelism=1, ici_autoregressive_parallelism=1,
    check_vma=False, shard_optimizer_over_data=False, dense_fsdp_use_two_stage_all_gather=False, num_slices=-1,
    vocab_tiling_ag_once=False, muon_use_all_to_all=False, custom_mesh='', allow_split_physical_axes=False,
    optimize_mesh_for_tpu_v6e=False, shardy=True, remove_size_one_mesh_axis_from_type=True,
    context_parallel_reorder_strategy='auto',
)
_ignored(
    KERNELS,
    mla_qk_head_chunk_size=0, csa_qk_head_chunk_size=0, megablox=True, use_custom_sort_vjp=True,
    router_topk_matmul_vjp=False, te_ep_overflow_check_every_n_steps=20,
    moe_use_direct_token_gather=False, use_gather_mosaic_kernel=False, ragged_gather_fallback=False,
    ragged_gather_reduce_fallback=False, ragged_gather_cost_estimate_flops=-1, ragged_gather_reduce_cost_estimate_flops=-1,
    ragged_gather_cost_estimate_bytes_accessed=-1, ragged_gather_reduce_cost_estimate_bytes_accessed=-1,
    wi_tile_fwd_batch_seq=512, wi_tile_fwd_embed_dim=1024, wi_tile_fwd_mlp_dim=1024, eval_wi_tile_fwd_batch_seq=512,
    eval_wi_tile_fwd_embed_dim=1024, eval_wi_tile_fwd_mlp_dim=1024, wi_tile_dlhs_batch_seq=512, wi_tile_dlhs_embed_dim=1024,
    wi_tile_dlhs_mlp_dim=1024, wi_tile_drhs_batch_seq=512, wi_tile_drhs_embed_dim=1024, wi_tile_drhs_mlp_dim=1024,
    wo_tile_fwd_batch_seq=512, wo_tile_fwd_embed_dim=1024, wo_tile_fwd_mlp_dim=1024, eval_wo_tile_fwd_batch_seq=512,
    eval_wo_tile_fwd_embed_dim=1024, eval_wo_tile_fwd_mlp_dim=1024, wo_tile_dlhs_batch_seq=512, wo_tile_dlhs_embed_dim=1024,
    wo_tile_dlhs_mlp_dim=1024, wo_tile_drhs_batch_seq=512, wo_tile_drhs_embed_dim=1024, wo_tile_drhs_mlp_dim=1024,
    merge_gating_gmm=False, use_tokamax_gmm=False, use_gmm_v2=False, use_gmm_v2_heuristic_tiling=False,
    use_sliced_mla_proj=False, use_mla_absorbed_mqa=False, use_csa_streamindex_kernel=False, fused_qkv=False, fused_mlp=False,
    num_vocab_tiling=1, use_iota_embed=False, sa_block_q=512, sa_block_kv=512, sa_block_kv_compute=512, eval_sa_block_q=512,
    eval_sa_block_kv=512, eval_sa_block_kv_compute=512, sa_block_q_dkv=512, sa_block_kv_dkv=512, sa_block_kv_dkv_compute=512,
    sa_block_q_dq=512, sa_block_kv_dq=512, sa_use_fused_bwd_kernel=False, sa_bwd_dkv_megacore=False,
    sa_q_layout='HEAD_DIM_MINOR', sa_k_layout='HEAD_DIM_MINOR', sa_v_layout='HEAD_DIM_MINOR',
    eval_sa_q_layout='HEAD_DIM_MINOR', eval_sa_k_layout='HEAD_DIM_MINOR', eval_sa_v_layout='HEAD_DIM_MINOR',
    use_splash_scheduler=False, ring_scan_unroll=1, sa_fuse_reciprocal=True, sa_use_base2_exp=True, local_sa_block_q='None',
    local_sa_block_kv='None', local_sa_block_kv_compute='None', eval_local_sa_block_q='None', eval_local_sa_block_kv='None',
    eval_local_sa_block_kv_compute='None', local_sa_block_q_dkv='None', local_sa_block_kv_dkv='None',
    local_sa_block_kv_dkv_compute='None', local_sa_block_q_dq='None', local_sa_block_kv_dq='None',
    local_sa_use_fused_bwd_kernel='None', local_sa_q_layout='None', local_sa_k_layout='None', local_sa_v_layout='None',
    eval_local_sa_q_layout='None', eval_local_sa_k_layout='None', eval_local_sa_v_layout='None',
    local_use_splash_scheduler='None', local_sa_fuse_reciprocal='None', local_sa_use_base2_exp='None',
    cost_estimate_flops_fwd=-1, cost_estimate_flops_bwd=-1, dq_reduction_steps=0, enable_padding_causal_mask=True,
    use_tokamax_splash=False, use_jax_splash=False, force_q_layout=False, use_mhc_pallas_kernel=False,
    mhc_pallas_kernel_fwd_block_size=256, mhc_pallas_kernel_bwd_block_size=128, mhc_pallas_kernel_bwd_feature_block_size=1024,
)
_ignored(
    REMAT,
    indexer_cutoff_threshold='remat', moe_mlpwi_0='remat', moe_mlpwi_1='remat', moe_mlpwo='remat',
    moe_x_sorted='remat', moe_routing_maps='remat', kv_proj='remat', query_wa_proj='remat', kv_wa_proj='remat', mla_q='remat',
    mla_kv='remat', attention_out='remat', engram='remat',
)
_ignored(
    INFERENCE,
    return_routed_experts=False, mla_naive_kvcache=True, max_prefill_predict_length=64, load_from_prefill_dir=False,
    prefill_cache_dir='', autoregressive_decode_assert='', inference_microbenchmark_prefill_lengths='64,128,256,512,1024',
    inference_microbenchmark_stages='prefill,generate', inference_microbenchmark_loop_iters=10,
    inference_microbenchmark_log_file_path='', inference_microbenchmark_num_samples=[1, 2, 3, 4, 5],
    inference_metadata_file='', inference_server='MaxtextInterleavedServer', prefill_slice='v5e-16', generate_slice='v5e-16',
    inference_benchmark_test=False, enable_model_warmup=False, enable_llm_inference_pool=False, multi_sampling=False,
    return_log_prob=False, stack_prefill_result_cache=False, prefill_cache_axis_order='1,2,0,3', ar_cache_axis_order='1,2,0,3',
    compute_axis_order='0,1,2,3', reshape_q=False, prometheus_port=0, use_ragged_attention=False, ragged_block_size=256,
    prefill_chunk_size=256, use_chunked_prefill=False, enable_prefix_caching=False, prefix_caching_hbm_byte=10000000000,
    prefix_caching_dram_byte=100000000000, vllm_hf_config_path='', vllm_hf_overrides={}, vllm_additional_config={},
    use_weight_converter=True, rollout_tensor_parallelism=-1, rollout_backend='maxtext', kv_tp_size=1, moe_mlp_tp_size=1,
    weight_sync_debug=False, use_raiden_ffi=None, vllm_load_format='dummy',
)
_ignored(
    DATA_IO,
    max_corpus_chars=10000000, grain_worker_count=1, grain_per_worker_buffer_size=1, grain_num_threads=16,
    grain_prefetch_buffer_size=500, grain_worker_count_eval=1, grain_per_worker_buffer_size_eval=1, grain_ram_budget_mb=1024,
    grain_num_threads_eval=16, grain_prefetch_buffer_size_eval=500, grain_data_source_max_workers=16,
    grain_index_storage_option=None, grain_shuffle_buffer_size=100, grain_use_elastic_iterator=False,
)
_add("load_parameters_path", Key(
    HONOURED, '', "an nnxtron checkpoint or a MaxText one (training, param-only or decode checkpoint, scanned or not: "
    "converted on load; `nnxtron convert from-maxtext` converts once; docs/maxtext.md, Checkpoints)",
    to=lambda value, ctx: {"load_parameters_path": value},
))
_ignored(
    DISTILL,
    distill_alpha=0.5, distill_temperature=1.0, distill_beta=0.0, distill_feature_loss_type='cosine',
    distill_layer_indices='None', distill_alpha_end='None', distill_alpha_schedule='constant', distill_temperature_end='None',
    distill_temperature_schedule='constant', distill_beta_end='None', distill_beta_schedule='constant',
)
_refused(
    'a MaxText-only model backend or checkpoint format',
    "convert the checkpoint to nnxtron's format and set load_parameters_path",
    use_m3_model=False, lora_input_adapters_path='', hf_lora_adapter_path='', load_full_state_path='',
    checkpoint_conversion_fn='none', source_checkpoint_layout='orbax', checkpoint_is_quantized=False,
    save_quantized_params_path='',
)
_refused(
    'repeats one batch (a TPU performance test), so it trains on different data',
    'leave it at 0',
    reuse_example_batch=0,
)
_refused(
    'nnxtron keeps gradients in float32',
    'leave grad_dtype=float32',
    grad_dtype='float32',
)
_refused(
    'an AQT / TransformerEngine quantization option; nnxtron quantizes with qwix only',
    'use_qwix_quantization=true quantization=int8|fp8|fp8_e4m3|fp8_e5m2|fp8_full',
    constant_bound_config='', quant_cfg_path='', use_manual_quantization=False, drhs_grad_quantization_calibration_method=None,
    quantization_local_shard_count=-1, unquantized_modules=[], weight_block_size=None, te_moe_block=False,
    te_gmm_quantization='', moe_quantize_token_all_gather=False, moe_quantize_combine_bwd_method='',
    experimental_sa_quant_q_fp8=False, experimental_sa_quant_k_fp8=False,
)
_refused(
    'nnxtron computes activations in dtype',
    'use dtype=float32 for float32 activations',
    activations_in_float32=False,
)
_refused(
    'nnxtron does not quantize the KV cache',
    'leave quantize_kvcache=false',
    quantize_kvcache=False,
)
_refused(
    'read only with quantize_kvcache=true',
    'leave quantize_kvcache=false',
    gate=('quantize_kvcache', (False,)),
    kv_quant_axis='heads_and_dkv', kv_quant_dtype='int8',
)
_refused(
    'nnxtron does not quantize the logits projection',
    'leave quantize_logits_proj=false',
    quantize_logits_proj=False,
)
_refused(
    'read only with quantize_logits_proj=true',
    'leave quantize_logits_proj=false',
    gate=('quantize_logits_proj', (False,)),
    logits_proj_quant_calibration_method='',
)
_refused(
    "MaxText's inference call mode is not a training function",
    'leave model_call_mode empty',
    model_call_mode='',
)
_refused(
    'nnxtron has no N:M weight sparsity',
    'leave weight_sparsity_n and weight_sparsity_m null',
    weight_sparsity_n=None, weight_sparsity_m=None,
)
_refused(
    'read only with N:M weight sparsity',
    'leave weight_sparsity_n null',
    gate=('weight_sparsity_n', (None,)),
    weight_sparsity_update_step=10, weight_sparsity_start_step=50,
)
_refused(
    "changes the model's widths or initialisation in a way nnxtron does not implement",
    'set base_emb_dim, base_mlp_dim, heads and head_dim directly',
    global_parameter_scale=1, dense_init_scale=1.0, attention_output_dim=-1, moe_expert_input_dim=-1,
)
_refused(
    "a Gemma 4 small (E2B / E4B, MaxText's decoder_block gemma4_small) feature nnxtron does not implement: per-layer "
    "inputs, key/value sharing across layers",
    'choose a model nnxtron has (decoder_block gemma4 builds Gemma 4 26B-A4B and 31B; `nnxtron config show` lists '
    'decoder_block values)',
    hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
)
_refused(
    'a float32 cast nnxtron does not make in bfloat16 (in float32 it is moot)',
    'use dtype=float32',
    gate=('dtype', ('float32',)),
    logits_dot_in_fp32=False, float32_qk_product=False, float32_logits=False, float32_weight_sum=True,
    float32_gate_logits=False,
)
_refused(
    'nnxtron returns float32 logits to the loss',
    'leave cast_logits_to_fp32=true',
    cast_logits_to_fp32=True,
)
_refused(
    "nnxtron's MTP looks the shifted tokens up in the embedding table",
    'leave mtp_reuse_input_embedding=false',
    mtp_reuse_input_embedding=False,
)
_refused(
    'a MoE variant nnxtron does not implement',
    "leave it at MaxText's default",
    moe_use_megatron_seq_aux_loss=False, use_random_routing=False, use_lineage=False,
)
_refused(
    'read only when ragged_buffer_factor drops tokens',
    'use ragged_buffer_factor=-1',
    gate=('ragged_buffer_factor', (-1.0,)),
    moe_dropless_fallback='None', retry_dropless_first_steps=0, first_phase_ragged_buffer_factor=0.0,
)
_refused(
    'an attention variant nnxtron does not implement',
    "leave it at MaxText's default",
    qk_norm_with_scale=True, moba=False, use_max_logit_estimate=-1,
)
_honoured(partial_rotary_factor=1.0)  # qwen3_next only (config/qwen3_next.py); nnxtron refuses it elsewhere as MaxText does
_refused(
    'read only with moba=true',
    'leave moba=false',
    gate=('moba', (False,)),
    moba_chunk_size=1024, moba_topk=8,
)
_refused(
    'nnxtron has no z-loss',
    'use z_loss_multiplier=0',
    z_loss_multiplier=0.0,
)
_refused(
    "DeepSeek-V3.2 sparse attention (DSA) is not implemented; nnxtron's indexer is DeepSeek-V4's (attention_type=compressed)",
    'leave use_indexer=false',
    gate=('attention_type', ('compressed',)),
    use_indexer=False,
)
_refused(
    'an indexer option nnxtron does not implement',
    "leave it at MaxText's default",
    indexer_use_approx_top_k=False, indexer_mask_exact_topk=True, indexer_sparse_training=False,
    indexer_loss_scaling_factor=0.0,
)
_refused(
    'read only with indexer_use_approx_top_k=true',
    'leave indexer_use_approx_top_k=false',
    gate=('indexer_use_approx_top_k', (False,)),
    indexer_approx_top_k_recall=0.95,
)
_refused(
    'nnxtron has no QK-clip',
    'leave use_qk_clip=false',
    use_qk_clip=False,
)
_refused(
    'read only with use_qk_clip=true',
    'leave use_qk_clip=false',
    gate=('use_qk_clip', (False,)),
    qk_clip_threshold=100.0,
)
_refused(
    'XLA flags can change numerics; nnxtron does not pass them to the compiler',
    'set XLA_FLAGS in the environment',
    compile_xla_flags='',
)
_refused(
    'a chat-template data option nnxtron does not have (SFT: use_sft, sft_train_on_completion_only, chat_template_path)',
    "leave it at MaxText's default",
    use_chat_template=False, chat_template='', tokenize_train_data=True, tokenize_eval_data=True,
    default_prompt='', max_segments_per_seq=-1,
)
_refused(
    "MaxText's DPO batches count pairs and read HF datasets; nnxtron's DPO (use_dpo, dpo_beta, dpo_label_smoothing) "
    'reads local preference records with two rows per pair (docs/post-training.md)',
    "leave it at MaxText's default and train DPO with an nnxtron config",
    use_dpo=False,
)
_honoured(use_sft=False, chat_template_path='')
# MaxText trains SFT on every token unless sft_train_on_completion_only=true (nnxtron's default: the answers only);
# MaxText reads the key only with use_sft=true
_translated("sft_train_on_completion_only", False, "sft_train_on_completion_only (read only with use_sft=true)",
            lambda v, c: {"sft_train_on_completion_only": v} if c.get("use_sft") else {})
_refused(
    'nnxtron evaluates with per_device_batch_size',
    'leave eval_per_device_batch_size=0',
    eval_per_device_batch_size=0.0,
)
_refused(
    'nnxtron has no batch-size ramp-up',
    'leave enable_rampup_batch_size=false',
    enable_rampup_batch_size=False,
)
_refused(
    'read only with enable_rampup_batch_size=true',
    'leave enable_rampup_batch_size=false',
    gate=('enable_rampup_batch_size', (False,)),
    per_device_batch_size_start=4.0, per_device_batch_size_increment=2.0, global_rampup_samples=500,
)
_refused(
    'read only by dataset_type=tfds, hf or c4_mlperf, which nnxtron does not have',
    'use dataset_type=synthetic or grain (arrayrecord, parquet)',
    gate=('dataset_type', ('synthetic', 'grain')),
    use_truncation=True, use_stream_chunking=None, generate_padding_batch_train=False, generate_padding_batch_eval=False,
    dataset_path='', dataset_name='c4/en:3.1.0', eval_dataset_name='c4/en:3.1.0', train_split='train', eval_split='validation',
    hf_path='', hf_name='', hf_data_dir='', hf_train_files='', hf_eval_split='', hf_eval_files='', train_shard_in_read=False,
    train_interleave_cycle_length=-1,
)
_refused(
    'read only by the mmap / OLMo data formats, which nnxtron does not read',
    'use grain_file_type=arrayrecord or parquet',
    gate=('grain_file_type', ('arrayrecord', 'parquet')),
    mmap_eod_id=0, blend_cache_dir='', blend_index_dir='', reset_attention_mask=True, eod_mask_loss=False,
    packing_max_segments_per_sample=25, mmap_split_sentences=False, mmap_npy_split='', olmo_index_path='',
    olmo_path_remap_from='', olmo_path_remap_to='', olmo_apply_ngram_filter=True,
)
_refused(
    'nnxtron evaluates on eval_split_fraction of the training sources',
    'leave grain_eval_files empty and set eval_split_fraction',
    eval_data_columns=['text'], grain_eval_files='',
)
_refused(
    "nnxtron mixes sources with grain_train_files='glob:weight;glob:weight'",
    'write the mixture in grain_train_files',
    grain_train_mixture_config_path='',
)
_refused(
    'nnxtron always shuffles documents (data_shuffle_seed)',
    'leave enable_data_shuffling=true',
    gate=('dataset_type', ('synthetic',)),
    enable_data_shuffling=True,
)
_refused(
    'nnxtron trains the causal-LM objective only',
    'use training_objective=causal_lm',
    training_objective='causal_lm',
)
_refused(
    'read only by training_objective=block_diffusion',
    'use training_objective=causal_lm',
    gate=('training_objective', ('causal_lm',)),
    causal_block_size=32, block_diffusion_mask_id=-1, block_diffusion_min_noise=0.001,
    block_diffusion_logit_alignment='same_position', block_diffusion_canvas_policy='all_masked',
)
_refused(
    'nnxtron has no DiLoCo',
    'leave enable_diloco=false',
    enable_diloco=False,
)
_refused(
    'read only with enable_diloco=true',
    'leave enable_diloco=false',
    gate=('enable_diloco', (False,)),
    diloco_sync_period=36, diloco_outer_lr=0.3, diloco_outer_momentum=0.9, enable_streaming_diloco=False,
    num_diloco_fragments=None, num_communication_overlapping_steps=0, communication_overlapping_alpha=0.0,
)
_refused(
    'a training-loop variant nnxtron does not implement',
    "leave it at MaxText's default",
    use_sequential_layers=False, skip_step_on_spikes=False, trainable_parameters_mask=[], eval_start_step=0,
    target_eval_loss=0.0,
)
_refused(
    'read only with skip_step_on_spikes=true',
    'leave skip_step_on_spikes=false',
    gate=('skip_step_on_spikes', (False,)),
    skip_step_interval=128, skip_step_scaling_factor=6.0,
)
_refused(
    'nnxtron stops on a non-finite loss or gradient (non_finite_policy=stop) or skips that update (non_finite_policy=skip); it never applies it',
    'leave it true and choose non_finite_policy',
    abort_on_nan_loss=True, abort_on_inf_loss=True,
)
_refused(
    'an optimizer option nnxtron does not implement',
    "leave it at MaxText's default",
    adam_eps_root=0.0, adamw_mask=[], mu_dtype='', muon_type='optax_muon', muon_include_routers=True,
)
_refused(
    'a positional-embedding or RoPE variant nnxtron does not implement',
    "leave it at MaxText's default",
    use_untrainable_positional_embedding=False, rope_use_scale=True, rope_min_timescale=1, rope_pairwise=False,
)
_refused(
    'nnxtron has no multimodal encoders',
    'leave use_multimodal=false',
    use_multimodal=False,
)
_refused(
    'read only by the vision encoder (use_multimodal=true)',
    'leave use_multimodal=false',
    gate=('use_multimodal', (False,)),
    train_image_column='image', eval_image_column='image', freeze_vision_encoder_params=True, dtype_mm='float32',
    remat_policy_for_vit='minimal', image_size_for_vit=896, image_path='', video_path='', image_placeholder='<|image|>',
    video_placeholder='<|video|>', video_max_grid_t=None, video_max_grid_h=None, video_max_grid_w=None,
    posemb_type_for_vit='learn', max_num_images_per_example=-1, vision_output_length=-1, hidden_size_for_vit=1408,
    intermediate_size_for_vit=5632, num_attention_heads_for_vit=16, num_channels_for_vit=3, tile_size_for_vit=336,
    patch_size_for_vit=14, conv_stride_for_vit=14, num_hidden_layers_for_vit=34, projector_input_dim_for_vit=4096,
    projector_output_dim_for_vit=4096, rope_theta_for_vit=10000, vision_output_dim_for_vit=4096,
    pixel_shuffle_ratio_for_vit=0.5, projector_dropout_for_vit=0.0, spatial_merge_size_for_vit=2, out_hidden_size_for_vit=512,
    temporal_patch_size_for_vit=2, num_position_embeddings_for_vit=1024, deepstack_visual_indexes_for_vit=[],
)
_refused(
    'nnxtron has no audio encoder',
    'leave use_audio=false',
    use_audio=False,
)
_refused(
    'read only by the audio encoder (use_audio=true)',
    'leave use_audio=false',
    gate=('use_audio', (False,)),
    freeze_audio_encoder_params=True, audio_path='', audio_placeholder='<|audio|>', use_audio_in_video=False,
    d_model_for_audio=256, encoder_attention_heads_for_audio=4, encoder_ffn_dim_for_audio=512, encoder_layers_for_audio=2,
    attention_dropout_for_audio=0.0, activation_dropout_for_audio=0.0, activation_function_for_audio='gelu',
    num_mel_bins_for_audio=128, max_source_positions_for_audio=1500, scale_embedding_for_audio=True, n_window_for_audio=50,
    n_window_infer_for_audio=800, conv_chunksize_for_audio=500, downsample_hidden_size_for_audio=256, output_dim_for_audio=512,
    num_conv_layers_for_audio=3, max_timescale_for_audio=10000.0, max_sample_len_for_audio=10000,
)
_refused(
    'nnxtron has no multimodal RoPE',
    'leave use_mrope=false',
    use_mrope=False,
)
_refused(
    'read only with use_mrope=true',
    'leave use_mrope=false',
    gate=('use_mrope', (False,)),
    mrope_section=[24, 20, 20], position_id_per_seconds=25,
)
# Qwen3-Next's Gated DeltaNet (decoder_block=qwen3_next; its delta rule a gdn_chunk_size chunk of tokens at a time)
_honoured(
    gdn_conv_kernel_dim=4, gdn_key_head_dim=128, gdn_value_head_dim=128, gdn_num_key_heads=16, gdn_num_value_heads=32,
    gdn_chunk_size=64,
)
_refused(
    "the Gated DeltaNet without the L2-normalised queries and keys, which nnxtron (and HF Qwen3-Next) does not have",
    'leave use_qk_norm_in_gdn=true',
    use_qk_norm_in_gdn=True,
)
_refused(
    'mHC-lite (permutation mixing) is not implemented; nnxtron runs Sinkhorn-Knopp',
    'leave enable_mhc_lite=false',
    enable_mhc_lite=False,
)
_refused(
    'nnxtron has no Engram layers',
    'leave engram_layers empty',
    engram_layers=[],
)
_refused(
    'read only by Engram layers',
    'leave engram_layers empty',
    gate=('engram_layers', ([],)),
    engram_max_ngram_size=3, engram_num_heads=8, engram_head_dim=1280, engram_vocab_bases=[], engram_kernel_size=4,
    engram_seed=0,
)
# fmt: on


# --- translated: MaxText's value becomes nnxtron key(s) -------------------------------------------
def _positive_or_nothing(key: str, target: str | None = None) -> Translate:
    """MaxText's ``-1`` / ``0`` = unset: nnxtron keeps its own value (the preset's or base.yml's)."""
    return lambda value, ctx: {target or key: value} if number(value, key) > 0 else {}


def _positive_or_zero(key: str) -> Translate:
    """MaxText's ``-1`` = off is nnxtron's ``0``."""
    return lambda value, ctx: {key: value if number(value, key) > 0 else 0}


def _pipeline_stages(ctx: Mapping[str, Any]) -> int:
    return int(ctx.get("ici_pipeline_parallelism", 1) or 1) * int(ctx.get("dcn_pipeline_parallelism", 1) or 1)


def _quantized(ctx: Mapping[str, Any]) -> bool:
    return bool(ctx.get("use_qwix_quantization")) and bool(ctx.get("quantization"))


ATTENTION_KERNELS = {"autoselected": "auto", "flash": "auto", "dot_product": "dot_product", "cudnn_flash_te": "cudnn"}


def _attention(value: Any, ctx: Mapping[str, Any]) -> dict[str, Any]:
    if value in options.ATTENTION_CHOICES:
        return {"attention": value}
    if value not in ATTENTION_KERNELS:
        raise refusal("attention", value, "nnxtron computes exact softmax attention only (no paged / ragged / vLLM kernels)",
                      "use attention=autoselected, dot_product, flash or cudnn_flash_te")  # fmt: skip
    return {"attention": ATTENTION_KERNELS[value]}


def _dataset_type(value: Any, ctx: Mapping[str, Any]) -> dict[str, Any]:
    if value in options.DATASET_TYPES:
        return {"dataset_type": value}
    if value == "grain":
        kind = ctx.get("grain_file_type", "arrayrecord")
        if kind not in ("arrayrecord", "parquet"):
            raise refusal("grain_file_type", kind, "nnxtron reads ArrayRecord and Parquet files", "use arrayrecord or parquet")
        return {"dataset_type": kind}
    raise refusal("dataset_type", value, "nnxtron has no TFDS / HF-datasets / c4_mlperf pipelines",
                  "use dataset_type=synthetic, or grain with grain_file_type=arrayrecord|parquet and grain_train_files")  # fmt: skip


def _train_data_columns(value: Any, ctx: Mapping[str, Any]) -> dict[str, Any]:
    columns = [value] if isinstance(value, str) else list(value)
    if ctx.get("use_sft"):  # instruction rows are whole records: nnxtron reads these fields by name
        if columns not in (["messages"], ["prompt", "completion"], ["text"]):
            raise refusal("train_data_columns", value, "nnxtron's SFT rows are 'messages' or 'prompt' + 'completion'",
                          "name ['messages'] or ['prompt', 'completion'] and store the rows under those fields")  # fmt: skip
        return {}
    if len(columns) != 1:
        raise refusal("train_data_columns", value, "nnxtron trains on one text column", "name one column")
    return {} if columns[0] == "text" else {"dataset_text_field": columns[0]}


def _eval_steps(value: Any, ctx: Mapping[str, Any]) -> dict[str, Any]:
    if number(value, "eval_steps") > 0:
        return {"eval_steps": value}
    if number(ctx.get("eval_interval", -1), "eval_interval") > 0:
        raise refusal("eval_steps", value, "nnxtron evaluates a fixed number of batches, not the whole eval set",
                      "set eval_steps=N")  # fmt: skip
    return {}


def _rope_scaling(target: str) -> Translate:
    """Read by MaxText's yarn RoPE only."""
    return lambda value, ctx: {target: value} if ctx.get("rope_type") == "yarn" else {}


def _rope_linear(value: Any, ctx: Mapping[str, Any]) -> dict[str, Any]:
    if same(value, 1.0) or ctx.get("rope_type", "default") != "default":
        return {}  # read by MaxText's default RoPE only
    return {"rope_type": "linear", "rope_scaling_factor": value}


def _gemma3_query_scalar(ctx: Mapping[str, Any]) -> dict[str, Any]:
    """MaxText derives Gemma 3's query scale from the sizes (models/gemma3.py get_query_pre_attn_scalar):
    ``head_dim ** -0.5`` for gemma3-4b / 12b, ``(emb_dim // query heads) ** -0.5`` for gemma3-27b;
    nnxtron's presets state it (``query_pre_attn_scalar``), so overridden sizes re-derive it."""
    name = str(ctx.get("model_name", ""))
    if name in ("gemma3-4b", "gemma3-12b"):
        return {"query_pre_attn_scalar": float(ctx["head_dim"])}
    if name == "gemma3-27b":
        return {"query_pre_attn_scalar": float(int(ctx["base_emb_dim"]) // int(ctx["base_num_query_heads"]))}
    return {}


def _override_model_config(value: Any, ctx: Mapping[str, Any]) -> dict[str, Any]:
    """A rule about the command line (config/maxtext.py: check_model_overrides); with it, Gemma 3's
    query scale follows the overridden sizes."""
    return _gemma3_query_scalar(ctx) if value is True else {}


for _key, _default in (("base_emb_dim", 2048), ("base_num_query_heads", 16), ("head_dim", 128)):  # sizes: the query scale too
    _add(_key, Key(HONOURED, _default, to=lambda v, c, key=_key: {key: v, **_gemma3_query_scalar(c)}))


_translated("base_output_directory", "", "base_output_directory; \"\" is MaxText's ./maxtext_output",
            lambda v, c: {"base_output_directory": v or "maxtext_output"})  # fmt: skip
_translated("override_model_config", False, "MaxText's rule: with model_name, a command-line key the model preset sets "
            "differently is an error unless override_model_config=true", _override_model_config)  # fmt: skip
_translated("max_num_checkpoints_to_keep", "None", "max_num_checkpoints_to_keep; None (keep all) is 2**40",
            lambda v, c: {"max_num_checkpoints_to_keep": MAX_STEPS if is_none(v) else v})  # fmt: skip
_translated("wandb_project_name", "maxtext", "wandb_project (passed only with enable_wandb=true)",
            lambda v, c: {"wandb_project": v} if c.get("enable_wandb") else {})  # fmt: skip
_translated("mlp_activations_limit", -1.0, "mlp_activations_limit; <= 0 (off) is 0", _positive_or_zero("mlp_activations_limit"))
_translated("base_moe_mlp_dim", -1, "base_moe_mlp_dim; -1 (unset) keeps nnxtron's", _positive_or_nothing("base_moe_mlp_dim"))
_translated("routed_score_func", "", 'routed_score_func; "" is softmax', lambda v, c: {"routed_score_func": v or "softmax"})
_translated("inhomogeneous_layer_cycle_interval", 1, "inhomogeneous_layer_cycle_interval; 1 (no cycle) is 0 (the layer pattern's period)",
            lambda v, c: {"inhomogeneous_layer_cycle_interval": v if number(v, "inhomogeneous_layer_cycle_interval") > 1 else 0})  # fmt: skip
_translated("scan_pipeline_repeats", False, "scan_pipeline_repeats, passed only with pipeline stages (unread without: both scan or unroll the same function)",
            lambda v, c: {"scan_pipeline_repeats": v} if _pipeline_stages(c) > 1 else {})  # fmt: skip
_translated("scan_layers_per_stage", False, "scan_layers_per_stage, passed only with pipeline stages (unread without)",
            lambda v, c: {"scan_layers_per_stage": v} if _pipeline_stages(c) > 1 else {})  # fmt: skip
_translated("attention", "autoselected", "attention: autoselected and flash are auto, dot_product is dot_product, cudnn_flash_te is cudnn; "
            "other kernels are refused", _attention)  # fmt: skip
_translated("o_lora_rank", 0, "o_lora_rank; 0 (unset) keeps nnxtron's", _positive_or_nothing("o_lora_rank"))
_translated("o_groups", 0, "o_groups; 0 (unset) keeps nnxtron's", _positive_or_nothing("o_groups"))


def _tokenizer_type(value: Any, ctx: Mapping[str, Any]) -> dict[str, Any]:
    if ctx.get("dataset_type") == "synthetic" and not ctx.get("tokenizer_path"):
        return {"tokenizer_type": "byte"}  # MaxText reads no tokenizer for synthetic data; nnxtron's byte needs no file
    return {"tokenizer_type": "hf" if value == "huggingface" else value}


_translated("tokenizer_type", "sentencepiece", "tokenizer_type; huggingface is hf; byte for synthetic data without "
            "tokenizer_path (MaxText reads no tokenizer then)", _tokenizer_type)  # fmt: skip
_translated("packing", True, "packing: true is concat, false is pad",
            lambda v, c: {"packing": v if v in options.PACKING_MODES else "concat" if v else "pad"})  # fmt: skip
_translated("dataset_type", "synthetic", "dataset_type: synthetic is synthetic, grain is grain_file_type (arrayrecord, parquet); "
            "tfds, hf and c4_mlperf are refused", _dataset_type)  # fmt: skip
_translated("grain_file_type", "arrayrecord", "read by dataset_type=grain (becomes dataset_type)", lambda v, c: {})
_translated("learning_rate_final_fraction", 0.1, "cosine_learning_rate_final_fraction with lr_schedule_type=cosine, else "
            "learning_rate_final_fraction", lambda v, c: {"cosine_learning_rate_final_fraction" if c.get("lr_schedule_type", "cosine") == "cosine" else "learning_rate_final_fraction": v})  # fmt: skip
_translated("muon_consistent_rms", "None", "muon_consistent_rms; None is 0",
            lambda v, c: {"muon_consistent_rms": 0.0 if is_none(v) else v})  # fmt: skip
_translated("trainable_position_size", -1, "trainable_position_size; -1 (off) is 0", _positive_or_zero("trainable_position_size"))
# MaxText's llama3.1 RoPE scales the frequencies with constants of its own (layers/embeddings.py
# LLaMARotaryEmbedding._apply_scaling_factor), whatever the model: Llama 4 too, whose HF config says 16 / 1 / 1
MAXTEXT_LLAMA31_SCALING = {
    "rope_scaling_factor": 8.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
    "rope_original_max_position_embeddings": 8192,
}  # fmt: skip
_translated(
    "rope_type", "default", "rope_type; llama3.1 is llama3 with MaxText's fixed scaling (factor 8, low 1, high 4, 8192 positions)",
    lambda v, c: {"rope_type": "llama3", **MAXTEXT_LLAMA31_SCALING} if v == "llama3.1" else {"rope_type": v},
)  # fmt: skip


def _block_reads(ctx: Mapping[str, Any]) -> frozenset[str]:
    """The MaxText keys only the config's MaxText block reads (``FamilyRules.maxtext_reads``: Gemma 4's)."""
    return rules_for(ctx.get("decoder_block", "llama2")).maxtext_reads


def _rope_timescale(key: str) -> Translate:
    """nnxtron's RoPE bases from MaxText's three. Most blocks: rope_max_timescale as it is, local_rope_max_timescale
    -1 (off) is 0 (the sliding layers take rope_max_timescale), global_rope_max_timescale unread. A block that reads
    global_rope_max_timescale (Gemma 4) rotates its global layers with it where > 0, else with rope_max_timescale,
    its sliding layers with local_rope_max_timescale where > 0, else rope_max_timescale: there each of the three keys
    gives nnxtron's two (rope_max_timescale the global layers', local_rope_max_timescale the sliding ones') alike."""

    def translate(value: Any, ctx: Mapping[str, Any]) -> dict[str, Any]:
        if "global_rope_max_timescale" not in _block_reads(ctx):
            if key == "local_rope_max_timescale":
                return {key: value if number(value, key) > 0 else 0}
            return {key: value} if key == "rope_max_timescale" else {}
        rope = number(ctx.get("rope_max_timescale", 10000), "rope_max_timescale")
        local = number(ctx.get("local_rope_max_timescale", -1), "local_rope_max_timescale")
        glob = number(ctx.get("global_rope_max_timescale", -1), "global_rope_max_timescale")
        return {"rope_max_timescale": glob if glob > 0 else rope, "local_rope_max_timescale": local if local > 0 else rope}

    return translate


_NOTE_TIMESCALES = ("rope_max_timescale; local_rope_max_timescale -1 (off) is 0; global_rope_max_timescale read by "
                    "decoder_block gemma4 only: there the three give rope_max_timescale (its global layers' base: "
                    "global_rope_max_timescale where > 0) and local_rope_max_timescale (its sliding layers')")  # fmt: skip
for _key, _default in (("rope_max_timescale", 10000), ("local_rope_max_timescale", -1), ("global_rope_max_timescale", -1)):
    _translated(_key, _default, _NOTE_TIMESCALES, _rope_timescale(_key))


def _block_key(key: str, refused_elsewhere: Any = NOT_IN_BASE) -> Translate:
    """A key only some blocks' MaxText layers read (``_block_reads``): passed on for them; elsewhere unread, as in
    MaxText (dropped), or refused at any value but ``refused_elsewhere`` where another MaxText block reads it too."""

    def translate(value: Any, ctx: Mapping[str, Any]) -> dict[str, Any]:
        if key in _block_reads(ctx):
            return {key: value}
        if refused_elsewhere is not NOT_IN_BASE and not same(value, refused_elsewhere):
            raise refusal(key, value, "read by decoder_block gemma4 only in nnxtron (MaxText's generic decoder layer "
                          "reads it too)", f"leave {key}={refused_elsewhere} or use decoder_block=gemma4")  # fmt: skip
        return {}

    return translate


def _proportion(key: str) -> Translate:
    """Gemma 4's RoPE proportions: MaxText rotates a share below 1 proportionally (HF's, nnxtron's) only under a
    model_name of the block's own (``gemma4-*``); under another one its plain partial RoPE (the first dims)."""
    passed = _block_key(key)

    def translate(value: Any, ctx: Mapping[str, Any]) -> dict[str, Any]:
        out = passed(value, ctx)
        named = str(ctx.get("model_name", "default")).startswith(str(ctx.get("decoder_block", "")))
        if out and number(value, key) < 1 and not named:
            raise refusal(key, value, f"MaxText rotates Gemma 4's proportional RoPE only under a model_name "
                          f"{ctx.get('decoder_block')}-* (model_name={ctx.get('model_name')} rotates the first dims "
                          "instead)", "use model_name=gemma4-26b or gemma4-31b")  # fmt: skip
        return out

    return translate


_translated("global_head_dim", 0, "global_head_dim (decoder_block gemma4 only; unread elsewhere)", _block_key("global_head_dim"))
_translated("global_num_kv_heads", 0, "global_num_kv_heads (decoder_block gemma4 only; unread elsewhere)",
            _block_key("global_num_kv_heads"))  # fmt: skip
_translated("share_kv_projections", False, "share_kv_projections (decoder_block gemma4 only; refused elsewhere)",
            _block_key("share_kv_projections", False))  # fmt: skip
_translated("global_rope_proportion", 0.25, "global_rope_proportion (decoder_block gemma4 with a gemma4-* model_name; "
            "unread elsewhere)", _proportion("global_rope_proportion"))  # fmt: skip
_translated("local_rope_proportion", 1.0, "local_rope_proportion (decoder_block gemma4 with a gemma4-* model_name; "
            "unread elsewhere)", _proportion("local_rope_proportion"))  # fmt: skip
_add("v_norm_with_scale", Key(
    REFUSED, True, "decoder_block gemma4's value norm has no weight (HF Gemma 4's v_norm); no other block has one",
    "use v_norm_with_scale=false with decoder_block gemma4 (its presets set it)",
    check=lambda value, ctx: value is False or "v_norm_with_scale" not in _block_reads(ctx)))  # fmt: skip
_translated(
    "decode_sampling_nucleus_p",
    -1,
    "decode_sampling_nucleus_p; -1 (unset) keeps nnxtron's",
    _positive_or_nothing("decode_sampling_nucleus_p"),
)
_translated(
    "decode_sampling_top_k", 0, "decode_sampling_top_k; 0 (unset) keeps nnxtron's", _positive_or_nothing("decode_sampling_top_k")
)
_translated("eval_steps", -1, "eval_steps; -1 (the whole eval set) is refused with eval_interval > 0", _eval_steps)
_translated("nope_layer_interval", -1, "nope_layer_interval; -1 (off) is 0", _positive_or_zero("nope_layer_interval"))
_translated("rope_factor", 40, "rope_scaling_factor (read with rope_type=yarn)", _rope_scaling("rope_scaling_factor"))
_translated("original_max_position_embeddings", 4096, "rope_original_max_position_embeddings (read with rope_type=yarn)",
            _rope_scaling("rope_original_max_position_embeddings"))  # fmt: skip


def _rope_interleave(value: Any, ctx: Mapping[str, Any]) -> dict[str, Any]:
    """MaxText reads rope_interleave in its YaRN RoPE only; its default RoPE rotates halves and its
    llama3.1 RoPE (model_name llama3.1*, rope_type llama3.1, Llama 4) rotates adjacent pairs."""
    rope_type = str(ctx.get("rope_type", "default"))
    if rope_type.startswith("yarn"):
        return {"rope_interleave": value}
    return {"rope_interleave": rope_type == "llama3.1" or str(ctx.get("model_name", "")).startswith("llama3.1")}


def _decoder_block(value: Any, ctx: Mapping[str, Any]) -> dict[str, Any]:
    """MaxText's plain attention (the ``maxtext_query_folded`` families of ``families.py``, without
    qk-norm) computes softmax(q.k): 1/sqrt(head_dim) is folded into the query kernel's initialiser,
    not applied; nnxtron's query_pre_attn_scalar=1 is that."""
    block = ctx.get("decoder_block", value)
    folded = rules_for(block).maxtext_query_folded
    unscaled = folded and not ctx.get("use_qk_norm") and ctx.get("attention_type", "global") == "global"
    pairs = rules_for(value).maxtext_layers_per_layer
    paired = {"sliding_window_pattern": pairs} if pairs > 1 else {}  # local, then global
    paired = {**paired, **rules_for(value).maxtext_block_values}  # what the block implies (qwen3_next: q/k norms)
    if rules_for(value).maxtext_layer_pattern:  # the block's fixed pattern (gpt_oss, gemma4)
        paired = {**paired, "sliding_window_pattern": rules_for(value).maxtext_layer_pattern}
    return {"decoder_block": value, **({"query_pre_attn_scalar": 1.0} if unscaled else {}), **paired}


def _norm_topk_prob(value: Any, ctx: Mapping[str, Any]) -> dict[str, Any]:
    """MaxText's router (layers/moe.py get_topk) takes the softmax over the top-k logits, which is
    renormalised whatever norm_topk_prob says; DeepSeek's routing renormalises sigmoid /
    sqrtsoftplus scores and never softmax ones; only Llama 4's reads norm_topk_prob."""
    renorm = rules_for(ctx.get("decoder_block", "llama2")).maxtext_topk_renorm
    if renorm == "score_func":
        return {"norm_topk_prob": ctx.get("routed_score_func") in ("sigmoid", "sqrtsoftplus")}
    return {"norm_topk_prob": value if renorm == "flag" else True}


_translated("norm_topk_prob", False, "true (MaxText's softmax over the top-k logits is renormalised); DeepSeek: true for "
            "sigmoid / sqrtsoftplus scores; Llama 4: norm_topk_prob", _norm_topk_prob)  # fmt: skip
_translated("rope_interleave", True, "rope_interleave with rope_type=yarn (where MaxText reads it); else false (MaxText's "
            "default RoPE rotates halves), true for llama3.1 RoPE", _rope_interleave)  # fmt: skip
_translated("decoder_block", "llama2", "decoder_block; llama2, mistral, mixtral, gemma and gemma2 (without qk-norm) also set "
            "query_pre_attn_scalar=1: MaxText folds 1/sqrt(head_dim) into the query kernel; gemma2 also sets "
            "sliding_window_pattern=2 (MaxText's layer: a sliding, then a global layer), gpt_oss sets it to 2 (its block "
            "alternates sliding and global layers), gemma4 to 6 (GEMMA4_ATTENTION_PATTERN) with use_qk_norm=true and "
            "query_pre_attn_scalar=1 (its q/k-normed, unscaled logits)", _decoder_block)  # fmt: skip


def _decoder_layers(value: Any, ctx: Mapping[str, Any]) -> dict[str, Any]:
    """MaxText's gemma2 layer is a (sliding, global) pair (``maxtext_layers_per_layer``): its
    base_num_decoder_layers counts pairs."""
    return {"base_num_decoder_layers": int(value) * rules_for(ctx.get("decoder_block", "llama2")).maxtext_layers_per_layer}


_translated("base_num_decoder_layers", 16, "base_num_decoder_layers; x2 for decoder_block=gemma2 (MaxText's Gemma 2 layer "
            "holds a sliding and a global layer)", _decoder_layers)  # fmt: skip


def _post_norm(value: Any, ctx: Mapping[str, Any]) -> bool:
    """nnxtron's gemma2 / gemma3 / gemma4 layers always have the post norms (MaxText's model configs set both true);
    MaxText's false there is base.yml's default, which a model_name's config overrides; other blocks have none."""
    if not rules_for(ctx.get("decoder_block", "llama2")).maxtext_post_norms:
        return value is False
    return value is True or str(ctx.get("model_name", "default")) != "default"


for _key in ("use_post_attn_norm", "use_post_ffw_norm"):
    _add(_key, Key(REFUSED, False, "nnxtron's gemma2, gemma3 and gemma4 layers always have their post-attention / "
                   "post-MLP norms, the other blocks none", f"use {_key}=true with decoder_block gemma2, gemma3 or gemma4, "
                   "else false", check=_post_norm))  # fmt: skip
_add("rope_attention_scaling", Key(
    REFUSED, False, "nnxtron's YaRN always multiplies cos / sin by HF's attention factor (MaxText's rope_attention_scaling=true); "
    "it has no other RoPE to scale", "use rope_attention_scaling=true only with rope_type=yarn (gpt-oss-* sets it)",
    check=lambda value, ctx: value is False or str(ctx.get("rope_type", "default")).startswith("yarn")))  # fmt: skip
_translated("rope_linear_scaling_factor", 1.0, "rope_type=linear with rope_scaling_factor (default RoPE only)", _rope_linear)
_translated("quantize_mtp", False, "with quantization on: qwix_module_path '.*layers/.*' (false) or '(.*layers|mtp)/.*' (true)",
            lambda v, c: {"qwix_module_path": "(.*layers|mtp)/.*" if v else ".*layers/.*"} if _quantized(c) else {})  # fmt: skip
_translated("quantize_router_proj", True, "with quantization on: qwix_exclude_module_path '.*/(.*_hc)' (true: routers quantized) "
            "or '.*/(router|.*_hc)' (false)", lambda v, c: {"qwix_exclude_module_path": ".*/(.*_hc)" if v else ".*/(router|.*_hc)"} if _quantized(c) else {})  # fmt: skip
_translated(
    "train_data_columns", ["text"], "dataset_text_field (one column); with use_sft the record's fields", _train_data_columns
)
_translated(
    "num_epoch",
    1,
    "data_num_epochs with dataset_type=grain",
    lambda v, c: {"data_num_epochs": v} if c.get("dataset_type") == "grain" else {},
)


# --- refused with a rule of their own ---------------------------------------------------------------
def _nnx(value: Any, ctx: Mapping[str, Any]) -> bool:
    return value is True


_add("grain_packing_type", Key(
    REFUSED, "first_fit", "nnxtron packs real data by concatenation (documents flow across rows; packing=false pads each)",
    "use grain_packing_type=concat_then_split", check=lambda v, c: v == "concat_then_split" or c.get("dataset_type") != "grain",
))  # fmt: skip
# parallel/ring_attention.py; ring attention is nnxtron's own default
_honoured(context_parallel_strategy="all_gather", context_parallel_load_balance=True)
_honoured(dropout_rate=0.0, enable_dropout=True)  # MaxText's sites and switch (layers/dropout.py); masks from nnxtron's RNG


# --- MoE: MaxText's capacity (dense path) and ragged buffer (sparse path) -----------------------------
def _sparse(ctx: Mapping[str, Any]) -> bool:
    return bool(ctx.get("sparse_matmul", True))


def _capacity_factor(value: Any, ctx: Mapping[str, Any]) -> dict[str, Any]:
    """MaxText reads capacity_factor on its dense path only (sparse_matmul=false), per sequence."""
    if number(value, "capacity_factor") > 0 and not _sparse(ctx):
        return {"capacity_factor": value, "capacity_scope": "sequence"}
    return {"capacity_factor": -1.0}


def _expert_shards(ctx: Mapping[str, Any]) -> int:
    """MaxText's expert-parallel degree; -1 (the rest of the devices) counts as several."""
    ici, dcn = int(ctx.get("ici_expert_parallelism", 1) or 1), int(ctx.get("dcn_expert_parallelism", 1) or 1)
    return 2 if -1 in (ici, dcn) else ici * dcn


def _ragged_buffer_unread(key: str) -> Check:
    """MaxText drops at its ragged buffer only on the sparse path, with expert parallelism (the
    ragged all-to-all receive buffer) or with use_ring_of_experts and use_ragged_sort."""

    def check(value: Any, ctx: Mapping[str, Any]) -> bool:
        if number(value, key) <= 0 or not _sparse(ctx):
            return True
        return _expert_shards(ctx) == 1 and not (ctx.get("use_ring_of_experts") and ctx.get("use_ragged_sort"))

    return check


_translated("capacity_factor", -1.0, "with sparse_matmul=false and a value > 0: capacity_factor with capacity_scope=sequence "
            "(MaxText's dense path: per sequence each expert admits int(max(ceil(length * k / experts) * factor, factor)) "
            "assignments in (position, slot) order, drops the rest, does not renormalise); else -1 (dropless: MaxText's "
            "sparse path reads no capacity_factor)", _capacity_factor)  # fmt: skip
_translated("sparse_matmul", True, "moe_compute: false is dense (every expert on every token, einsums; it also applies "
            "capacity_factor), true is grouped (jax.lax.ragged_dot on the routed tokens; dropless, ragged_buffer_factor "
            "aside); otherwise the same function", lambda v, c: {"moe_compute": "grouped" if v else "dense"})  # fmt: skip
_ignored("MaxText's Pallas ragged-sort kernel in place of argsort: the same permutation (only ragged_buffer_factor drops "
         "tokens)", use_ragged_sort=False)  # fmt: skip
RAGGED_BUFFER = (
    "MaxText's sparse path with expert parallelism (or use_ring_of_experts with use_ragged_sort) gives each expert shard a "
    "buffer of int(factor * its tokens * k) assignments and drops the rest in (sending shard, expert) order, a rule of the "
    "device layout nnxtron does not reproduce (the value is accepted where MaxText does not read it: factor <= 0, "
    "sparse_matmul=false, or one expert shard without ring-of-experts ragged sort)"
)
for _key in ("ragged_buffer_factor", "eval_ragged_buffer_factor"):
    _add(_key, Key(REFUSED, -1.0, RAGGED_BUFFER, f"use {_key}=-1 (dropless), or sparse_matmul=false with capacity_factor > 0 "
                   "for MaxText's per-sequence expert capacity", check=_ragged_buffer_unread(_key)))  # fmt: skip
MATMUL_PRECISION_ALIASES = {"bfloat16": "default", "float32": "highest"}
_translated("matmul_precision", "default", "matmul_precision; bfloat16 is default, float32 is highest (MaxText's aliases)",
            lambda v, c: {"matmul_precision": MATMUL_PRECISION_ALIASES.get(v, v)})  # fmt: skip
for _key in ("enable_nnx", "pure_nnx", "pure_nnx_decoder"):  # unknown to MaxText 0.2.5 as well (its Linen path is gone)
    _add(_key, Key(REFUSED, NOT_IN_BASE, "nnxtron has only the NNX path (MaxText's Linen decoder is not implemented)",
                   f"use {_key}=true or leave it out", check=_nnx))  # fmt: skip
