"""Qwen3-Next: the pre-norm block (``models/prenorm.py``) whose token mixer is Gated DeltaNet linear
attention (``layers/gated_deltanet.py``) on most layers and gated full attention on every
``inhomogeneous_layer_cycle_interval``-th one, with a routed MoE plus a sigmoid-gated shared expert on every
layer, and zero-centred ``(1 + w)`` RMSNorms throughout.

HF ``Qwen3NextForCausalLM`` (``decoder_block=qwen3_next``). Per layer::

    h = x + mixer(norm_in(x))             # GatedDeltaNet, or gated attention on full-attention layers
    y = h + moe(n) + sigmoid(n @ g) * shared(n),  n = norm_post(h)
    gated attention: q, gate = split(q_proj(x)) per head; o = attn(rope_p(qn(q)), rope_p(kn(k)), v) * sigmoid(gate)

``rope_p`` rotates the first ``int(head_dim * partial_rotary_factor)`` dims of a head (HF's partial RoPE);
``qn`` / ``kn`` are zero-centred RMSNorms over ``head_dim``. The router is Qwen3-MoE's (softmax, top-k,
``norm_topk_prob``). Config rules: ``config/qwen3_next.py``; HF ``config.json`` maps: ``models/qwen3_next_hf.py``.

HF weights of a full-attention layer: ``self_attn.q_proj [N * 2 hd, D]`` (per head: hd query rows, then hd
gate rows: nnxtron's ``attention/query/kernel [D, N, 2 hd]``), ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``,
``k_norm``; of a linear one ``linear_attn.{in_proj_qkvz, in_proj_ba, conv1d, dt_bias, A_log, norm, out_proj}``;
of every MoE ``mlp.gate``, ``mlp.experts`` (hub or fused layout), ``mlp.shared_expert.{gate,up,down}_proj`` and
``mlp.shared_expert_gate``. Decoding caches keys / values on full-attention layers and the conv inputs and
recurrent state on DeltaNet layers (``layers/gated_deltanet.GatedDeltaNet.cache_spec``).
"""

from __future__ import annotations

import jax
from flax import nnx

from nnxtron.config.layout import PLAIN, LayerKind
from nnxtron.config.qwen3_next import rotary_dim
from nnxtron.config.schema import Config
from nnxtron.layers.attention import Attention, attend_sharded, attend_with_cache, gqa_attention
from nnxtron.layers.gated_deltanet import GatedDeltaNet
from nnxtron.layers.linear import Linear
from nnxtron.layers.rope import RopeSpec, apply_rope
from nnxtron.models.family import Golden, StrategyRow, WeightMap
from nnxtron.models.gemma3 import gemma_norm
from nnxtron.models.hf_common import GQA_WEIGHTS, NORM_WEIGHTS, QK_NORM_WEIGHTS, gated_mlp_weights, routed_expert_weights
from nnxtron.models.prenorm import PreNormBlock, pre_norm_family
from nnxtron.models.qwen3_next_hf import config_from_hf, config_to_hf
from nnxtron.models.qwen3_next_maxtext import MAXTEXT


class GatedAttention(Attention):
    """GQA whose query projection also yields a per-head gate: ``out(attn(q, k, v) * sigmoid(gate))``
    (HF ``Qwen3NextAttention``); zero-centred q/k norms, partial RoPE (``rope.head_dim`` < ``head_dim``)."""

    def __init__(self, emb_dim: int, num_heads: int, num_kv_heads: int, head_dim: int, *args, **kw):
        super().__init__(emb_dim, num_heads, num_kv_heads, head_dim, *args, **kw)
        self.query = Linear(
            [emb_dim], [num_heads, 2 * head_dim], ("embed", "q_heads", "head_dim"),
            dtype=kw["dtype"], weight_dtype=kw["weight_dtype"], rngs=kw["rngs"],
        )  # fmt: skip

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        projected = self.query(x)  # [B, S, N, 2 hd]: per head the query, then its gate
        head_dim = projected.shape[-1] // 2
        q, gate = projected[..., :head_dim], projected[..., head_dim:]
        q, k = self.query_norm(q), self.key_norm(self.key(x))
        q, k = apply_rope(q, positions, self.rope), apply_rope(k, positions, self.rope)
        v = self.value(x)
        if hasattr(self, "cache"):  # decoding: Attention's key/value cache
            out = attend_with_cache(self.cache, q, k, v, positions, segment_ids, scale=self.scale, dtype=self.dtype)
        else:
            out = attend_sharded(
                q, k, v, segment_ids, scale=self.scale, dtype=self.dtype, implementation=self.implementation,
                context=self.context, sliding_window=0,
            )  # fmt: skip
        return self.out(out * jax.nn.sigmoid(gate).astype(out.dtype))


def make_mixer(cfg: Config, rngs: nnx.Rngs, kind: LayerKind, fused_projections: bool = True) -> nnx.Module:
    """The layer's token mixer: Gated DeltaNet on ``linear`` layers (its projections fused as Qwen3-Next's, or
    split as Qwen3.5's: ``layers/gated_deltanet.py``), gated attention on ``global`` ones."""
    if kind.attention == "linear":
        return GatedDeltaNet(cfg, rngs, fused_projections)
    attention = gqa_attention(cfg, rngs, kind, qk_norm="rms_zero_centered", cls=GatedAttention)
    attention.rope = RopeSpec.from_config(cfg, rotary_dim(cfg))
    return attention


class Qwen3NextBlock(PreNormBlock):
    """One Qwen3-Next layer (zero-centred norms, its mixer, the MoE with a gated shared expert)."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs, kind: LayerKind = PLAIN):
        super().__init__(cfg, rngs, kind, zero_centered=True, make_attention=make_mixer, gated_shared_expert=True)


LINEAR_WEIGHTS = (
    WeightMap("attention/in_proj_qkvz/kernel", "linear_attn.in_proj_qkvz.weight", 1),
    WeightMap("attention/in_proj_ba/kernel", "linear_attn.in_proj_ba.weight", 1),
    WeightMap("attention/conv", "linear_attn.conv1d.weight"),
    WeightMap("attention/dt_bias", "linear_attn.dt_bias"),
    WeightMap("attention/A_log", "linear_attn.A_log"),
    WeightMap("attention/norm/norm/scale", "linear_attn.norm.weight"),
    WeightMap("attention/out/kernel", "linear_attn.out_proj.weight", 2),
)
MOE_WEIGHTS = (
    *routed_expert_weights("mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    *gated_mlp_weights("mlp/shared", "mlp.shared_expert"),
    WeightMap("mlp/shared_gate/kernel", "mlp.shared_expert_gate.weight", 1),
)


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    mixer = LINEAR_WEIGHTS if kind.attention == "linear" else GQA_WEIGHTS + QK_NORM_WEIGHTS
    return NORM_WEIGHTS + mixer + MOE_WEIGHTS


FAMILIES = (
    pre_norm_family(
        "qwen3_next",
        "qwen3_next",
        "Qwen3NextForCausalLM",
        layer_weights,
        config_from_hf,
        config_to_hf,
        make_block=Qwen3NextBlock,
        make_final_norm=gemma_norm,
        maxtext=MAXTEXT,
        goldens=(Golden("qwen3_next", "qwen3_next"),),
        # the input cotangent of this tiny random model is ill-conditioned (the recurrence through L2-normalised
        # keys amplifies float32 reordering): against the unrolled one-device run, with the loss equal to 1 ulp,
        # measured 1.1e-5 (one device, scanned + remat full), 2.0e-5 (fsdp4 x tensor2, unrolled), 7.1e-6 (data2 x
        # fsdp4) and 8.8e-6 (expert2 x fsdp4, scanned + remat full) at 3 layers; 3.0e-6..1.8e-5 at 4. Its aggregate
        # bound is 5e-5 (the matrix's 1e-5 elsewhere); a real fault (a lost state, a wrong split) moves it by O(1).
        # The chunked delta rule (a triangular solve per chunk) moves single leaves by up to 4.1e-5 of their norm
        # (the token-by-token scan: 1.3e-5): the per-leaf bound is 1e-4 (the matrix's 2e-5)
        strategy_rows=(
            StrategyRow("qwen3-next-tiny", True, "full", "expert2_fsdp4", 1, bounds=(("aggregate_rel", 5e-5), ("rel", 1e-4))),
        ),
    ),
)
