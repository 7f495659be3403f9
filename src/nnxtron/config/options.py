"""Every closed list of option values, defined once.

The schema's ``Literal`` types are built from these tuples, and the code that acts on an
option (the remat policies, the quantization types, the tokenizers, the family registry
...) reads the same tuple, so a new value is added in one place and a module that does
not handle it fails loudly (``tests/unit/test_options.py`` ties each table to its user).
The ``*_OFF`` tables are the values that mean "not used"; ``base.yml`` holds the same
values (tested).
"""

from __future__ import annotations

from typing import Any

DTYPES = ("float32", "bfloat16")
# the decoder families (models/registry.py builds one Family per name and checks it has them all)
DECODER_BLOCKS = (
    "llama2",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "deepseek",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma4",  # Gemma 4 text decoder (26B-A4B MoE, 31B dense): MaxText's gemma4 block, HF Gemma4ForCausalLM
    "llama4",
    "gpt3",
    "deepseek4",
    "olmo3",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5",  # Qwen3.5 text decoder (MoE): Qwen3-Next's computation, HF's split DeltaNet projections
    "simple",  # MaxText's toy blocks (models/simple.py): no HF counterpart
    "simple_mlp",
)
ATTENTION_TYPES = ("global", "mla", "compressed")  # mla: DeepSeek-V3 latent attention; compressed: DeepSeek-V4
ATTENTION_IMPLEMENTATIONS = ("xla", "dot_product", "cudnn", "splash")  # what attention=auto resolves to, per layer
ATTENTION_CHOICES = ("auto", *ATTENTION_IMPLEMENTATIONS)
# context parallelism (parallel/ring_attention.py): keys/values pass around the context axis, or are gathered
CONTEXT_PARALLEL_STRATEGIES = ("ring", "all_gather")
ROPE_TYPES = ("default", "llama3", "yarn", "linear")  # linear: positions / rope_scaling_factor
ROUTER_SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
CAPACITY_SCOPES = ("call", "sequence")  # capacity_factor > 0: over all tokens of a MoE call, or per sequence (MaxText)
# MoE load-balance loss (layers/router.py): nnxtron = over all tokens of a call, summed over layers; maxtext =
# per sequence, averaged over the MoE layers (MaxText 0.2.5 load_balance_loss; docs/moe.md)
LOAD_BALANCE_CONVENTIONS = ("nnxtron", "maxtext")
MOE_COMPUTES = ("grouped", "dense")  # routed experts: a grouped matmul on the routed tokens, or every expert on every token
# moe_compute=grouped (parallel/grouped_matmul.py): auto = ragged_dot on TPU or quantized, blocked elsewhere
GROUPED_MATMULS = ("auto", "ragged_dot", "blocked")
MATMUL_PRECISIONS = ("default", "high", "highest")  # jax.lax.Precision of the model's matmuls (MaxText's names)
# two = gated (GLU), one = plain MLP (gpt3 only: config/families.py)
SUPPORTED_MLP_ACTIVATIONS = (("silu", "linear"), ("gelu", "linear"), ("gelu",), ("sigmoid", "linear"))  # sigmoid: gpt_oss only

# remat (parallel/remat.py gives each policy its jax.checkpoint policy)
REMAT_POLICIES = (
    "none",
    "full",
    "minimal",
    "minimal_with_context",
    "save_dot_with_context_except_mlp",
    "save_dot_except_mlpwi",
    "save_dot_except_mlp",
    "save_qkv_proj",
    "save_out_proj",
    "qkv_proj_offloaded",
    "minimal_offloaded",
    "custom",
)
REMAT_CHOICES = ("remat", "device", "offload")  # per named activation, for remat_policy=custom

# quantized training (models/quant.py): mode -> (forward, backward) element type names
QUANTIZATION_MODES: dict[str, tuple[str, str]] = {
    "int8": ("int8", "int8"),
    "fp8": ("float8_e4m3fn", "float8_e4m3fn"),  # MaxText's name for fp8_e4m3
    "fp8_e4m3": ("float8_e4m3fn", "float8_e4m3fn"),
    "fp8_e5m2": ("float8_e5m2", "float8_e5m2"),
    "fp8_full": ("float8_e4m3fn", "float8_e5m2"),
}
QUANTIZATION_OPTIONS_OFF: dict[str, Any] = {  # their base.yml values; any other value needs quantization on
    "qwix_module_path": "(.*layers|mtp)/.*",  # every decoder layer stack and the MTP depths
    "qwix_exclude_module_path": ".*/(router|.*_hc)",  # MoE routers, DeepSeek-V4 hyper-connection mixing
    "weight_quantization_calibration_method": "absmax",
    "act_quantization_calibration_method": "absmax",
    "bwd_quantization_calibration_method": "absmax",
    "quantization_tile_size": 0,
    "quantization_bwd_tile_size": 0,
}
CALIBRATION_ARGS = {"absmax": (0, 1), "minmax": (0, 1), "rms": (1, 1), "fixed": (2, 2)}  # method -> (min, max) numbers

# pipeline parallelism (config/pipeline.py): option -> the value that means "not used"; set
# with one stage, any other value is an error
PIPELINE_OPTIONS_OFF: dict[str, Any] = {
    "num_pipeline_microbatches": -1,
    "num_pipeline_repeats": -1,
    "num_layers_per_pipeline_stage": 1,
    "pipeline_parallel_layers": -1,
    "scan_pipeline_iterations": True,
    "scan_pipeline_repeats": True,
    "scan_layers_per_stage": True,
    "set_remat_policy_on_pipeline_iterations": True,
    "set_remat_policy_on_layers_per_stage": False,
    "pipeline_delay_activation_forwarding": False,
    "pipeline_fsdp_ag_once": False,
}

# data (data/records.py opens the formats, data/tokenizer.py builds the tokenizers)
DATASET_FORMATS = ("text", "jsonl", "parquet", "arrayrecord")
DATASET_TYPES = ("synthetic", *DATASET_FORMATS)
TOKENIZER_TYPES = ("byte", "hf", "sentencepiece", "tiktoken")
PACKING_MODES = ("concat", "pad")  # concat: documents flow across rows; pad: each row starts a document

# learning-rate schedules and optimizers (train/schedules.py, train/optimizer.py; docs/optimizers.md):
# a schedule or optimizer reads exactly its keys here; any other of these keys set to a value
# other than its base.yml default (OPTIMIZATION_DEFAULTS, tested) is an error (config/checks.py)
LR_SCHEDULES = ("cosine", "wsd", "linear", "constant")  # each after the linear warm-up; MaxText has cosine, wsd
WSD_DECAY_STYLES = ("linear", "cosine")
# maxtext: MaxText's schedule arithmetic (warm-up steps int(), its decays reach the final value at the last
# schedule step, 0 after learning_rate_schedule_steps); cosine and wsd only (train/schedules.py)
LR_SCHEDULE_CONVENTIONS = ("nnxtron", "maxtext")
WEIGHT_DECAY_MASKS = ("matrices", "all")  # decoupled weight decay on rank >= 2 parameters, or on every parameter (MaxText)
SCHEDULE_KEYS: dict[str, tuple[str, ...]] = {
    "cosine": ("cosine_learning_rate_final_fraction",),
    "wsd": ("learning_rate_final_fraction", "wsd_decay_steps_fraction", "wsd_decay_style"),
    "linear": ("learning_rate_final_fraction",),
    "constant": (),
}
OPTIMIZERS = ("adamw", "adafactor", "lion", "sgd", "muon")  # MaxText has adamw, adam_pax, sgd, muon
_ADAM_KEYS = ("adam_b1", "adam_b2", "adam_eps", "adam_weight_decay")
OPTIMIZER_KEYS: dict[str, tuple[str, ...]] = {
    "adamw": _ADAM_KEYS,
    "adafactor": ("adafactor_decay_rate", "adafactor_weight_decay"),
    "lion": ("lion_b1", "lion_b2", "lion_weight_decay"),
    "sgd": ("sgd_momentum",),
    "muon": ("muon_beta", "muon_weight_decay", "muon_consistent_rms", *_ADAM_KEYS),  # Adam: embeddings, norms, vectors
}
OPTIMIZATION_DEFAULTS: dict[str, Any] = {  # their base.yml values
    "cosine_learning_rate_final_fraction": 0.1,
    "learning_rate_final_fraction": 0.1,
    "wsd_decay_steps_fraction": 0.1,
    "wsd_decay_style": "linear",
    "adam_b1": 0.9,
    "adam_b2": 0.95,
    "adam_eps": 1.0e-8,
    "adam_weight_decay": 0.1,
    "adafactor_decay_rate": 0.8,
    "adafactor_weight_decay": 0.0,
    "lion_b1": 0.9,
    "lion_b2": 0.99,
    "lion_weight_decay": 1.0e-3,
    "sgd_momentum": 0.0,
    "muon_beta": 0.95,
    "muon_weight_decay": 0.0,
    "muon_consistent_rms": 0.0,
}

NON_FINITE_POLICIES = ("stop", "skip")  # a NaN/Inf loss or gradient: stop the run, or skip that update
SAMPLING_STRATEGIES = ("greedy", "weighted", "topk", "nucleus")

# mixture of experts: the MoE keys' base.yml values, which MaxText's base.yml shares; any other
# value needs num_experts > 1 (a dense model never reads them). The MoE keys whose MaxText
# defaults differ from nnxtron's (norm_topk_prob, base_moe_mlp_dim, routed_score_func's ""),
# are listed in config/inert.py for dense models instead, so MaxText configs keep loading.
MOE_OPTIONS_OFF: dict[str, Any] = {
    "num_experts_per_tok": 1,
    "shared_experts": 0,
    "first_num_dense_layers": 0,
    "dense_layers": (),
    "routed_scaling_factor": 1.0,
    "routed_bias": False,
    "routed_bias_update_rate": 0.0,
    "n_routing_groups": -1,
    "topk_routing_group": -1,
    "router_scales_expert_input": False,
    "capacity_factor": -1.0,
    "capacity_scope": "call",
    "grouped_matmul": "auto",
    "moe_token_chunks": 1,
    "load_balance_loss_weight": 0.0,
}

# Weights & Biases (train/wandb_logger.py passes it to wandb.init): "" = W&B's own choice (WANDB_MODE, else online)
WANDB_MODES = ("", "online", "offline")
# the wandb_* keys' base.yml values; any other value needs enable_wandb=true
WANDB_OPTIONS_OFF: dict[str, Any] = {"wandb_project": "", "wandb_entity": "", "wandb_run_name": "", "wandb_mode": ""}
