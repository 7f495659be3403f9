"""Qwen3.5's MaxText checkpoint names (MaxText 0.2.5 ``decoder_block=qwen3_5``, ``models/qwen3_5.py``).

MaxText's ``Qwen3_5DecoderLayer`` is Qwen3-Next's layer (``models/qwen3_next_maxtext.py``: the same names, norms,
full attention, MoE, conv kernel and flat kernels): its Gated DeltaNet is Qwen3-Next's class, so MaxText stores the
DeltaNet's input projections FUSED per key head, ``attention/in_proj_qkvz/kernel [D, Hk (2 dk + 2 r dv)]`` (per key
head ``h``: its query, its key, the values of its ``r = Hv / Hk`` value heads ``h r .. h r + r - 1``, their gates z)
and ``attention/in_proj_ba/kernel [D, Hk 2 r]`` (per key head: its ``r`` b's, then its ``r`` a's). nnxtron's Qwen3.5
(HF's layout) holds them split: ``in_proj_qkv [D, C]`` (all queries, all keys, all values: the conv's channel order),
``in_proj_z [D, Hv, dv]``, ``in_proj_b`` and ``in_proj_a [D, Hv]``. ``from_tree`` cuts the fused kernels into the
split ones and ``to_tree`` joins them back (reshapes, slices and concatenations of whole channel groups: the same
bytes both ways).

Scanned, MaxText stacks ``Qwen3_5ScannableBlock``s (one per ``inhomogeneous_layer_cycle_interval`` layers, the
full-attention layer last) on ``param_scan_axis`` = 1: ``decoder/layers/layer_{j}/...`` is position ``j`` of every
block (``MaxTextMap.block_layer``; the generic blocked scan of ``convert/maxtext_tree.py``). It builds
``int(L / interval)`` blocks and no remainder, so a layer count that is not a multiple of the interval is refused
scanned (MaxText would drop the leftover layers); unscanned, layer ``i`` is ``decoder/layers_{i}`` as Qwen3-Next's.
"""

from __future__ import annotations

import numpy as np

from nnxtron.config.layout import LayerKind
from nnxtron.config.schema import Config
from nnxtron.errors import CheckpointError
from nnxtron.models import qwen3_next_maxtext as qwen3_next
from nnxtron.models.maxtext_map import MaxTextMap, Rule

QKVZ, BA = "/attention/in_proj_qkvz/kernel", "/attention/in_proj_ba/kernel"
QKV, Z, B, A = (f"/attention/in_proj_{n}/kernel" for n in ("qkv", "z", "b", "a"))
SPLIT = tuple(Rule(name[1:], name[1:]) for name in (QKV, Z, B, A))
FUSED = (QKVZ[1:], BA[1:])


def layer_rules(cfg: Config, kind: LayerKind) -> tuple[Rule, ...]:
    """Qwen3-Next's layer, the DeltaNet's fused input projections replaced by the split ones ``from_tree`` cuts."""
    rules = tuple(r for r in qwen3_next.layer_rules(cfg, kind) if r.maxtext not in FUSED)
    return (*SPLIT, *rules) if kind.attention == "linear" else rules


def _sizes(cfg: Config) -> tuple[int, int, int, int]:
    """``(Hk, r, dk, dv)``: key heads, value heads per key head, key and value head widths."""
    hk = cfg.gdn_num_key_heads
    return hk, cfg.gdn_num_value_heads // hk, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim


def split_projections(qkvz: np.ndarray, ba: np.ndarray, cfg: Config) -> tuple[np.ndarray, ...]:
    """MaxText's fused ``in_proj_qkvz [D, Hk, 2 dk + 2 r dv]`` and ``in_proj_ba [D, Hk, 2 r]`` (heads split, as
    ``qwen3_next_maxtext.from_tree`` gives them) -> ``in_proj_qkv [D, C]``, ``in_proj_z [D, Hv, dv]``, ``in_proj_b``,
    ``in_proj_a [D, Hv]`` (``layers/gated_deltanet.GatedDeltaNet.project``'s cut of the fused outputs)."""
    hk, r, dk, dv = _sizes(cfg)
    emb = qkvz.shape[0]
    q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
    v, z = qkvz[..., 2 * dk : 2 * dk + r * dv], qkvz[..., 2 * dk + r * dv :]
    qkv = np.concatenate([x.reshape(emb, -1) for x in (q, k, v)], axis=-1)
    b, a = ba[..., :r].reshape(emb, hk * r), ba[..., r:].reshape(emb, hk * r)
    return qkv, z.reshape(emb, hk * r, dv), b, a


def fuse_projections(qkv: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray, cfg: Config) -> tuple[np.ndarray, ...]:
    """The inverse of ``split_projections``: ``(in_proj_qkvz [D, Hk, 2 dk + 2 r dv], in_proj_ba [D, Hk, 2 r])``."""
    hk, r, dk, dv = _sizes(cfg)
    emb, keys = qkv.shape[0], hk * dk
    q, k, v = qkv[:, :keys], qkv[:, keys : 2 * keys], qkv[:, 2 * keys :]
    per_key_head = (q.reshape(emb, hk, dk), k.reshape(emb, hk, dk), v.reshape(emb, hk, r * dv), z.reshape(emb, hk, r * dv))
    qkvz = np.concatenate(per_key_head, axis=-1)
    return qkvz, np.concatenate([b.reshape(emb, hk, r), a.reshape(emb, hk, r)], axis=-1)


def _check(key: str, value: np.ndarray, want: tuple[int, ...], cfg: Config) -> None:
    if value.shape != want:
        raise CheckpointError(
            f"MaxText array '{key}' has shape {list(value.shape)} (heads split), model '{cfg.decoder_block}' expects "
            f"{list(want)}; give the model settings the checkpoint was written with"
        )


def from_tree(flat: dict, cfg: Config) -> dict:
    """MaxText's unscanned arrays -> nnxtron's: Qwen3-Next's rewrite, then the fused DeltaNet projections cut."""
    out = qwen3_next.from_tree(flat, cfg)
    hk, r, dk, dv = _sizes(cfg)
    for key in [k for k in out if k.endswith(QKVZ)]:
        layer = key[: -len(QKVZ)]
        if layer + BA not in out:
            raise CheckpointError(
                f"MaxText checkpoint lacks '{layer + BA}' that model '{cfg.decoder_block}' needs next to '{key}'; give "
                "the model settings the checkpoint was written with"
            )
        qkvz, ba = out.pop(key), out.pop(layer + BA)
        _check(key, qkvz, (cfg.base_emb_dim, hk, 2 * dk + 2 * r * dv), cfg)
        _check(layer + BA, ba, (cfg.base_emb_dim, hk, 2 * r), cfg)
        out.update(zip((layer + n for n in (QKV, Z, B, A)), split_projections(qkvz, ba, cfg), strict=True))
    return out


def to_tree(flat: dict, cfg: Config) -> dict:
    """The inverse of ``from_tree``: the split projections joined, then Qwen3-Next's rewrite back."""
    out = dict(flat)
    for key in [k for k in flat if k.endswith(QKV)]:
        layer = key[: -len(QKV)]
        qkvz, ba = fuse_projections(*(out.pop(layer + n) for n in (QKV, Z, B, A)), cfg)
        out[layer + QKVZ], out[layer + BA] = qkvz, ba
    return qwen3_next.to_tree(out, cfg)


def scan_cycle(cfg: Config) -> int:
    """MaxText's scanned block: one cycle of ``inhomogeneous_layer_cycle_interval`` layers, and no remainder."""
    cycle = cfg.inhomogeneous_layer_cycle_interval
    if cfg.base_num_decoder_layers % cycle:
        raise CheckpointError(
            f"MaxText scans Qwen3.5 in whole blocks of {cycle} layers (inhomogeneous_layer_cycle_interval) and drops the "
            f"rest; base_num_decoder_layers={cfg.base_num_decoder_layers} is not a multiple: use the unscanned layout"
        )
    return cycle


MAXTEXT = MaxTextMap(
    layer_rules, from_tree=from_tree, to_tree=to_tree, scan_cycle=scan_cycle, scan_blocks=True, block_layer="layer"
)
