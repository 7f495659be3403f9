"""The typed configuration schema: every option of a run, its type and its range.

Types and constraints live here; default values live in ``presets/base.yml`` (every
field is required by the schema, so base.yml must name each one — a test checks it);
closed lists of values in ``options.py``; cross-key checks in ``checks.py`` (and, for the
DeepSeek-V4 keys, ``deepseek4.py``). Key names follow MaxText's where MaxText has one.

This module is the bottom of ``config/``: it imports nothing of the package but
``options``. The cross-key checks read the layout and pipeline arithmetic, which read
``Config``; so ``checks.py`` sits above the schema and the package's ``__init__`` registers
its ``check_combinations`` here (``register_cross_key_check``), which the validator runs.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from nnxtron.config import options
from nnxtron.errors import ConfigError

T = TypeVar("T")

# the cross-key checks every Config runs (``config/__init__.py`` registers ``checks.check_combinations``)
_CROSS_KEY_CHECKS: list[Callable[[Config], None]] = []


def register_cross_key_check(check: Callable[[Config], None]) -> None:
    """Make every ``Config`` run ``check`` once its keys are parsed (it raises ``ConfigError``)."""
    if check not in _CROSS_KEY_CHECKS:
        _CROSS_KEY_CHECKS.append(check)


class _ModelKey:
    """Marks a key that changes the function the model computes: it is part of the model's
    fingerprint (``config/fingerprint.py``), which a run and its checkpoints record."""


MODEL_KEY = _ModelKey()
Model = Annotated[T, MODEL_KEY]
DType = Literal[options.DTYPES]
RematPolicy = Literal[options.REMAT_POLICIES]
RematChoice = Literal[options.REMAT_CHOICES]  # per named activation, for remat_policy=custom
# ranges checked before anything is allocated or looped over (a typo of a few digits is an
# error line, not a terabyte allocation or a run of 10^23 steps)
MAX_SIZE = 2**24  # widths, lengths, vocabulary, batch
MAX_COUNT = 2**16  # layers, heads, experts, mesh axes, microbatches
MAX_STEPS = 2**40  # steps and periods
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: below it a value computes as 0 or loses its digits
MAX_RUN_NAME = 200  # characters (file systems allow 255 bytes per name)


class Config(BaseModel):
    """Every option of a run. Unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # every float finite

    # --- run ------------------------------------------------------------------
    run_name: str  # "" = a fresh timestamped name; an existing name resumes that run
    base_output_directory: str
    model_name: str  # preset chosen from config/presets/<model_name>.yml
    # persistent compilation cache (runtime/compile_cache.py): a restarted run loads its compiled steps
    compilation_cache_dir: str  # "" = off; "~" is expanded; env JAX_COMPILATION_CACHE_DIR replaces the base.yml default
    compilation_cache_min_compile_seconds: float = Field(ge=0)  # only compiles at least this long are stored

    # --- model ----------------------------------------------------------------
    decoder_block: Model[Literal[options.DECODER_BLOCKS]]
    base_emb_dim: Model[int] = Field(gt=0, le=MAX_SIZE)
    base_num_query_heads: Model[int] = Field(gt=0, le=MAX_COUNT)
    base_num_kv_heads: Model[int] = Field(gt=0, le=MAX_COUNT)
    head_dim: Model[int] = Field(ge=-1, le=MAX_SIZE)  # -1 = base_emb_dim // base_num_query_heads
    base_mlp_dim: Model[int] = Field(gt=0, le=MAX_SIZE)
    base_num_decoder_layers: Model[int] = Field(gt=0, le=MAX_COUNT)
    vocab_size: Model[int] = Field(gt=0, le=MAX_SIZE)
    normalization_layer_epsilon: Model[float] = Field(gt=0)
    mlp_activations: Model[tuple[str, ...]]
    rope_type: Model[Literal[options.ROPE_TYPES]]  # linear: positions / rope_scaling_factor
    rope_max_timescale: Model[float] = Field(gt=0)
    rope_interleave: Model[bool]  # False: rotate-half pairs (i, i+d/2) as HF Llama; True: (2i, 2i+1)
    rope_scaling_factor: Model[float] = Field(gt=0)
    rope_low_freq_factor: Model[float] = Field(gt=0)
    rope_high_freq_factor: Model[float] = Field(gt=0)
    rope_original_max_position_embeddings: Model[int] = Field(gt=0, le=MAX_SIZE)
    max_position_embeddings: Model[int] = Field(
        gt=0, le=MAX_SIZE
    )  # HF max_position_embeddings (context the RoPE scaling targets)
    beta_fast: Model[float] = Field(gt=0)  # yarn ramp (HF rope_scaling beta_fast)
    beta_slow: Model[float] = Field(gt=0)  # yarn ramp (HF rope_scaling beta_slow)
    mscale: Model[float] = Field(
        ge=0
    )  # yarn (HF mscale; 0 = unset): cos/sin x m(mscale)/m(mscale_all_dim) when both set, else m(1)
    mscale_all_dim: Model[float] = Field(ge=0)  # yarn (HF rope_scaling mscale_all_dim): softmax scale x m(mscale_all_dim)^2
    rope_truncate: Model[bool]  # yarn: floor / ceil the correction range (HF rope_parameters truncate; GPT-OSS: false)
    sliding_window_size: Model[int] = Field(ge=0, le=MAX_SIZE)  # 0 = full causal attention
    # --- layer patterns (Gemma 3, Llama 4): layer i is 0-based; see config/layout.py ---
    # > 0: layer i is global iff (i+1) % pattern == 0, else sliding (Gemma 3: 6)
    sliding_window_pattern: Model[int] = Field(ge=0, le=MAX_COUNT)
    # RoPE theta of sliding layers under a pattern (0 = rope_max_timescale, unscaled)
    local_rope_max_timescale: Model[float] = Field(ge=0)
    query_pre_attn_scalar: Model[float] = Field(ge=0)  # attention logits x query_pre_attn_scalar^-0.5 (0 = head_dim)
    attn_logits_soft_cap: Model[float] = Field(
        ge=0
    )  # > 0: attention logits cap * tanh(logits / cap) before the mask (Gemma 2: 50)
    nope_layer_interval: Model[int] = Field(ge=0, le=MAX_COUNT)  # > 0: layer i has no RoPE iff (i+1) % interval == 0 (Llama 4: 4)
    chunk_attn_window_size: Model[int] = Field(
        ge=0, le=MAX_SIZE
    )  # > 0: RoPE layers attend within aligned chunks of this size (Llama 4)
    temperature_tuning: Model[bool]  # Llama 4: NoPE layers scale q by log1p(floor((pos+1)/floor_scale))*scale + 1
    temperature_tuning_floor_scale: Model[float] = Field(gt=0)
    temperature_tuning_scale: Model[float] = Field(ge=0)
    # MoE models: layer i is MoE iff (i+1) % step == 0 (Llama 4 Maverick: 2)
    interleave_moe_layer_step: Model[int] = Field(gt=0, le=MAX_COUNT)
    inhomogeneous_layer_cycle_interval: int = Field(ge=0, le=MAX_COUNT)  # layers per scanned block (0 = the pattern's period)
    trainable_position_size: Model[int] = Field(ge=0, le=MAX_SIZE)  # > 0: learned absolute position embeddings (GPT-3), no RoPE
    attention_type: Model[Literal[options.ATTENTION_TYPES]]  # mla: DeepSeek-V3 latent attention; compressed: DeepSeek-V4
    # implementation of attention_type=global and mla (docs/attention.md); auto: splash on a TPU, cudnn on a CUDA GPU where it runs, else xla
    attention: Literal[options.ATTENTION_CHOICES]
    # > 0: attention (xla, dot_product; global and mla) over blocks of this many queries, each
    # recomputed in the backward pass: scores of one block alive at a time; the same values
    attention_query_block: int = Field(ge=0, le=MAX_SIZE)
    use_qk_norm: Model[
        bool
    ]  # q/k norm over head_dim: RMSNorm before RoPE (Qwen3, Gemma 3 (1+w)); weightless L2 after RoPE (Llama 4)
    # biases on the query, key and value projections and the output one (decoder_block=qwen2: none on the
    # output, MaxText's and HF Qwen2's); attention_type=global only
    attention_bias: Model[bool]
    attention_sink: Model[bool]  # one learned logit per query head joins the softmax denominator (gpt_oss only)
    q_lora_rank: Model[int] = Field(ge=0, le=MAX_SIZE)  # mla: 0 = plain query projection
    kv_lora_rank: Model[int] = Field(gt=0, le=MAX_SIZE)  # mla
    qk_nope_head_dim: Model[int] = Field(gt=0, le=MAX_SIZE)  # mla
    qk_rope_head_dim: Model[int] = Field(gt=0, le=MAX_SIZE)  # mla
    v_head_dim: Model[int] = Field(gt=0, le=MAX_SIZE)  # mla
    # --- DeepSeek-V4 (attention_type=compressed, decoder_block=deepseek4; rules in config/deepseek4.py) ---
    compress_ratios: Model[tuple[int, ...]]  # per layer: 0 sliding only, csa_compress_ratio (CSA), hca_compress_ratio (HCA)
    # HF compress_rates.compressed_sparse_attention (overlapping windows + indexer)
    csa_compress_ratio: Model[int] = Field(gt=0, le=MAX_SIZE)
    hca_compress_ratio: Model[int] = Field(
        gt=0, le=MAX_SIZE
    )  # HF compress_rates.heavily_compressed_attention (non-overlapping windows)
    compressed_rope_max_timescale: Model[float] = Field(gt=0)  # RoPE theta of CSA/HCA layers (HF compress_rope_theta)
    o_groups: Model[int] = Field(gt=0, le=MAX_COUNT)  # grouped low-rank output projection: groups
    o_lora_rank: Model[int] = Field(gt=0, le=MAX_SIZE)  # ... and rank per group
    indexer_n_heads: Model[int] = Field(gt=0, le=MAX_COUNT)  # lightning indexer (CSA layers)
    indexer_head_dim: Model[int] = Field(gt=0, le=MAX_SIZE)
    indexer_topk: Model[int] = Field(gt=0, le=MAX_SIZE)  # compressed entries each query attends to on CSA layers
    mhc_expansion_rate: Model[int] = Field(gt=0, le=MAX_COUNT)  # residual streams of the hyper-connections (1 = off)
    sinkhorn_iterations: Model[int] = Field(gt=0, le=MAX_COUNT)
    mhc_eps: Model[float] = Field(gt=0)  # HF hc_eps
    first_num_hash_layers: Model[int] = Field(
        ge=0, le=MAX_COUNT
    )  # leading MoE layers routed by the non-trainable token->expert table
    mlp_activations_limit: Model[float] = Field(ge=0)  # SwiGLU clamp (HF swiglu_limit): gate <= L, |up| <= L; 0 = off
    mlp_bias: Model[bool]  # routed experts' gate, up and down projections have biases (gpt_oss only)
    # --- Qwen3-Next and Qwen3.5 (decoder_block=qwen3_next, qwen3_5; rules in config/qwen3_next.py): Gated DeltaNet ---
    gdn_conv_kernel_dim: Model[int] = Field(gt=0, le=MAX_SIZE)  # causal depthwise conv over q/k/v (HF linear_conv_kernel_dim)
    gdn_key_head_dim: Model[int] = Field(gt=0, le=MAX_SIZE)  # query/key head width (HF linear_key_head_dim)
    gdn_value_head_dim: Model[int] = Field(gt=0, le=MAX_SIZE)  # value head width (HF linear_value_head_dim)
    gdn_num_key_heads: Model[int] = Field(gt=0, le=MAX_COUNT)  # query/key heads (HF linear_num_key_heads)
    gdn_num_value_heads: Model[int] = Field(gt=0, le=MAX_COUNT)  # value heads, a multiple of the key heads
    gdn_chunk_size: Model[int] = Field(gt=0, le=MAX_SIZE)  # tokens the delta rule takes at a time (the same function)
    partial_rotary_factor: Model[float] = Field(gt=0, le=1)  # RoPE on the first head_dim x this dims (qwen3_next, qwen3_5 only)
    # --- Gemma 4 (decoder_block=gemma4; rules in config/gemma4.py): its global layers' own attention shape ---
    global_head_dim: Model[int] = Field(ge=0, le=MAX_SIZE)  # head width of the global layers (0 = head_dim)
    global_num_kv_heads: Model[int] = Field(ge=0, le=MAX_COUNT)  # their key/value heads (0 = base_num_kv_heads)
    share_kv_projections: Model[bool]  # their values are their key projection (HF attention_k_eq_v): no value weights
    # proportional RoPE (HF's): the share of a head's frequencies that rotate on global / sliding layers
    global_rope_proportion: Model[float] = Field(gt=0, le=1)
    local_rope_proportion: Model[float] = Field(gt=0, le=1)

    # --- mixture of experts -------------------------------------------------------
    num_experts: Model[int] = Field(gt=0, le=MAX_COUNT)  # 1 = dense MLP layers
    num_experts_per_tok: Model[int] = Field(gt=0, le=MAX_COUNT)
    base_moe_mlp_dim: Model[int] = Field(gt=0, le=MAX_SIZE)  # hidden size of each routed (and shared) expert
    shared_experts: Model[int] = Field(ge=0, le=MAX_COUNT)  # always-on experts: one MLP of shared_experts x base_moe_mlp_dim
    first_num_dense_layers: Model[int] = Field(ge=0, le=MAX_COUNT)  # leading dense layers (their own scanned stack)
    dense_layers: Model[tuple[int, ...]]  # 0-based layers anywhere that keep the dense MLP (HF Qwen3-MoE mlp_only_layers)
    routed_score_func: Model[Literal[options.ROUTER_SCORE_FUNCS]]
    norm_topk_prob: Model[bool]  # renormalise the selected experts' weights to sum to 1
    routed_scaling_factor: Model[float] = Field(gt=0)  # multiplies the combine weights (DeepSeek)
    routed_bias: Model[bool]  # correction bias added to the scores for selection only (DeepSeek)
    routed_bias_update_rate: float = Field(ge=0)  # loss-free balancing: bias += rate * sign(mean load - load)
    n_routing_groups: Model[int] = Field(ge=-1, le=MAX_COUNT)  # group-limited routing: groups of experts (-1 = off)
    topk_routing_group: Model[int] = Field(ge=-1, le=MAX_COUNT)  # group-limited routing: groups kept per token (-1 = off)
    router_scales_expert_input: Model[bool]  # Llama 4: sigmoid(top-1 logit) scales the expert input, not its output
    capacity_factor: Model[float]  # -1 = dropless; > 0: each expert takes at most about factor * tokens * k / experts tokens
    capacity_scope: Model[Literal[options.CAPACITY_SCOPES]]  # capacity_factor > 0: the tokens counted (layers/moe.py)
    moe_compute: Literal[options.MOE_COMPUTES]  # grouped (routed tokens only) | dense (all experts, einsums): the same function
    grouped_matmul: Literal[options.GROUPED_MATMULS]  # moe_compute=grouped: ragged_dot | blocked (padded blocks) | auto
    # moe_compute=grouped: each device's routed tokens in this many pieces, one after another, each
    # recomputed in the backward pass: 1/chunks of the grouped rows alive at a time; the same values
    moe_token_chunks: int = Field(ge=1, le=MAX_COUNT)
    load_balance_loss_weight: float = Field(ge=0)  # 0 = off
    load_balance_convention: Literal[options.LOAD_BALANCE_CONVENTIONS]  # maxtext: per sequence, mean over layers (docs/moe.md)

    # --- multi-token prediction ---------------------------------------------------
    mtp_num_layers: Model[int] = Field(ge=0, le=MAX_COUNT)  # 0 = off
    mtp_loss_scaling_factor: float = Field(ge=0)
    mtp_eval_target_module: int = Field(ge=0, le=MAX_COUNT)  # eval reports this MTP depth's acceptance rate (0 = off)
    logits_via_embedding: Model[bool]  # tied output head
    normalize_embedding_logits: Model[bool]  # MaxText's tied logits / sqrt(emb_dim) (layers/embed.py: tied_logit_scale)
    tied_head_bf16: Model[bool]  # the tied head rounds its table to bfloat16 whatever dtype is (MaxText's, layers/embed.py)
    final_logits_soft_cap: Model[float] = Field(ge=0)  # 0 = off
    dtype: Model[DType]  # activations
    weight_dtype: Model[DType]  # parameters
    matmul_precision: Literal[options.MATMUL_PRECISIONS]  # precision of the model's matmuls (default: the backend's)

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
    gradient_accumulation_steps: int = Field(gt=0, le=MAX_COUNT)

    # --- parallelism ------------------------------------------------------------
    ici_data_parallelism: int = Field(ge=-1, le=MAX_COUNT)
    ici_fsdp_parallelism: int = Field(ge=-1, le=MAX_COUNT)
    ici_tensor_parallelism: int = Field(ge=-1, le=MAX_COUNT)
    ici_context_parallelism: int = Field(ge=-1, le=MAX_COUNT)
    context_parallel_strategy: Literal[options.CONTEXT_PARALLEL_STRATEGIES]  # ring: keys/values pass around the context axis
    context_parallel_load_balance: bool  # ring: zig-zag sequence chunks inside attention, even causal work per device
    ici_expert_parallelism: int = Field(ge=-1, le=MAX_COUNT)  # experts split over the `expert` mesh axis
    sharding_tolerance: float = Field(ge=0, le=1)  # max fraction of parameter elements left unsharded
    # --- pipeline parallelism (schedule and checks: config/pipeline.py) ---
    ici_pipeline_parallelism: int = Field(ge=1, le=MAX_COUNT)  # pipeline stages within a slice/host group
    dcn_pipeline_parallelism: int = Field(
        ge=1, le=MAX_COUNT
    )  # x this: stages across slices/hosts (the `stage` axis is outermost)
    num_pipeline_microbatches: int = Field(ge=-1, le=MAX_COUNT)  # -1 = the number of stages
    num_pipeline_repeats: int = Field(ge=-1, le=MAX_COUNT)  # -1 = derived; > 1 = circular schedule
    num_layers_per_pipeline_stage: int = Field(ge=1, le=MAX_COUNT)  # layers a stage applies per repeat
    pipeline_parallel_layers: int = Field(ge=-1, le=MAX_COUNT)  # layers of the main stack that are pipelined (-1 = all)
    scan_pipeline_iterations: bool  # iterations of one repeat under lax.scan (false: unrolled)
    scan_pipeline_repeats: bool  # the repeats under lax.scan (false: unrolled)
    scan_layers_per_stage: bool  # a stage's layers under lax.scan (false: a Python loop, MaxText's default)
    set_remat_policy_on_pipeline_iterations: bool  # remat_policy around each pipeline iteration
    set_remat_policy_on_layers_per_stage: bool  # remat_policy around each layer inside a stage
    pipeline_delay_activation_forwarding: bool  # a stage's output reaches the next stage one iteration later
    pipeline_fsdp_ag_once: bool  # all-gather the fsdp-sharded stage weights once per step, not per iteration
    logical_axis_rules: tuple[tuple[str, tuple[str, ...]], ...]

    # --- quantized training (qwix; see models/quant.py, docs/quantization.md) ---------
    use_qwix_quantization: bool
    quantization: Literal[("", *options.QUANTIZATION_MODES)]  # "" = off
    qwix_module_path: str  # regex over module paths: whose weight matmuls are quantized
    qwix_exclude_module_path: str  # regex: modules never quantized (wins over qwix_module_path)
    weight_quantization_calibration_method: str  # absmax[,c] | minmax[,c] | rms,c | fixed,lo,hi
    act_quantization_calibration_method: str
    bwd_quantization_calibration_method: str
    quantization_tile_size: int = Field(ge=0, le=MAX_SIZE)  # forward scales per tile of the contraction axis (0 = per channel)
    quantization_bwd_tile_size: int = Field(ge=0, le=MAX_SIZE)  # the same for the weight-gradient matmul (0 = per channel)

    # --- data -------------------------------------------------------------------
    dataset_type: Literal[options.DATASET_TYPES]  # see docs/data.md
    dataset_path: tuple[str, ...]
    dataset_weights: tuple[float, ...]  # one weight per dataset_path entry: a mixture of sources (empty = one corpus)
    grain_train_files: str  # MaxText's form of the sources: "glob" or "glob:weight;glob:weight" (replaces dataset_path)
    dataset_text_field: str  # JSON field / Parquet column of the text ("" = "text"); arrayrecord: records are JSON
    tokenizer_type: Model[Literal[options.TOKENIZER_TYPES]]  # the ids a model was trained on mean its tokenizer's
    tokenizer_path: str  # the tokenizer file or its directory (every type but byte)
    add_bos: bool
    add_eos: bool
    packing: Literal[options.PACKING_MODES]  # concat: documents flow across rows; pad: each row starts a document
    truncate_documents: bool  # keep only the first row's worth of each document
    skip_bad_records: bool  # count and skip unusable documents instead of stopping with an error
    use_sft: bool  # instruction records (messages / prompt+completion), rendered with the chat template (data/sft.py)
    sft_train_on_completion_only: bool  # use_sft: the loss trains on the answers only (false: every token)
    chat_template_path: str  # use_sft / use_dpo: a Jinja chat template replacing the tokenizer's
    # use_sft / use_dpo: the limits of one rendering of the chat template (data/template_render.py: RenderLimits)
    chat_template_timeout: float = Field(gt=0, le=86400)  # seconds, then its process is stopped
    chat_template_memory_mib: int = Field(ge=64, le=MAX_SIZE)  # the rendering process's address space (Linux)
    chat_template_max_chars: int = Field(ge=1, le=2**31)  # characters of output
    use_dpo: bool  # preference pairs (chosen / rejected), trained by DPO against the starting weights (train/dpo.py)
    dpo_beta: float = Field(gt=0, le=1000)  # use_dpo: the KL strength beta of the DPO loss
    dpo_label_smoothing: float = Field(ge=0, lt=0.5)  # use_dpo: the chance a preference label is flipped (cDPO)
    lora_rank: int = Field(ge=0, le=MAX_SIZE)  # > 0: train LoRA adapters of this rank on a frozen base (layers/lora.py)
    lora_alpha: float = Field(gt=0, le=1e6)  # lora_rank > 0: the adapters' output is scaled by lora_alpha / lora_rank
    lora_target_modules: str  # lora_rank > 0: regex searched in each dense layer's module path (no layer indices)
    lora_dropout: float = Field(ge=0, lt=1)  # lora_rank > 0: dropout on the adapters' input in training
    eval_split_fraction: float = Field(ge=0, le=0.5)
    data_shuffle_seed: int = Field(ge=0, lt=2**32)
    data_num_epochs: int = Field(ge=-1, le=MAX_STEPS)  # -1 = endless; else training past the last epoch is an error
    data_read_threads: int = Field(ge=0, le=MAX_COUNT)  # threads reading and tokenizing documents (0 = in the training thread)
    data_prefetch_batches: int = Field(ge=0, le=MAX_COUNT)  # batches prepared ahead in a background thread (0 = none)
    data_stats_documents: int = Field(gt=0, le=MAX_SIZE)  # documents packed at start-up for the statistics line
    per_device_batch_size: float = Field(gt=0, le=MAX_SIZE)
    max_target_length: int = Field(gt=1, le=MAX_SIZE)

    # --- optimisation -----------------------------------------------------------
    steps: int = Field(gt=0, le=MAX_STEPS)
    learning_rate: float = Field(gt=0, lt=FLOAT32_MAX)  # finite in float32
    warmup_steps_fraction: float = Field(ge=0, le=1)
    learning_rate_schedule_steps: int = Field(ge=-1, le=MAX_STEPS)  # -1 = steps
    cosine_learning_rate_final_fraction: float = Field(ge=0, le=1)  # read by lr_schedule_type=cosine
    lr_schedule_type: Literal[options.LR_SCHEDULES]  # see docs/optimizers.md
    learning_rate_final_fraction: float = Field(ge=0, le=1)  # read by lr_schedule_type=wsd and linear
    wsd_decay_steps_fraction: float = Field(ge=0, le=1)  # the final fraction of the schedule that decays
    wsd_decay_style: Literal[options.WSD_DECAY_STYLES]
    lr_schedule_convention: Literal[options.LR_SCHEDULE_CONVENTIONS]  # maxtext: MaxText's arithmetic (docs/optimizers.md)
    opt_type: Literal[options.OPTIMIZERS]  # keys each optimizer reads: options.OPTIMIZER_KEYS
    weight_decay_mask: Literal[options.WEIGHT_DECAY_MASKS]  # the parameters decoupled weight decay applies to
    adam_b1: float = Field(ge=0, lt=1)
    adam_b2: float = Field(ge=0, lt=1)
    adam_eps: float = Field(gt=0)
    adam_weight_decay: float = Field(ge=0)
    adafactor_decay_rate: float = Field(gt=0, le=1)  # second-moment decay exponent: beta2_t = 1 - t^-decay_rate
    adafactor_weight_decay: float = Field(ge=0)  # decoupled, times the learning rate (0 = off)
    lion_b1: float = Field(ge=0, lt=1)
    lion_b2: float = Field(ge=0, lt=1)
    lion_weight_decay: float = Field(ge=0)  # decoupled, times the learning rate
    sgd_momentum: float = Field(ge=0, lt=1)  # 0 = plain SGD (MaxText's opt_type=sgd)
    muon_beta: float = Field(ge=0, lt=1)
    muon_weight_decay: float = Field(ge=0)  # decoupled, on the Muon matrices; times the learning rate
    muon_consistent_rms: float = Field(ge=0)  # 0 = width scaling (MaxText's None); > 0: updates of this RMS
    gradient_clipping_threshold: float = Field(ge=0)  # 0 = off
    non_finite_policy: Literal[options.NON_FINITE_POLICIES]  # a NaN/Inf loss or gradient: stop the run, or skip that update
    init_weights_seed: int = Field(ge=-(2**63), lt=2**63)  # also seeds the dropout masks (layers/dropout.py)
    dropout_rate: float = Field(ge=0, lt=1)  # training only, where MaxText drops (docs/optimizers.md#dropout)
    enable_dropout: bool  # false: train without dropout whatever dropout_rate says (MaxText's switch)

    # --- eval, checkpoints, logging ----------------------------------------------
    eval_interval: int = Field(ge=-1, le=MAX_STEPS)  # -1 = no periodic eval
    eval_steps: int = Field(gt=0, le=MAX_STEPS)
    enable_checkpointing: bool
    checkpoint_period: int = Field(gt=0, le=MAX_STEPS)
    max_num_checkpoints_to_keep: int = Field(gt=0, le=MAX_STEPS)
    load_parameters_path: str  # "" = fresh init; else an nnxtron checkpoint (e.g. from `convert from-hf`)
    init_from: str  # "" = off; else an HF model directory or nnxtron run: its model, tokenizer and weights
    log_period: int = Field(gt=0, le=MAX_STEPS)  # progress-bar / TensorBoard flush period in steps
    enable_tensorboard: bool
    enable_wandb: bool  # Weights & Biases (pip install 'nnxtron[wandb]'); the wandb_* keys need it on
    wandb_project: str  # "" = W&B's default (WANDB_PROJECT, else "uncategorized")
    wandb_entity: str  # "" = W&B's default (WANDB_ENTITY, else your default entity)
    wandb_run_name: str  # "" = the run directory's name
    wandb_mode: Literal[options.WANDB_MODES]  # "" = WANDB_MODE from the environment, else online
    peak_tflops: float = Field(ge=0)  # 0 = look up (accelerators) or measure (CPU) once
    sample_after_training: int = Field(ge=0, le=MAX_SIZE)  # tokens to sample at the end of `train` (0 = off)

    # --- sampling (generate) ------------------------------------------------------
    prompt: str
    max_new_tokens: int = Field(gt=0, le=MAX_SIZE)
    decode_sampling_strategy: Literal[options.SAMPLING_STRATEGIES]
    decode_sampling_temperature: float = Field(gt=0)
    decode_sampling_top_k: int = Field(gt=0, le=MAX_SIZE)
    decode_sampling_nucleus_p: float = Field(gt=0, le=1)
    decode_sampling_seed: int = Field(ge=-(2**63), lt=2**63)

    @field_validator("run_name")
    @classmethod
    def _run_name_is_one_directory_name(cls, value: str) -> str:
        odd = next((c for c in value if not c.isprintable()), None)
        bad = (
            "a path separator" if "/" in value or "\\" in value
            else "'.' or '..'" if value in (".", "..")
            else f"{'a control' if unicodedata.category(odd) == 'Cc' else 'a non-printable'} character "
                 f"(U+{ord(odd):04X})" if odd is not None
            else f"more than {MAX_RUN_NAME} characters" if len(value) > MAX_RUN_NAME
            else None
        )  # fmt: skip
        if bad:
            raise ValueError(
                f"must be one directory name under base_output_directory, but it has {bad}; choose a name of at most "
                f"{MAX_RUN_NAME} printable characters (letters, digits, spaces, punctuation) without '/' or '\\'"
            )
        return value

    @field_validator("base_output_directory")
    @classmethod
    def _output_directory_is_named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("is empty (runs would land in the current directory); name a directory, e.g. runs or .")
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: object, info: ValidationInfo) -> object:
        """``steps=true`` is a mistake, not 1: pydantic would take a bool for an int or float."""
        items = value if isinstance(value, list | tuple) else (value,)
        if info.field_name in _NUMBER_KEYS and any(isinstance(item, bool) for item in items):
            raise ValueError("must be a number, not true/false")
        return value

    @field_validator("*")
    @classmethod
    def _float32_representable(cls, value: object) -> object:
        """A float the model's float32 arithmetic keeps: finite and, unless 0, at least the
        smallest normal float32 in size (``learning_rate=1e-300`` would silently train with 0)."""
        for number in value if isinstance(value, tuple) else (value,):
            if isinstance(number, float) and abs(number) > FLOAT32_MAX:
                raise ValueError("is beyond float32's range (±3.4e38): it would compute as inf; give a smaller value")
            if isinstance(number, float) and 0 < abs(number) < FLOAT32_TINY:
                raise ValueError("is smaller than float32 can hold (1.2e-38): it would compute as 0; give a larger value")
        return value

    @field_validator("*")
    @classmethod
    def _text_is_utf8(cls, value: object) -> object:
        for text in value if isinstance(value, tuple) else (value,):
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError("is not valid UTF-8 text (undecodable bytes on the command line?); pass UTF-8") from None
        return value

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
    def _check_combinations(self) -> Config:
        """Cross-key checks (``checks.py``): a ``ConfigError`` goes through pydantic unchanged."""
        if not _CROSS_KEY_CHECKS:  # never validate silently without them
            raise RuntimeError("no cross-key checks registered: nnxtron/config/__init__.py registers config/checks.py")
        try:
            for check in _CROSS_KEY_CHECKS:
                check(self)
        except ConfigError as err:
            raise ConfigError(f"inconsistent config: {err}") from None
        return self

    @property
    def pipeline_stages(self) -> int:
        return self.ici_pipeline_parallelism * self.dcn_pipeline_parallelism

    @property
    def stacked_layers(self) -> bool:
        """Whether layer parameters are stored stacked (``<stack>/layers/<param>[blocks, ...]``):
        with ``scan_layers``, and always under a pipeline, whose ``stage`` axis shards the
        stacked dimension (``scan_layers=false`` then only unrolls the layer loop)."""
        return self.scan_layers or self.pipeline_stages > 1

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim > 0 else self.base_emb_dim // self.base_num_query_heads


# the keys whose values are numbers (``_no_boolean_for_a_number``): int, float or tuples of them
_NUMBER_KEYS = frozenset(
    name
    for name, field in Config.model_fields.items()
    if field.annotation in (int, float) or str(field.annotation) in ("tuple[int, ...]", "tuple[float, ...]")
)
