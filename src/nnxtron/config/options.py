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
DECODER_BLOCKS = ("llama2", "mistral", "mixtral", "qwen3", "qwen3_moe", "deepseek", "gemma3", "llama4", "gpt3", "deepseek4")
ATTENTION_TYPES = ("global", "mla", "compressed")  # mla: DeepSeek-V3 latent attention; compressed: DeepSeek-V4
ATTENTION_IMPLEMENTATIONS = ("xla", "dot_product", "cudnn")  # what attention=auto resolves to, per layer
ATTENTION_CHOICES = ("auto", *ATTENTION_IMPLEMENTATIONS)
ROPE_TYPES = ("default", "llama3", "yarn", "linear")  # linear: positions / rope_scaling_factor
ROUTER_SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
SUPPORTED_MLP_ACTIVATIONS = (("silu", "linear"), ("gelu", "linear"), ("gelu",))  # two = gated (GLU), one = plain MLP

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

NON_FINITE_POLICIES = ("stop", "skip")  # a NaN/Inf loss or gradient: stop the run, or skip that update
SAMPLING_STRATEGIES = ("greedy", "weighted", "topk", "nucleus")
