"""The typed configuration schema: the one source of truth for every option.

Types and constraints live here; default values live in ``presets/base.yml`` (every
field is required by the schema, so base.yml must name each one — a test checks it).
Key names follow MaxText's where MaxText has one.
"""

from __future__ import annotations

import math
import re
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
QUANTIZATION_MODES = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_full")
QUANTIZATION_OPTIONS_OFF: dict[str, object] = {  # their base.yml values; any other value needs quantization on
    "qwix_module_path": "(.*layers|mtp)/.*",  # every decoder layer stack and the MTP depths
    "qwix_exclude_module_path": ".*/(router|.*_hc)",  # MoE routers, DeepSeek-V4 hyper-connection mixing
    "weight_quantization_calibration_method": "absmax",
    "act_quantization_calibration_method": "absmax",
    "bwd_quantization_calibration_method": "absmax",
    "quantization_tile_size": 0,
    "quantization_bwd_tile_size": 0,
}
CALIBRATION_ARGS = {"absmax": (0, 1), "minmax": (0, 1), "rms": (1, 1), "fixed": (2, 2)}  # method -> (min, max) numbers


def _check_calibration(key: str, value: str) -> None:
    """qwix's calibration syntax: ``<method>[,<number>...]``."""
    method, *args = [part.strip() for part in value.split(",")]
    lo, hi = CALIBRATION_ARGS.get(method, (-1, -1))
    if lo < 0:
        raise ValueError(f"{key}={value!r}: unknown calibration method {method!r}; use one of {sorted(CALIBRATION_ARGS)}")
    if not lo <= len(args) <= hi:
        raise ValueError(f"{key}={value!r}: {method} takes {lo if lo == hi else f'{lo} to {hi}'} number(s) after the name")
    for arg in args:
        try:
            float(arg)
        except ValueError:
            raise ValueError(f"{key}={value!r}: {arg!r} is not a number") from None


SUPPORTED_MLP_ACTIVATIONS = (("silu", "linear"), ("gelu", "linear"), ("gelu",))  # two = gated (GLU), one = plain MLP


class Config(BaseModel):
    """Every option of a run. Unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- run ------------------------------------------------------------------
    run_name: str  # "" = a fresh timestamped name; an existing name resumes that run
    base_output_directory: str
    model_name: str  # preset chosen from config/presets/<model_name>.yml
    # persistent compilation cache (nnxtron/compile_cache.py): a restarted run loads its compiled steps
    compilation_cache_dir: str  # "" = off; "~" is expanded; env JAX_COMPILATION_CACHE_DIR replaces the base.yml default
    compilation_cache_min_compile_seconds: float = Field(ge=0)  # only compiles at least this long are stored

    # --- model ----------------------------------------------------------------
    decoder_block: Literal[
        "llama2", "mistral", "mixtral", "qwen3", "qwen3_moe", "deepseek", "gemma3", "llama4", "gpt3", "deepseek4"
    ]
    base_emb_dim: int = Field(gt=0)
    base_num_query_heads: int = Field(gt=0)
    base_num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(ge=-1)  # -1 = base_emb_dim // base_num_query_heads
    base_mlp_dim: int = Field(gt=0)
    base_num_decoder_layers: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    normalization_layer_epsilon: float = Field(gt=0)
    mlp_activations: tuple[str, ...]
    rope_type: Literal["default", "llama3", "yarn", "linear"]  # linear: positions / rope_scaling_factor
    rope_max_timescale: float = Field(gt=0)
    rope_interleave: bool  # False: rotate-half pairs (i, i+d/2) as HF Llama; True: (2i, 2i+1)
    rope_scaling_factor: float = Field(gt=0)
    rope_low_freq_factor: float = Field(gt=0)
    rope_high_freq_factor: float = Field(gt=0)
    rope_original_max_position_embeddings: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)  # HF max_position_embeddings (context the RoPE scaling targets)
    beta_fast: float = Field(gt=0)  # yarn ramp (HF rope_scaling beta_fast)
    beta_slow: float = Field(gt=0)  # yarn ramp (HF rope_scaling beta_slow)
    mscale: float = Field(ge=0)  # yarn (HF mscale; 0 = unset): cos/sin x m(mscale)/m(mscale_all_dim) when both set, else m(1)
    mscale_all_dim: float = Field(ge=0)  # yarn (HF rope_scaling mscale_all_dim): softmax scale x m(mscale_all_dim)^2
    sliding_window_size: int = Field(ge=0)  # 0 = full causal attention
    # --- layer patterns (Gemma 3, Llama 4): layer i is 0-based; see models/pattern.py ---
    sliding_window_pattern: int = Field(ge=0)  # > 0: layer i is global iff (i+1) % pattern == 0, else sliding (Gemma 3: 6)
    local_rope_max_timescale: float = Field(
        ge=0
    )  # RoPE theta of sliding layers under a pattern (0 = rope_max_timescale, unscaled)
    query_pre_attn_scalar: float = Field(ge=0)  # attention logits x query_pre_attn_scalar^-0.5 (0 = head_dim)
    nope_layer_interval: int = Field(ge=0)  # > 0: layer i has no RoPE iff (i+1) % interval == 0 (Llama 4: 4)
    chunk_attn_window_size: int = Field(ge=0)  # > 0: RoPE layers attend within aligned chunks of this size (Llama 4)
    temperature_tuning: bool  # Llama 4: NoPE layers scale q by log1p(floor((pos+1)/floor_scale))*scale + 1
    temperature_tuning_floor_scale: float = Field(gt=0)
    temperature_tuning_scale: float = Field(ge=0)
    interleave_moe_layer_step: int = Field(gt=0)  # MoE models: layer i is MoE iff (i+1) % step == 0 (Llama 4 Maverick: 2)
    inhomogeneous_layer_cycle_interval: int = Field(ge=0)  # layers per scanned block (0 = the pattern's period)
    trainable_position_size: int = Field(ge=0)  # > 0: learned absolute position embeddings (GPT-3), no RoPE
    attention_type: Literal["global", "mla", "compressed"]  # mla: DeepSeek-V3 latent attention; compressed: DeepSeek-V4
    # implementation of attention_type=global (docs/attention.md); auto: cudnn on a CUDA GPU where it runs, else xla
    attention: Literal["auto", "xla", "dot_product", "cudnn"]
    use_qk_norm: bool  # q/k norm over head_dim: RMSNorm before RoPE (Qwen3, Gemma 3 (1+w)); weightless L2 after RoPE (Llama 4)
    q_lora_rank: int = Field(ge=0)  # mla: 0 = plain query projection
    kv_lora_rank: int = Field(gt=0)  # mla
    qk_nope_head_dim: int = Field(gt=0)  # mla
    qk_rope_head_dim: int = Field(gt=0)  # mla
    v_head_dim: int = Field(gt=0)  # mla
    # --- DeepSeek-V4 (attention_type=compressed, decoder_block=deepseek4) ---
    compress_ratios: tuple[int, ...]  # per layer: 0 sliding only, csa_compress_ratio (CSA), hca_compress_ratio (HCA)
    csa_compress_ratio: int = Field(gt=0)  # HF compress_rates.compressed_sparse_attention (overlapping windows + indexer)
    hca_compress_ratio: int = Field(gt=0)  # HF compress_rates.heavily_compressed_attention (non-overlapping windows)
    compressed_rope_max_timescale: float = Field(gt=0)  # RoPE theta of CSA/HCA layers (HF compress_rope_theta)
    o_groups: int = Field(gt=0)  # grouped low-rank output projection: groups
    o_lora_rank: int = Field(gt=0)  # ... and rank per group
    indexer_n_heads: int = Field(gt=0)  # lightning indexer (CSA layers)
    indexer_head_dim: int = Field(gt=0)
    indexer_topk: int = Field(gt=0)  # compressed entries each query attends to on CSA layers
    mhc_expansion_rate: int = Field(gt=0)  # residual streams of the hyper-connections (1 = off)
    sinkhorn_iterations: int = Field(gt=0)
    mhc_eps: float = Field(gt=0)  # HF hc_eps
    first_num_hash_layers: int = Field(ge=0)  # leading MoE layers routed by the non-trainable token->expert table
    mlp_activations_limit: float = Field(ge=0)  # SwiGLU clamp (HF swiglu_limit): gate <= L, |up| <= L; 0 = off

    # --- mixture of experts -------------------------------------------------------
    num_experts: int = Field(gt=0)  # 1 = dense MLP layers
    num_experts_per_tok: int = Field(gt=0)
    base_moe_mlp_dim: int = Field(gt=0)  # hidden size of each routed (and shared) expert
    shared_experts: int = Field(ge=0)  # always-on experts: one MLP of shared_experts x base_moe_mlp_dim
    first_num_dense_layers: int = Field(ge=0)  # leading dense layers (their own scanned stack)
    routed_score_func: Literal["softmax", "sigmoid", "sqrtsoftplus"]
    norm_topk_prob: bool  # renormalise the selected experts' weights to sum to 1
    routed_scaling_factor: float = Field(gt=0)  # multiplies the combine weights (DeepSeek)
    routed_bias: bool  # correction bias added to the scores for selection only (DeepSeek)
    routed_bias_update_rate: float = Field(ge=0)  # loss-free balancing: bias += rate * sign(mean load - load)
    n_routing_groups: int = Field(ge=-1)  # group-limited routing: groups of experts (-1 = off)
    topk_routing_group: int = Field(ge=-1)  # group-limited routing: groups kept per token (-1 = off)
    router_scales_expert_input: bool  # Llama 4: sigmoid(top-1 logit) scales the expert input, not its output
    capacity_factor: float  # -1 = dropless; > 0: each expert takes at most factor * tokens * k / experts tokens
    load_balance_loss_weight: float = Field(ge=0)  # 0 = off

    # --- multi-token prediction ---------------------------------------------------
    mtp_num_layers: int = Field(ge=0)  # 0 = off
    mtp_loss_scaling_factor: float = Field(ge=0)
    mtp_eval_target_module: int = Field(ge=0)  # eval reports this MTP depth's acceptance rate (0 = off)
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
    ici_expert_parallelism: int = Field(ge=-1)  # experts split over the `expert` mesh axis
    sharding_tolerance: float = Field(ge=0, le=1)  # max fraction of parameter elements left unsharded
    # --- pipeline parallelism (see parallel/schedule.py; checked by _check_pipeline) ---
    ici_pipeline_parallelism: int = Field(ge=1)  # pipeline stages within a slice/host group
    dcn_pipeline_parallelism: int = Field(ge=1)  # x this: stages across slices/hosts (the `stage` axis is outermost)
    num_pipeline_microbatches: int = Field(ge=-1)  # -1 = the number of stages
    num_pipeline_repeats: int = Field(ge=-1)  # -1 = derived; > 1 = circular schedule
    num_layers_per_pipeline_stage: int = Field(ge=1)  # layers a stage applies per repeat
    pipeline_parallel_layers: int = Field(ge=-1)  # layers of the main stack that are pipelined (-1 = all)
    scan_pipeline_iterations: bool  # iterations of one repeat under lax.scan (false: unrolled)
    scan_pipeline_repeats: bool  # the repeats under lax.scan (false: unrolled)
    set_remat_policy_on_pipeline_iterations: bool  # remat_policy around each pipeline iteration
    set_remat_policy_on_layers_per_stage: bool  # remat_policy around each layer inside a stage
    pipeline_delay_activation_forwarding: bool  # a stage's output reaches the next stage one iteration later
    pipeline_fsdp_ag_once: bool  # all-gather the fsdp-sharded stage weights once per step, not per iteration
    logical_axis_rules: tuple[tuple[str, tuple[str, ...]], ...]

    # --- quantized training (qwix; see nnxtron/quant.py, docs/quantization.md) ---------
    use_qwix_quantization: bool
    quantization: Literal["", "int8", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_full"]  # "" = off; QUANTIZATION_MODES
    qwix_module_path: str  # regex over module paths: whose weight matmuls are quantized
    qwix_exclude_module_path: str  # regex: modules never quantized (wins over qwix_module_path)
    weight_quantization_calibration_method: str  # absmax[,c] | minmax[,c] | rms,c | fixed,lo,hi
    act_quantization_calibration_method: str
    bwd_quantization_calibration_method: str
    quantization_tile_size: int = Field(ge=0)  # forward scales per tile of the contraction axis (0 = per channel)
    quantization_bwd_tile_size: int = Field(ge=0)  # the same for the weight-gradient matmul (0 = per channel)

    # --- data -------------------------------------------------------------------
    dataset_type: Literal["synthetic", "text", "jsonl", "parquet", "arrayrecord"]  # see docs/data.md
    dataset_path: tuple[str, ...]
    dataset_text_field: str  # JSON field / Parquet column of the text ("" = "text"); arrayrecord: records are JSON
    tokenizer_type: Literal["byte", "hf", "sentencepiece", "tiktoken"]
    tokenizer_path: str  # the tokenizer file or its directory (every type but byte)
    add_bos: bool
    add_eos: bool
    packing: Literal["concat", "pad"]  # concat: documents flow across rows; pad: each row starts a document
    truncate_documents: bool  # keep only the first row's worth of each document
    skip_bad_records: bool  # count and skip unusable documents instead of stopping with an error
    eval_split_fraction: float = Field(ge=0, le=0.5)
    data_shuffle_seed: int = Field(ge=0, lt=2**32)
    data_num_epochs: int = Field(ge=-1)  # -1 = endless; else training past the last epoch is an error
    data_read_threads: int = Field(ge=0)  # threads reading and tokenizing documents (0 = in the training thread)
    data_prefetch_batches: int = Field(ge=0)  # batches prepared ahead in a background thread (0 = none)
    data_stats_documents: int = Field(gt=0)  # documents packed at start-up for the statistics line
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
    non_finite_policy: Literal["stop", "skip"]  # a NaN/Inf loss or gradient: stop the run, or skip that update
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
                f"{self.decoder_block}; use one of {[list(a) for a in SUPPORTED_MLP_ACTIVATIONS]}"
            )
        self._check_moe()
        self._check_mla_and_mtp()
        self._check_attention()
        self._check_layer_pattern()
        self._check_deepseek4()
        self._check_pipeline()
        self._check_quantization()
        if self.rope_type == "linear" and self.rope_scaling_factor < 1:
            raise ValueError(f"rope_type=linear needs rope_scaling_factor >= 1, got {self.rope_scaling_factor}")
        if self.rope_type == "llama3" and self.rope_high_freq_factor < self.rope_low_freq_factor:
            raise ValueError("rope_high_freq_factor must be at least rope_low_freq_factor for rope_type=llama3")
        self._check_data()
        return self

    def _check_data(self) -> None:
        if self.tokenizer_path and self.tokenizer_type == "byte":
            raise ValueError(
                "tokenizer_path is not read by tokenizer_type=byte; unset it or choose hf, sentencepiece or tiktoken"
            )
        if self.data_num_epochs == 0:
            raise ValueError("data_num_epochs must be -1 (endless) or a positive number of epochs, got 0")
        if self.dataset_type == "synthetic":
            unread = {"dataset_text_field": self.dataset_text_field != "", "packing": self.packing != "concat",
                      "truncate_documents": self.truncate_documents, "skip_bad_records": self.skip_bad_records,
                      "data_num_epochs": self.data_num_epochs != -1}  # fmt: skip
            for key, is_set in unread.items():
                if is_set:
                    raise ValueError(f"{key} is not read with dataset_type=synthetic; unset it or train on a corpus")
            return
        kind = self.dataset_type
        if not self.dataset_path:
            raise ValueError(f"dataset_type={kind} needs dataset_path (files, directories or globs)")
        if self.dataset_text_field and kind == "text":
            raise ValueError("dataset_text_field is not read by dataset_type=text (one document per file); unset it")
        if self.eval_interval > 0 and self.eval_split_fraction == 0:
            raise ValueError(
                f"eval_interval > 0 with dataset_type={kind} needs eval_split_fraction > 0 (or set eval_interval=-1)"
            )

    def _check_moe(self) -> None:
        experts, k = self.num_experts, self.num_experts_per_tok
        if experts == 1:
            if self.ici_expert_parallelism not in (1, -1):
                raise ValueError(f"ici_expert_parallelism={self.ici_expert_parallelism} needs num_experts > 1 (got 1)")
            return
        if k > experts:
            raise ValueError(f"num_experts_per_tok ({k}) is larger than num_experts ({experts}); choose at most {experts}")
        if self.ici_expert_parallelism > 1 and experts % self.ici_expert_parallelism:
            raise ValueError(
                f"ici_expert_parallelism={self.ici_expert_parallelism} does not divide num_experts={experts}; "
                "choose a divisor of the expert count"
            )
        groups, keep = self.n_routing_groups, self.topk_routing_group
        if (groups == -1) != (keep == -1):
            raise ValueError("set both n_routing_groups and topk_routing_group (or neither, -1) for group-limited routing")
        if groups != -1:
            if groups < 1 or experts % groups:
                raise ValueError(f"n_routing_groups={groups} does not divide num_experts={experts}; choose a divisor")
            if not 1 <= keep <= groups:
                raise ValueError(f"topk_routing_group={keep} must be between 1 and n_routing_groups={groups}")
            if k > keep * (experts // groups):
                raise ValueError(
                    f"num_experts_per_tok={k} is more than the {keep * (experts // groups)} experts in the "
                    f"topk_routing_group={keep} kept groups; raise topk_routing_group"
                )
            if self.routed_score_func == "softmax":
                raise ValueError("n_routing_groups needs routed_score_func=sigmoid or sqrtsoftplus (DeepSeek routing)")
        if self.capacity_factor != -1 and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be -1 (dropless) or > 0")
        if self.routed_bias_update_rate > 0 and not self.routed_bias:
            raise ValueError("routed_bias_update_rate > 0 needs routed_bias=true (the bias it updates)")
        if self.router_scales_expert_input and (k != 1 or self.routed_score_func != "sigmoid"):
            raise ValueError("router_scales_expert_input=true needs num_experts_per_tok=1 and routed_score_func=sigmoid")
        if self.first_num_dense_layers >= self.base_num_decoder_layers:
            raise ValueError(
                f"first_num_dense_layers={self.first_num_dense_layers} leaves no MoE layer out of "
                f"base_num_decoder_layers={self.base_num_decoder_layers}"
            )

    def _check_mla_and_mtp(self) -> None:
        if self.attention_type == "mla":
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
            if self.base_num_kv_heads != self.base_num_query_heads:
                raise ValueError(
                    "attention_type=mla has one key/value head per query head: set base_num_kv_heads = base_num_query_heads"
                )
        if self.mtp_num_layers:
            if self.mtp_loss_scaling_factor == 0:
                raise ValueError(
                    "mtp_num_layers > 0 with mtp_loss_scaling_factor=0 trains MTP layers on nothing; set a factor > 0"
                )
            if self.mtp_num_layers >= self.max_target_length - 1:
                raise ValueError(f"mtp_num_layers={self.mtp_num_layers} needs max_target_length > mtp_num_layers + 1")
        if self.mtp_eval_target_module > self.mtp_num_layers:
            raise ValueError(
                f"mtp_eval_target_module={self.mtp_eval_target_module} names an MTP depth beyond "
                f"mtp_num_layers={self.mtp_num_layers}"
            )

    def _check_attention(self) -> None:
        """What ``attention=`` can run whatever the backend; that ``cudnn`` has a CUDA GPU is
        checked where the model is built (``layers.attention.resolve_attention``)."""
        if self.attention in ("dot_product", "cudnn") and self.attention_type != "global":
            raise ValueError(
                f"attention={self.attention} supports attention_type=global only ({self.attention_type} runs its own "
                "einsum attention); use attention=auto or xla"
            )
        if self.attention == "cudnn":
            from nnxtron.layers.attention import cudnn_unsupported

            reason = cudnn_unsupported(
                self.dtype,
                self.resolved_head_dim,
                chunked=self.chunk_attn_window_size > 0,
                sequence_sharded=self.ici_context_parallelism != 1,
            )
            if reason is not None:
                raise ValueError(f"attention=cudnn {reason}; use attention=auto, dot_product or xla")

    def _check_layer_pattern(self) -> None:
        """Window, chunk and pattern sizes; whether a cycle fits the pattern is checked by
        ``models.pattern.layer_stacks`` (it needs the family)."""
        for name in ("sliding_window_size", "chunk_attn_window_size"):
            size = getattr(self, name)
            if size > self.max_position_embeddings:
                raise ValueError(
                    f"{name}={size} is larger than max_position_embeddings={self.max_position_embeddings}: the window "
                    f"could never apply; choose at most {self.max_position_embeddings} (or 0 for no window)"
                )
        if self.sliding_window_pattern and not self.sliding_window_size:
            raise ValueError(
                f"sliding_window_pattern={self.sliding_window_pattern} makes sliding layers but sliding_window_size=0; "
                "set sliding_window_size > 0 (or sliding_window_pattern=0 for all-global layers)"
            )
        if self.sliding_window_pattern and self.chunk_attn_window_size:
            raise ValueError("sliding_window_pattern and chunk_attn_window_size cannot be combined; set one of them to 0")
        if self.trainable_position_size:
            if self.trainable_position_size < self.max_target_length:
                raise ValueError(
                    f"trainable_position_size={self.trainable_position_size} is smaller than max_target_length="
                    f"{self.max_target_length}: later positions would have no embedding; raise it or shorten sequences"
                )
            if self.nope_layer_interval:
                raise ValueError(
                    "trainable_position_size (learned positions, no RoPE) and nope_layer_interval cannot be combined"
                )
        if self.temperature_tuning and not self.nope_layer_interval:
            raise ValueError(
                "temperature_tuning scales queries on NoPE layers; set nope_layer_interval > 0 (or temperature_tuning=false)"
            )
        period, cycle = self.layer_pattern_period, self.inhomogeneous_layer_cycle_interval
        if cycle and cycle % period:
            raise ValueError(
                f"inhomogeneous_layer_cycle_interval={cycle} does not fit the layer pattern, which repeats every "
                f"{period} layers; set it to a multiple of {period} (or 0 to use {period})"
            )
        if self.interleave_moe_layer_step > 1 and self.num_experts == 1:
            raise ValueError(f"interleave_moe_layer_step={self.interleave_moe_layer_step} needs num_experts > 1")
        if self.interleave_moe_layer_step > 1 and self.first_num_dense_layers:
            raise ValueError("interleave_moe_layer_step > 1 and first_num_dense_layers > 0 cannot be combined; use one of them")

    def _check_deepseek4(self) -> None:
        v4 = self.decoder_block == "deepseek4"
        if v4 != (self.attention_type == "compressed"):
            raise ValueError("decoder_block=deepseek4 and attention_type=compressed go together; set both or neither")
        for name, off in (("mhc_expansion_rate", 1), ("first_num_hash_layers", 0), ("mlp_activations_limit", 0)):
            if not v4 and getattr(self, name) != off:
                raise ValueError(f"{name} is read by decoder_block=deepseek4 only; leave it at {off} for {self.decoder_block}")
        if not v4:
            if self.compress_ratios:
                raise ValueError("compress_ratios is read by decoder_block=deepseek4 only; leave it empty")
            return
        layers = self.base_num_decoder_layers
        if len(self.compress_ratios) != layers:
            raise ValueError(
                f"compress_ratios has {len(self.compress_ratios)} entries but base_num_decoder_layers={layers}; "
                "give one ratio per layer"
            )
        allowed = (0, self.csa_compress_ratio, self.hca_compress_ratio)
        bad = sorted({r for r in self.compress_ratios if r not in allowed})
        if bad:
            raise ValueError(
                f"compress_ratios entries {bad} are not supported: use 0 (sliding), csa_compress_ratio="
                f"{self.csa_compress_ratio} (CSA) or hca_compress_ratio={self.hca_compress_ratio} (HCA)"
            )
        if self.csa_compress_ratio == self.hca_compress_ratio:
            raise ValueError("csa_compress_ratio and hca_compress_ratio must differ")
        if self.num_experts == 1:
            raise ValueError("decoder_block=deepseek4 has MoE layers only; set num_experts > 1")
        if self.first_num_hash_layers > layers:
            raise ValueError(f"first_num_hash_layers={self.first_num_hash_layers} exceeds base_num_decoder_layers={layers}")
        if self.first_num_dense_layers:
            raise ValueError("decoder_block=deepseek4 has no dense layers; set first_num_dense_layers=0")
        if self.mtp_num_layers:
            raise ValueError("mtp_num_layers > 0 is not supported with decoder_block=deepseek4 (HF drops its MTP layer)")
        if self.qk_rope_head_dim > self.resolved_head_dim or self.qk_rope_head_dim > self.indexer_head_dim:
            raise ValueError("qk_rope_head_dim must be at most head_dim and indexer_head_dim (RoPE on the last dims)")
        if self.base_num_kv_heads != 1:
            raise ValueError("attention_type=compressed shares one key/value head: set base_num_kv_heads=1")
        if (self.base_num_query_heads * self.resolved_head_dim) % self.o_groups:
            raise ValueError(f"o_groups={self.o_groups} must divide base_num_query_heads x head_dim")
        if not self.q_lora_rank or not self.sliding_window_size:
            raise ValueError("attention_type=compressed needs q_lora_rank > 0 and sliding_window_size > 0")

    def _check_pipeline(self) -> None:
        """Pipeline options only with stages > 1, and a schedule that exists (parallel/schedule.py)."""
        from nnxtron.errors import ConfigError
        from nnxtron.parallel.schedule import check_pipeline_options

        try:
            check_pipeline_options(self)
        except ConfigError as err:
            raise ValueError(str(err)) from None

    def _check_quantization(self) -> None:
        """Quantization options only with qwix quantization on; regexes and calibration methods parse."""
        if self.use_qwix_quantization and not self.quantization:
            raise ValueError(f"use_qwix_quantization=true needs quantization= one of {list(QUANTIZATION_MODES)}")
        if self.quantization and not self.use_qwix_quantization:
            raise ValueError(
                f"quantization={self.quantization} needs use_qwix_quantization=true (nnxtron quantizes with qwix only)"
            )
        defaults = QUANTIZATION_OPTIONS_OFF
        if not self.use_qwix_quantization:
            changed = [key for key, value in defaults.items() if getattr(self, key) != value]
            if changed:
                raise ValueError(f"{changed[0]} is set but quantization is off; set use_qwix_quantization=true quantization=...")
            return
        for key in ("qwix_module_path", "qwix_exclude_module_path"):
            try:
                re.compile(getattr(self, key))
            except re.error as err:
                raise ValueError(f"{key}={getattr(self, key)!r} is not a valid regular expression ({err})") from None
        for key in ("weight", "act", "bwd"):
            key = f"{key}_quantization_calibration_method"
            _check_calibration(key, getattr(self, key))
        if self.num_experts > 1:
            moe_only_default = ["quantization_tile_size", "quantization_bwd_tile_size"] + [
                f"{k}_quantization_calibration_method" for k in ("weight", "act", "bwd")
            ]
            changed = [key for key in moe_only_default if getattr(self, key) != defaults[key]]
            if changed:
                raise ValueError(
                    f"{changed[0]}={getattr(self, changed[0])!r} cannot apply to the MoE grouped matmuls (qwix's ragged_dot "
                    "quantizes per channel with absmax only); leave it at its default for num_experts > 1"
                )

    @property
    def pipeline_stages(self) -> int:
        return self.ici_pipeline_parallelism * self.dcn_pipeline_parallelism

    @property
    def layer_pattern_period(self) -> int:
        """The smallest number of layers after which the layer kinds repeat (1: all alike).

        DeepSeek-V4: the smallest period of ``compress_ratios`` after the hash-routed
        prefix (a leftover shorter than the period must repeat its start).
        """
        periods = [self.sliding_window_pattern or 1, self.nope_layer_interval or 1]
        if self.num_experts > 1:
            periods.append(self.interleave_moe_layer_step)
        if self.compress_ratios:
            ratios = self.compress_ratios[self.first_num_hash_layers :]
            periods.append(next((p for p in range(1, len(ratios) + 1) if all(
                r == ratios[i % p] for i, r in enumerate(ratios))), 1))  # fmt: skip
        return math.lcm(*periods)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim > 0 else self.base_emb_dim // self.base_num_query_heads
