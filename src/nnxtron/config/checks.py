"""Cross-key checks of a config: pure functions of the values, no JAX.

``Config``'s validator runs ``check_combinations`` (``config/__init__.py`` registers it with
the schema, which sits below this module and imports nothing of it); each check raises ``ConfigError``
with one line that names the key and the fix. A family's own rules are in ``config/<family>.py``
(``families.py`` lists them, ``check_family`` runs them) and the pipeline layout in ``pipeline.py``.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from nnxtron.config import families, options
from nnxtron.config.layout import is_moe_layer, layer_pattern_period
from nnxtron.config.pipeline import check_pipeline_options
from nnxtron.errors import ConfigError

if TYPE_CHECKING:
    from nnxtron.config.schema import Config

CUDNN_MAX_HEAD_DIM = 256  # cuDNN flash: head_dim a multiple of 8, <= 256 from Hopper (sm90) on ...
CUDNN_AUTO_MAX_HEAD_DIM = 128  # ... <= 128 before it: auto picks cudnn only where every CUDA GPU runs it


def check_combinations(cfg: Config) -> None:
    """Every cross-key check; raises ``ConfigError`` naming the key and the fix."""
    if cfg.base_num_query_heads % cfg.base_num_kv_heads:
        raise ConfigError(
            f"base_num_query_heads ({cfg.base_num_query_heads}) must be a multiple of base_num_kv_heads ({cfg.base_num_kv_heads})"
        )
    if cfg.head_dim == -1 and cfg.base_emb_dim % cfg.base_num_query_heads:
        raise ConfigError(
            f"base_emb_dim ({cfg.base_emb_dim}) is not divisible by base_num_query_heads "
            f"({cfg.base_num_query_heads}); set head_dim explicitly"
        )
    if cfg.head_dim == 0 or cfg.resolved_head_dim % 2:
        raise ConfigError(f"head_dim must be a positive even number for RoPE, got {cfg.resolved_head_dim}")
    if tuple(cfg.mlp_activations) not in options.SUPPORTED_MLP_ACTIVATIONS:
        raise ConfigError(
            f"mlp_activations {list(cfg.mlp_activations)} is not supported by decoder_block "
            f"{cfg.decoder_block}; use one of {[list(a) for a in options.SUPPORTED_MLP_ACTIVATIONS]}"
        )
    check_moe(cfg)
    check_mla_and_mtp(cfg)
    check_attention(cfg)
    check_layer_pattern(cfg)
    check_family(cfg)
    check_pipeline_options(cfg)
    check_quantization(cfg)
    if cfg.rope_type == "linear" and cfg.rope_scaling_factor < 1:
        raise ConfigError(f"rope_type=linear needs rope_scaling_factor >= 1, got {cfg.rope_scaling_factor}")
    if cfg.rope_type == "llama3" and cfg.rope_high_freq_factor < cfg.rope_low_freq_factor:
        raise ConfigError("rope_high_freq_factor must be at least rope_low_freq_factor for rope_type=llama3")
    if not cfg.rope_truncate and cfg.rope_type != "yarn":
        raise ConfigError(
            f"rope_truncate=false leaves YaRN's correction range unrounded (GPT-OSS); rope_type={cfg.rope_type} has "
            "none, so it would change nothing: use rope_type=yarn or leave rope_truncate=true"
        )
    check_data(cfg)
    check_mixture(cfg)
    check_dpo(cfg)
    check_lora(cfg)
    check_wandb(cfg)
    check_init_from(cfg)
    check_optimization(cfg)


def check_family(cfg: Config) -> None:
    """The family's own rules (``config/families.py``), and every other family's keys and values
    left alone: a key only one family reads is at its "off" value elsewhere."""
    for name, rules in families.RULES.items():
        if name == cfg.decoder_block:
            continue
        for key, value in rules.own_values.items():
            if getattr(cfg, key) == value:
                shown = list(value) if isinstance(value, tuple) else value
                raise ConfigError(
                    f"{key}={shown} is taken by decoder_block={name} only (this config's is {cfg.decoder_block}); "
                    "set both or neither"
                )
        for key, off in rules.own_keys.items():
            if getattr(cfg, key) != off and key not in families.rules_for(cfg.decoder_block).own_keys:
                owners = "/".join(n for n, r in families.RULES.items() if key in r.own_keys)
                hint = "leave it empty" if off == () else f"leave it at {off} for {cfg.decoder_block}"
                raise ConfigError(f"{key} is read by decoder_block={owners} only; {hint}")
    check = families.rules_for(cfg.decoder_block).check
    if check is not None:
        check(cfg)


def check_init_from(cfg: Config) -> None:
    """A run starts from one source of weights."""
    if cfg.init_from and cfg.load_parameters_path:
        raise ConfigError(
            "init_from and load_parameters_path are both set; init_from takes the model, tokenizer and weights of an "
            "HF directory or run, load_parameters_path only the weights of a checkpoint: keep one"
        )


def check_wandb(cfg: Config) -> None:
    """The wandb_* keys are read only with enable_wandb=true: set without it, they name themselves."""
    if cfg.enable_wandb:
        return
    changed = [key for key, off in options.WANDB_OPTIONS_OFF.items() if getattr(cfg, key) != off]
    if changed:
        raise ConfigError(f"{', '.join(changed)} {'is' if len(changed) == 1 else 'are'} set but enable_wandb=false; "
                          "set enable_wandb=true to log to Weights & Biases, or unset them")  # fmt: skip


# base.yml's values of the chat template's rendering limits (data/template_render.py: RenderLimits)
TEMPLATE_LIMITS = {"chat_template_timeout": 10.0, "chat_template_memory_mib": 512, "chat_template_max_chars": 1 << 24}


def check_data(cfg: Config) -> None:
    if cfg.tokenizer_path and cfg.tokenizer_type == "byte":
        raise ConfigError("tokenizer_path is not read by tokenizer_type=byte; unset it or choose hf, sentencepiece or tiktoken")
    if cfg.data_num_epochs == 0:
        raise ConfigError("data_num_epochs must be -1 (endless) or a positive number of epochs, got 0")
    if not cfg.use_sft:
        for key, is_set in {"sft_train_on_completion_only": not cfg.sft_train_on_completion_only,
                            "chat_template_path": cfg.chat_template_path != "" and not cfg.use_dpo}.items():  # fmt: skip
            if is_set:
                raise ConfigError(f"{key} is read only with use_sft=true (instruction data); set use_sft=true or unset it")
    if not cfg.use_sft and not cfg.use_dpo:
        for key, default in TEMPLATE_LIMITS.items():
            if getattr(cfg, key) != default:
                raise ConfigError(
                    f"{key} is read only with use_sft=true or use_dpo=true (it limits the chat template's rendering of "
                    "records); set one of them or unset it (nnxtron serve: --" + key.replace("_", "-") + ")"
                )
    if cfg.dataset_type == "synthetic":
        unread = {"dataset_path": cfg.dataset_path not in ((), DEFAULT_DATASET_PATH),  # () or base.yml's: unset
                  "dataset_text_field": cfg.dataset_text_field != "", "packing": cfg.packing != "concat",
                  "truncate_documents": cfg.truncate_documents, "skip_bad_records": cfg.skip_bad_records,
                  "data_num_epochs": cfg.data_num_epochs != -1, "use_sft": cfg.use_sft, "use_dpo": cfg.use_dpo}  # fmt: skip
        for key, is_set in unread.items():
            if is_set:
                raise ConfigError(f"{key} is not read with dataset_type=synthetic; unset it or train on a corpus")
        return
    kind = cfg.dataset_type
    if not cfg.dataset_path:
        raise ConfigError(f"dataset_type={kind} needs dataset_path (files, directories or globs)")
    if cfg.dataset_text_field and kind == "text":
        raise ConfigError("dataset_text_field is not read by dataset_type=text (one document per file); unset it")
    for key in ("use_sft", "use_dpo"):
        if getattr(cfg, key) and kind == "text":
            kind_of = "instruction" if key == "use_sft" else "preference"
            raise ConfigError(
                f"{key}=true reads {kind_of} records: set dataset_type to jsonl, parquet or arrayrecord (JSON records)"
            )
        if getattr(cfg, key) and cfg.dataset_text_field:
            raise ConfigError(f"dataset_text_field is not read with {key}=true (each row is a whole record); unset it")
    if cfg.eval_interval > 0 and cfg.eval_split_fraction == 0:
        raise ConfigError(f"eval_interval > 0 with dataset_type={kind} needs eval_split_fraction > 0 (or set eval_interval=-1)")


def check_dpo(cfg: Config) -> None:
    """DPO's keys are read only with ``use_dpo``; it needs rows of one answer each and a loss
    the model's other objectives do not change."""
    if not cfg.use_dpo:
        for key, is_set in {"dpo_beta": cfg.dpo_beta != 0.1, "dpo_label_smoothing": cfg.dpo_label_smoothing != 0.0}.items():
            if is_set:
                raise ConfigError(f"{key} is read only with use_dpo=true (preference pairs); set use_dpo=true or unset it")
        return
    refusals = [
        (cfg.use_sft, "use_dpo=true and use_sft=true are two training objectives; choose one"),
        (cfg.packing != "pad", "use_dpo=true puts one answer in each row: set packing=pad"),
        (not cfg.sft_train_on_completion_only, "sft_train_on_completion_only is not read with use_dpo=true (DPO scores the answers); unset it"),
        (cfg.mtp_num_layers > 0, "use_dpo=true with mtp_num_layers > 0: multi-token prediction has no DPO loss; set mtp_num_layers=0"),
        (len(mixture_sources(cfg)) > 1, "use_dpo=true reads one dataset (a batch holds whole pairs): give one dataset_path source"),
    ]  # fmt: skip
    for refused, message in refusals:
        if refused:
            raise ConfigError(message)


LORA_DEFAULTS = {"lora_alpha": 16.0, "lora_target_modules": "/(query|key|value|out|wi_0|wi_1|wi|wo)$", "lora_dropout": 0.0}


def check_lora(cfg: Config) -> None:
    """LoRA's keys are read only with ``lora_rank`` > 0; its regex compiles; the frozen base
    is held in device memory."""
    if not cfg.lora_rank:
        for key, default in LORA_DEFAULTS.items():
            if getattr(cfg, key) != default:
                raise ConfigError(f"{key} is read only with lora_rank > 0 (LoRA fine-tuning); set lora_rank or unset {key}")
        return
    try:
        re.compile(cfg.lora_target_modules)
    except re.error as err:
        raise ConfigError(
            f"lora_target_modules={cfg.lora_target_modules!r} is not a regular expression ({err}); fix it"
        ) from None
    if cfg.lora_dropout and not cfg.enable_dropout:
        raise ConfigError(
            "lora_dropout > 0 with enable_dropout=false: no dropout is drawn; set enable_dropout=true or lora_dropout=0"
        )
    if cfg.parameter_memory_host_offload:
        raise ConfigError(
            "lora_rank > 0 with parameter_memory_host_offload=true: the frozen base stays in device memory and the "
            "adapters are small; set parameter_memory_host_offload=false"
        )


DEFAULT_DATASET_PATH = ("{python_stdlib}/*.py",)  # base.yml's dataset_path: grain_train_files may replace only it


def check_mixture(cfg: Config) -> None:
    """dataset_weights / grain_train_files (a mixture of sources) are well formed; see ``mixture_sources``."""
    if cfg.dataset_type == "synthetic":
        for key in ("dataset_weights", "grain_train_files"):
            if getattr(cfg, key):
                raise ConfigError(f"{key} is not read with dataset_type=synthetic; unset it or train on a corpus")
        return
    mixture_sources(cfg)


def mixture_sources(cfg: Config) -> tuple[tuple[tuple[str, ...], float], ...]:
    """The corpus sources of a config: ``((patterns, weight), ...)``.

    Without weights all of ``dataset_path`` is one source of weight 1 (one corpus). With
    ``dataset_weights`` (one per ``dataset_path`` entry) each entry is a source; MaxText's
    ``grain_train_files`` gives ``"glob"`` (one source) or ``"glob:weight;glob:weight"``."""
    weights, text = tuple(cfg.dataset_weights), cfg.grain_train_files.strip()
    if text:
        if weights:
            raise ConfigError("set dataset_weights (with dataset_path) or grain_train_files (MaxText's form), not both")
        if tuple(cfg.dataset_path) != DEFAULT_DATASET_PATH:
            raise ConfigError(
                "set dataset_path (with dataset_weights) or grain_train_files (MaxText's form), not both; "
                "grain_train_files replaces dataset_path"
            )
        if ";" not in text:
            return (((text,), 1.0),)
        sources = []
        for part in (p.strip() for p in text.split(";")):
            pattern, _, weight = part.rpartition(":")
            try:
                value = float(weight)
            except ValueError:
                value = None
            if not pattern.strip() or value is None:
                raise ConfigError(
                    f"grain_train_files part {part!r} is not 'glob:weight'; write 'glob:weight;glob:weight' (MaxText's form)"
                )
            sources.append(((pattern.strip(),), _positive_weight("grain_train_files", part, value)))
        return tuple(sources)
    if not weights:
        return ((tuple(cfg.dataset_path), 1.0),)
    if len(weights) != len(cfg.dataset_path):
        raise ConfigError(
            f"dataset_weights has {len(weights)} weights for {len(cfg.dataset_path)} dataset_path entries; "
            "give one weight per entry (each entry is one source of the mixture) or unset dataset_weights"
        )
    return tuple(((path,), _positive_weight("dataset_weights", path, w)) for path, w in zip(cfg.dataset_path, weights))


def _positive_weight(key: str, source: str, weight: float) -> float:
    if not (math.isfinite(weight) and weight > 0):
        raise ConfigError(
            f"{key}: the weight of {source!r} is {weight}, not a positive finite number; give every source a weight > 0 "
            "(leave a source out rather than weighting it 0)"
        )
    return float(weight)


def check_moe(cfg: Config) -> None:
    experts, k = cfg.num_experts, cfg.num_experts_per_tok
    if experts == 1:
        if cfg.ici_expert_parallelism not in (1, -1):
            raise ConfigError(f"ici_expert_parallelism={cfg.ici_expert_parallelism} needs num_experts > 1 (got 1)")
        changed = [key for key, off in options.MOE_OPTIONS_OFF.items() if getattr(cfg, key) != off]
        if changed:
            key = changed[0]
            raise ConfigError(
                f"{key}={getattr(cfg, key)!r} is read only by MoE layers, and this model is dense (num_experts=1); "
                f"set num_experts > 1 or leave {key} at {options.MOE_OPTIONS_OFF[key]!r}"
            )
        return
    if k > experts:
        raise ConfigError(f"num_experts_per_tok ({k}) is larger than num_experts ({experts}); choose at most {experts}")
    if cfg.ici_expert_parallelism > 1 and experts % cfg.ici_expert_parallelism:
        raise ConfigError(
            f"ici_expert_parallelism={cfg.ici_expert_parallelism} does not divide num_experts={experts}; "
            "choose a divisor of the expert count"
        )
    groups, keep = cfg.n_routing_groups, cfg.topk_routing_group
    if (groups == -1) != (keep == -1):
        raise ConfigError("set both n_routing_groups and topk_routing_group (or neither, -1) for group-limited routing")
    if groups != -1:
        if groups < 1 or experts % groups:
            raise ConfigError(f"n_routing_groups={groups} does not divide num_experts={experts}; choose a divisor")
        if not 1 <= keep <= groups:
            raise ConfigError(f"topk_routing_group={keep} must be between 1 and n_routing_groups={groups}")
        if k > keep * (experts // groups):
            raise ConfigError(
                f"num_experts_per_tok={k} is more than the {keep * (experts // groups)} experts in the "
                f"topk_routing_group={keep} kept groups; raise topk_routing_group"
            )
        if cfg.routed_score_func == "softmax":
            raise ConfigError("n_routing_groups needs routed_score_func=sigmoid or sqrtsoftplus (DeepSeek routing)")
    if cfg.capacity_factor != -1 and cfg.capacity_factor <= 0:
        raise ConfigError(f"capacity_factor={cfg.capacity_factor} must be -1 (dropless) or > 0")
    if cfg.capacity_scope != "call" and cfg.capacity_factor <= 0:
        raise ConfigError(f"capacity_scope={cfg.capacity_scope} needs capacity_factor > 0 (the experts are dropless)")
    if cfg.routed_bias_update_rate > 0 and not cfg.routed_bias:
        raise ConfigError("routed_bias_update_rate > 0 needs routed_bias=true (the bias it updates)")
    if cfg.moe_token_chunks > 1 and cfg.moe_compute != "grouped":
        raise ConfigError(f"moe_token_chunks={cfg.moe_token_chunks} applies to moe_compute=grouped only; set it to 1")
    if cfg.grouped_matmul != "auto" and cfg.moe_compute != "grouped":
        raise ConfigError(f"grouped_matmul={cfg.grouped_matmul} applies to moe_compute=grouped only; leave it at auto")
    if cfg.grouped_matmul == "blocked" and cfg.use_qwix_quantization:
        raise ConfigError(
            "grouped_matmul=blocked cannot be quantized with use_qwix_quantization=true (qwix quantizes the experts' "
            "ragged_dot); use grouped_matmul=auto or ragged_dot"
        )
    if cfg.router_scales_expert_input and (k != 1 or cfg.routed_score_func != "sigmoid"):
        raise ConfigError("router_scales_expert_input=true needs num_experts_per_tok=1 and routed_score_func=sigmoid")
    if cfg.first_num_dense_layers >= cfg.base_num_decoder_layers:
        raise ConfigError(
            f"first_num_dense_layers={cfg.first_num_dense_layers} leaves no MoE layer out of "
            f"base_num_decoder_layers={cfg.base_num_decoder_layers}"
        )
    layers = cfg.base_num_decoder_layers
    if list(cfg.dense_layers) != sorted(set(cfg.dense_layers)) or not all(0 <= i < layers for i in cfg.dense_layers):
        raise ConfigError(
            f"dense_layers={list(cfg.dense_layers)} must list distinct layer indices in increasing order, each in "
            f"0..{layers - 1} (base_num_decoder_layers={layers})"
        )
    if not any(is_moe_layer(cfg, i) for i in range(layers)):
        raise ConfigError(
            f"first_num_dense_layers, dense_layers and interleave_moe_layer_step leave no MoE layer out of "
            f"base_num_decoder_layers={layers}; use num_experts=1 for a dense model"
        )


def check_mla_and_mtp(cfg: Config) -> None:
    if cfg.attention_type == "mla":
        if cfg.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even for RoPE, got {cfg.qk_rope_head_dim}")
        if cfg.base_num_kv_heads != cfg.base_num_query_heads:
            raise ConfigError(
                "attention_type=mla has one key/value head per query head: set base_num_kv_heads = base_num_query_heads"
            )
    if cfg.mtp_num_layers:
        if cfg.mtp_loss_scaling_factor == 0:
            raise ConfigError("mtp_num_layers > 0 with mtp_loss_scaling_factor=0 trains MTP layers on nothing; set a factor > 0")
        if cfg.mtp_num_layers >= cfg.max_target_length - 1:
            raise ConfigError(f"mtp_num_layers={cfg.mtp_num_layers} needs max_target_length > mtp_num_layers + 1")
    if cfg.mtp_eval_target_module > cfg.mtp_num_layers:
        raise ConfigError(
            f"mtp_eval_target_module={cfg.mtp_eval_target_module} names an MTP depth beyond mtp_num_layers={cfg.mtp_num_layers}"
        )


def check_attention(cfg: Config) -> None:
    """What ``attention=`` can run whatever the backend; that ``cudnn`` has a CUDA GPU is
    checked where the model is built (``layers.attention.resolve_attention``)."""
    if cfg.attention in ("dot_product", "cudnn") and cfg.attention_type != "global":
        raise ConfigError(
            f"attention={cfg.attention} supports attention_type=global only ({cfg.attention_type} runs its own "
            "einsum attention); use attention=auto or xla"
        )
    if cfg.attention_bias and cfg.attention_type != "global":
        raise ConfigError(
            f"attention_bias=true biases the query/key/value/output projections of attention_type=global; "
            f"attention_type={cfg.attention_type} has no such projections; set attention_bias=false"
        )
    if cfg.attn_logits_soft_cap:
        check_soft_cap(cfg)
    if cfg.attention_sink:
        check_sinks(cfg)
    if cfg.attention == "splash" and cfg.attention_type == "compressed":
        raise ConfigError(
            "attention=splash supports attention_type=global and mla (DeepSeek-V4's compressed attention runs its own "
            "einsum attention); use attention=auto or xla"
        )
    if cfg.attention == "splash" and cfg.ici_context_parallelism != 1:
        raise ConfigError(
            "attention=splash cannot shard queries over the sequence (ici_context_parallelism > 1); "
            "use attention=auto (xla there) or xla"
        )
    if cfg.attention == "dot_product" and cfg.ici_context_parallelism != 1 and cfg.context_parallel_strategy == "ring":
        raise ConfigError(
            "attention=dot_product cannot run as ring attention (context_parallel_strategy=ring, ici_context_parallelism "
            "> 1); use attention=auto or xla (ring attention has xla's numerics), or context_parallel_strategy=all_gather"
        )
    check_query_block(cfg)
    if cfg.attention == "cudnn":
        reason = cudnn_unsupported(
            cfg.dtype,
            cfg.resolved_head_dim,
            chunked=cfg.chunk_attn_window_size > 0,
            sequence_sharded=cfg.ici_context_parallelism != 1,
        )
        if reason is not None:
            raise ConfigError(f"attention=cudnn {reason}; use attention=auto, dot_product or xla")


SOFT_CAP_UNSUPPORTED = ("dot_product", "cudnn")  # jax.nn.dot_product_attention has no logit soft cap
SINKS_UNSUPPORTED = ("dot_product", "cudnn", "splash")  # attention sinks: the einsum (xla) path only


def soft_cap_refusal(implementation: str) -> str:
    """The refusal of ``attn_logits_soft_cap`` by ``attention=implementation`` (config check and layer alike)."""
    return (
        f"attention={implementation} cannot apply attn_logits_soft_cap (jax.nn.dot_product_attention has no logit "
        "soft cap); use attention=auto, xla or splash, or attn_logits_soft_cap=0"
    )


def sinks_refusal(implementation: str) -> str:
    """The refusal of ``attention_sink`` by ``attention=implementation`` (config check and layer alike)."""
    return (
        f"attention={implementation} cannot apply attention sinks (attention_sink=true: an extra logit per head in "
        "the softmax denominator; only the einsum path has it); use attention=auto or xla"
    )


def check_soft_cap(cfg: Config) -> None:
    """``attn_logits_soft_cap`` caps the logits of the GQA attention's xla and splash paths (and the KV
    cache's); the other attentions cannot apply it."""
    if cfg.attention_type != "global":
        raise ConfigError(
            f"attn_logits_soft_cap applies to attention_type=global; attention_type={cfg.attention_type} runs its own "
            "attention without a soft cap; set attn_logits_soft_cap=0"
        )
    if cfg.attention in SOFT_CAP_UNSUPPORTED:
        raise ConfigError(soft_cap_refusal(cfg.attention))
    if cfg.ici_context_parallelism != 1 and cfg.context_parallel_strategy == "ring":
        raise ConfigError(
            "ring attention (context_parallel_strategy=ring, ici_context_parallelism > 1) cannot apply "
            "attn_logits_soft_cap (its backward pass is written by hand without the cap); use "
            "context_parallel_strategy=all_gather or attn_logits_soft_cap=0"
        )


def check_sinks(cfg: Config) -> None:
    """``attention_sink`` (GPT-OSS) adds its logits on the GQA attention's einsum path (xla, and the KV cache's);
    the kernels and ring attention cannot."""
    if cfg.attention in SINKS_UNSUPPORTED:
        raise ConfigError(sinks_refusal(cfg.attention))
    if cfg.ici_context_parallelism != 1 and cfg.context_parallel_strategy == "ring":
        raise ConfigError(
            "ring attention (context_parallel_strategy=ring, ici_context_parallelism > 1) cannot apply attention "
            "sinks (attention_sink=true); use context_parallel_strategy=all_gather"
        )


def check_query_block(cfg: Config) -> None:
    """``attention_query_block`` blocks the gathered (non-ring) xla/dot_product attention."""
    block = cfg.attention_query_block
    if not block:
        return
    if cfg.attention_type == "compressed":
        raise ConfigError("attention_query_block does not apply to attention_type=compressed (DeepSeek-V4); set it to 0")
    if cfg.attention in ("cudnn", "splash"):
        raise ConfigError(
            f"attention_query_block applies to attention=xla or dot_product (attention={cfg.attention} is blockwise); set it to 0"
        )
    context = cfg.ici_context_parallelism
    if context != 1 and cfg.context_parallel_strategy == "ring":
        raise ConfigError(
            "attention_query_block does not apply to ring attention (context_parallel_strategy=ring already works in "
            "blocks); set it to 0 or use context_parallel_strategy=all_gather"
        )
    if cfg.max_target_length % block:
        raise ConfigError(
            f"attention_query_block={block} does not divide max_target_length={cfg.max_target_length}; use a divisor"
        )
    if context > 1 and block % context:
        raise ConfigError(
            f"attention_query_block={block} is not a multiple of ici_context_parallelism={context} "
            "(each block holds queries of every context shard); use a multiple"
        )


def cudnn_unsupported(
    dtype: str, head_dim: int, *, chunked: bool = False, sequence_sharded: bool = False, max_head_dim: int = CUDNN_MAX_HEAD_DIM
) -> str | None:
    """Why cuDNN flash attention cannot run this attention (``None``: it can).

    ``dtype`` is an element type name (``bfloat16``...). The limits are those
    ``jax._src.cudnn.fused_attention_stablehlo`` checks (dtype and head dim) plus what
    nnxtron cannot express with it: aligned chunks (Llama 4) and queries sharded over the
    sequence (its sharding rule refuses that).
    """
    if dtype not in ("bfloat16", "float16"):
        return f"needs dtype=bfloat16 (cuDNN flash attention has no {dtype} kernel)"
    if head_dim % 8 or head_dim > max_head_dim:
        return f"needs head_dim a multiple of 8 and at most {max_head_dim}, got {head_dim}"
    if chunked:
        return "cannot express chunked attention (chunk_attn_window_size > 0)"
    if sequence_sharded:
        return "cannot shard queries over the sequence (ici_context_parallelism > 1)"
    return None


def check_layer_pattern(cfg: Config) -> None:
    """Window, chunk and pattern sizes; whether the layers form whole stacks is checked by
    ``layout.pattern_stacks`` (when a model is built, or here through a pipeline)."""
    if cfg.chunk_attn_window_size and cfg.sliding_window_size and not cfg.sliding_window_pattern and not cfg.compress_ratios:
        raise ConfigError(
            f"sliding_window_size={cfg.sliding_window_size} is not read when chunk_attn_window_size="
            f"{cfg.chunk_attn_window_size} > 0 (chunked attention replaces the sliding window on RoPE layers, "
            "NoPE layers are global); set sliding_window_size=0"
        )
    for name in ("sliding_window_size", "chunk_attn_window_size"):
        size = getattr(cfg, name)
        if size > cfg.max_position_embeddings:
            raise ConfigError(
                f"{name}={size} is larger than max_position_embeddings={cfg.max_position_embeddings}: the window "
                f"could never apply; choose at most {cfg.max_position_embeddings} (or 0 for no window)"
            )
    if cfg.sliding_window_pattern and not cfg.sliding_window_size:
        raise ConfigError(
            f"sliding_window_pattern={cfg.sliding_window_pattern} makes sliding layers but sliding_window_size=0; "
            "set sliding_window_size > 0 (or sliding_window_pattern=0 for all-global layers)"
        )
    if cfg.sliding_window_pattern and cfg.chunk_attn_window_size:
        raise ConfigError("sliding_window_pattern and chunk_attn_window_size cannot be combined; set one of them to 0")
    if cfg.trainable_position_size:
        if cfg.trainable_position_size < cfg.max_target_length:
            raise ConfigError(
                f"trainable_position_size={cfg.trainable_position_size} is smaller than max_target_length="
                f"{cfg.max_target_length}: later positions would have no embedding; raise it or shorten sequences"
            )
        if cfg.nope_layer_interval:
            raise ConfigError("trainable_position_size (learned positions, no RoPE) and nope_layer_interval cannot be combined")
    if cfg.temperature_tuning and not cfg.nope_layer_interval:
        raise ConfigError(
            "temperature_tuning scales queries on NoPE layers; set nope_layer_interval > 0 (or temperature_tuning=false)"
        )
    period, cycle = layer_pattern_period(cfg), cfg.inhomogeneous_layer_cycle_interval
    if cycle and cycle % period:
        raise ConfigError(
            f"inhomogeneous_layer_cycle_interval={cycle} does not fit the layer pattern, which repeats every "
            f"{period} layers; set it to a multiple of {period} (or 0 to use {period})"
        )
    if cfg.interleave_moe_layer_step > 1 and cfg.num_experts == 1:
        raise ConfigError(f"interleave_moe_layer_step={cfg.interleave_moe_layer_step} needs num_experts > 1")
    if cfg.interleave_moe_layer_step > 1 and cfg.first_num_dense_layers:
        raise ConfigError("interleave_moe_layer_step > 1 and first_num_dense_layers > 0 cannot be combined; use one of them")


def check_quantization(cfg: Config) -> None:
    """Quantization options only with qwix quantization on; regexes and calibration methods parse."""
    if cfg.use_qwix_quantization and not cfg.quantization:
        raise ConfigError(f"use_qwix_quantization=true needs quantization= one of {list(options.QUANTIZATION_MODES)}")
    if cfg.quantization and not cfg.use_qwix_quantization:
        raise ConfigError(f"quantization={cfg.quantization} needs use_qwix_quantization=true (nnxtron quantizes with qwix only)")
    defaults = options.QUANTIZATION_OPTIONS_OFF
    if not cfg.use_qwix_quantization:
        changed = [key for key, value in defaults.items() if getattr(cfg, key) != value]
        if changed:
            raise ConfigError(f"{changed[0]} is set but quantization is off; set use_qwix_quantization=true quantization=...")
        return
    for key in ("qwix_module_path", "qwix_exclude_module_path"):
        try:
            re.compile(getattr(cfg, key))
        except re.error as err:
            raise ConfigError(f"{key}={getattr(cfg, key)!r} is not a valid regular expression ({err})") from None
    for key in ("weight", "act", "bwd"):
        key = f"{key}_quantization_calibration_method"
        _check_calibration(key, getattr(cfg, key))
    for key in ("weight_quantization_calibration_method", "act_quantization_calibration_method"):
        if getattr(cfg, key).split(",")[0].strip() == "minmax":  # qwix's backward asserts zero_point is None
            raise ConfigError(
                f"{key}={getattr(cfg, key)!r}: minmax calibration adds a zero point, which qwix's training backward "
                "pass does not support for the forward operands; use absmax[,c], rms,c or fixed,lo,hi "
                "(bwd_quantization_calibration_method may be minmax)"
            )
    if cfg.num_experts > 1:
        moe_only_default = ["quantization_tile_size", "quantization_bwd_tile_size"] + [
            f"{k}_quantization_calibration_method" for k in ("weight", "act", "bwd")
        ]
        changed = [key for key in moe_only_default if getattr(cfg, key) != defaults[key]]
        if changed:
            raise ConfigError(
                f"{changed[0]}={getattr(cfg, changed[0])!r} cannot apply to the MoE grouped matmuls (qwix's ragged_dot "
                "quantizes per channel with absmax only); leave it at its default for num_experts > 1"
            )


def _check_calibration(key: str, value: str) -> None:
    """qwix's calibration syntax: ``<method>[,<number>...]``."""
    method, *args = [part.strip() for part in value.split(",")]
    lo, hi = options.CALIBRATION_ARGS.get(method, (-1, -1))
    if lo < 0:
        raise ConfigError(
            f"{key}={value!r}: unknown calibration method {method!r}; use one of {sorted(options.CALIBRATION_ARGS)}"
        )
    if not lo <= len(args) <= hi:
        raise ConfigError(f"{key}={value!r}: {method} takes {lo if lo == hi else f'{lo} to {hi}'} number(s) after the name")
    for arg in args:
        try:
            float(arg)
        except ValueError:
            raise ConfigError(f"{key}={value!r}: {arg!r} is not a number") from None


def check_optimization(cfg: Config) -> None:
    """A schedule or optimizer key is set (differs from its base.yml default) only where the
    chosen ``lr_schedule_type`` / ``opt_type`` reads it (``options.SCHEDULE_KEYS``, ``OPTIMIZER_KEYS``)."""
    hints = {
        ("cosine", "learning_rate_final_fraction"): "; cosine's is cosine_learning_rate_final_fraction",
        ("wsd", "cosine_learning_rate_final_fraction"): "; wsd's is learning_rate_final_fraction",
        ("linear", "cosine_learning_rate_final_fraction"): "; linear's is learning_rate_final_fraction",
    }
    for choice_key, table in (("lr_schedule_type", options.SCHEDULE_KEYS), ("opt_type", options.OPTIMIZER_KEYS)):
        choice = getattr(cfg, choice_key)
        for key in dict.fromkeys(k for keys in table.values() for k in keys):
            value = getattr(cfg, key)
            if key in table[choice] or value == options.OPTIMIZATION_DEFAULTS[key]:
                continue
            readers = "/".join(name for name, keys in table.items() if key in keys)
            raise ConfigError(
                f"{key}={value!r} is not read by {choice_key}={choice} (only by {choice_key}={readers}); "
                f"unset it or choose that {choice_key}{hints.get((choice, key), '')}"
            )
    if cfg.lr_schedule_convention == "maxtext" and cfg.lr_schedule_type not in ("cosine", "wsd"):
        raise ConfigError(
            f"lr_schedule_convention=maxtext follows MaxText's schedules, cosine and wsd; lr_schedule_type="
            f"{cfg.lr_schedule_type} is nnxtron's: use lr_schedule_convention=nnxtron or lr_schedule_type=cosine|wsd"
        )
    if cfg.lr_schedule_type == "wsd" and cfg.warmup_steps_fraction + cfg.wsd_decay_steps_fraction > 1:
        raise ConfigError(
            f"warmup_steps_fraction ({cfg.warmup_steps_fraction}) + wsd_decay_steps_fraction "
            f"({cfg.wsd_decay_steps_fraction}) exceed 1 with lr_schedule_type=wsd; lower one of them"
        )
