"""Qwen3-Next's MaxText checkpoint names (MaxText 0.2.5 ``decoder_block=qwen3_next``, ``models/qwen3.py``).

A MaxText layer (``Qwen3NextDecoderLayer``) is ``input_layernorm``, ``post_attention_layernorm`` (zero-centred
scales, as nnxtron's and HF's: stored as they are), ``attention`` and ``mlp``:

* a Gated DeltaNet layer: ``attention/{in_proj_qkvz, in_proj_ba, out_proj}/kernel`` flat (``[D, Hk W]``,
  ``[D, Hk 2g]``, ``[Hv dv, D]``: nnxtron splits the heads, the per-key-head grouping is the same, so a reshape),
  ``attention/conv1d/kernel [K, 1, C]`` (flax's ``Conv``; nnxtron's is HF's ``[C, 1, K]``: a transpose),
  ``attention/{A_log, dt_bias}``, ``attention/norm/rms_norm/scale``;
* a full-attention layer: ``attention/attention/{query, key, value}/kernel`` (the query ``[D, N, 2 hd]``, per head
  the query then its gate, as nnxtron's; nothing folded: MaxText scales the query at run time),
  ``attention/attention/out/kernel [N hd, D]`` flat, ``attention/attention/{query_norm, key_norm}/scale``;
* ``mlp/routed_experts/{gate/kernel, wi_0, wi_1, wo}``, ``mlp/shared_expert/{wi_0, wi_1, wo}/kernel`` and
  ``mlp/shared_expert_gate/kernel [D, 1]``.

Scanned (``Qwen3NextScannableBlock``, one block per ``inhomogeneous_layer_cycle_interval`` layers, the full-attention
layer last): ``decoder/layers/local_layers/...`` holds the block's DeltaNet layers, ``decoder/layers/global_layer/...``
the full-attention layer and ``decoder/layers_remainder/local_layers/...`` the last ``L % interval`` layers
(``models/maxtext_nested.py``: the layer axes).
"""

from __future__ import annotations

import numpy as np

from nnxtron.config.layout import LayerKind
from nnxtron.config.schema import Config
from nnxtron.errors import CheckpointError
from nnxtron.models.maxtext_map import MaxTextMap, Rule
from nnxtron.models.maxtext_nested import nested_scan

NORMS = (
    Rule("input_layernorm/scale", "pre_attention_norm/scale"),
    Rule("post_attention_layernorm/scale", "post_attention_norm/scale"),
)
LINEAR = (
    Rule("attention/in_proj_qkvz/kernel", "attention/in_proj_qkvz/kernel"),
    Rule("attention/in_proj_ba/kernel", "attention/in_proj_ba/kernel"),
    Rule("attention/conv1d/kernel", "attention/conv"),
    Rule("attention/A_log", "attention/A_log"),
    Rule("attention/dt_bias", "attention/dt_bias"),
    Rule("attention/norm/rms_norm/scale", "attention/norm/norm/scale"),
    Rule("attention/out_proj/kernel", "attention/out/kernel"),
)
FULL = tuple(
    Rule(f"attention/attention/{n}", f"attention/{n}")
    for n in ("query/kernel", "key/kernel", "value/kernel", "out/kernel", "query_norm/scale", "key_norm/scale")
)
MOE = (
    Rule("mlp/routed_experts/gate/kernel", "mlp/router/kernel"),
    *(Rule(f"mlp/routed_experts/{n}", f"mlp/{n}") for n in ("wi_0", "wi_1", "wo")),
    *(Rule(f"mlp/shared_expert/{n}/kernel", f"mlp/shared/{n}/kernel") for n in ("wi_0", "wi_1", "wo")),
    Rule("mlp/shared_expert_gate/kernel", "mlp/shared_gate/kernel"),
)


def layer_rules(cfg: Config, kind: LayerKind) -> tuple[Rule, ...]:
    """One layer: its norms, its mixer (Gated DeltaNet on ``linear`` layers, else gated full attention), the MoE."""
    return (*NORMS, *(LINEAR if kind.attention == "linear" else FULL), *MOE)


def _heads(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The head-split shapes nnxtron gives MaxText's flat kernels (the last suffix of each name)."""
    hk, hv, dv = cfg.gdn_num_key_heads, cfg.gdn_num_value_heads, cfg.gdn_value_head_dim
    emb = cfg.base_emb_dim
    return {
        "/attention/in_proj_qkvz/kernel": (emb, hk, -1),
        "/attention/in_proj_ba/kernel": (emb, hk, -1),
        "/attention/out_proj/kernel": (hv, dv, emb),
        "/attention/attention/out/kernel": (cfg.base_num_query_heads, cfg.resolved_head_dim, emb),
    }


CONV = "/attention/conv1d/kernel"


def _split(value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """MaxText's 2-D kernel as ``shape`` (``[D, Hk, -1]``: the output axis split; ``[H, d, D]``: the input axis), or
    None where it does not hold that."""
    if value.ndim != 2:
        return None
    if shape[-1] == -1:
        fits = value.shape[0] == shape[0] and value.shape[1] % shape[1] == 0
    else:
        fits = value.shape == (shape[0] * shape[1], shape[2])
    return value.reshape(shape) if fits else None


def from_tree(flat: dict, cfg: Config) -> dict:
    """MaxText's unscanned arrays -> nnxtron's layouts (heads split, the conv kernel ``[C, 1, K]``)."""
    out = dict(flat)
    shapes = _heads(cfg)
    for key, value in flat.items():
        suffix = next((s for s in shapes if key.endswith(s)), None)
        if suffix is not None:
            split = _split(value, shapes[suffix])
            if split is None:
                raise CheckpointError(
                    f"MaxText array '{key}' has shape {list(value.shape)}, model '{cfg.decoder_block}' expects a 2-D kernel holding "
                    f"{[d if d > 0 else '*' for d in shapes[suffix]]}; give the model settings the checkpoint was written with"
                )
            out[key] = split
        elif key.endswith(CONV):
            if value.ndim != 3:
                raise CheckpointError(f"MaxText array '{key}' has shape {list(value.shape)}, not [K, 1, C]")
            out[key] = np.ascontiguousarray(np.transpose(value, (2, 1, 0)))
    return out


def to_tree(flat: dict, cfg: Config) -> dict:
    """The inverse of ``from_tree``: MaxText's flat kernels and ``[K, 1, C]`` conv kernel."""
    out = dict(flat)
    for key, value in flat.items():
        if key.endswith(("/in_proj_qkvz/kernel", "/in_proj_ba/kernel")):
            out[key] = value.reshape(value.shape[0], -1)  # [D, Hk, W] -> [D, Hk W]
        elif key.endswith(("/attention/out_proj/kernel", "/attention/attention/out/kernel")):
            out[key] = value.reshape(-1, value.shape[-1])  # [H, d, D] -> [H d, D]
        elif key.endswith(CONV):
            out[key] = np.ascontiguousarray(np.transpose(value, (2, 1, 0)))
    return out


unscan, scan = nested_scan("layers", lambda cfg: cfg.inhomogeneous_layer_cycle_interval)


MAXTEXT = MaxTextMap(layer_rules, from_tree=from_tree, to_tree=to_tree, unscan=unscan, scan=scan)
