"""MaxText checkpoints (Orbax, MaxText 0.2.5 NNX or its former Linen decoders) <-> nnxtron parameters.

``read_maxtext_checkpoint`` reads the parameter tree of a MaxText checkpoint on CPU without
MaxText: a training checkpoint (``<step>/items`` holding ``params/params/<tree>`` next to
``opt_state``), a param-only one (``checkpointing.save_params_to_path``: ``items/params/params``)
or an NNX decode one (``generate_param_only_checkpoint``: ``items/<tree>`` with ``{"value": x}``
leaves). ``from_maxtext`` / ``to_maxtext`` map that tree to nnxtron's and back (names, the scan
axis and the value conventions of ``maxtext_tree``); ``write_maxtext_checkpoint`` writes a
checkpoint MaxText's ``load_parameters_path`` loads (``<out>/0/items``, ``params/params/<tree>``).

A MaxText checkpoint does not say which model it holds: the caller gives the config, and every
MaxText array must be used and every nnxtron parameter filled, with the shapes the config gives.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from nnxtron.config.families import rules_for
from nnxtron.config.loader import load_config
from nnxtron.config.maxtext import MODEL_CONFIGS_SETTING
from nnxtron.config.maxtext_keys import MAXTEXT_LLAMA31_SCALING
from nnxtron.config.schema import Config
from nnxtron.convert import maxtext_tree as tree
from nnxtron.errors import CheckpointError, reason
from nnxtron.layers.moe import ExpertLoad
from nnxtron.models.build import abstract_model
from nnxtron.models.decoder import Decoder
from nnxtron.params import flatten

__all__ = [
    "is_maxtext_checkpoint",
    "read_maxtext_checkpoint",
    "from_maxtext",
    "to_maxtext",
    "write_maxtext_checkpoint",
    "load_maxtext_model",
    "checkpoint_config",
    "export_maxtext",
]

ITEMS = "items"
STEP = 0


def _is_nnxtron(path: Path) -> bool:
    """An nnxtron run directory, its checkpoints/, one step or one item of a step."""
    return (
        (path / "config.yml").is_file()
        or (path / "meta").is_dir()
        or (path.name in ("params", "train") and (path.parent / "meta").is_dir())
        or any((c / "meta").is_dir() for c in path.iterdir() if c.is_dir() and c.name.isdigit())
    )


def _items_dir(path: Path) -> Path | None:
    """The Orbax items directory of a MaxText checkpoint root, step directory or items directory."""
    if (path / "_METADATA").is_file():
        return path
    if (path / ITEMS).is_dir():
        return path / ITEMS
    steps = sorted(int(c.name) for c in path.iterdir() if c.name.isdigit() and (c / ITEMS).is_dir())
    if steps:
        return path / str(steps[-1]) / ITEMS
    if (path / "checkpoints").is_dir():  # a MaxText run directory (base_output_directory/run_name)
        return _items_dir(path / "checkpoints")
    return None


def is_maxtext_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` looks like a MaxText checkpoint (and not an nnxtron one)."""
    p = Path(path)
    return p.is_dir() and not _is_nnxtron(p) and _items_dir(p) is not None


def _locate(path: str | Path) -> Path:
    p = Path(path).expanduser().absolute()  # Orbax reads relative paths as missing
    if not p.is_dir():
        raise CheckpointError(f"MaxText checkpoint '{path}' is not a directory; pass a MaxText checkpoint directory")
    if _is_nnxtron(p):
        raise CheckpointError(
            f"'{path}' is an nnxtron checkpoint, not a MaxText one; use it directly (init_from=, load_parameters_path=, "
            "nnxtron generate)"
        )
    items = _items_dir(p)
    if items is None:
        raise CheckpointError(
            f"'{path}' holds no MaxText checkpoint (no items/_METADATA, no <step>/items); pass MaxText's checkpoint "
            "directory (base_output_directory/run_name/checkpoints), one step of it or its items directory"
        )
    if not (items / "_METADATA").is_file():
        raise CheckpointError(f"MaxText checkpoint '{items}' has no _METADATA file; the checkpoint is incomplete or damaged")
    return items


def _strip_rngs(meta: Any) -> Any:
    """A stored subtree without its RNG streams (``.../rngs/...``: not weights); None if empty."""
    if not isinstance(meta, dict):
        return meta
    kept = {k: _strip_rngs(v) for k, v in meta.items() if k != "rngs"}
    kept = {k: v for k, v in kept.items() if v is not None and v != {}}
    return kept or None


def _wanted(meta: Any, items: Path) -> tuple[dict, bool]:
    """The part of the stored tree that holds weights, and whether leaves are ``{"value": x}``:
    ``params/<collection>/...`` (training, Linen and param-only checkpoints; ``params/params``
    holds the ``nnx.Param``s) plus a training checkpoint's non-RNG ``nnx_aux/model`` state, or a
    decode checkpoint's bare tree."""
    if isinstance(meta, dict) and isinstance(meta.get("params"), dict) and isinstance(meta["params"].get("params"), dict):
        wanted = {"params": {k: v for k, v in meta["params"].items() if isinstance(v, dict)}}
        aux = _strip_rngs(meta.get("nnx_aux", {}).get("model")) if isinstance(meta.get("nnx_aux"), dict) else None
        if aux:
            wanted["nnx_aux"] = {"model": aux}
        return wanted, False
    if isinstance(meta, dict) and "decoder" in meta and "token_embedder" in meta:
        return meta, True  # NNX decode checkpoint (generate_param_only_checkpoint)
    raise CheckpointError(
        f"MaxText checkpoint '{items}' holds no parameter tree (params/params/decoder/...); it is not a MaxText model checkpoint"
    )


def _names(restored: dict, wrapped: bool) -> dict[str, Any]:
    """Flat MaxText names: ``nnx.Param``s by path, other collections under their name, a training
    checkpoint's model state under ``MoEBiasVar`` (the only such state of the covered families)."""
    if wrapped:
        return {k.removesuffix("/value"): v for k, v in flatten(restored).items()}
    flat: dict[str, Any] = {}
    for collection, subtree in restored["params"].items():
        prefix = "" if collection == "params" else f"{collection}/"
        flat.update({prefix + k: v for k, v in flatten(subtree).items()})
    aux = restored.get("nnx_aux", {}).get("model", {})
    flat.update({f"{tree.BIAS_COLLECTION}/{k}": v for k, v in flatten(aux).items()})
    return flat


class _QuietAbsl(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:  # Orbax warns about a missing step metadata file
        return "_CHECKPOINT_METADATA" not in record.getMessage()


def read_maxtext_checkpoint(path: str | Path) -> dict[str, np.ndarray]:
    """The weights of a MaxText checkpoint as ``{"decoder/layers/mlp/wi_0/kernel": array}``
    (paths below the params collection; other collections, e.g. DeepSeek's router bias, under
    ``MoEBiasVar/...``; the newest step of a checkpoint root), read on CPU."""
    items = _locate(path)
    quiet = _QuietAbsl()
    logging.getLogger("absl").addFilter(quiet)
    try:
        with ocp.PyTreeCheckpointer() as reader:
            try:
                meta = reader.metadata(items).item_metadata.tree
            except Exception as err:  # Orbax raises many types for a damaged tree
                raise CheckpointError(
                    f"MaxText checkpoint '{items}' has unreadable metadata ({_short(err)}); it is damaged"
                ) from None
            wanted, wrapped = _wanted(meta, items)
            args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
            try:
                restored = reader.restore(items, item=wanted, restore_args=args, partial_restore=True)
            except Exception as err:
                raise CheckpointError(f"MaxText checkpoint '{items}' cannot be read ({_short(err)}); it is damaged") from None
    finally:
        logging.getLogger("absl").removeFilter(quiet)
    flat = _names(restored, wrapped)
    for key, value in flat.items():
        if not isinstance(value, np.ndarray):
            raise CheckpointError(f"MaxText checkpoint '{items}': '{key}' holds no array; the checkpoint is damaged")
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value.astype(np.float32)).all():
            raise CheckpointError(f"MaxText checkpoint '{items}': '{key}' holds NaN/Inf values; the weights are damaged")
    return flat


def _short(err: BaseException) -> str:
    return reason(err)


def _abstract(cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    """Flat abstract nnxtron parameters and model state (the MoE load counters start at zero)."""
    _, params, _, rest = nnx.split(abstract_model(cfg), nnx.Param, ExpertLoad, ...)
    return flatten(params), flatten(rest)


def checkpoint_config(file: str | None, overrides: list[str]) -> Config:
    """The config of a MaxText checkpoint's model (a MaxText checkpoint does not carry one): the
    user's MaxText/nnxtron config file and ``key=value``s. For the families whose MaxText query
    kernels carry ``1/sqrt(head_dim)`` it defaults ``query_pre_attn_scalar=1`` (no logit scaling):
    the weights are then kept as MaxText stores them — a bit-exact round trip, and training
    that matches MaxText's (Adam sees the same parametrisation); ``query_pre_attn_scalar=0``
    gives HF-meaning kernels (rescaled; needed for `convert to-hf`). A tied head defaults to
    MaxText's bfloat16 table (``tied_head_bf16=true``) and MaxText's base.yml
    ``normalize_embedding_logits=true`` (logits / sqrt(emb_dim); Gemma 3: HF's head) unless MaxText's
    model config sets it (GPT-3, Qwen3: the preset's false), so the converted model computes
    MaxText's logits; ``tied_head_bf16=false`` rounds no table. A llama3 RoPE defaults to MaxText's
    fixed scaling (``llama3.1``: factor 8, low 1, high 4, 8192 positions; Llama 4's HF config says
    16 / 1 / 1)."""
    cfg = load_config(file, overrides)
    tied: dict[str, Any] = {"tied_head_bf16": True}
    if cfg.model_name not in MODEL_CONFIGS_SETTING["normalize_embedding_logits"]:
        tied["normalize_embedding_logits"] = True
    defaults: dict[str, Any] = dict(tied) if cfg.logits_via_embedding else {}
    if rules_for(cfg.decoder_block).maxtext_query_folded:
        defaults["query_pre_attn_scalar"] = 1.0
    if cfg.rope_type == "llama3":  # MaxText's llama3.1 RoPE, with its fixed scaling (Llama 4: not HF's)
        defaults.update(MAXTEXT_LLAMA31_SCALING)
    # defaults: under the file and the command line
    return load_config(file, overrides, defaults=defaults) if defaults else cfg


def export_maxtext(model: Decoder, out_dir: str | Path, *, scanned: bool) -> Path:
    """Write ``model``'s weights as a MaxText checkpoint (``write_maxtext_checkpoint``)."""
    _, params, _, rest = nnx.split(model, nnx.Param, ExpertLoad, ...)
    flat = to_maxtext(nnx.to_pure_dict(params), model.config, scanned=scanned, state=nnx.to_pure_dict(rest))
    return write_maxtext_checkpoint(flat, out_dir)


def load_maxtext_model(path: str | Path, cfg: Config) -> Decoder:
    """The ``Decoder`` of ``cfg`` holding a MaxText checkpoint's weights (counters at zero)."""
    params, state = from_maxtext(read_maxtext_checkpoint(path), cfg)
    graphdef, abstract_params, counters, rest = nnx.split(abstract_model(cfg), nnx.Param, ExpertLoad, ...)
    nnx.replace_by_pure_dict(abstract_params, jax.tree.map(jnp.asarray, params))
    nnx.replace_by_pure_dict(rest, jax.tree.map(jnp.asarray, state))
    zeros = jax.tree.map(lambda v: jnp.zeros(v.shape, v.dtype), counters)
    return nnx.merge(graphdef, abstract_params, zeros, rest)


def _unflatten(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        parts = [int(p) if p.isdigit() else p for p in key.split("/")]
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def from_maxtext(flat: dict[str, np.ndarray], cfg: Config) -> tuple[dict, dict]:
    """nnxtron's ``(params, model state)`` pure dicts (``nnx.to_pure_dict`` layout, the layout
    ``cfg.stacked_layers`` asks for, ``weight_dtype``) from a MaxText tree of the model ``cfg``
    describes. Every MaxText array is used, every nnxtron variable filled; anything else is
    one ``CheckpointError`` naming the path."""
    tree.check_supported(cfg)
    unscanned = tree.unscan(flat, cfg) if tree.is_scanned(flat) else dict(flat)
    if (rewrite := tree.maxtext_map(cfg).from_tree) is not None:
        unscanned = rewrite(unscanned, cfg)
    params, state = _abstract(cfg)
    weight_dtype = np.dtype(cfg.weight_dtype)
    filled: dict[str, Any] = {}
    parts: dict[str, dict[int, np.ndarray]] = {}
    for entry in tree.entries(cfg):
        target = (state if entry.rule.state else params).get(entry.path)
        if target is None:  # a table bug, not a user error
            raise RuntimeError(f"MaxText map: nnxtron path {entry.path} is not in the {cfg.decoder_block} model")
        if entry.maxtext not in unscanned:
            raise CheckpointError(
                f"MaxText checkpoint lacks '{entry.maxtext}' that model {_model(cfg)} needs; give the model settings the "
                "checkpoint was written with"
            )
        value = unscanned.pop(entry.maxtext)
        want = tuple(target.shape[1:] if entry.block is not None else target.shape)
        if tuple(value.shape) != want:
            raise CheckpointError(
                f"MaxText array '{entry.maxtext}' has shape {list(value.shape)}, model {_model(cfg)} expects {list(want)}; "
                "give the model settings the checkpoint was written with"
            )
        dtype = weight_dtype if not entry.rule.state else np.dtype(target.dtype)
        converted = tree.to_nnxtron_value(value.astype(dtype), entry.rule.convention, cfg)
        if entry.block is None:
            filled[entry.path] = converted
        else:
            parts.setdefault(entry.path, {})[entry.block] = converted
    for path, blocks in parts.items():
        filled[path] = np.stack([blocks[i] for i in range(len(blocks))])
    if unscanned:
        extra = sorted(unscanned)
        shown = ", ".join(extra[:3]) + (f" (+{len(extra) - 3} more)" if len(extra) > 3 else "")
        raise CheckpointError(
            f"MaxText checkpoint holds arrays model {_model(cfg)} does not use: {shown}; give the model settings the "
            "checkpoint was written with"
        )
    missing = sorted((set(params) | set(state)) - set(filled))
    if missing:  # a table bug
        raise RuntimeError(f"MaxText map leaves nnxtron variables unfilled: {missing[:5]}")
    return _unflatten({k: v for k, v in filled.items() if k in params}), _unflatten(
        {k: v for k, v in filled.items() if k in state}
    )


def _model(cfg: Config) -> str:
    return f"'{cfg.decoder_block}' (emb {cfg.base_emb_dim}, {cfg.base_num_decoder_layers} layers, vocab {cfg.vocab_size})"


def to_maxtext(params: dict, cfg: Config, *, scanned: bool, state: dict | None = None) -> dict[str, np.ndarray]:
    """MaxText's flat tree (``scanned``: layers stacked on axis 1) of nnxtron ``params`` (and the
    model state, e.g. DeepSeek's router biases) of the model ``cfg`` describes."""
    tree.check_supported(cfg)
    flat = {k: np.asarray(v) for k, v in flatten(params).items()}
    flat.update({k: np.asarray(v) for k, v in flatten(state or {}).items()})
    out: dict[str, np.ndarray] = {}
    used: set[str] = set()
    for entry in tree.entries(cfg):
        if entry.path not in flat:
            raise CheckpointError(f"nnxtron parameters lack '{entry.path}' of model {_model(cfg)}")
        used.add(entry.path)
        value = flat[entry.path] if entry.block is None else flat[entry.path][entry.block]
        out[entry.maxtext] = np.ascontiguousarray(tree.to_maxtext_value(value, entry.rule.convention, cfg))
    left = sorted(k for k in set(flat) - used if not k.endswith("expert_load"))
    if left:
        raise CheckpointError(f"nnxtron parameters hold '{left[0]}' that model {_model(cfg)} has no MaxText name for")
    if (rewrite := tree.maxtext_map(cfg).to_tree) is not None:
        out = rewrite(out, cfg)
    return tree.scan(out, cfg) if scanned else out


def write_maxtext_checkpoint(flat: dict[str, np.ndarray], out_dir: str | Path, *, step: int = STEP) -> Path:
    """Write ``flat`` as MaxText's ``<out_dir>/<step>/items`` (tree ``params/params/...`` and
    ``params/MoEBiasVar/...``: the param-only layout its ``load_parameters_path`` reads); returns
    the items directory. Refuses a directory that already holds that step."""
    root = Path(out_dir).expanduser().absolute()
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"'{root}' is a file, not a directory; choose a directory for the MaxText checkpoint")
    if (root / str(step)).exists():
        raise CheckpointError(f"'{root}' already holds step {step}; choose an empty output directory")
    state = {k: v for k, v in flat.items() if k.startswith(f"{tree.BIAS_COLLECTION}/")}
    collections = {"params": _unflatten_str({k: v for k, v in flat.items() if k not in state})}
    if state:  # MaxText's load_params_from_path reads non-Param variables from their collection
        collections[tree.BIAS_COLLECTION] = _unflatten_str({k.split("/", 1)[1]: v for k, v in state.items()})
    nested = {"params": collections}
    with ocp.CheckpointManager(root, item_names=(ITEMS,), options=ocp.CheckpointManagerOptions(create=True)) as manager:
        manager.save(step, args=ocp.args.Composite(**{ITEMS: ocp.args.PyTreeSave(nested)}))
        manager.wait_until_finished()
    return root / str(step) / ITEMS


def _unflatten_str(flat: dict[str, Any]) -> dict:
    """Nested dict of ``flat`` with every key a string (MaxText's names: ``layers_0``, never ints)."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        parts = key.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out
