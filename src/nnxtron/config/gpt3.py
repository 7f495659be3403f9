"""GPT-3's config rules (``models/gpt3.py`` holds its block and HF map): one ungated MLP
activation, as many key/value heads as query heads (its fused projection has no grouped
form), attention_bias left false (its projections always have biases), and one remat choice
for that fused query/key/value projection."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nnxtron.errors import ConfigError

if TYPE_CHECKING:
    from nnxtron.config.schema import Config


def check(cfg: Config) -> None:
    """The rules of ``decoder_block=gpt3`` (``config/families.py`` runs them for it only)."""
    if len(cfg.mlp_activations) != 1:
        raise ConfigError(
            f"decoder_block gpt3 has a plain (ungated) MLP, so mlp_activations={list(cfg.mlp_activations)} cannot apply; "
            "use one activation, e.g. mlp_activations=[gelu]"
        )
    if cfg.base_num_kv_heads != cfg.base_num_query_heads:
        raise ConfigError(
            f"decoder_block gpt3 computes query, key and value in one fused projection with as many key/value heads as "
            f"query heads, so base_num_kv_heads={cfg.base_num_kv_heads} cannot apply; set it to base_num_query_heads "
            f"({cfg.base_num_query_heads})"
        )
    if cfg.attention_bias:
        raise ConfigError(
            "decoder_block gpt3's fused query/key/value projection and its output projection always have biases "
            "(attention_bias is not read there); set attention_bias=false"
        )
    if cfg.attn_logits_soft_cap:
        raise ConfigError("decoder_block gpt3's attention has no logit soft cap; set attn_logits_soft_cap=0")
    check_fused_qkv_remat(cfg)


def check_fused_qkv_remat(cfg: Config) -> None:
    """GPT-3 computes q, k and v in one fused projection (one named activation, ``qkv_proj``):
    a custom remat choice that differs between them cannot be applied."""
    if cfg.remat_policy != "custom":
        return
    own = {name: getattr(cfg, name) for name in ("query_proj", "key_proj", "value_proj")}
    resolved = {name: cfg.qkv_proj if choice == "remat" else choice for name, choice in own.items()}
    if len(set(resolved.values())) > 1:
        raise ConfigError(
            f"decoder_block=gpt3 computes query, key and value in one fused projection, so remat_policy=custom "
            f"cannot treat them differently (got {resolved}); set qkv_proj=remat|device|offload instead"
        )
