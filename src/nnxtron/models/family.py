"""What a decoder family is: its block, its weight maps to HF and MaxText and its HF config maps,
and what checks it (its HF goldens and its rows of the strategy-parity matrix).

Each family module (``models/<family>.py``, or ``models/deepseek4/``) defines its
``Family`` records in ``FAMILIES``; ``models/registry.py`` collects them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flax import nnx

from nnxtron.config.layout import LayerKind
from nnxtron.config.schema import Config
from nnxtron.layers.norms import rms_norm
from nnxtron.models.maxtext_map import MaxTextMap


@dataclass(frozen=True)
class WeightMap:
    """One parameter's HF name and layout.

    ``path`` is the nnxtron path inside a block (or the model, for top-level weights),
    ``hf_key`` the HF name (per-layer keys are relative to ``model.layers.{i}.``) and
    ``linear_in_dims`` > 0 marks an HF ``nn.Linear.weight`` [out, in] whose nnxtron
    kernel is ``[*in, *out]`` with that many input dims; 0 means the same layout.

    Routed experts: an ``hf_key`` containing ``{e}`` names one tensor per expert (the hub
    layout ``save_pretrained`` writes); the nnxtron variable stacks the experts on its
    leading axis and ``linear_in_dims`` describes one expert. ``fused_key`` is the
    transformers>=5 in-memory layout holding all experts in one tensor
    ``[E, fused_parts * out, in]``; this weight is chunk ``fused_part`` along dim 1.

    Other layouts: ``conv1d`` marks a tensor with the nnxtron element order, only
    reshaped — HF ``Conv1D.weight`` ``[in, out]`` (GPT-2) is ``[prod(in dims), prod(out
    dims)]`` with ``linear_in_dims`` input dims, a fused bias (or Qwen2's ``q_proj.bias`` of
    ``[heads, head_dim]``) is flat. ``split_parts`` > 1
    marks an HF tensor that concatenates that many variables along its last axis (Llama 4
    ``experts.gate_up_proj [E, D, 2F]``); this variable is chunk ``split_part``. ``interleaved``: the
    parts alternate along that axis instead (GPT-OSS ``mlp.experts.gate_up_proj [E, D, 2F]`` and its bias:
    gate at the even columns, up at the odd ones); this variable is columns ``split_part::split_parts``.
    ``stacked_linear``: the HF tensor stacks one ``nn.Linear.weight`` ``[out, in]`` per expert (Gemma 4's
    ``experts.gate_up_proj [E, 2F, D]`` and ``experts.down_proj [E, D, F]``, written so by ``save_pretrained``):
    nnxtron's ``[E, in, out]`` is its last two axes swapped, and ``split_parts`` lie along HF's ``out`` axis.
    """

    path: str
    hf_key: str
    linear_in_dims: int = 0
    fused_key: str = ""
    fused_part: int = 0
    fused_parts: int = 1
    conv1d: bool = False
    split_part: int = 0
    split_parts: int = 1
    interleaved: bool = False
    stacked_linear: bool = False

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.hf_key


@dataclass(frozen=True)
class Golden:
    """One HF golden of a family: transformers' forward pass (and greedy generation) on a tiny
    random HF model, stored in ``tests/assets/golden/<name>/`` (and ``adversarial/<name>/``).

    ``generator`` is the module ``scripts/goldens/<generator>.py`` whose ``CASES`` holds the
    ``Case`` of that name (the HF config and model classes, the tiny config, its init and checks);
    ``scripts/make_goldens.py`` and ``make_generate_goldens.py`` generate every declared golden,
    ``tests/parity/test_hf_golden.py`` checks each against nnxtron (``TOL`` there; its config must
    import as this family). ``fused_checked``: that test also loads its ``fused.safetensors`` (the
    transformers>=5 fused expert layout)."""

    name: str
    generator: str
    fused_checked: bool = False


@dataclass(frozen=True)
class StrategyRow:
    """A row of the strategy-parity matrix for the family (``tests/parity/test_matrix.py``,
    ``FAMILY_ROWS``): its tiny preset ``model`` with ``overrides``, scanned or not, under the remat
    policy ``remat``, on ``mesh`` (a mesh name of that test) with ``accumulation`` microbatches,
    against the same model unrolled, without remat, on one device. ``bounds``: the parity bounds
    (``tools/parity.assert_grad_parity``'s keywords) the row widens, measured and explained where it is declared."""

    model: str
    scan: bool
    remat: str
    mesh: str
    accumulation: int
    overrides: tuple[tuple[str, Any], ...] = ()
    bounds: tuple[tuple[str, float], ...] = ()  # the test's gradient bounds this family's row widens, with its reason


@dataclass(frozen=True)
class Family:
    """A decoder family: its block (dense or MoE kind), weight maps and HF config maps.

    ``name`` is the ``decoder_block`` value (``config.options.DECODER_BLOCKS``). Empty
    ``hf_model_type`` and ``hf_architecture``: the family has no HF counterpart (MaxText's toy blocks,
    ``models/simple.py``); its weight maps refuse HF import and export, it has no HF golden, and
    MaxText's own logits on its MaxText checkpoints are its reference.
    ``make_block(cfg, rngs, kind)`` and ``layer_weights(cfg, kind)`` take the layer's
    ``LayerKind`` (MoE or dense feed-forward, attention mask kind, RoPE or NoPE; which
    layer has which kind is ``config/layout.py``). ``hf_layer_prefix`` is the HF name
    prefix of layer ``{i}``; ``make_final_norm(cfg)`` builds the norm before the output
    head; ``scale_embeddings`` multiplies the token embeddings by ``sqrt(emb_dim)``
    (Gemma). ``make_stream_head(cfg, rngs)``, when set, makes the residual several
    streams: the decoder calls the module's ``expand`` on the embeddings and the module
    itself to collapse the streams before the final norm (DeepSeek-V4 hyper-connections);
    ``block_takes_tokens``: blocks are called with the token ids as a fourth argument
    (DeepSeek-V4 hash routing). ``mtp_weights``, when set, maps a multi-token-prediction
    depth's own weights (``models/mtp.MTPDepth``; its block uses ``layer_weights``) to the HF
    layer after the decoder's last (DeepSeek-V3's ``model.layers.61``); ``mtp_copies`` lists
    (key in that layer, top-level key) pairs the HF layer repeats (its embedding and head).
    ``maxtext``: the family's MaxText checkpoint names (``models/maxtext_map.py``; None: MaxText
    checkpoints of it are not converted). ``hf_multimodal_type``: the ``model_type`` of the HF
    multimodal wrapper around this text decoder (its config's ``text_config``), whose keys starting
    with ``hf_vision_prefixes`` are the vision parts, not imported. ``goldens``: its HF goldens
    (``Golden``; generated and tested in this order); ``strategy_rows``: its rows of the strategy-parity
    matrix (a family whose preset the matrix's own rows run has none). The family's config-level rules
    (checks, MaxText config facts) are ``config/families.py``'s row of the same name.
    """

    name: str
    hf_model_type: str
    hf_architecture: str
    make_block: Callable[[Config, nnx.Rngs, LayerKind], nnx.Module]
    layer_weights: Callable[[Config, LayerKind], tuple[WeightMap, ...]]
    top_weights: Callable[[Config], tuple[WeightMap, ...]]
    config_from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    config_to_hf: Callable[[Config], dict[str, Any]]
    make_final_norm: Callable[[Config], nnx.Module] = rms_norm
    hf_layer_prefix: str = "model.layers.{i}."
    scale_embeddings: bool = False
    make_stream_head: Callable[[Config, nnx.Rngs], nnx.Module] | None = None
    block_takes_tokens: bool = False
    mtp_weights: tuple[WeightMap, ...] = ()
    mtp_copies: tuple[tuple[str, str], ...] = ()
    maxtext: MaxTextMap | None = None
    hf_multimodal_type: str = ""
    hf_vision_prefixes: tuple[str, ...] = ()
    goldens: tuple[Golden, ...] = ()
    strategy_rows: tuple[StrategyRow, ...] = ()
