"""The flag-sensitivity matrix: every config key, set to a valid non-default value, changes
something observable — or it is in ``nnxtron.config.inert.INERT`` with its reason.

``VALUES`` gives each key its value, the tiny family config where the key applies, the
observer that must see it (``tests/flags/observers.py``: by default the traced eval step — the
model's forward and its loss, at about a third of the train step's tracing; the traced train
step for keys that only the gradient, the optimizer or training's own forward read; the initial
weights, the batches, the files and output of ``nnxtron train`` ...) and
``base``: keys set in both the reference and the variant so that the key is read (e.g.
``opt_type=lion`` for ``lion_b1``). ``also`` (rare) is set in the variant only, for keys that
are legal only together with another (``csa_compress_ratio`` renames entries of
``compress_ratios``). Schema keys are iterated, so a new key fails here until it has an entry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
import pytest

import nnxtron
from nnxtron.config import load_config
from nnxtron.config.inert import INERT, INERT_UNLESS
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from tests.flags import observers as obs
from tests.flags import read_coverage

TRACE = {"max_target_length": 16, "per_device_batch_size": 1}  # every traced family: tiny shapes
FAMILIES: dict[str, dict[str, Any]] = {  # family -> what shrinks it further (the presets are already tiny)
    "llama3.1-tiny": {"base_num_decoder_layers": 2},
    "mixtral-tiny": {},
    "deepseek3-test": {},
    "deepseek4-test": {
        "base_num_decoder_layers": 3,
        "compress_ratios": (0, 4, 8),
        "first_num_hash_layers": 1,
        "sinkhorn_iterations": 3,
    },
    "gemma3-tiny": {"base_num_decoder_layers": 2, "sliding_window_pattern": 2},  # one local + one global layer
    "llama4-tiny": {},
    "gpt3-52k": {},
    "llama2-tiny": {"vocab_size": 320},  # data and run observers: a byte-level model
}
C = obs.corpus()
T = obs.tokenizers()
DATA = {"dataset_path": (C["text"],), "eval_split_fraction": 0.3, "max_target_length": 16}
SFT_DATA = {**DATA, "dataset_type": "jsonl", "dataset_path": (C["sft"],)}
DPO_DATA = {**DATA, "dataset_type": "jsonl", "dataset_path": (C["dpo"],), "packing": "pad", "max_target_length": 64}
DPO = {**DPO_DATA, "use_dpo": True}
LORA = {"lora_rank": 4}
RUN = {
    "dataset_path": (C["text"],), "eval_split_fraction": 0.3, "per_device_batch_size": 1, "max_target_length": 16,
    "base_num_decoder_layers": 1, "steps": 4, "eval_interval": 2, "eval_steps": 1, "checkpoint_period": 2,
    "log_period": 1, "sample_after_training": 0, "enable_tensorboard": False, "learning_rate": 0.01,
    "warmup_steps_fraction": 0.0,
}  # fmt: skip
CACHE_DIR = str(obs.WORK / "jax-cache")
PIPE = {"ici_pipeline_parallelism": 2, "base_num_decoder_layers": 4, "per_device_batch_size": 2}
QUANT = {"use_qwix_quantization": True, "quantization": "int8"}
MOE_PIPE = {"base_num_decoder_layers": 2, "per_device_batch_size": 2, "load_balance_loss_weight": 0.01}  # + its aux loss
GPIPE = {**PIPE, "num_layers_per_pipeline_stage": 2}  # one repeat
MAXTEXT_LR = {"lr_schedule_convention": "maxtext", "lr_schedule_type": "cosine"}
MAXTEXT_SCHEDULE_KEYS = ("learning_rate", "warmup_steps_fraction", "learning_rate_schedule_steps",
                         "cosine_learning_rate_final_fraction", "steps")  # fmt: skip
CUSTOM = {"remat_policy": "custom"}
BASELINE_RUN = "<baseline run>"  # a value: the run directory of the reference config, trained (tests/flags/observers.py)


TRACED_STEPS = ("eval_step", "train_step")  # the observers that trace a step of the tiny family config


@dataclass(frozen=True)
class Flag:
    value: Any
    observer: str = "eval_step"
    family: str = "llama3.1-tiny"
    base: dict[str, Any] = field(default_factory=dict)
    also: dict[str, Any] = field(default_factory=dict)


F = Flag
D, R = "llama2-tiny", "run"
VALUES: dict[str, Flag] = {
    # --- run
    "run_name": F("flagrun", "run_dir", D),
    "base_output_directory": F(str(obs.WORK / "elsewhere"), "run_dir", D),
    "model_name": F("qwen3-tiny"),
    "compilation_cache_dir": F(CACHE_DIR, "compile_cache", D),
    "compilation_cache_min_compile_seconds": F(7.0, "compile_cache", D, {"compilation_cache_dir": CACHE_DIR}),
    # --- model
    "decoder_block": F("gemma3"),
    "base_emb_dim": F(32),
    "base_num_query_heads": F(8),
    "base_num_kv_heads": F(4),
    "head_dim": F(8),
    "base_mlp_dim": F(64),
    "base_num_decoder_layers": F(3),
    "vocab_size": F(512),
    "normalization_layer_epsilon": F(1e-3),
    "mlp_activations": F(("gelu", "linear")),
    "rope_type": F("default"),
    "rope_max_timescale": F(10000.0),
    "rope_interleave": F(True),
    "rope_scaling_factor": F(4.0),
    "rope_low_freq_factor": F(2.0),
    "rope_high_freq_factor": F(8.0),
    "rope_original_max_position_embeddings": F(32),
    "max_position_embeddings": F(8, "sample", D, {"base_num_decoder_layers": 1}),  # decoding's limit (RoPE: HF ignores it)
    "beta_fast": F(128.0, family="deepseek3-test"),  # the yarn ramp of 4 frequencies moves
    "beta_slow": F(0.25, family="deepseek3-test"),
    "mscale": F(0.5, family="deepseek3-test"),
    "mscale_all_dim": F(0.5, family="deepseek3-test"),
    "rope_truncate": F(False, family="deepseek3-test"),  # its yarn correction range unrounded: other frequencies
    "sliding_window_size": F(8),
    "sliding_window_pattern": F(3, family="gemma3-tiny"),
    "local_rope_max_timescale": F(20000.0, family="gemma3-tiny"),
    "query_pre_attn_scalar": F(32.0, family="gemma3-tiny"),
    "nope_layer_interval": F(2, family="llama4-tiny"),
    "chunk_attn_window_size": F(4, family="llama4-tiny"),
    "temperature_tuning": F(False, family="llama4-tiny"),
    "temperature_tuning_floor_scale": F(4.0, family="llama4-tiny"),
    "temperature_tuning_scale": F(0.2, family="llama4-tiny"),
    "interleave_moe_layer_step": F(1, family="llama4-tiny"),
    "inhomogeneous_layer_cycle_interval": F(8, family="llama4-tiny"),
    "trainable_position_size": F(1024, family="gpt3-52k"),
    "attention_type": F("global", family="deepseek3-test"),
    "attention": F("dot_product"),
    "attention_query_block": F(8),  # TRACE: 16 tokens, two blocks of queries (lax.map) in the train step
    "use_qk_norm": F(True),
    "attention_bias": F(True),  # q/k/v/out biases: new parameters in the train step
    "attention_sink": F(False, "init", "gpt-oss-tiny"),  # the sinks leave the initial parameters (a model-building read)
    "q_lora_rank": F(0, family="deepseek3-test"),
    "kv_lora_rank": F(32, family="deepseek3-test"),
    "qk_nope_head_dim": F(8, family="deepseek3-test"),
    "qk_rope_head_dim": F(16, family="deepseek3-test"),
    "v_head_dim": F(8, family="deepseek3-test"),
    "compress_ratios": F((0, 8, 4), family="deepseek4-test"),
    "csa_compress_ratio": F(2, family="deepseek4-test", also={"compress_ratios": (0, 2, 8)}),
    "hca_compress_ratio": F(16, family="deepseek4-test", also={"compress_ratios": (0, 4, 16)}),
    "compressed_rope_max_timescale": F(80000.0, family="deepseek4-test"),
    "o_groups": F(4, family="deepseek4-test"),
    "o_lora_rank": F(4, family="deepseek4-test"),
    "indexer_n_heads": F(2, family="deepseek4-test"),
    "indexer_head_dim": F(16, family="deepseek4-test"),
    "indexer_topk": F(1, family="deepseek4-test"),
    "mhc_expansion_rate": F(2, family="deepseek4-test"),
    "sinkhorn_iterations": F(5, family="deepseek4-test"),
    "mhc_eps": F(1e-3, family="deepseek4-test"),
    "first_num_hash_layers": F(2, family="deepseek4-test"),
    "mlp_activations_limit": F(1.0, family="deepseek4-test"),
    "mlp_bias": F(False, "init", "gpt-oss-tiny"),  # the experts' biases leave the initial parameters (a model-building read)
    "gdn_conv_kernel_dim": F(2, family="qwen3-next-tiny"),  # Gated DeltaNet: a shorter causal conv
    "gdn_key_head_dim": F(16, family="qwen3-next-tiny"),
    "gdn_value_head_dim": F(16, family="qwen3-next-tiny"),
    "gdn_num_key_heads": F(1, family="qwen3-next-tiny"),
    "gdn_num_value_heads": F(2, family="qwen3-next-tiny"),
    "gdn_chunk_size": F(4, family="qwen3-next-tiny"),  # the delta rule 4 tokens at a time: another program
    "partial_rotary_factor": F(0.25, family="qwen3-next-tiny"),  # RoPE on 2 of the 8 dims of a full-attention head
    "global_head_dim": F(32, family="gemma4-tiny"),  # the global layer's heads 32 wide, not 16
    "global_num_kv_heads": F(2, family="gemma4-tiny"),
    "share_kv_projections": F(False, family="gemma4-tiny"),  # the global layer gets its value projection
    "global_rope_proportion": F(0.5, family="gemma4-tiny"),  # 4 of the global head's 8 frequencies rotate, not 2
    "local_rope_proportion": F(0.5, family="gemma4-tiny"),  # 2 of the sliding head's 4, not all
    # --- mixture of experts
    "num_experts": F(8, family="mixtral-tiny"),
    "num_experts_per_tok": F(1, family="mixtral-tiny"),
    "base_moe_mlp_dim": F(48, family="mixtral-tiny"),
    "shared_experts": F(2, family="deepseek3-test"),
    "first_num_dense_layers": F(2, family="deepseek3-test"),
    "dense_layers": F((1,), family="mixtral-tiny"),  # layer 1 becomes a dense MLP
    "routed_score_func": F("sigmoid", family="mixtral-tiny"),
    "norm_topk_prob": F(False, family="deepseek3-test"),
    "routed_scaling_factor": F(1.0, family="deepseek3-test"),
    "routed_bias": F(False, family="deepseek3-test"),
    "routed_bias_update_rate": F(0.01, "train_step", family="deepseek3-test"),
    "n_routing_groups": F(2, family="deepseek3-test", base={"n_routing_groups": 4, "topk_routing_group": 2}),
    "topk_routing_group": F(1, family="deepseek3-test", base={"n_routing_groups": 4, "topk_routing_group": 2}),
    "router_scales_expert_input": F(False, family="llama4-tiny"),
    "capacity_factor": F(1.0, family="mixtral-tiny"),
    "capacity_scope": F("sequence", family="mixtral-tiny", base={"capacity_factor": 1.0}),
    "moe_compute": F("dense", family="mixtral-tiny"),
    "grouped_matmul": F("ragged_dot", family="mixtral-tiny"),
    "moe_token_chunks": F(2, family="mixtral-tiny"),  # the experts' lax.map over token pieces in the train step
    "load_balance_loss_weight": F(0.01, family="mixtral-tiny"),
    "load_balance_convention": F("maxtext", family="mixtral-tiny", base={"load_balance_loss_weight": 0.01}),
    # --- multi-token prediction and the head
    "mtp_num_layers": F(1, family="deepseek3-test"),
    "mtp_loss_scaling_factor": F(0.3, family="deepseek3-test", base={"mtp_num_layers": 1}),
    "mtp_eval_target_module": F(1, "eval_step", "deepseek3-test", {"mtp_num_layers": 1}),
    "logits_via_embedding": F(False),
    "tied_head_bf16": F(True),
    "normalize_embedding_logits": F(True),  # llama3.1-tiny ties its head: logits / sqrt(emb_dim), std-1 table
    "final_logits_soft_cap": F(30.0),
    "attn_logits_soft_cap": F(1.0),  # llama3.1-tiny's attention logits (O(1)) capped at 1 in the train step
    "dtype": F("bfloat16"),
    "weight_dtype": F("bfloat16"),
    "matmul_precision": F("highest"),
    # --- layer stacking and memory
    "scan_layers": F(False),
    "remat_policy": F("minimal"),
    "decoder_layer_input": F("device", "train_step", base=CUSTOM),
    "query_proj": F("device", "train_step", base=CUSTOM),
    "key_proj": F("device", "train_step", base=CUSTOM),
    "value_proj": F("device", "train_step", base=CUSTOM),
    "qkv_proj": F("device", "train_step", base=CUSTOM),  # shorthand for query/key/value_proj
    "context": F("device", "train_step", base=CUSTOM),
    "out_proj": F("device", "train_step", base=CUSTOM),
    "mlpwi": F("device", "train_step", base=CUSTOM),
    "mlpwi_0": F("device", "train_step", base=CUSTOM),
    "mlpwi_1": F("device", "train_step", base=CUSTOM),
    # its post-MLP norm reads it (a pre-norm block's backward does not)
    "mlpwo": F("device", "train_step", family="gemma3-tiny", base=CUSTOM),
    "parameter_memory_host_offload": F(True),
    "optimizer_memory_host_offload": F(True),
    "gradient_accumulation_steps": F(2, "train_step", base={"per_device_batch_size": 2}),
    # --- parallelism
    "ici_data_parallelism": F(2),
    "ici_fsdp_parallelism": F(2, base={"ici_data_parallelism": -1, "ici_fsdp_parallelism": 1}),
    "ici_tensor_parallelism": F(2),
    "ici_context_parallelism": F(2),
    "context_parallel_strategy": F("all_gather", base={"ici_context_parallelism": 2}),
    "context_parallel_load_balance": F(False, base={"ici_context_parallelism": 2}),
    "ici_expert_parallelism": F(2, family="mixtral-tiny"),
    "sharding_tolerance": F(0.0, "setup"),
    "ici_pipeline_parallelism": F(2),
    "dcn_pipeline_parallelism": F(2),
    "num_pipeline_microbatches": F(4, base=PIPE),
    "num_layers_per_pipeline_stage": F(2, base=PIPE),
    "pipeline_parallel_layers": F(2, base=PIPE),
    "scan_pipeline_iterations": F(False, base=PIPE),
    "scan_pipeline_repeats": F(False, base=PIPE),
    "scan_layers_per_stage": F(False, base=GPIPE),
    "set_remat_policy_on_pipeline_iterations": F(False, base=PIPE),
    "set_remat_policy_on_layers_per_stage": F(True, base=PIPE),
    "pipeline_delay_activation_forwarding": F(True, base={**PIPE, "num_pipeline_microbatches": 4}),
    "pipeline_fsdp_ag_once": F(True, base=PIPE),
    "logical_axis_rules": F("activation_batch without fsdp"),  # replaced by RULES below
    # --- quantized training
    "use_qwix_quantization": F(True, also={"quantization": "int8"}),
    "quantization": F("fp8", base=QUANT),
    "qwix_module_path": F("(.*layers)/.*mlp.*", base=QUANT),
    "qwix_exclude_module_path": F(".*/(router|.*_hc|.*attention.*)", base=QUANT),
    "weight_quantization_calibration_method": F("absmax,0.9", base=QUANT),
    "act_quantization_calibration_method": F("absmax,0.9", base=QUANT),
    "bwd_quantization_calibration_method": F("minmax", "train_step", base=QUANT),
    "quantization_tile_size": F(16, base=QUANT),
    "quantization_bwd_tile_size": F(16, "train_step", base=QUANT),
    # --- data
    "dataset_type": F("synthetic", "data", D, DATA, also={"dataset_path": ()}),  # synthetic reads no dataset_path
    "dataset_path": F((C["text_a"],), "data", D, DATA),
    "dataset_weights": F((0.9, 0.1), "data", D, {**DATA, "dataset_path": (C["text_a"], C["text_b"])}),
    "grain_train_files": F(
        f"{C['text_a']}:0.5;{C['text_b']}:0.5", "data", D, {**DATA, "dataset_path": ("{python_stdlib}/*.py",)}
    ),
    "dataset_text_field": F("body", "data", D, {**DATA, "dataset_type": "jsonl", "dataset_path": (C["jsonl"],)}),
    "tokenizer_type": F("hf", "data", D, DATA, also={"tokenizer_path": T["bpe_a"]}),
    "tokenizer_path": F(T["bpe_b"], "data", D, {**DATA, "tokenizer_type": "hf", "tokenizer_path": T["bpe_a"]}),
    "add_bos": F(False, "data", D, DATA),
    "add_eos": F(False, "data", D, DATA),
    "packing": F("pad", "data", D, DATA),
    "truncate_documents": F(True, "data", D, DATA),
    "skip_bad_records": F(True, "data", D, {**DATA, "dataset_type": "jsonl", "dataset_path": (C["jsonl_bad"],)}),
    "use_sft": F(True, "data", D, SFT_DATA, also={"chat_template_path": C["template"]}),
    "sft_train_on_completion_only": F(False, "data", D, {**SFT_DATA, "use_sft": True, "chat_template_path": C["template"]}),
    "chat_template_path": F(C["template_b"], "data", D, {**SFT_DATA, "use_sft": True, "chat_template_path": C["template"]}),
    # 2 ms (the least a wait can be: it is counted in whole milliseconds) for a template that renders in ~20 ms
    "chat_template_timeout": F(0.002, "data", D, {**SFT_DATA, "use_sft": True, "chat_template_path": C["template_slow"]}),
    "chat_template_memory_mib": F(64, "data", D, {**SFT_DATA, "use_sft": True, "chat_template_path": C["template_big"]}),
    "chat_template_max_chars": F(20, "data", D, {**SFT_DATA, "use_sft": True, "chat_template_path": C["template"]}),
    "use_dpo": F(True, "data", D, DPO_DATA),
    "dpo_beta": F(0.3, "train_step", D, DPO),
    "dpo_label_smoothing": F(0.1, "train_step", D, DPO),
    "lora_rank": F(4, "train_step", D),
    "lora_alpha": F(32.0, "train_step", D, LORA),
    "lora_target_modules": F("attention/query$", "train_step", D, LORA),
    "lora_dropout": F(0.1, "train_step", D, LORA),
    "eval_split_fraction": F(0.5, "data", D, DATA),
    "data_shuffle_seed": F(7, "data", D, DATA),
    "data_num_epochs": F(1, "data", D, DATA),
    "data_read_threads": F(0, "data", D, DATA),
    "data_prefetch_batches": F(0, "data", D, DATA),
    "data_stats_documents": F(2, "data", D, DATA),
    "per_device_batch_size": F(2, "train_step"),
    "max_target_length": F(32, "train_step"),
    # --- optimisation
    "steps": F(100, "train_step"),
    "learning_rate": F(1e-3, "train_step"),
    "warmup_steps_fraction": F(0.2, "train_step"),
    "learning_rate_schedule_steps": F(200, "train_step"),
    "cosine_learning_rate_final_fraction": F(0.3, "train_step"),
    "lr_schedule_type": F("wsd", "train_step"),
    "learning_rate_final_fraction": F(0.3, "train_step", base={"lr_schedule_type": "linear"}),
    "wsd_decay_steps_fraction": F(0.3, "train_step", base={"lr_schedule_type": "wsd"}),
    "wsd_decay_style": F("cosine", "train_step", base={"lr_schedule_type": "wsd"}),
    "lr_schedule_convention": F("maxtext", "train_step"),
    "opt_type": F("lion"),
    "weight_decay_mask": F("all", "train_step"),
    "adam_b1": F(0.8, "train_step"),
    "adam_b2": F(0.99, "train_step"),
    "adam_eps": F(1e-6, "train_step"),
    "adam_weight_decay": F(0.01, "train_step"),
    "adafactor_decay_rate": F(0.5, "train_step", base={"opt_type": "adafactor"}),
    "adafactor_weight_decay": F(0.01, "train_step", base={"opt_type": "adafactor"}),
    "lion_b1": F(0.8, "train_step", base={"opt_type": "lion"}),
    "lion_b2": F(0.95, "train_step", base={"opt_type": "lion"}),
    "lion_weight_decay": F(0.01, "train_step", base={"opt_type": "lion"}),
    "sgd_momentum": F(0.9, base={"opt_type": "sgd"}),
    "muon_beta": F(0.9, "train_step", base={"opt_type": "muon"}),
    "muon_weight_decay": F(0.01, "train_step", base={"opt_type": "muon"}),
    "muon_consistent_rms": F(0.2, "train_step", base={"opt_type": "muon"}),
    "gradient_clipping_threshold": F(0.5, "train_step"),
    "non_finite_policy": F("skip", "train_step"),
    "init_weights_seed": F(3, "init"),
    "dropout_rate": F(0.1, "train_step"),
    "enable_dropout": F(False, "train_step", base={"dropout_rate": 0.1}),
    # --- eval, checkpoints, logging
    "eval_interval": F(1, R, D, RUN),
    "eval_steps": F(2, R, D, RUN),
    "enable_checkpointing": F(False, R, D, RUN),
    "checkpoint_period": F(1, R, D, RUN),
    "max_num_checkpoints_to_keep": F(1, R, D, RUN),
    "load_parameters_path": F(BASELINE_RUN, R, D, RUN),
    "init_from": F(BASELINE_RUN, R, D, RUN),
    "log_period": F(2, R, D, RUN),
    "enable_tensorboard": F(False, "metrics_writer", D),
    "enable_wandb": F(True, "metrics_writer", D, also={"wandb_mode": "offline"}),
    "wandb_project": F("p", "metrics_writer", D, {"enable_wandb": True}),
    "wandb_entity": F("e", "metrics_writer", D, {"enable_wandb": True}),
    "wandb_run_name": F("n", "metrics_writer", D, {"enable_wandb": True}),
    "wandb_mode": F("offline", "metrics_writer", D, {"enable_wandb": True}),
    "peak_tflops": F(50.0, "peak", D),
    "sample_after_training": F(4, R, D, RUN),
    # --- sampling
    "prompt": F("class ", "generate", D, {**RUN, "max_new_tokens": 6}),
    "max_new_tokens": F(3, "generate", D, {**RUN, "max_new_tokens": 6}),
    "decode_sampling_strategy": F("greedy", "sampler", D),
    "decode_sampling_temperature": F(0.3, "sampler", D),
    "decode_sampling_top_k": F(3, "sampler", D),
    "decode_sampling_nucleus_p": F(0.3, "sampler", D, {"decode_sampling_strategy": "nucleus"}),
    "decode_sampling_seed": F(5, "sampler", D),
}

# keys read on more than one path: each further context (label -> entry) is checked as well
MORE: dict[str, dict[str, Flag]] = {
    "adam_b1": {"muon": F(0.8, "train_step", base={"opt_type": "muon"})},  # muon's Adam for embeddings, norms and vectors
    "adam_b2": {"muon": F(0.99, "train_step", base={"opt_type": "muon"})},
    "adam_eps": {"muon": F(1e-6, "train_step", base={"opt_type": "muon"})},
    "adam_weight_decay": {"muon": F(0.01, "train_step", base={"opt_type": "muon"})},
    # Gemma 3 presets say true (HF's head there): false multiplies the tied logits by sqrt(emb_dim)
    "normalize_embedding_logits": {"gemma3": F(False, family="gemma3-tiny")},
    # the schedule keys under lr_schedule_convention=maxtext (train/schedules.py maxtext_schedule: its own reads)
    **{key: {"maxtext": replace(VALUES[key], base={**VALUES[key].base, **MAXTEXT_LR})} for key in MAXTEXT_SCHEDULE_KEYS},
    "wsd_decay_steps_fraction": {"maxtext": F(0.3, "train_step", base={**MAXTEXT_LR, "lr_schedule_type": "wsd"})},
    "wsd_decay_style": {"maxtext": F("cosine", "train_step", base={**MAXTEXT_LR, "lr_schedule_type": "wsd"})},
    "learning_rate_final_fraction": {"maxtext": F(0.3, "train_step", base={**MAXTEXT_LR, "lr_schedule_type": "wsd"})},
    # every pipeline schedule, both values (parallel/pipeline.py _Run.rounds: a scan over the rounds or a loop):
    # PIPE is circular (4 layers, 2 stages, 1 layer a stage: 2 repeats); GPipe is one repeat; host offload
    # fetches each round's weights from host memory
    "scan_pipeline_repeats": {
        "circular_true": F(True, base={**PIPE, "scan_pipeline_repeats": False}),
        "gpipe": F(False, base=GPIPE),
        "gpipe_true": F(True, base={**GPIPE, "scan_pipeline_repeats": False}),
        "host_offload": F(False, base={**PIPE, "parameter_memory_host_offload": True}),
        "host_offload_true": F(True, base={**PIPE, "parameter_memory_host_offload": True, "scan_pipeline_repeats": False}),
    },
    "scan_layers_per_stage": {
        "circular": F(False, base={**PIPE, "base_num_decoder_layers": 8, "num_layers_per_pipeline_stage": 2}),
        "host_offload": F(False, base={**GPIPE, "parameter_memory_host_offload": True}),
    },
}

WSD = {"lr_schedule_type": "wsd"}
MTP = {"mtp_num_layers": 1}
MIXTURE = {**DATA, "dataset_path": (C["text_a"], C["text_b"]), "dataset_weights": (0.5, 0.5)}
SYNTHETIC = {**DATA, "dataset_type": "synthetic", "dataset_path": ()}
# gemma3-tiny with one 4-layer cycle (3 sliding, 1 global) on 2 stages: one-layer blocks whose kind is data
SELECTED_PIPE = {
    "ici_pipeline_parallelism": 2,
    "base_num_decoder_layers": 4,
    "sliding_window_pattern": 4,
    "per_device_batch_size": 2,
}
PARTIAL = {"base_num_decoder_layers": 4, "per_device_batch_size": 2, "scan_layers": False}  # + pipeline_parallel_layers=2
MAXTEXT_BALANCE = {"load_balance_convention": "maxtext", "load_balance_loss_weight": 0.01}
# Contexts that run a key's further read sites (issue 54's backlog, tests/flags/read_coverage.py):
# each runs the named reader and changes its observation with the key.
READ_SITE_CASES: dict[str, dict[str, Flag]] = {
    # train/loop.py (the Trainer, the recorder), train/step.py, train/state.py, train/optimizer.py, train/schedules.py
    "per_device_batch_size": {"run": F(2, R, D, RUN)},
    "steps": {"run": F(3, R, D, {**RUN, "log_period": 2}), "wsd": F(100, "train_step", base=WSD)},
    "use_dpo": {"run": F(True, R, D, {**RUN, **DPO_DATA}), "train_step": F(True, "train_step", D, DPO_DATA)},
    "lora_rank": {"run": F(4, R, D, RUN), "init_from": F(4, R, D, {**RUN, "init_from": BASELINE_RUN})},
    "init_weights_seed": {"run": F(3, R, D, RUN), "dropout": F(3, "train_step", base={"dropout_rate": 0.1})},
    "logical_axis_rules": {
        "eval": F("activation_batch without fsdp", "eval_step"),
        "lora_frozen": F("embed without fsdp", "train_step", D, {**LORA, "sharding_tolerance": 1.0}),
    },
    "opt_type": {"muon": F("muon")},
    "learning_rate": {"wsd": F(1e-3, "train_step", base=WSD)},
    "learning_rate_final_fraction": {"wsd": F(0.3, "train_step", base=WSD)},
    "lr_schedule_type": {"maxtext": F("wsd", "train_step", base={"lr_schedule_convention": "maxtext"})},
    "learning_rate_schedule_steps": {"wsd": F(200, "train_step", base=WSD)},
    "warmup_steps_fraction": {"wsd": F(0.2, "train_step", base=WSD)},
    # pipelines: host offload, partial pipelines with unscanned layers, cycle blocks
    "parameter_memory_host_offload": {"pipeline": F(True, base=PIPE)},
    "pipeline_fsdp_ag_once": {
        "gpipe_host_offload": F(True, base={**GPIPE, "parameter_memory_host_offload": True}),
        "host_offload": F(True, base={**PIPE, "parameter_memory_host_offload": True}),
    },
    "num_pipeline_microbatches": {"moe": F(4, family="mixtral-tiny", base={**MOE_PIPE, "ici_pipeline_parallelism": 2})},
    "num_layers_per_pipeline_stage": {
        "cycle_blocks": F(12, family="gemma3-tiny", base={"ici_pipeline_parallelism": 2, "base_num_decoder_layers": 24}),
        # one-layer blocks whose attention kind is data (config/layout.selected_stacks): GPipe vs 2 repeats
        "selected_kinds": F(2, family="gemma3-tiny", base=SELECTED_PIPE),
    },
    "pipeline_parallel_layers": {"selected_kinds": F(2, family="gemma3-tiny", base=SELECTED_PIPE)},  # 2 of 4, 2 after
    "rope_interleave": {"selected_kinds": F(True, family="gemma3-tiny", base=SELECTED_PIPE)},  # the per-layer RoPE choice
    "ici_pipeline_parallelism": {
        "selected_kinds": F(2, family="gemma3-tiny", base={"per_device_batch_size": 2}),  # 1 whole cycle for 2 stages
        "moe": F(2, family="mixtral-tiny", base=MOE_PIPE),  # the router's auxiliary losses, a mean over microbatches
        "partial": F(2, base=PARTIAL, also={"pipeline_parallel_layers": 2}),
        "partial_unscanned_dropout": F(
            2, base={"scan_layers": False, "base_num_decoder_layers": 3, "dropout_rate": 0.1}, also={"pipeline_parallel_layers": 2}
        ),
    },
    "dcn_pipeline_parallelism": {
        "moe": F(2, family="mixtral-tiny", base=MOE_PIPE),
        "partial": F(2, base=PARTIAL, also={"pipeline_parallel_layers": 2}),
        "partial_unscanned_dropout": F(
            2, base={"scan_layers": False, "base_num_decoder_layers": 3, "dropout_rate": 0.1}, also={"pipeline_parallel_layers": 2}
        ),
    },
    "scan_layers": {"pipeline": F(False, base=PIPE)},
    # data: mixtures, synthetic batches, jsonl, tokenizers in runs and SFT
    "data_prefetch_batches": {"mixture": F(0, "data", D, MIXTURE)},
    "data_shuffle_seed": {"synthetic": F(7, "data", D, SYNTHETIC), "mixture": F(7, "data", D, MIXTURE)},
    "dataset_type": {
        "jsonl": F("jsonl", "data", D, {**DATA, "dataset_path": (C["jsonl"],)}),
        "score": F("jsonl", "score", D, {**DATA, "dataset_path": (C["jsonl"],), "eval_interval": 0}),
    },
    "max_target_length": {"data": F(32, "data", D, DATA), "quant": F(32, base=QUANT), "lm_eval": F(16, "lm_eval", D)},
    "vocab_size": {"synthetic": F(512, "data", D, SYNTHETIC)},
    "tokenizer_path": {
        "run": F(T["bpe_b"], R, D, {**RUN, "tokenizer_type": "hf", "tokenizer_path": T["bpe_a"]}),
        "sft": F(
            T["bpe_b"], "data", D,
            {**SFT_DATA, "use_sft": True, "chat_template_path": C["template"], "tokenizer_type": "hf", "tokenizer_path": T["bpe_a"]},
        ),
    },
    # (steps=3: its variant must not be another case's reference, whose run the observer has cached)
    "tokenizer_type": {"run": F("hf", R, D, {**RUN, "steps": 3}, also={"tokenizer_path": T["bpe_a"]})},
    # the chat prompt of `generate --chat`, the serving engine's context, a run stopped by a non-finite loss
    "prompt": {"chat": F("class ", "sample_chat", D, {"base_num_decoder_layers": 1})},
    "max_position_embeddings": {"serve": F(64, "serve_engine", D, {"base_num_decoder_layers": 1})},
    "non_finite_policy": {"run": F("skip", "run_outcome", D, {**RUN, "learning_rate": 1e30})},
    # the lm-eval adapter (infer/harness.py: nnxtron eval --tasks)
    "add_bos": {"lm_eval": F(False, "lm_eval", D)},
    # what `nnxtron eval` scores (infer/score.py), held out as the run was
    "eval_interval": {"score": F(0, "score", D, DATA)},
    "eval_split_fraction": {"score": F(0.5, "score", D, DATA)},
    "dataset_text_field": {"score": F("body", "score", D, {**DATA, "dataset_type": "jsonl", "dataset_path": (C["jsonl"],)})},
    "use_sft": {"score": F(True, "score", D, SFT_DATA, also={"chat_template_path": C["template"]})},
    # attention, RoPE (YaRN), MoE routing and balance
    "base_num_query_heads": {
        "mla": F(8, family="deepseek3-test", also={"base_num_kv_heads": 8}),
        "yarn": F(8, base={"rope_type": "yarn", "head_dim": -1}),
        "gpt3": F(4, family="gpt3-52k", also={"base_num_kv_heads": 4}),
    },
    "mlp_activations": {"moe": F(("gelu", "linear"), family="mixtral-tiny"), "gemma3": F(("silu", "linear"), family="gemma3-tiny")},
    "use_qwix_quantization": {"moe": F(True, family="mixtral-tiny", also={"quantization": "int8"})},
    "head_dim": {
        "yarn": F(8, base={"rope_type": "yarn"}),
        "deepseek4": F(8, family="deepseek4-test"),
        "gpt3": F(4, family="gpt3-52k"),
    },
    "rope_scaling_factor": {
        "yarn": F(4.0, family="deepseek3-test"),
        "yarn_no_mscale_all_dim": F(4.0, family="deepseek3-test", base={"mscale_all_dim": 0.0}),
    },
    "rope_type": {"mla": F("default", family="deepseek3-test")},
    "compressed_rope_max_timescale": {"yarn": F(80000.0, family="deepseek4-test", base={"rope_type": "yarn"})},
    "rope_max_timescale": {"yarn": F(20000.0, family="deepseek3-test"), "deepseek4": F(20000.0, family="deepseek4-test")},
    "rope_original_max_position_embeddings": {"yarn": F(32, family="deepseek3-test")},
    "mtp_num_layers": {"maxtext_balance": F(1, family="deepseek3-test", base=MAXTEXT_BALANCE)},
    "load_balance_convention": {"scales_input": F("maxtext", family="llama4-tiny", base={"load_balance_loss_weight": 0.01})},
    "routed_score_func": {"maxtext_balance": F("sigmoid", family="mixtral-tiny", base=MAXTEXT_BALANCE)},
    # families: DeepSeek-V4's blocks and compressed attention, GPT-3, MTP layers, dense layers of a MoE model
    "base_num_decoder_layers": {"dense_layers": F(3, family="mixtral-tiny", base={"dense_layers": (1,)})},
    "base_emb_dim": {"deepseek4": F(64, family="deepseek4-test"), "mtp": F(32, family="deepseek3-test", base=MTP)},
    "q_lora_rank": {"deepseek4": F(8, family="deepseek4-test")},
    "sliding_window_size": {"deepseek4": F(4, family="deepseek4-test")},
    "qk_rope_head_dim": {"deepseek4": F(4, family="deepseek4-test")},
    "base_mlp_dim": {"gpt3": F(32, family="gpt3-52k")},
    "dtype": {"mtp": F("bfloat16", family="deepseek3-test", base=MTP)},
    "weight_dtype": {"mtp": F("bfloat16", family="deepseek3-test", base=MTP)},
    "normalization_layer_epsilon": {"mtp": F(1e-3, family="deepseek3-test", base=MTP)},
    "dropout_rate": {"mtp": F(0.1, "train_step", family="deepseek3-test", base=MTP)},
}  # fmt: skip
# Qwen3-Next: its layer pattern (one full-attention layer in 4, not 2) and the Gated DeltaNet's own reads
Q3N = "qwen3-next-tiny"
for _key, _flag in {
    "inhomogeneous_layer_cycle_interval": F(4, family=Q3N),
    "base_emb_dim": F(64, family=Q3N),
    "normalization_layer_epsilon": F(1e-3, family=Q3N),
    "dtype": F("bfloat16", family=Q3N),
    "weight_dtype": F("bfloat16", family=Q3N),
    "head_dim": F(16, family=Q3N),  # the partial RoPE's width (config/qwen3_next.rotary_dim, layers/rope.apply_rope)
    "base_num_query_heads": F(8, family=Q3N),
}.items():
    MORE.setdefault(_key, {})["qwen3_next"] = _flag
# Gemma 4: its block's own widths (its preset shares llama3.1-tiny's emb 32 and MLP 64), its proportional RoPE's
# rotated pairs (RopeSpec.rotated_pairs reads the head width), the global layer's heads
G4 = "gemma4-tiny"
for _key, _flag in {
    "base_emb_dim": F(64, family=G4),
    "base_mlp_dim": F(32, family=G4),
    "head_dim": F(16, family=G4),
    "base_num_query_heads": F(2, family=G4),
}.items():
    MORE.setdefault(_key, {})["gemma4"] = _flag
# Qwen3.5: Qwen3-Next's layers, but its Gated DeltaNet's split input projections (their widths read base_emb_dim)
MORE.setdefault("base_emb_dim", {})["qwen3_5"] = F(64, family="qwen3.5-tiny")
for _key, _cases in READ_SITE_CASES.items():
    assert not set(_cases) & set(MORE.get(_key, {})), f"{_key}: a label of READ_SITE_CASES is already in MORE"
    MORE.setdefault(_key, {}).update(_cases)


def _rules_without_fsdp(logical: str) -> tuple:
    """base.yml's logical_axis_rules with ``fsdp`` taken off the ``logical`` axis."""
    rules = load_config().logical_axis_rules
    return tuple((name, tuple(a for a in axes if a != "fsdp") if name == logical else axes) for name, axes in rules)


def _value(key: str, flag: Flag) -> Any:
    """The variant value (a few depend on this process: rules, a baseline run to load)."""
    if key == "logical_axis_rules":  # "<axis> without fsdp"
        return _rules_without_fsdp(flag.value.split()[0])
    if flag.value == BASELINE_RUN:
        return obs.baseline_run(obs.frozen(_reference(flag)))
    return flag.value


def _reference(flag: Flag) -> dict[str, Any]:
    """The reference config; a ``BASELINE_RUN`` in ``base`` is the run directory of the same
    config trained without it (to start from)."""
    traced = flag.observer in (*TRACED_STEPS, "setup")
    values = {"model_name": flag.family, **(TRACE if traced else {}), **FAMILIES[flag.family], **flag.base}
    for key in [k for k, v in values.items() if v == BASELINE_RUN]:
        values[key] = obs.baseline_run(obs.frozen({k: v for k, v in values.items() if k != key}))
    return values


# A model key is read by each family's own module: a reader that one family drops or reads
# as another key hides behind the entry's family. So every key a family module reads
# (found in the source: ``cfg.<key>`` / ``config.<key>``) is also checked on that family,
# with the entry's value — or, where that family's config refuses the value, the refusal is
# what is checked (a refused flag is not an ignored one).
FAMILY_MODULES = {
    "models/gpt3.py": "gpt3-52k",
    "models/deepseek.py": "deepseek3-test",
    "layers/mla.py": "deepseek3-test",
    "models/deepseek4/": "deepseek4-test",
    "models/gemma.py": "gemma-tiny",
    "models/gemma3.py": "gemma3-tiny",
    "models/gemma4.py": "gemma4-tiny",
    "models/llama4.py": "llama4-tiny",
    "models/mixtral.py": "mixtral-tiny",
    "models/olmo3.py": "olmo3-tiny",
    "models/qwen2.py": "qwen2-tiny",
    "models/qwen3.py": "qwen3-tiny",
    "models/qwen3.py ": "qwen3-moe-tiny",  # the same module serves the MoE variant (a trailing space keeps the key unique)
    "models/simple.py": "simple_mlp-tiny",  # its one block class reads every key of both toy blocks (simple: mlp=False)
}
FAMILIES.setdefault("qwen2-tiny", {})
FAMILIES.setdefault("gemma-tiny", {})
FAMILIES.setdefault("olmo3-tiny", {})
FAMILIES.setdefault("gpt-oss-tiny", {})
FAMILIES.setdefault("qwen3-next-tiny", {})
FAMILIES.setdefault("qwen3.5-tiny", {})
FAMILIES.setdefault("gemma4-tiny", {})
FAMILIES.setdefault("qwen3-tiny", {})
FAMILIES.setdefault("qwen3-moe-tiny", {})
FAMILIES.setdefault("simple_mlp-tiny", {})


def family_readers() -> dict[str, set[str]]:
    """key -> the families whose own modules read it."""
    root = Path(nnxtron.__file__).parent
    found: dict[str, set[str]] = {}
    for module, family in FAMILY_MODULES.items():
        module = module.strip()
        for path in sorted(root.glob(f"{module}*.py") if module.endswith("/") else [root / module]):
            for key in re.findall(r"\b(?:cfg|config)\.([a-z_0-9]+)", path.read_text()):
                found.setdefault(key, set()).add(family)
    return found


def _family_contexts() -> dict[str, dict[str, Flag]]:
    """The further (key, family) checks: traced-step keys without companions, on the families
    that read them where the entry's value is not that family's own."""
    readers = family_readers()
    own = {family: load_config(values=_reference(Flag(None, family=family))) for family in set(FAMILY_MODULES.values())}
    contexts: dict[str, dict[str, Flag]] = {}
    for key, flag in sorted(VALUES.items()):
        if flag.observer not in TRACED_STEPS or flag.base or flag.also:
            continue
        for family in sorted(readers.get(key, set()) - {flag.family}):
            if getattr(own[family], key) != flag.value:
                contexts.setdefault(key, {})[family] = replace(flag, family=family)
    return contexts


FAMILY_CONTEXTS = _family_contexts()
CASES = (
    [pytest.param(key, flag, id=key) for key, flag in sorted(VALUES.items())]
    + [pytest.param(key, flag, id=f"{key}-{label}") for key, more in sorted(MORE.items()) for label, flag in more.items()]
    + [pytest.param(key, flag, id=f"{key}-{family}") for key, more in FAMILY_CONTEXTS.items() for family, flag in more.items()]
)


def test_every_schema_key_has_one_entry():
    keys = set(Config.model_fields)
    assert not keys - set(VALUES) - set(INERT), (
        f"keys with neither a matrix entry nor an INERT reason: {sorted(keys - set(VALUES) - set(INERT))}"
    )
    assert not set(VALUES) & set(INERT), f"keys both in the matrix and in INERT: {sorted(set(VALUES) & set(INERT))}"
    assert not (set(VALUES) | set(INERT)) - keys, (
        f"entries for keys the schema does not have: {sorted((set(VALUES) | set(INERT)) - keys)}"
    )
    assert all(reason.strip() for reason in INERT.values())
    assert set(MORE) <= set(VALUES), "a further context of a key without its main entry"


@pytest.mark.parametrize("key, flag", CASES)
def test_flag_changes_its_observation(key, flag, request):
    """The observation changes; the read sites of the key that ran meanwhile are recorded
    (tests/flags/read_coverage.py judges them when the whole matrix has run)."""
    recorder = read_coverage.Recorder(key)
    read_coverage.clear_package_caches()
    try:
        _assert_observation_changes(key, flag, recorder)
    finally:
        read_coverage.save(request.node.callspec.id, key, recorder.hit, len(CASES), recorder.traced)


def _assert_observation_changes(key: str, flag: Flag, recorder: read_coverage.Recorder) -> None:
    observe = obs.OBSERVERS[flag.observer]
    reference = _reference(flag)
    value = _value(key, flag)
    variant = {**reference, key: value, **flag.also}
    ref_cfg = load_config(values=reference)
    further = flag.family in FAMILY_CONTEXTS.get(key, {}) and FAMILY_CONTEXTS[key][flag.family] is flag
    if further:
        try:  # a further family: its config may refuse the value (then the flag is refused, not ignored)
            with recorder:
                var_cfg = load_config(values=variant)
        except ConfigError:
            recorder.hit.clear()  # refused, not ignored: but no observation proves the sites that ran
            return
    else:
        with recorder:  # the config's own derivations (cached per config, so not run again when observed)
            var_cfg = load_config(values=variant)  # both must be valid
    assert getattr(var_cfg, key) != getattr(ref_cfg, key), f"{key}={value!r} is the reference config's own value"
    when = INERT_UNLESS.get(key)
    if when is not None and not when.reads(var_cfg):
        assert further, f"{key}'s own entry must be a config that reads it ({when.condition})"
        recorder.hit.clear()  # the observation does not change here: nothing is proven
        _assert_inert(key, value, flag, reference, variant)
        return
    try:
        with recorder, obs.retraining():
            observed = observe(obs.frozen(variant))
    except ConfigError:
        if further:  # refused when the model is built (e.g. a family without MoE layers): not ignored
            recorder.hit.clear()
            return
        raise
    assert observed != _baseline(flag.observer, obs.frozen(reference)), (
        f"{key}={value!r} changed nothing the '{flag.observer}' observer sees ({flag.family}, base {flag.base}): the key "
        "is not read, or read as another; fix the reader, or list the key in nnxtron/config/inert.py with its reason"
    )


def _fresh_observation(observer: str, values: dict) -> Any:
    """The observation on empty JAX caches: a traced program prints a sub-jaxpr by name where the
    same object occurs twice, and whether JAX's bounded tracing caches hand out one object or
    two depends on what the process traced before (seen in full-suite runs)."""
    jax.clear_caches()
    return obs.OBSERVERS[observer](obs.frozen(values))


def _assert_inert(key: str, value: Any, flag: Flag, reference: dict, variant: dict) -> None:
    """INERT_UNLESS says the key is not read here: the observation must indeed not change
    (both observed from the same, empty, caches)."""
    assert _fresh_observation(flag.observer, variant) == _fresh_observation(flag.observer, reference), (
        f"{key}={value!r} changed the '{flag.observer}' observation on {flag.family}, where nnxtron/config/inert.py "
        f"says it is read only when {INERT_UNLESS[key].condition}: update that table"
    )


@pytest.mark.parametrize("key", sorted(INERT_UNLESS))
def test_read_only_when_keys_are_inert_elsewhere(key):
    """Each INERT_UNLESS key, on the first traced family that does not read it, changes nothing
    (so the table stays true); its matrix entry shows it is read where the condition holds."""
    flag = VALUES[key]
    when = INERT_UNLESS[key]
    assert when.reads(load_config(values={**_reference(flag), key: _value(key, flag)}))
    for family in FAMILIES:
        other = replace(flag, family=family, base={})
        reference = _reference(other)
        try:
            variant_cfg = load_config(values={**reference, key: _value(key, flag)})
        except ConfigError:
            continue  # refused here: not an ignored value
        if not when.reads(variant_cfg) and getattr(variant_cfg, key) != getattr(load_config(values=reference), key):
            _assert_inert(key, flag.value, other, reference, {**reference, key: _value(key, flag)})
            return
    pytest.fail(f"no traced family leaves {key} unread; drop it from INERT_UNLESS")


_BASELINES: dict = {}


def _baseline(observer: str, reference: obs.Overrides) -> Any:
    """The reference observation, once per (observer, reference config) in this process."""
    if (observer, reference) not in _BASELINES:
        _BASELINES[observer, reference] = obs.OBSERVERS[observer](reference)
    return _BASELINES[observer, reference]


def test_config_show_prints_the_inert_table(capsys):
    from nnxtron.cli import main

    assert main(["config", "show", "--inert"]) == 0
    out = capsys.readouterr().out
    assert all(f"{key}  {reason}" in out for key, reason in INERT.items()) if INERT else "(none" in out
