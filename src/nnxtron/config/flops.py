"""Model FLOPs per trained token: a value derived from the config (for TFLOP/s and MFU).

The device's peak FLOP/s, the other half of MFU, is ``runtime/peak.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nnxtron.config import deepseek4
from nnxtron.config.families import rules_for
from nnxtron.config.layout import LayerKind, attention_shape, layer_kinds

if TYPE_CHECKING:
    from nnxtron.config.schema import Config


def _attention_params(cfg: Config, kind: LayerKind) -> tuple[int, int, int]:
    """(matmul params of one attention layer of ``kind``, query heads, q.k + p.v width per head); a global layer
    of its own shape (Gemma 4, ``layout.attention_shape``) counts its head width, key/value heads and shared key
    projection."""
    d, h = cfg.base_emb_dim, cfg.base_num_query_heads
    if cfg.attention_type == "mla":
        qk, v, rope = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
        lora = cfg.q_lora_rank
        query = d * lora + lora * h * qk if lora else d * h * qk
        kv = d * (cfg.kv_lora_rank + rope) + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + v)
        return query + kv + h * v * d, h, qk + v
    k, hd, shared_kv = attention_shape(cfg, kind)
    gate = h * hd if rules_for(cfg.decoder_block).query_gate else 0  # the output gate's half of the query projection
    return d * (h + (1 if shared_kv else 2) * k) * hd + d * gate + h * hd * d, h, 2 * hd


def _linear_attention(cfg: Config) -> tuple[int, int]:
    """Gated DeltaNet (Qwen3-Next's ``linear`` layers): (matmul params, forward flops per token of its
    recurrence and conv): the decay, the memory read, the update and the output, each ``dk x dv`` per value
    head, and the depthwise conv over q, k, v."""
    d, hk, hv = cfg.base_emb_dim, cfg.gdn_num_key_heads, cfg.gdn_num_value_heads
    dk, dv = cfg.gdn_key_head_dim, cfg.gdn_value_head_dim
    params = d * (2 * hk * dk + 2 * hv * dv) + d * 2 * hv + hv * dv * d
    channels = 2 * hk * dk + hv * dv
    return params, 2 * 4 * hv * dk * dv + 2 * cfg.gdn_conv_kernel_dim * channels


def _ffn_params(cfg: Config, moe: bool) -> int:
    """Matmul params one token goes through in a feed-forward layer (active experts only)."""
    d = cfg.base_emb_dim
    if not moe:
        return len(cfg.mlp_activations) * d * cfg.base_mlp_dim + d * cfg.base_mlp_dim  # gated: 3 matrices, plain: 2
    shared = cfg.base_mlp_dim if rules_for(cfg.decoder_block).dense_shared_expert else cfg.base_moe_mlp_dim
    return d * cfg.num_experts + 3 * d * (cfg.base_moe_mlp_dim * cfg.num_experts_per_tok + shared * cfg.shared_experts)


def _keys_seen(cfg: Config, kind: LayerKind) -> float:
    """Keys a query attends to, on average over a causal sequence of ``max_target_length``."""
    seq = cfg.max_target_length
    if kind.attention in ("csa", "hca"):
        return deepseek4.keys_seen(cfg, kind.attention)
    if kind.attention == "chunked":
        chunk = min(cfg.chunk_attn_window_size, seq)
        return (chunk + 1) / 2
    window = min(cfg.sliding_window_size, seq) if kind.attention == "sliding" else seq
    return window - (window * window) / (2 * seq) if window < seq else seq / 2


def training_flops_per_token(cfg: Config) -> float:
    """Model FLOPs per trained token: 6 x active matmul params + causal attention (fwd + bwd).

    Every layer counts by its kind (MoE or dense; global, sliding or chunked attention).
    DeepSeek-V4 layers count their compressors, indexer and hyper-connection mixes; Gated DeltaNet layers
    (``linear``) their projections, recurrence and conv; Qwen3-Next's gated attention its query projection's
    gate half too (``FamilyRules.query_gate``).
    MoE layers count the router, the ``num_experts_per_tok`` routed and the shared
    experts a token actually uses; MTP depths count as one more layer each (of the last
    layer's kind) plus their [2D -> D] projection and output head.
    """
    d = cfg.base_emb_dim
    kinds = list(layer_kinds(cfg))
    kinds += [kinds[-1]] * cfg.mtp_num_layers

    linear_params, linear_flops = _linear_attention(cfg)

    def attention(kind: LayerKind) -> int:
        if kind.attention == "linear":
            return linear_params
        if cfg.attention_type == "compressed":
            return deepseek4.attention_params(cfg, kind.attention)
        return _attention_params(cfg, kind)[0]

    def mixing(kind: LayerKind) -> float:  # q.k and p.v: 2 flops per multiply-add over the keys each query sees, per head
        if kind.attention == "linear":
            return linear_flops
        _, heads, width = _attention_params(cfg, kind)
        return 2 * heads * width * _keys_seen(cfg, kind)

    matmul_params = sum(attention(kind) + _ffn_params(cfg, kind.moe) for kind in kinds)
    matmul_params += (1 + cfg.mtp_num_layers) * d * cfg.vocab_size + cfg.mtp_num_layers * 2 * d * d
    attention = sum(mixing(kind) for kind in kinds)
    return 6.0 * matmul_params + 3.0 * attention
