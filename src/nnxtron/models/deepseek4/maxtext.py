"""DeepSeek-V4 in MaxText (0.2.5, ``decoder_block: deepseek4``) checkpoints: names and layouts.

MaxText's tree (``convert/maxtext_tree.py`` applies it): unscanned, ``decoder/layers_{i}/...``;
scanned, the hash-routed prefix (``first_num_hash_layers``) stays ``decoder/layers_{i}`` and the
rest is ``decoder/scanned_blocks/layers_{0,1}/...`` (MaxText's ``DeepSeek4ScannableBlock``: an
HCA layer with ``compress_ratio=128`` then a CSA layer with ratio 4, whatever ``compress_ratios``
says, and no remainder layer). Per layer:

* ``self_attention/``: ``wq_a``, ``q_norm``, ``wq_b``, ``wkv`` [D, 1, head_dim] (nnxtron: [D,
  head_dim], one KV head), ``kv_norm``, ``o_a_proj`` [groups, in, o_lora] (nnxtron ``wo_a``
  [groups, o_lora, in]), ``o_b_proj`` (``wo_b``), ``sinks``; the HCA layer's
  ``hca_compressor/``, the CSA layer's ``csa_compressor/`` (``kv_proj`` -> ``wkv``, ``gate_proj``
  -> ``wgate``, ``position_bias``, ``kv_norm`` -> ``norm``) with its ``indexer/`` (the same four,
  ``q_proj`` [q_lora, H*d] -> ``wq_b`` [q_lora, H, d], ``weights_proj``);
* ``mhc_attention/``, ``mhc_mlp/`` (nnxtron ``attention_hc``, ``mlp_hc``): ``pre_alpha``,
  ``post_alpha`` [kD, k], ``res_alpha`` [kD, k*k], their ``*_alpha_scale`` [1], ``pre_beta``,
  ``post_beta`` [k], ``res_beta`` [k, k] and ``mhc_norm/scale`` [kD]; nnxtron (HF) holds
  ``fn = (concat(pre, post, res alphas) * mhc_norm)^T`` [(2+k)k, kD] (its norm is weightless:
  MaxText's norm scale is folded in; written back as ones, so a MaxText tree whose norm scales
  are not 1 converts with the same function but not byte-exactly back),
  ``base = concat(pre_beta, post_beta, res_beta)``, ``scale = concat(the three scales)``;
* ``pre_self_attention_layer_norm`` / ``post_self_attention_layer_norm``;
* ``mlp/MoeBlock_0/`` (``gate/kernel`` = router, ``wi_0``, ``wi_1``, ``wo``),
  ``mlp/shared_experts/``; model state: ``MoeBlock_0/gate/bias`` (the router bias) in the non-hash
  layers and ``MoeBlock_0/tid2eid`` (the token -> expert table, float32 in MaxText, int32 in
  nnxtron) in the hash-routed ones, both under ``MoEBiasVar/`` (where the reader puts a training
  checkpoint's ``nnx_aux/model`` state).

Top level: ``token_embedder``, ``decoder/decoder_norm``, ``decoder/logits_dense`` and
``decoder/hc_head/{hc_fn [kD, k], hc_base, hc_scale}`` (nnxtron ``hyper_head``, ``fn`` transposed).
"""

from __future__ import annotations

import numpy as np

from nnxtron.config.layout import LayerKind
from nnxtron.config.schema import Config
from nnxtron.errors import CheckpointError
from nnxtron.models.maxtext_map import PRE_NORMS, MaxTextMap, Rule, expert_rules, mlp_rules
from nnxtron.models.maxtext_map import top_rules as maxtext_top_rules

HC = (("mhc_attention", "attention_hc"), ("mhc_mlp", "mlp_hc"))
PARTS = ("pre", "post", "res")
COMPRESSOR = (("kv_proj/kernel", "wkv/kernel"), ("gate_proj/kernel", "wgate/kernel"), ("position_bias", "position_bias"))
COMPRESSOR += (("kv_norm/scale", "norm/scale"),)


def _compressor(maxtext: str, nnxtron: str) -> list[Rule]:
    return [Rule(f"{maxtext}/{a}", f"{nnxtron}/{b}") for a, b in COMPRESSOR]


def layer_rules(cfg: Config, kind: LayerKind) -> tuple[Rule, ...]:
    att = "self_attention"
    rules = [
        Rule(f"{att}/{n}", f"attention/{n}")
        for n in ("wq_a/kernel", "q_norm/scale", "wq_b/kernel", "wkv/kernel", "kv_norm/scale", "sinks")
    ]
    rules += [Rule(f"{att}/o_a_proj/kernel", "attention/wo_a"), Rule(f"{att}/o_b_proj/kernel", "attention/wo_b/kernel")]
    if kind.attention == "hca":
        rules += _compressor(f"{att}/hca_compressor", "attention/compressor")
    if kind.attention == "csa":
        csa = f"{att}/csa_compressor"
        rules += _compressor(csa, "attention/compressor") + _compressor(f"{csa}/indexer", "attention/indexer/compressor")
        rules += [
            Rule(f"{csa}/indexer/q_proj/kernel", "attention/indexer/wq_b/kernel"),
            Rule(f"{csa}/indexer/weights_proj/kernel", "attention/indexer/weights_proj/kernel"),
        ]
    rules += [Rule(f"{mt}/{n}", f"{nx}/{n}") for mt, nx in HC for n in ("fn", "base", "scale")]
    rules += [*PRE_NORMS, *expert_rules("mlp/MoeBlock_0/")]
    if cfg.shared_experts:
        rules += mlp_rules("mlp/shared_experts/", "mlp/shared/")
    if kind.hash:
        rules.append(Rule("mlp/MoeBlock_0/tid2eid", "mlp/tid2eid", state=True))
    elif cfg.routed_bias:
        rules.append(Rule("mlp/MoeBlock_0/gate/bias", "mlp/router_bias", state=True))
    return tuple(rules)


def top_rules(cfg: Config) -> tuple[Rule, ...]:
    """The shared top level and the stream head (``hc_fn`` transposed by the tree rewrites)."""
    return (*maxtext_top_rules(cfg), *(Rule(f"decoder/hc_head/hc_{n}", f"hyper_head/{n}") for n in ("fn", "base", "scale")))


def _hc_prefixes(flat: dict, suffix: str) -> list[str]:
    return sorted(k.removesuffix(suffix) for k in flat if k.endswith(suffix))


def from_tree(flat: dict, cfg: Config) -> dict:
    """MaxText's arrays -> the ones the rules name (nnxtron's layouts)."""
    out = dict(flat)
    k = cfg.mhc_expansion_rate
    for mt, _ in HC:
        for p in _hc_prefixes(out, f"/{mt}/pre_alpha"):
            hc = f"{p}/{mt}"
            try:
                norm = out.pop(f"{hc}/mhc_norm/scale")
                alphas = [out.pop(f"{hc}/{n}_alpha") for n in PARTS]
                betas = [out.pop(f"{hc}/{n}_beta") for n in PARTS]
                scales = [out.pop(f"{hc}/{n}_alpha_scale") for n in PARTS]
            except KeyError as err:
                raise CheckpointError(f"MaxText checkpoint lacks '{err.args[0]}' that model deepseek4 needs") from None
            alpha = np.concatenate(alphas, axis=-1)
            dtype = alpha.dtype
            if not np.all(norm == 1):  # nnxtron's (HF's) norm is weightless: fold MaxText's scale in
                alpha = (alpha.astype(np.float32) * norm.astype(np.float32)[:, None]).astype(dtype)
            out[f"{hc}/fn"] = np.ascontiguousarray(alpha.T)
            out[f"{hc}/base"] = np.concatenate([b.reshape(-1) for b in betas])
            out[f"{hc}/scale"] = np.concatenate([s.reshape(-1) for s in scales])
            if out[f"{hc}/base"].shape != ((2 + k) * k,):
                raise CheckpointError(f"MaxText '{hc}' has {k=}-incompatible biases; give mhc_expansion_rate")
    for key in list(out):
        value = out[key]
        if key.endswith("/self_attention/wkv/kernel") and value.ndim == 3:
            out[key] = value.reshape(value.shape[0], -1)  # [D, 1, head_dim]: nnxtron's one KV head
        elif key.endswith("/o_a_proj/kernel"):
            out[key] = np.ascontiguousarray(np.swapaxes(value, -1, -2))
        elif key.endswith("/indexer/q_proj/kernel"):
            out[key] = value.reshape(value.shape[0], cfg.indexer_n_heads, -1)
        elif key == "decoder/hc_head/hc_fn":
            out[key] = np.ascontiguousarray(value.T)
    return out


def to_tree(flat: dict, cfg: Config) -> dict:
    """The inverse of ``from_tree`` (the hyper-connections' norm scales written as ones)."""
    out = dict(flat)
    k = cfg.mhc_expansion_rate
    for mt, _ in HC:
        for p in _hc_prefixes(out, f"/{mt}/fn"):
            hc = f"{p}/{mt}"
            fn, base, scale = out.pop(f"{hc}/fn"), out.pop(f"{hc}/base"), out.pop(f"{hc}/scale")
            alpha = fn.T
            out[f"{hc}/mhc_norm/scale"] = np.ones(alpha.shape[0], fn.dtype)
            for n, a, b in zip(PARTS, (0, k, 2 * k), (k, 2 * k, (2 + k) * k), strict=True):
                out[f"{hc}/{n}_alpha"] = np.ascontiguousarray(alpha[:, a:b])
                out[f"{hc}/{n}_beta"] = base[a:b].reshape((k, k) if n == "res" else (k,))
            for i, n in enumerate(PARTS):
                out[f"{hc}/{n}_alpha_scale"] = scale[i : i + 1]
    for key in list(out):
        value = out[key]
        if key.endswith("/self_attention/wkv/kernel"):
            out[key] = value.reshape(value.shape[0], cfg.base_num_kv_heads, -1)
        elif key.endswith("/o_a_proj/kernel"):
            out[key] = np.ascontiguousarray(np.swapaxes(value, -1, -2))
        elif key.endswith("/indexer/q_proj/kernel"):
            out[key] = value.reshape(value.shape[0], -1)
        elif key.endswith("/tid2eid"):
            out[key] = value.astype(np.float32)  # MaxText keeps the table as float32
        elif key == "decoder/hc_head/hc_fn":
            out[key] = np.ascontiguousarray(value.T)
    return out


def scan_prefix(cfg: Config) -> int:
    """The hash-routed prefix; refuses a model MaxText's scanned decoder does not build (it scans
    (HCA 128, CSA 4) pairs after the prefix and drops an odd last layer)."""
    prefix = cfg.first_num_hash_layers
    rest = tuple(cfg.compress_ratios[prefix:])
    if len(rest) % 2 or rest != (128, 4) * (len(rest) // 2):
        raise CheckpointError(
            f"MaxText's scanned deepseek4 decoder scans (128, 4) pairs of compress ratios after the {prefix} hash-routed "
            f"layers; compress_ratios={list(cfg.compress_ratios)} has {list(rest)} there: use scan_layers=false"
        )
    return prefix


MAXTEXT = MaxTextMap(
    layer_rules,
    top_rules=top_rules,
    scan_cycle=2,
    scan_prefix=scan_prefix,
    scan_group="scanned_blocks",
    from_tree=from_tree,
    to_tree=to_tree,
)
