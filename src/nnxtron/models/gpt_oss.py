"""GPT-OSS: the pre-norm block (``models/prenorm.py``) with attention sinks and biases, alternating sliding /
global layers, and a routed MoE on every layer whose experts are a clamped SwiGLU with biases.

HF ``GptOssForCausalLM`` (``decoder_block=gpt_oss``). Per layer::

    h = x + o(attn(rope(q(norm_in(x))), rope(k(.)), v(.)))        # q/k/v/o biases; one sink logit per head
    y = h + sum_j w_j (down_e(glu(gate_e(n), up_e(n))) + b_e)       # n = norm_post(h), e = the j-th chosen expert
    glu(g, u) = min(g, L) * sigmoid(1.702 min(g, L)) * (clip(u, -L, L) + 1)

The router's logits ``n @ W + b`` (a trained bias) choose the top-k experts, weighted by the softmax over
the chosen logits (``routed_score_func=softmax``, ``norm_topk_prob=true``: the same weights). Layer ``i`` is
global iff ``(i + 1) % 2 == 0`` (``sliding_window_pattern=2``: layer 0 slides); every layer rotates with
the same YaRN RoPE (``rope_truncate=false``, HF's ``truncate``). The sinks, ``[heads]``, join each row's
softmax and are dropped (``layers/attention.masked_attention``). Untied head. Config rules:
``config/gpt_oss.py``; HF ``config.json`` maps: ``models/gpt_oss_hf.py``.

HF weights: ``self_attn.sinks``, ``mlp.router.{weight,bias}``, ``mlp.experts.gate_up_proj [E, D, 2F]``
with gate and up **interleaved** on the last axis (gate the even columns, up the odd ones; its bias
``[E, 2F]`` too), ``mlp.experts.down_proj [E, F, D]`` and ``down_proj_bias [E, D]`` (no per-expert hub
layout: ``save_pretrained`` writes these).

MaxText (``decoder_block=gpt_oss``, ``models/gpt_oss.py: GptOssDecoderLayer``) names a layer
``GptOssAttention/{query,key,value,out}/{kernel,bias}``, ``GptOssAttention/sinks``,
``pre_self_attention_layer_norm`` / ``post_self_attention_layer_norm`` and
``GptOssMlp/{gate/kernel, gate/bias, wi_0, wi_1, wo, wi_0_bias, wi_1_bias, wo_bias}``; it scans blocks of
2 layers (``inhomogeneous_layer_cycle_interval``) and scales the query at run time (nothing folded).
"""

from __future__ import annotations

from flax import nnx

from nnxtron.config.gpt_oss import PATTERN
from nnxtron.config.layout import PLAIN, LayerKind
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.models.family import Golden, StrategyRow, WeightMap
from nnxtron.models.gpt_oss_hf import config_from_hf, config_to_hf
from nnxtron.models.hf_common import GQA_BIAS_WEIGHTS, GQA_WEIGHTS, NORM_WEIGHTS
from nnxtron.models.maxtext_map import PRE_NORMS, MaxTextMap, Rule
from nnxtron.models.prenorm import PreNormBlock, pre_norm_family


class GptOssBlock(PreNormBlock):
    """One GPT-OSS layer: the pre-norm block whose MoE router has a trained bias (``routed_bias``)."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs, kind: LayerKind = PLAIN):
        super().__init__(cfg, rngs, kind, trained_router_bias=True)


ATTENTION_BIAS_WEIGHTS = (*GQA_BIAS_WEIGHTS, WeightMap("attention/out/bias", "self_attn.o_proj.bias"))
SINK_WEIGHTS = (WeightMap("attention/sinks", "self_attn.sinks"),)
EXPERT_WEIGHTS = (
    WeightMap("mlp/router/kernel", "mlp.router.weight", 1),
    WeightMap("mlp/router/bias", "mlp.router.bias"),
    WeightMap("mlp/wi_0", "mlp.experts.gate_up_proj", split_part=0, split_parts=2, interleaved=True),
    WeightMap("mlp/wi_1", "mlp.experts.gate_up_proj", split_part=1, split_parts=2, interleaved=True),
    WeightMap("mlp/wo", "mlp.experts.down_proj"),
)
EXPERT_BIAS_WEIGHTS = (
    WeightMap("mlp/wi_0_bias", "mlp.experts.gate_up_proj_bias", split_part=0, split_parts=2, interleaved=True),
    WeightMap("mlp/wi_1_bias", "mlp.experts.gate_up_proj_bias", split_part=1, split_parts=2, interleaved=True),
    WeightMap("mlp/wo_bias", "mlp.experts.down_proj_bias"),
)


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    if not kind.moe:
        raise ConfigError("decoder_block gpt_oss has only MoE layers; set num_experts > 1 and first_num_dense_layers=0")
    maps = NORM_WEIGHTS + GQA_WEIGHTS + EXPERT_WEIGHTS
    if cfg.attention_bias:
        maps += ATTENTION_BIAS_WEIGHTS
    if cfg.attention_sink:
        maps += SINK_WEIGHTS
    if cfg.mlp_bias:
        maps += EXPERT_BIAS_WEIGHTS
    if not cfg.routed_bias:
        maps = tuple(m for m in maps if m.path != "mlp/router/bias")
    return maps


def maxtext_layer_rules(cfg: Config, kind: LayerKind) -> tuple[Rule, ...]:
    """MaxText's ``GptOssDecoderLayer``: ``GptOssAttention/`` and ``GptOssMlp/`` (nothing folded: its
    query is scaled at run time)."""
    attention = [Rule(f"GptOssAttention/{n}/kernel", f"attention/{n}/kernel") for n in ("query", "key", "value", "out")]
    if cfg.attention_bias:
        attention += [Rule(f"GptOssAttention/{n}/bias", f"attention/{n}/bias") for n in ("query", "key", "value", "out")]
    if cfg.attention_sink:
        attention.append(Rule("GptOssAttention/sinks", "attention/sinks"))
    moe = [Rule("GptOssMlp/gate/kernel", "mlp/router/kernel")] + [
        Rule(f"GptOssMlp/{n}", f"mlp/{n}") for n in ("wi_0", "wi_1", "wo")
    ]
    if cfg.routed_bias:
        moe.append(Rule("GptOssMlp/gate/bias", "mlp/router/bias"))
    if cfg.mlp_bias:
        moe += [Rule(f"GptOssMlp/{n}", f"mlp/{n}") for n in ("wi_0_bias", "wi_1_bias", "wo_bias")]
    return (*attention, *PRE_NORMS, *moe)


FAMILIES = (
    pre_norm_family(
        "gpt_oss",
        "gpt_oss",
        "GptOssForCausalLM",
        layer_weights,
        config_from_hf,
        config_to_hf,
        make_block=GptOssBlock,
        maxtext=MaxTextMap(maxtext_layer_rules, scan_cycle=PATTERN),
        goldens=(Golden("gpt_oss", "gpt_oss"),),
        # the experts' biases (a ones column on the tokens, a row on the kernels) split over the expert axis
        strategy_rows=(StrategyRow("gpt-oss-tiny", True, "full", "expert2_fsdp4", 1),),
    ),
)
