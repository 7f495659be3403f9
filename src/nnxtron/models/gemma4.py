"""Gemma 4 (text decoder of 26B-A4B and 31B): Gemma 3's sliding / global pattern and sandwich norms, with
global layers of their own shape, a value norm, proportional RoPE, routed experts beside the MLP and a
learned per-layer output scalar.

HF ``Gemma4ForCausalLM`` (``model_type: gemma4_text``), MaxText ``decoder_block=gemma4``. Per layer::

    a = attn(norm_in(x))        # q/k RMSNorms (weights) and a weightless v norm, before RoPE; logits unscaled
    h = x + norm_post_attn(a)
    f = mlp(norm_pre_ffw(h))                                       # GeGLU, base_mlp_dim wide
    f = norm_post_mlp(f) + norm_post_exp(experts(norm_pre_exp(h)))  # MoE layers only (every layer with experts)
    y = (h + norm_post_ffw(f)) * layer_scalar

Every RMSNorm is the plain ``x_hat * w`` (weights start at 1; HF ``Gemma4RMSNorm``, unlike Gemma 3's ``1 + w``).
Layer ``i`` is global iff ``(i + 1) % sliding_window_pattern == 0``: its heads are ``global_head_dim`` wide,
it has ``global_num_kv_heads`` key/value heads and, with ``share_kv_projections``, no value projection (the
values are the key projection, normed without a weight: HF ``attention_k_eq_v``); it rotates the first
``global_rope_proportion`` of its frequencies (HF's proportional RoPE, base ``rope_max_timescale``), the sliding
layers ``local_rope_proportion`` of theirs (base ``local_rope_max_timescale``). The router (``Gemma4Experts``)
sees ``rms(h) * router_scale / sqrt(emb_dim)``, takes the softmax over all experts, the top-k renormalised
(``norm_topk_prob``) and each chosen expert's weight times its ``per_expert_scale``. Embeddings are scaled by
``sqrt(emb_dim)`` (HF rounds it to the table's dtype); the head is tied, ``final_logits_soft_cap`` applies.
Config rules: ``config/gemma4.py``; HF maps: ``models/gemma4_hf.py``; MaxText's: ``models/gemma4_maxtext.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nnxtron.config.layout import PLAIN, LayerKind
from nnxtron.config.schema import Config
from nnxtron.layers import dropout
from nnxtron.layers.attention import gqa_attention
from nnxtron.layers.mlp import GatedMLP, Intermediate
from nnxtron.layers.moe import MoE
from nnxtron.layers.norms import l2_norm, rms_norm
from nnxtron.models.family import Family, Golden, StrategyRow
from nnxtron.models.gemma4_hf import config_from_hf, config_to_hf, layer_weights
from nnxtron.models.gemma4_maxtext import MAXTEXT
from nnxtron.models.hf_common import top_weights
from nnxtron.parallel.sharding import RESIDUAL, constrain


class Gemma4Experts(MoE):
    """Gemma 4's routed experts (``layers/moe.MoE``, with ``per_expert_scale``; the layer's MLP is the shared
    expert): their own input norm (HF ``pre_feedforward_layernorm_2``) and output norm
    (``post_feedforward_layernorm_2``), and a router fed ``rms(h) * router_scale * emb_dim ** -0.5`` (HF
    ``router.norm`` without a weight, ``router.scale``; MaxText's ``gate_norm`` and ``pre_forward_scale_2``)."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        super().__init__(cfg, rngs, per_expert_scale=True, shared_expert=False)
        self.pre_norm = rms_norm(cfg)
        self.post_norm = rms_norm(cfg)
        self.router_scale = nnx.Param(jnp.ones((cfg.base_emb_dim,), jnp.dtype(cfg.weight_dtype)), out_sharding=("norm",))
        self.router_root = cfg.base_emb_dim**-0.5
        self.eps = cfg.normalization_layer_epsilon

    def __call__(  # type: ignore[override]
        self, h: jax.Array, tokens: jax.Array | None = None, intermediate: Intermediate = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``h [B, S, D]`` (the residual after attention) -> ``(norm_post(experts(norm_pre(h))), aux)``."""
        dtype = self.dtype
        routed_from = l2_norm(h, self.eps).astype(dtype) * self.router_scale[...].astype(dtype)
        routed_from = routed_from * jnp.asarray(self.router_root, dtype)
        y, aux = super().__call__(self.pre_norm(h), tokens, intermediate, router_input=routed_from)
        return self.post_norm(y), aux


class Gemma4Block(nnx.Module):
    """One Gemma 4 layer of ``kind`` (sliding or global attention; routed experts beside the MLP when ``kind.moe``)."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs, kind: LayerKind = PLAIN):
        dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
        self.pre_attention_norm = rms_norm(cfg)
        self.attention = gqa_attention(cfg, rngs, kind, qk_norm="rms", value_norm=True)
        self.post_attention_norm = rms_norm(cfg)
        self.pre_ffw_norm = rms_norm(cfg)
        self.mlp = GatedMLP(
            cfg.base_emb_dim, cfg.base_mlp_dim, cfg.mlp_activations[0], dtype=dtype, weight_dtype=weight_dtype, rngs=rngs
        )
        self.post_ffw_norm = rms_norm(cfg)
        if kind.moe:
            self.post_mlp_norm = rms_norm(cfg)  # HF post_feedforward_layernorm_1
            self.experts = Gemma4Experts(cfg, rngs)
        # a trained scalar in MaxText (an nnx.Param), a loaded buffer in HF: ones at init
        self.layer_scalar = nnx.Param(jnp.ones((1,), weight_dtype), out_sharding=(None,))
        self.moe = kind.moe
        self.dtype = dtype
        self.dropout_rate = cfg.dropout_rate

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, dropout_keys: dropout.Keys | None = None
    ) -> jax.Array | tuple[jax.Array, dict]:
        """With ``dropout_keys`` (training) the MLP's intermediate activations are dropped, as in MaxText's Gemma 4
        layer (no dropout on its output; the routed experts are not dropped)."""
        x = checkpoint_name(constrain(x, RESIDUAL), "decoder_layer_input")
        h = x + self.post_attention_norm(self.attention(self.pre_attention_norm(x), positions, segment_ids))
        hidden = self.mlp(self.pre_ffw_norm(h), dropout.site_dropout(dropout_keys, self.dropout_rate, dropout.MLP))
        aux: dict = {}
        if self.moe:
            routed, aux = self.experts(h)
            hidden = self.post_mlp_norm(hidden) + routed
        y = (h + self.post_ffw_norm(hidden)) * self.layer_scalar[...].astype(self.dtype)
        return (y, aux) if self.moe else y


FAMILIES = (
    Family(
        name="gemma4",
        hf_model_type="gemma4_text",
        hf_architecture="Gemma4ForCausalLM",
        make_block=Gemma4Block,
        layer_weights=layer_weights,
        top_weights=top_weights,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        scale_embeddings=True,
        maxtext=MAXTEXT,
        hf_multimodal_type="gemma4",
        hf_vision_prefixes=tuple(
            f"{p}{part}." for p in ("model.", "") for part in ("vision_tower", "audio_tower", "embed_vision", "embed_audio")
        ),
        goldens=(Golden("gemma4", "gemma4"),),
        # two (sliding, global) cycles: global layers of their own shape (one key/value head: no tensor split), routed
        # experts beside the MLP split over the expert axis
        strategy_rows=(StrategyRow("gemma4-tiny", True, "full", "expert2_fsdp4", 2),),
    ),
)
