"""The typed configuration schema: the one source of truth for every option.

Types and constraints live here; default values live in ``presets/base.yml`` (every
field is required by the schema, so base.yml must name each one — a test checks it).
Key names follow MaxText's where MaxText has one.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DType = Literal["float32", "bfloat16"]
RematPolicy = Literal[
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
]
RematChoice = Literal["remat", "device", "offload"]  # per named activation, for remat_policy=custom
SUPPORTED_MLP_ACTIVATIONS = (("silu", "linear"),)


class Config(BaseModel):
    """Every option of a run. Unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- run ------------------------------------------------------------------
    run_name: str  # "" = a fresh timestamped name; an existing name resumes that run
    base_output_directory: str
    model_name: str  # preset chosen from config/presets/<model_name>.yml

    # --- model ----------------------------------------------------------------
    decoder_block: Literal["llama2", "mistral"]
    base_emb_dim: int = Field(gt=0)
    base_num_query_heads: int = Field(gt=0)
    base_num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(ge=-1)  # -1 = base_emb_dim // base_num_query_heads
    base_mlp_dim: int = Field(gt=0)
    base_num_decoder_layers: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    normalization_layer_epsilon: float = Field(gt=0)
    mlp_activations: tuple[str, ...]
    rope_type: Literal["default", "llama3"]
    rope_max_timescale: float = Field(gt=0)
    rope_interleave: bool  # False: rotate-half pairs (i, i+d/2) as HF Llama; True: (2i, 2i+1)
    rope_scaling_factor: float = Field(gt=0)
    rope_low_freq_factor: float = Field(gt=0)
    rope_high_freq_factor: float = Field(gt=0)
    rope_original_max_position_embeddings: int = Field(gt=0)
    sliding_window_size: int = Field(ge=0)  # 0 = full causal attention
    logits_via_embedding: bool  # tied output head
    final_logits_soft_cap: float = Field(ge=0)  # 0 = off
    dtype: DType  # activations
    weight_dtype: DType  # parameters

    # --- layer stacking and memory ----------------------------------------------
    scan_layers: bool
    remat_policy: RematPolicy
    # remat_policy=custom: what to do with each named activation (MaxText names)
    decoder_layer_input: RematChoice
    query_proj: RematChoice
    key_proj: RematChoice
    value_proj: RematChoice
    qkv_proj: RematChoice  # shorthand for query_proj + key_proj + value_proj when not "remat"
    context: RematChoice  # attention output, before the output projection
    out_proj: RematChoice
    mlpwi: RematChoice  # shorthand for mlpwi_0 + mlpwi_1 when not "remat"
    mlpwi_0: RematChoice
    mlpwi_1: RematChoice
    mlpwo: RematChoice
    parameter_memory_host_offload: bool
    optimizer_memory_host_offload: bool
    gradient_accumulation_steps: int = Field(gt=0)

    # --- parallelism ------------------------------------------------------------
    ici_data_parallelism: int = Field(ge=-1)
    ici_fsdp_parallelism: int = Field(ge=-1)
    ici_tensor_parallelism: int = Field(ge=-1)
    ici_context_parallelism: int = Field(ge=-1)
    sharding_tolerance: float = Field(ge=0, le=1)  # max fraction of parameter elements left unsharded
    logical_axis_rules: tuple[tuple[str, tuple[str, ...]], ...]

    # --- data -------------------------------------------------------------------
    dataset_type: Literal["synthetic", "text"]
    dataset_path: tuple[str, ...]
    tokenizer_type: Literal["byte"]
    add_bos: bool
    add_eos: bool
    eval_split_fraction: float = Field(ge=0, le=0.5)
    data_shuffle_seed: int
    per_device_batch_size: float = Field(gt=0)
    max_target_length: int = Field(gt=1)

    # --- optimisation -----------------------------------------------------------
    steps: int = Field(gt=0)
    learning_rate: float = Field(gt=0)
    warmup_steps_fraction: float = Field(ge=0, le=1)
    learning_rate_schedule_steps: int = Field(ge=-1)  # -1 = steps
    cosine_learning_rate_final_fraction: float = Field(ge=0, le=1)
    adam_b1: float = Field(ge=0, lt=1)
    adam_b2: float = Field(ge=0, lt=1)
    adam_eps: float = Field(gt=0)
    adam_weight_decay: float = Field(ge=0)
    gradient_clipping_threshold: float = Field(ge=0)  # 0 = off
    init_weights_seed: int

    # --- eval, checkpoints, logging ----------------------------------------------
    eval_interval: int = Field(ge=-1)  # -1 = no periodic eval
    eval_steps: int = Field(gt=0)
    enable_checkpointing: bool
    checkpoint_period: int = Field(gt=0)
    max_num_checkpoints_to_keep: int = Field(gt=0)
    load_parameters_path: str  # "" = fresh init; else an nnxtron checkpoint (e.g. from `convert from-hf`)
    log_period: int = Field(gt=0)  # progress-bar / TensorBoard flush period in steps
    enable_tensorboard: bool
    peak_tflops: float = Field(ge=0)  # 0 = look up (accelerators) or measure (CPU) once
    sample_after_training: int = Field(ge=0)  # tokens to sample at the end of `train` (0 = off)

    # --- sampling (generate) ------------------------------------------------------
    prompt: str
    max_new_tokens: int = Field(gt=0)
    decode_sampling_strategy: Literal["greedy", "weighted", "topk", "nucleus"]
    decode_sampling_temperature: float = Field(gt=0)
    decode_sampling_top_k: int = Field(gt=0)
    decode_sampling_nucleus_p: float = Field(gt=0, le=1)
    decode_sampling_seed: int

    @field_validator("dataset_path", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, value):
        return (value,) if isinstance(value, str) else value

    @field_validator("logical_axis_rules", mode="before")
    @classmethod
    def _normalise_rules(cls, value):
        if not isinstance(value, (list, tuple)):
            raise ValueError("must be a list of [logical_name, [mesh_axes...]] pairs")
        rules = []
        for rule in value:
            if not isinstance(rule, (list, tuple)) or len(rule) != 2:
                raise ValueError(f"each rule is [logical_name, mesh_axes], got {rule!r}")
            name, axes = rule
            axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            rules.append((name, axes))
        return tuple(rules)

    @model_validator(mode="after")
    def _check_combinations(self) -> "Config":
        if self.base_num_query_heads % self.base_num_kv_heads:
            raise ValueError(
                f"base_num_query_heads ({self.base_num_query_heads}) must be a multiple of "
                f"base_num_kv_heads ({self.base_num_kv_heads})"
            )
        if self.head_dim == -1 and self.base_emb_dim % self.base_num_query_heads:
            raise ValueError(
                f"base_emb_dim ({self.base_emb_dim}) is not divisible by base_num_query_heads "
                f"({self.base_num_query_heads}); set head_dim explicitly"
            )
        if self.head_dim == 0 or self.resolved_head_dim % 2:
            raise ValueError(f"head_dim must be a positive even number for RoPE, got {self.resolved_head_dim}")
        if tuple(self.mlp_activations) not in SUPPORTED_MLP_ACTIVATIONS:
            raise ValueError(
                f"mlp_activations {list(self.mlp_activations)} is not supported by decoder_block "
                f"{self.decoder_block}; use [silu, linear]"
            )
        if self.rope_type == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError("rope_high_freq_factor must exceed rope_low_freq_factor for rope_type=llama3")
        if self.dataset_type == "text" and not self.dataset_path:
            raise ValueError("dataset_type=text needs dataset_path (files, directories or globs)")
        if self.eval_interval > 0 and self.dataset_type == "text" and self.eval_split_fraction == 0:
            raise ValueError("eval_interval > 0 with dataset_type=text needs eval_split_fraction > 0 (or set eval_interval=-1)")
        return self

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim > 0 else self.base_emb_dim // self.base_num_query_heads
