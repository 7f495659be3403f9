"""Qwen3.5's text decoder (``decoder_block=qwen3_5``, MaxText's name; HF ``Qwen3_5MoeForCausalLM``, the text model
of ``Qwen3_5MoeForConditionalGeneration``): Qwen3-Next's layers (``models/qwen3_next.py``) and config rule
(``config/qwen3_next.py``) — Gated DeltaNet on most layers, gated full attention with zero-centred q/k norms and
partial RoPE on every ``inhomogeneous_layer_cycle_interval``-th, a routed MoE (softmax top-k, renormalised) plus a
sigmoid-gated shared expert on every layer, zero-centred ``(1 + w)`` RMSNorms — as MaxText's ``Qwen3_5DecoderLayer``
reuses its Qwen3-Next layers. What differs is HF's weight layout of the DeltaNet's input projections:
``linear_attn.{in_proj_qkv, in_proj_z, in_proj_b, in_proj_a}`` instead of the fused per-key-head
``in_proj_qkvz`` / ``in_proj_ba`` (``GatedDeltaNet(fused_projections=False)``; the same function).

Text only: the vision tower and the multimodal RoPE are not implemented (MaxText's ``use_multimodal`` and
``use_mrope`` are refused by name, ``config/maxtext_keys.py``); on text, HF's interleaved mRoPE has three equal
position ids and is the plain (partial) RoPE this block applies. The hub checkpoints' wrapper
(``model.language_model.*``) loads its text decoder; its ``model.visual.*`` and ``mtp.*`` weights are not imported.
HF ``config.json`` maps: ``models/qwen3_5_hf.py``; MaxText checkpoint names (its fused DeltaNet projections cut into
these split ones, the scanned ``Qwen3_5ScannableBlock``): ``models/qwen3_5_maxtext.py``. HF's dense
``Qwen3_5ForCausalLM`` (``qwen3_5_text``) is not supported (MaxText's qwen3_5 block is MoE only).
"""

from __future__ import annotations

from flax import nnx

from nnxtron.config.layout import PLAIN, LayerKind
from nnxtron.config.schema import Config
from nnxtron.models.family import Golden, StrategyRow, WeightMap
from nnxtron.models.gemma3 import gemma_norm
from nnxtron.models.hf_common import GQA_WEIGHTS, NORM_WEIGHTS, QK_NORM_WEIGHTS
from nnxtron.models.prenorm import PreNormBlock, pre_norm_family
from nnxtron.models.qwen3_5_hf import ARCHITECTURE, MODEL_TYPE, MULTIMODAL_TYPE, config_from_hf, config_to_hf
from nnxtron.models.qwen3_5_maxtext import MAXTEXT
from nnxtron.models.qwen3_next import LINEAR_WEIGHTS, MOE_WEIGHTS, make_mixer


def make_split_mixer(cfg: Config, rngs: nnx.Rngs, kind: LayerKind) -> nnx.Module:
    """Qwen3-Next's mixer with the DeltaNet's input projections split as HF Qwen3.5's."""
    return make_mixer(cfg, rngs, kind, fused_projections=False)


class Qwen3_5Block(PreNormBlock):
    """One Qwen3.5 layer: a Qwen3-Next layer whose DeltaNet has Qwen3.5's split input projections."""

    def __init__(self, cfg: Config, rngs: nnx.Rngs, kind: LayerKind = PLAIN):
        super().__init__(cfg, rngs, kind, zero_centered=True, make_attention=make_split_mixer, gated_shared_expert=True)


SPLIT_PROJECTIONS = (
    WeightMap("attention/in_proj_qkv/kernel", "linear_attn.in_proj_qkv.weight", 1),
    WeightMap("attention/in_proj_z/kernel", "linear_attn.in_proj_z.weight", 1),
    WeightMap("attention/in_proj_b/kernel", "linear_attn.in_proj_b.weight", 1),
    WeightMap("attention/in_proj_a/kernel", "linear_attn.in_proj_a.weight", 1),
)
FUSED = ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")
LINEAR_WEIGHTS_SPLIT = SPLIT_PROJECTIONS + tuple(w for w in LINEAR_WEIGHTS if w.hf_key not in FUSED)


def layer_weights(cfg: Config, kind: LayerKind) -> tuple[WeightMap, ...]:
    mixer = LINEAR_WEIGHTS_SPLIT if kind.attention == "linear" else GQA_WEIGHTS + QK_NORM_WEIGHTS
    return NORM_WEIGHTS + mixer + MOE_WEIGHTS


FAMILIES = (
    pre_norm_family(
        "qwen3_5",
        MODEL_TYPE,
        ARCHITECTURE,
        layer_weights,
        config_from_hf,
        config_to_hf,
        make_block=Qwen3_5Block,
        make_final_norm=gemma_norm,
        hf_multimodal_type=MULTIMODAL_TYPE,
        hf_vision_prefixes=("model.visual.", "mtp."),  # the vision tower and the MTP layer (HF ignores both too)
        maxtext=MAXTEXT,
        goldens=(Golden("qwen3_5", "qwen3_5"),),
        # scanned on fsdp4 x tensor2 (the split projections' heads on `tensor`; Qwen3-Next's row runs the same layers
        # under remat full on expert2 x fsdp4, with its remainder layer) against the unrolled one-device run, at 2
        # layers (one scanned cycle): loss 8e-8, input cotangent 3.2e-6, aggregate 3.1e-6 (measured), in the matrix's
        # own bounds; at 3 layers the ill-conditioned recurrence (Qwen3-Next's row says why) measures 2.6e-5
        strategy_rows=(StrategyRow("qwen3.5-tiny", True, "none", "fsdp4_tensor2", 1, (("base_num_decoder_layers", 2),)),),
    ),
)
