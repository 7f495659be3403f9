"""MaxText configs: MaxText 0.2.5's own base.yml loads, every key of it is classified, MaxText's
reference commands resolve, refused values are one error line, base_config inherits."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml

from nnxtron.config import maxtext
from nnxtron.config.loader import load_config, load_config_report
from nnxtron.config.maxtext_keys import HONOURED, IGNORED, KEYS, NOT_IN_BASE, REFUSED, TRANSLATED, same
from nnxtron.errors import ConfigError
from tests.integration.conftest import assert_user_error, run_cli
from tests.scripts import load_script

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "maxtext"
BASE = ASSETS / "base.yml"
# the reference run of MaxText's MTP/qwix fix (issue 24), verbatim apart from the program
REFERENCE = (
    "model_name=deepseek3-tiny per_device_batch_size=1 max_target_length=128 steps=20 dataset_type=synthetic "
    "enable_checkpointing=false sparse_matmul=false mtp_num_layers=1 mtp_loss_scaling_factor=0.1"
).split()
RUN = ["base_output_directory=OUT", "run_name=nnx_mtp"]


def base_values() -> dict:
    return yaml.safe_load(BASE.read_text())


def test_every_key_of_maxtexts_base_yml_is_in_the_table_with_its_default():
    values = base_values()
    assert len(values) == 786
    assert [k for k in values if k not in KEYS] == []  # MaxText adds a key: classify it
    assert [k for k in values if not same(values[k], KEYS[k].default)] == []
    extra = [k for k, r in KEYS.items() if r.default is NOT_IN_BASE]
    assert sorted(extra) == ["enable_nnx", "pure_nnx", "pure_nnx_decoder"]
    counts = Counter(r.kind for k, r in KEYS.items() if k in values)
    # gpt_oss: attention_sink, mlp_bias and rope_truncate honoured (were refused); qwen3_next: the gdn_* keys and
    # partial_rotary_factor honoured, and gdn_chunk_size (the chunk the delta rule takes at a time); gemma4: its
    # global-layer shape and RoPE keys translated (were refused), rope_max_timescale translated with them
    assert counts == {IGNORED: 372, REFUSED: 225, HONOURED: 141, TRANSLATED: 48}


def test_each_class_carries_what_it_needs():
    for key, rule in KEYS.items():
        if rule.kind in (IGNORED, REFUSED):
            assert rule.note, key
        if rule.kind == REFUSED:
            assert rule.use, key
        if rule.kind in (HONOURED, TRANSLATED):
            assert rule.to is not None, key


def test_the_docs_table_is_generated_from_the_key_table():
    script = load_script("scripts/maxtext_keys_table.py")
    assert script.main(["--check"]) == 0, "run python scripts/maxtext_keys_table.py"
    text = script.render()
    for key in KEYS:
        assert f"| `{key}` |" in text


def test_maxtexts_base_yml_loads_unchanged_with_maxtexts_values():
    cfg, report = load_config_report(BASE)
    assert report.maxtext_file
    assert (cfg.dtype, cfg.remat_policy, cfg.per_device_batch_size, cfg.steps) == ("bfloat16", "full", 12.0, 150001)
    assert (cfg.base_emb_dim, cfg.base_mlp_dim, cfg.base_num_decoder_layers) == (2048, 7168, 16)
    assert (cfg.attention, cfg.packing, cfg.rope_interleave, cfg.routed_score_func) == ("auto", "concat", False, "softmax")
    # MaxText's semantics where they differ from HF's (docs/maxtext.md, tests/parity/test_maxtext_reproduction.py):
    # unscaled q.k for llama2, its default RoPE rotates halves, renormalised top-k, decay on all, its schedule
    assert (cfg.query_pre_attn_scalar, cfg.norm_topk_prob, cfg.weight_decay_mask, cfg.lr_schedule_convention) == (
        1.0, True, "all", "maxtext")  # fmt: skip
    assert (cfg.base_output_directory, cfg.max_num_checkpoints_to_keep, cfg.sample_after_training) == ("maxtext_output", 2**40, 0)
    assert cfg.tokenizer_type == "byte"  # synthetic data without tokenizer_path: MaxText reads no tokenizer
    assert len(report.ignored) == 372 and "profiler" in report.ignored and "use_ragged_sort" in report.ignored


def test_scan_layers_per_stage_follows_maxtexts_default_in_a_pipeline():
    """MaxText runs a stage's layers one after another unless scan_layers_per_stage=true; nnxtron
    reads the key only with pipeline stages (its own default scans them)."""
    stages = ["ici_pipeline_parallelism=2", "base_num_decoder_layers=4", "ici_fsdp_parallelism=1", "ici_data_parallelism=1"]
    assert load_config_report(BASE, stages)[0].scan_layers_per_stage is False
    assert load_config_report(BASE, [*stages, "scan_layers_per_stage=true"])[0].scan_layers_per_stage is True
    assert load_config_report(BASE)[0].scan_layers_per_stage is True  # no pipeline: not passed, nnxtron's default
    assert load_config(values={"ici_pipeline_parallelism": 2, "base_num_decoder_layers": 4}).scan_layers_per_stage is True


@pytest.mark.parametrize("model", ["llama4-17b-16e", "llama3.1-8b"])
def test_maxtexts_llama31_rope_keeps_its_fixed_scaling_under_a_maxtext_config(model):
    """MaxText's rope_type llama3.1 scales by 8 / 1 / 4 over 8192 positions whatever the model
    (LLaMARotaryEmbedding._apply_scaling_factor): Llama 4's preset (HF: 16 / 1 / 1) gives way to it."""
    cfg = load_config(str(BASE), [f"model_name={model}"])
    got = (cfg.rope_type, cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor)
    assert got == ("llama3", 8.0, 1.0, 4.0) and cfg.rope_original_max_position_embeddings == 8192
    yml = load_config(str(BASE), ["rope_type=llama3.1"])  # a MaxText config's own key
    assert (yml.rope_type, yml.rope_scaling_factor, yml.rope_high_freq_factor) == ("llama3", 8.0, 4.0)
    assert load_config(None, ["model_name=llama4-17b-16e"]).rope_scaling_factor == 16.0  # nnxtron's preset: HF's


# MaxText 0.2.5's configs/models/gemma2-2b.yml (its keys; the file is in MaxText's wheel, not here)
GEMMA2_2B = [
    "decoder_block=gemma2", "base_emb_dim=2304", "base_num_query_heads=8", "base_num_kv_heads=4", "base_mlp_dim=9216",
    "base_num_decoder_layers=13", "head_dim=256", "mlp_activations=[gelu,linear]", "vocab_size=256128",
    "normalization_layer_epsilon=1e-6", "logits_via_embedding=true", "final_logits_soft_cap=30.0",
    "attn_logits_soft_cap=50.0", "sliding_window_size=4096", "use_post_attn_norm=true", "use_post_ffw_norm=true",
]  # fmt: skip


def test_maxtexts_gemma2_layer_pairs_and_keys():
    """MaxText's gemma2 layer is a (sliding, global) pair: 13 layers there are nnxtron's 26 (its preset's),
    alternating from a sliding one; the post norms are accepted where nnxtron has them, refused elsewhere."""
    cfg = load_config(BASE, GEMMA2_2B)
    assert (cfg.base_num_decoder_layers, cfg.sliding_window_pattern, cfg.query_pre_attn_scalar) == (26, 2, 1.0)
    assert (cfg.attn_logits_soft_cap, cfg.final_logits_soft_cap) == (50.0, 30.0)
    preset = load_config(None, ["model_name=gemma2-2b"])
    assert preset.base_num_decoder_layers == 26 and load_config(BASE, ["model_name=gemma2-2b", "base_num_decoder_layers=13"])
    with pytest.raises(ConfigError, match=r"base_num_decoder_layers=12 \(MaxText's; 24 nnxtron layers\)"):
        load_config(BASE, ["model_name=gemma2-2b", "base_num_decoder_layers=12"])
    with pytest.raises(ConfigError, match="MaxText key use_post_ffw_norm=False is refused"):
        load_config(BASE, [*GEMMA2_2B, "use_post_ffw_norm=false"])
    with pytest.raises(ConfigError, match="MaxText key use_post_attn_norm=True is refused"):
        load_config(BASE, ["use_post_attn_norm=true"])  # llama2 has no post norms
    assert load_config(BASE, ["decoder_block=mistral", "base_num_decoder_layers=13"]).base_num_decoder_layers == 13


# MaxText 0.2.5's configs/models/gpt-oss-20b.yml (its keys)
GPT_OSS_20B = [
    "decoder_block=gpt_oss", "base_emb_dim=2880", "base_num_query_heads=64", "base_num_kv_heads=8", "head_dim=64",
    "sliding_window_size=128", "attention_bias=true", "attention_sink=true", "rope_type=yarn", "rope_max_timescale=150000",
    "max_position_embeddings=131072", "original_max_position_embeddings=4096", "rope_factor=32", "beta_fast=32",
    "beta_slow=1", "rope_interleave=false", "rope_truncate=false", "rope_attention_scaling=true", "base_mlp_dim=2880",
    "base_moe_mlp_dim=2880", "mlp_activations=[sigmoid,linear]", "mlp_activations_limit=7.0", "routed_bias=true",
    "mlp_bias=true", "num_experts=32", "num_experts_per_tok=4", "base_num_decoder_layers=24", "vocab_size=201088",
    "normalization_layer_epsilon=1.0e-5", "enable_dropout=false", "logits_via_embedding=false",
    "inhomogeneous_layer_cycle_interval=2",
]  # fmt: skip


def test_maxtexts_gpt_oss_keys_give_the_preset():
    """MaxText's gpt-oss-20b keys (sinks, expert biases, the untruncated YaRN with its cos/sin scaling, the clamped
    SwiGLU) load as nnxtron's preset, the block's alternating layers included; its keys are refused elsewhere."""
    cfg, preset = load_config(BASE, GPT_OSS_20B), load_config(None, ["model_name=gpt-oss-20b"])
    keys = ("decoder_block", "sliding_window_pattern", "sliding_window_size", "attention_sink", "attention_bias", "mlp_bias",
            "routed_bias", "routed_score_func", "norm_topk_prob", "mlp_activations", "mlp_activations_limit", "rope_type",
            "rope_truncate", "rope_scaling_factor", "rope_original_max_position_embeddings", "rope_max_timescale",
            "base_moe_mlp_dim", "num_experts", "num_experts_per_tok", "inhomogeneous_layer_cycle_interval")  # fmt: skip
    assert {k: getattr(cfg, k) for k in keys} == {k: getattr(preset, k) for k in keys}
    assert cfg.sliding_window_pattern == 2 and cfg.attention_sink and cfg.mlp_bias and not cfg.rope_truncate
    with pytest.raises(ConfigError, match="MaxText key rope_attention_scaling=True is refused"):
        load_config(BASE, ["rope_attention_scaling=true"])  # default RoPE: nothing to scale
    for key in ("attention_sink", "mlp_bias"):
        with pytest.raises(ConfigError, match=f"{key} is read by decoder_block=gpt_oss only"):
            load_config(BASE, [f"{key}=true"])


# MaxText 0.2.5's configs/models/qwen3-next-80b-a3b.yml (its keys)
QWEN3_NEXT_80B = [
    "decoder_block=qwen3_next", "base_emb_dim=2048", "base_num_decoder_layers=48", "base_num_query_heads=16",
    "base_num_kv_heads=2", "head_dim=256", "vocab_size=151936", "normalization_layer_epsilon=1.0e-6", "base_mlp_dim=512",
    "base_moe_mlp_dim=512", "num_experts=512", "shared_experts=1", "num_experts_per_tok=10", "norm_topk_prob=true",
    "inhomogeneous_layer_cycle_interval=4", "gdn_conv_kernel_dim=4", "gdn_key_head_dim=128", "gdn_value_head_dim=128",
    "gdn_num_key_heads=16", "gdn_num_value_heads=32", "gdn_chunk_size=64", "rope_max_timescale=10000000",
    "partial_rotary_factor=0.25", "enable_dropout=false",
]  # fmt: skip


def test_maxtexts_qwen3_next_keys_give_the_preset():
    """MaxText's qwen3-next-80b-a3b keys (the Gated DeltaNet's, partial RoPE, one full-attention layer in 4, the
    shared expert) load as nnxtron's preset (its q/k norms set by the block); its keys are refused elsewhere."""
    cfg, preset = load_config(BASE, QWEN3_NEXT_80B), load_config(None, ["model_name=qwen3-next-80b-a3b"])
    keys = ("decoder_block", "use_qk_norm", "partial_rotary_factor", "inhomogeneous_layer_cycle_interval", "shared_experts",
            "gdn_conv_kernel_dim", "gdn_key_head_dim", "gdn_value_head_dim", "gdn_num_key_heads", "gdn_num_value_heads",
            "base_moe_mlp_dim", "num_experts", "num_experts_per_tok", "norm_topk_prob", "routed_score_func", "head_dim",
            "rope_max_timescale")  # fmt: skip
    assert {k: getattr(cfg, k) for k in keys} == {k: getattr(preset, k) for k in keys}
    for key, value in (("gdn_num_key_heads", 8), ("partial_rotary_factor", 0.5)):
        with pytest.raises(ConfigError, match=f"{key} is read by decoder_block=qwen3_next/qwen3_5 only"):
            load_config(BASE, [f"{key}={value}"])
    with pytest.raises(ConfigError, match="use_qk_norm_in_gdn=False is refused"):
        load_config(BASE, [*QWEN3_NEXT_80B, "use_qk_norm_in_gdn=false"])


# MaxText 0.2.5's configs/models/qwen3.5-35b-a3b.yml (its keys; the vision encoder's are read only with
# use_multimodal=true, mrope_section only with use_mrope=true). Left out: use_mrope=true (refused below) and
# vision_encoder_block, which MaxText's base.yml does not hold (types.py only), so the key table does not know it
QWEN3_5_35B_TEXT = [
    "decoder_block=qwen3_5", "base_emb_dim=2048", "base_num_decoder_layers=40", "base_num_query_heads=16",
    "base_num_kv_heads=2", "head_dim=256", "vocab_size=248320", "normalization_layer_epsilon=1.0e-6", "base_mlp_dim=512",
    "base_moe_mlp_dim=512", "num_experts=256", "shared_experts=1", "num_experts_per_tok=8", "norm_topk_prob=true",
    "inhomogeneous_layer_cycle_interval=4", "gdn_conv_kernel_dim=4", "gdn_key_head_dim=128", "gdn_value_head_dim=128",
    "gdn_num_key_heads=16", "gdn_num_value_heads=32", "gdn_chunk_size=64", "rope_max_timescale=10000000",
    "partial_rotary_factor=0.25", "enable_dropout=false", "image_size_for_vit=768",
    "hidden_size_for_vit=1152", "intermediate_size_for_vit=4304", "num_attention_heads_for_vit=16",
    "num_hidden_layers_for_vit=27", "num_channels_for_vit=3", "patch_size_for_vit=16", "temporal_patch_size_for_vit=2",
    "spatial_merge_size_for_vit=2", "out_hidden_size_for_vit=2048", "num_position_embeddings_for_vit=2304",
    "deepstack_visual_indexes_for_vit=[]", "rope_theta_for_vit=10000", "mrope_section=[11,11,10]",
]  # fmt: skip


def test_maxtexts_qwen3_5_keys_give_the_preset():
    """MaxText's qwen3.5-35b-a3b keys load as nnxtron's preset (decoder_block=qwen3_5 accepted, its q/k norms set by
    the block), the vision encoder's keys unread without use_multimodal; the file's use_mrope=true (multimodal RoPE)
    and use_multimodal=true are refused by name: nnxtron has the text decoder only."""
    cfg, preset = load_config(BASE, QWEN3_5_35B_TEXT), load_config(None, ["model_name=qwen3.5-35b-a3b"])
    keys = ("decoder_block", "use_qk_norm", "partial_rotary_factor", "inhomogeneous_layer_cycle_interval", "shared_experts",
            "gdn_conv_kernel_dim", "gdn_key_head_dim", "gdn_value_head_dim", "gdn_num_key_heads", "gdn_num_value_heads",
            "base_moe_mlp_dim", "base_mlp_dim", "num_experts", "num_experts_per_tok", "norm_topk_prob", "routed_score_func",
            "head_dim", "rope_max_timescale", "vocab_size", "base_num_decoder_layers", "base_emb_dim")  # fmt: skip
    assert {k: getattr(cfg, k) for k in keys} == {k: getattr(preset, k) for k in keys}
    assert cfg.decoder_block == "qwen3_5" and cfg.use_qk_norm
    with pytest.raises(ConfigError, match="MaxText key use_mrope=True is refused: nnxtron has no multimodal RoPE"):
        load_config(BASE, [*QWEN3_5_35B_TEXT, "use_mrope=true"])
    with pytest.raises(ConfigError, match="MaxText key use_multimodal=True is refused: nnxtron has no multimodal encoders"):
        load_config(BASE, [*QWEN3_5_35B_TEXT, "use_multimodal=true"])


# MaxText 0.2.5's configs/models/gemma4-{26b,31b}.yml (their keys; the vision encoder's are read only with
# use_multimodal=true; vision_encoder_block is not in MaxText's base.yml, so the key table does not know it)
GEMMA4_VISION = [
    "rope_theta_for_vit=100", "image_size_for_vit=[672,960]", "num_channels_for_vit=3", "patch_size_for_vit=16",
    "conv_stride_for_vit=16", "hidden_size_for_vit=1152", "intermediate_size_for_vit=4304", "num_hidden_layers_for_vit=27",
    "num_attention_heads_for_vit=16", "image_placeholder=<|image|>", "vision_output_length=280",
    "num_position_embeddings_for_vit=10240",
]  # fmt: skip
GEMMA4_COMMON = [
    "mlp_activations=[gelu,linear]", "head_dim=256", "global_head_dim=512", "vocab_size=262144", "decoder_block=gemma4",
    "normalization_layer_epsilon=1.0e-6", "logits_via_embedding=true", "sliding_window_size=1024", "use_post_attn_norm=true",
    "use_post_ffw_norm=true", "share_kv_projections=true", "local_rope_max_timescale=10000",
    "global_rope_max_timescale=1000000", "rope_max_timescale=1000000", "global_rope_proportion=0.25",
    "local_rope_proportion=1.0", "v_norm_with_scale=false", "final_logits_soft_cap=30.0", *GEMMA4_VISION,
]  # fmt: skip
GEMMA4 = {
    "gemma4-26b": [
        "model_name=gemma4-26b", "base_num_decoder_layers=30", "base_emb_dim=2816", "base_num_query_heads=16", "base_num_kv_heads=8",
        "base_mlp_dim=2112", "base_moe_mlp_dim=704", "global_num_kv_heads=2", "num_experts=128", "num_experts_per_tok=8",
        "shared_experts=1", "norm_topk_prob=true", "load_balance_loss_weight=0.001", *GEMMA4_COMMON,
    ],
    "gemma4-31b": [
        "model_name=gemma4-31b", "base_num_decoder_layers=60", "base_emb_dim=5376", "base_num_query_heads=32", "base_num_kv_heads=16",
        "base_mlp_dim=21504", "global_num_kv_heads=4", *GEMMA4_COMMON,
    ],
}  # fmt: skip


@pytest.mark.parametrize("model", sorted(GEMMA4))
def test_maxtexts_gemma4_keys_give_the_preset(model):
    """MaxText's model_name=gemma4-26b / gemma4-31b with its model config's keys loads as nnxtron's preset (a key the
    preset sets otherwise would be MaxText's override_model_config error; decoder_block=gemma4's fixed pattern of 6, q/k
    norms and unscaled logits set by the block; the three RoPE bases and the two proportions translated). Gemma 4's
    keys are dropped for another block (MaxText reads them for gemma4 only) or refused where MaxText differs."""
    cfg, preset = load_config(BASE, GEMMA4[model]), load_config(None, [f"model_name={model}"])
    keys = ("decoder_block", "sliding_window_pattern", "use_qk_norm", "query_pre_attn_scalar", "head_dim", "global_head_dim",
            "global_num_kv_heads", "share_kv_projections", "rope_max_timescale", "local_rope_max_timescale",
            "global_rope_proportion", "local_rope_proportion", "num_experts", "shared_experts", "base_moe_mlp_dim",
            "final_logits_soft_cap", "sliding_window_size", "normalize_embedding_logits")  # fmt: skip
    keys += ("norm_topk_prob", "num_experts_per_tok", "load_balance_loss_weight") if preset.num_experts > 1 else ()
    assert {k: getattr(cfg, k) for k in keys} == {k: getattr(preset, k) for k in keys}
    assert load_config(BASE, ["global_head_dim=512", "global_rope_proportion=0.5"]).global_head_dim == 0  # llama2: unread
    with pytest.raises(ConfigError, match="v_norm_with_scale=True is refused"):
        load_config(BASE, [*GEMMA4[model], "v_norm_with_scale=true"])
    with pytest.raises(ConfigError, match="share_kv_projections=True is refused"):
        load_config(BASE, ["share_kv_projections=true"])


GEMMA4_BLOCK = ["decoder_block=gemma4", "mlp_activations=[gelu,linear]", "sliding_window_size=8", "v_norm_with_scale=false", "use_post_attn_norm=true",
                "use_post_ffw_norm=true", "global_rope_proportion=1.0"]  # fmt: skip


def test_maxtexts_gemma4_rope_bases_and_proportions():
    """MaxText's gemma4 block: global layers on global_rope_max_timescale where > 0, else rope_max_timescale; sliding
    layers on local_rope_max_timescale where > 0, else rope_max_timescale (nnxtron: rope_max_timescale, local_*). A
    proportion below 1 is Gemma 4's proportional RoPE only under a gemma4-* model_name (else MaxText's plain partial
    RoPE rotates the first dims): refused there."""
    for given, want in (
        ([], (10000.0, 10000.0)),  # base.yml: rope 1e4, global and local -1
        (["rope_max_timescale=500", "global_rope_max_timescale=7000"], (7000.0, 500.0)),
        (["global_rope_max_timescale=7000", "local_rope_max_timescale=300"], (7000.0, 300.0)),
    ):
        cfg = load_config(BASE, [*GEMMA4_BLOCK, *given])
        assert (cfg.rope_max_timescale, cfg.local_rope_max_timescale) == want, given
    cfg = load_config(BASE, ["rope_max_timescale=500", "global_rope_max_timescale=7000", "local_rope_max_timescale=300"])
    assert (cfg.rope_max_timescale, cfg.local_rope_max_timescale) == (500.0, 300.0)  # llama2 reads neither global one
    with pytest.raises(ConfigError, match="global_rope_proportion=0.5 is refused: MaxText rotates Gemma 4's proportional"):
        load_config(BASE, [*GEMMA4_BLOCK, "global_rope_proportion=0.5"])


def test_reference_command_resolves():
    cfg, report = load_config_report(BASE, [*RUN, *REFERENCE])
    assert (cfg.decoder_block, cfg.attention_type, cfg.base_emb_dim, cfg.num_experts) == ("deepseek", "mla", 64, 16)
    assert (cfg.mtp_num_layers, cfg.mtp_loss_scaling_factor, cfg.steps, cfg.max_target_length) == (1, 0.1, 20, 128)
    assert (cfg.dataset_type, cfg.enable_checkpointing, cfg.dtype, cfg.capacity_factor) == ("synthetic", False, "bfloat16", -1.0)
    assert cfg.rope_scaling_factor == 40.0 and cfg.quantization == ""
    lines = report.startup_lines(cfg)
    assert lines[0].startswith("MaxText keys ignored") and "sparse_matmul" not in lines[0]  # translated: the MoE line
    assert cfg.moe_compute == "dense" and "moe_compute=dense" in lines[-1] and "sparse_matmul=False" in lines[-1]
    assert "dropless" in lines[-1]


def test_fp8_full_variant_quantizes_as_maxtext_does():
    cfg = load_config(BASE, [*RUN, *REFERENCE, "use_qwix_quantization=true", "quantization=fp8_full"])
    assert (cfg.use_qwix_quantization, cfg.quantization) == (True, "fp8_full")
    assert cfg.qwix_module_path == ".*layers/.*"  # quantize_mtp=false: MaxText leaves the MTP depths unquantized
    assert cfg.qwix_exclude_module_path == ".*/(.*_hc)"  # quantize_router_proj=true: routers quantized
    cfg = load_config(BASE, [*REFERENCE, "use_qwix_quantization=true", "quantization=fp8_full", "quantize_mtp=true",
                             "quantize_router_proj=false"])  # fmt: skip
    assert (cfg.qwix_module_path, cfg.qwix_exclude_module_path) == ("(.*layers|mtp)/.*", ".*/(router|.*_hc)")


def test_linen_variant_is_one_line(capsys):
    args = ["config", "show", str(BASE), *RUN, *REFERENCE, "enable_nnx=false", "pure_nnx_decoder=false", "pure_nnx=false"]
    code, _, err = run_cli(capsys, *args)
    assert_user_error(code, err, "MaxText key enable_nnx=False is refused: nnxtron has only the NNX path")
    assert load_config(BASE, ["enable_nnx=true", "pure_nnx=true", "pure_nnx_decoder=true"]).dtype == "bfloat16"


def test_config_show_lists_the_ignored_keys(capsys):
    code, out, _ = run_cli(capsys, "config", "show", str(BASE), "profiler=xplane")
    assert code == 0
    assert "# MaxText keys ignored (372;" in out and "profiler='xplane'" in out and "gcs_metrics=False" in out
    assert "dtype: bfloat16" in out


@pytest.mark.parametrize(
    ("arg", "fragment"),
    [
        ("ragged_buffer_factor=1.0 ici_expert_parallelism=2", "MaxText key ragged_buffer_factor=1.0 is refused"),
        ("use_multimodal=true", "MaxText key use_multimodal=True is refused"),
        ("attention=paged", "MaxText key attention='paged' is refused"),
        ("dataset_type=tfds", "MaxText key dataset_type='tfds' is refused"),
        ("dataset_type=grain", "MaxText key grain_packing_type='first_fit' is refused"),
        ("z_loss_multiplier=0.0001", "MaxText key z_loss_multiplier=0.0001 is refused"),
        ("base_emb_dim=2048", "model_name=deepseek3-tiny sets base_emb_dim=64 and the command line sets base_emb_dim=2048"),
    ],
)
def test_refused_values_are_one_error_line(capsys, arg, fragment):
    args = [*REFERENCE, arg] if arg.startswith("base_emb_dim") else arg.split()
    code, _, err = run_cli(capsys, "config", "show", str(BASE), *args)
    assert_user_error(code, err, fragment)


def test_accepted_values_of_refused_keys():
    cfg = load_config(BASE, ["dropout_rate=0.3", "enable_dropout=false", "ragged_buffer_factor=-1", "megablox=false"])
    assert cfg.dtype == "bfloat16"
    assert load_config(BASE, ["model_name=gemma3-tiny"]).logits_via_embedding  # normalize_embedding_logits=true: HF's head
    # override_model_config=true: the command line wins over the preset, as in MaxText
    cfg = load_config(BASE, [*REFERENCE, "override_model_config=true", "base_emb_dim=128"])
    assert cfg.base_emb_dim == 128


def test_maxtexts_sft_keys():
    """use_sft and chat_template_path are honoured; sft_train_on_completion_only keeps MaxText's default (false,
    every token) and is read only with use_sft; train_data_columns name the record's fields."""
    data = [
        "dataset_type=grain",
        "grain_file_type=parquet",
        "grain_train_files=/data/*.parquet",
        "grain_packing_type=concat_then_split",
    ]
    cfg = load_config(BASE, [*data, "use_sft=true", "train_data_columns=['messages']", "chat_template_path=/t.jinja"])
    assert (cfg.use_sft, cfg.sft_train_on_completion_only, cfg.chat_template_path) == (True, False, "/t.jinja")
    assert cfg.dataset_type == "parquet" and cfg.dataset_text_field == ""
    cfg = load_config(
        BASE, [*data, "use_sft=true", "sft_train_on_completion_only=true", "train_data_columns=['prompt','completion']"]
    )
    assert (cfg.use_sft, cfg.sft_train_on_completion_only) == (True, True)
    assert not load_config(BASE, ["sft_train_on_completion_only=true"]).use_sft  # read only with use_sft
    with pytest.raises(ConfigError, match="train_data_columns"):
        load_config(BASE, [*data, "use_sft=true", "train_data_columns=['question','answer']"])


def test_maxtext_keys_on_the_command_line_without_a_maxtext_file():
    cfg, report = load_config_report(None, ["sparse_matmul=false", "megablox=false", "dropout_rate=0", "steps=3"])
    assert cfg.steps == 3 and cfg.dtype == "float32"  # nnxtron's defaults: no MaxText file
    assert report.ignored == {"megablox": False}  # sparse_matmul is translated: it selects MaxText's capacity path
    assert load_config(None, ["dropout_rate=0.5"]).dropout_rate == 0.5  # honoured (nnxtron's key too)
    assert load_config(BASE, ["dropout_rate=0.5", "enable_dropout=false"]).enable_dropout is False


def test_base_config_inherits_relative_to_the_file(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "base.yml").write_text(BASE.read_text())
    (tmp_path / "configs" / "small.yml").write_text("base_config: base.yml\nbase_emb_dim: 256\nhardware: cpu\n")
    (tmp_path / "smaller.yml").write_text("base_config: configs/small.yml\nsteps: 7\n")
    cfg, report = load_config_report(tmp_path / "smaller.yml")
    assert (cfg.base_emb_dim, cfg.steps, cfg.dtype) == (256, 7, "bfloat16")
    assert report.ignored["hardware"] == "cpu"
    (tmp_path / "loop.yml").write_text("base_config: loop.yml\n")
    with pytest.raises(ConfigError, match="a cycle"):
        load_config(tmp_path / "loop.yml")
    (tmp_path / "orphan.yml").write_text("base_config: nowhere.yml\n")
    with pytest.raises(ConfigError, match="base_config 'nowhere.yml' of config file"):
        load_config(tmp_path / "orphan.yml")


def test_unknown_key_in_a_maxtext_file_names_it(tmp_path):
    (tmp_path / "mt.yml").write_text("sparse_matmul: false\nmegabox: true\n")
    with pytest.raises(ConfigError, match="unknown config key 'megabox' .*a MaxText config.*did you mean 'megablox'"):
        load_config(tmp_path / "mt.yml")


def test_an_nnxtron_file_keeps_its_rules(tmp_path):
    (tmp_path / "run.yml").write_text("steps: 5\npacking: pad\n")
    cfg, report = load_config_report(tmp_path / "run.yml")
    assert (cfg.steps, cfg.packing, cfg.dtype) == (5, "pad", "float32") and not report.maxtext_file
    (tmp_path / "typo.yml").write_text("steps: 5\nlearning_rat: 0.1\n")
    with pytest.raises(ConfigError, match="unknown config key 'learning_rat' in config file .*did you mean 'learning_rate'"):
        load_config(tmp_path / "typo.yml")
    with pytest.raises(ConfigError, match="unknown config key 'learning_rat' in command-line overrides"):
        load_config(None, ["learning_rat=0.1"])


def test_detection_rule():
    assert maxtext.is_maxtext_config({"base_config": "base.yml"})
    assert maxtext.is_maxtext_config({"steps": 3, "sparse_matmul": True})
    assert not maxtext.is_maxtext_config({"steps": 3, "dtype": "bfloat16"})


def test_train_prints_the_ignored_keys_at_start_up(capsys, tmp_path):
    tiny = ["base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=2", "head_dim=16", "base_mlp_dim=64",
            "base_num_decoder_layers=1", "vocab_size=256", "max_target_length=16", "per_device_batch_size=1", "steps=1",
            "enable_checkpointing=false", "enable_tensorboard=false", "profiler=xplane"]  # fmt: skip
    code, out, err = run_cli(
        capsys, "train", str(BASE), f"base_output_directory={tmp_path}", "run_name=mt", "--no-progress", *tiny
    )
    assert code == 0, err
    text = out + err
    assert "MaxText keys ignored (372; infrastructure nnxtron does not have" in text
    assert "371 at MaxText's default values; set otherwise: profiler='xplane'" in text
    assert "profilers and compiler dumps nnxtron does not have in training (36):\n    " in text  # named, grouped by reason
