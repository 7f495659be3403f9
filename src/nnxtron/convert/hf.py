"""HuggingFace checkpoints (``config.json`` + safetensors) <-> nnxtron ``Decoder``.

``from_hf`` builds the model abstractly (no random init) and fills every parameter from
the safetensors file(s) using the family's ``WeightMap``s; ``to_hf`` writes the inverse.
Both directions are exact: transposes and reshapes only, plus a cast to ``weight_dtype``.
An HF ``nn.Linear.weight`` is ``[out, in]``; the nnxtron kernel is ``[*in, *out]``, so
``kernel = weight.T.reshape(kernel_shape)`` and ``weight = kernel.reshape(in, out).T``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from nnxtron.config.layout import layer_kinds
from nnxtron.config.loader import load_config
from nnxtron.config.schema import Config
from nnxtron.config.stacks import layer_stacks
from nnxtron.convert.hf_values import marked, unmarked
from nnxtron.data.chat_template import find_chat_template, template_directory
from nnxtron.data.sources import BYTE_MODEL_VOCAB_LIMIT, tokenizer_for
from nnxtron.data.tokenizer import ByteTokenizer, Tokenizer
from nnxtron.data.tokenizer_files import (
    GENERATION_FILE,
    detect_tokenizer,
    tokenizer_values,
    write_chat_template,
    write_hf_tokenizer,
)
from nnxtron.errors import CheckpointError, ConfigError
from nnxtron.layers.moe import ExpertLoad
from nnxtron.models.build import abstract_model
from nnxtron.models.decoder import Decoder
from nnxtron.models.family import Family, WeightMap
from nnxtron.models.registry import FAMILIES, family_for, family_for_hf

__all__ = ["check_tokenizer", "from_hf", "to_hf", "hf_config", "load_hf_weights", "read_hf_config", "hf_config_to_nnxtron"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
IGNORED_SUFFIXES = (
    "rotary_emb.inv_freq",
    ".attn.bias",
    ".attn.masked_bias",
)  # buffers some HF versions save (RoPE frequencies, GPT-2 causal masks); recomputed

ParamPath = tuple[Any, ...]


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` of an HF model directory."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(
            f"HF checkpoint directory '{root}' does not exist; pass a directory holding config.json and model.safetensors"
        )
    file = root / CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(f"'{root}' has no config.json; pass an HF model directory as written by save_pretrained")
    try:
        hf = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"'{file}' is not valid JSON ({err}); fix the file or re-save the model") from None
    if not isinstance(hf, dict) or not isinstance(hf.get("model_type"), str):
        raise CheckpointError(f"'{file}' has no model_type; it is not an HF transformers model config")
    return hf


# Multimodal hub wrappers whose text decoder nnxtron reads: model_type -> key prefixes of the
# vision parts (not imported). The text keys are ``language_model.<text model key>`` (what
# save_pretrained writes) or ``model.language_model.<key without "model.">`` (transformers>=5
# in-memory names); the text config is ``text_config``. Each family names its wrapper (``Family.hf_multimodal_type``).
MULTIMODAL = {f.hf_multimodal_type: f.hf_vision_prefixes for f in FAMILIES.values() if f.hf_multimodal_type}


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's config: ``hf`` itself, or a multimodal wrapper's ``text_config``."""
    if hf.get("model_type") not in MULTIMODAL:
        return hf
    text = hf.get("text_config")
    if not isinstance(text, dict) or "model_type" not in text:
        raise CheckpointError(f"HF {hf['model_type']} config has no text_config with a model_type; re-save the model")
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in hf:
        text = {**text, "tie_word_embeddings": hf["tie_word_embeddings"]}
    return text


def _text_key(key: str, model_type: str) -> str | None:
    """The text-decoder name of a multimodal checkpoint key (None: a vision key, not imported)."""
    if key.startswith(MULTIMODAL[model_type]):
        return None
    if key.startswith("language_model."):
        return key[len("language_model.") :]
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model.") :]
    return key


def _map_config(hf: dict[str, Any], origin: Path) -> dict[str, Any]:
    hf = marked(_text_config(hf))  # 4.5, true and "4" where a number belongs raise ValueError (hf_values.py)
    _, family = family_for_hf(str(hf["model_type"]))  # ConfigError naming unsupported types
    try:
        values = unmarked(family.config_from_hf(hf))
        if values.get("mtp_num_layers") and not _holds_mtp_layers(origin.parent, family, values["base_num_decoder_layers"]):
            values["mtp_num_layers"] = 0  # transformers' save_pretrained drops the MTP layers its config counts
        return values
    except KeyError as err:
        raise CheckpointError(f"'{origin}' lacks key {err}; re-save the config with transformers") from None
    except (TypeError, ValueError, AttributeError, OverflowError) as err:  # a value of the wrong type or range
        raise CheckpointError(f"'{origin}' has an invalid value ({err}); fix config.json") from None
    except ZeroDivisionError:  # e.g. a head count of 0, divided into the width
        raise CheckpointError(f"'{origin}' has 0 for a size or count that divides another; fix config.json") from None


def _holds_mtp_layers(root: Path, family: Family, layers: int) -> bool:
    """Whether the weights in ``root`` hold the first multi-token-prediction layer (True
    without weight files: the config alone describes the model)."""
    if not family.mtp_weights:
        return True  # weight_maps refuses mtp_num_layers for this family, naming the key
    key = family.hf_layer_prefix.format(i=layers) + family.mtp_weights[0].hf_key
    try:
        files = _weight_files(root)
    except CheckpointError:
        return True
    if len(files) > 1:
        return key in json.loads((root / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"]
    with safe_open(str(files[0]), "numpy") as handle:
        return key in handle.keys()


def hf_config_to_nnxtron(path: str | os.PathLike) -> dict[str, Any]:
    """nnxtron config values (a subset of ``Config`` keys) for an HF model directory."""
    return _map_config(read_hf_config(path), Path(path) / CONFIG_FILE)


@dataclass(frozen=True)
class _Mapped:
    """One model variable and where its values live in an HF checkpoint."""

    path: ParamPath
    layer_prefixes: tuple[str, ...]  # HF key prefix of each layer it holds ("" for top-level weights)
    wm: WeightMap
    stacked: bool  # the variable stacks len(layer_prefixes) layers on its leading axis


def weight_maps(cfg: Config) -> Iterator[_Mapped]:
    """Every variable of the model with an HF counterpart, layer stacks in HF layer order."""
    family = family_for(cfg.decoder_block)
    for wm in family.top_weights(cfg):
        yield _Mapped(tuple(wm.path.split("/")), ("",), wm, False)
    for stack in layer_stacks(cfg):
        for position, kind in enumerate(stack.kinds):
            prefixes = tuple(
                family.hf_layer_prefix.format(i=stack.hf_layer(block, position)) for block in range(stack.num_layers)
            )
            for wm in family.layer_weights(cfg, kind):
                sub = (*stack.sub_path(position), *wm.path.split("/"))
                if cfg.stacked_layers:
                    yield _Mapped((stack.name, "layers", *sub), prefixes, wm, True)
                else:
                    for i, prefix in enumerate(prefixes):
                        yield _Mapped((stack.name, "layers", i, *sub), (prefix,), wm, False)
    if cfg.mtp_num_layers:
        if not family.mtp_weights:
            raise ConfigError(
                f"mtp_num_layers={cfg.mtp_num_layers}: HF {family.hf_architecture} has no multi-token prediction "
                "layers; set mtp_num_layers=0 to import or export it"
            )
        last = layer_kinds(cfg)[-1]  # an MTP depth's block is of the last layer's kind (models/mtp.py)
        for depth, prefix in enumerate(mtp_prefixes(cfg, family)):
            for wm in family.mtp_weights:
                yield _Mapped(("mtp", "depths", depth, *wm.path.split("/")), (prefix,), wm, False)
            for wm in family.layer_weights(cfg, last):
                yield _Mapped(("mtp", "depths", depth, "block", *wm.path.split("/")), (prefix,), wm, False)


def mtp_prefixes(cfg: Config, family: Family) -> list[str]:
    """The HF key prefix of each multi-token-prediction depth: the layers after the decoder's."""
    return [family.hf_layer_prefix.format(i=cfg.base_num_decoder_layers + d) for d in range(cfg.mtp_num_layers)]


def _mtp_copy_source(cfg: Config, top_key: str) -> str:
    """The top-level HF key an MTP layer's copy repeats (a tied head repeats the embedding)."""
    return "model.embed_tokens.weight" if top_key == "lm_head.weight" and cfg.logits_via_embedding else top_key


def _check_covered(params: dict[ParamPath, Any], mapped: set[ParamPath], family: str) -> None:
    unmapped = sorted("/".join(map(str, p)) for p in set(params) - mapped)
    if unmapped:  # a family bug, not a user error
        raise RuntimeError(f"decoder_block {family}: parameters without an HF weight map: {unmapped}")


def _hf_shape(kernel_shape: tuple[int, ...], in_dims: int, conv1d: bool = False) -> tuple[int, ...]:
    if conv1d:
        if not in_dims:
            return (math.prod(kernel_shape),)
        return (math.prod(kernel_shape[:in_dims]), math.prod(kernel_shape[in_dims:]))
    if not in_dims:
        return tuple(kernel_shape)
    return (math.prod(kernel_shape[in_dims:]), math.prod(kernel_shape[:in_dims]))


def _from_hf_tensor(tensor: np.ndarray, kernel_shape: tuple[int, ...], in_dims: int, conv1d: bool = False) -> np.ndarray:
    if conv1d:
        return tensor.reshape(kernel_shape)
    return tensor.T.reshape(kernel_shape) if in_dims else tensor


def _to_hf_tensor(kernel: np.ndarray, in_dims: int, conv1d: bool = False) -> np.ndarray:
    if conv1d:
        return np.ascontiguousarray(kernel.reshape(_hf_shape(kernel.shape, in_dims, conv1d=True)))
    if not in_dims:
        return np.ascontiguousarray(kernel)
    return np.ascontiguousarray(kernel.reshape(math.prod(kernel.shape[:in_dims]), -1).T)


class _Reader:
    """Reads one layer's value of a weight map from open safetensors handles, in either
    expert layout (hub per-expert keys or the transformers>=5 fused tensor)."""

    def __init__(self, root: Path, handles: dict[str, Any], file_keys: dict[str, str] | None = None):
        self.root, self.handles = root, handles
        self.file_keys = file_keys or {}  # key -> its name in the file, where they differ (multimodal wrappers)
        self.used: set[str] = set()

    def raw(self, key: str) -> np.ndarray:
        """The tensor ``key`` as stored, unchecked."""
        return self.handles[key].get_tensor(self.file_keys.get(key, key))

    def _get(self, key: str, want: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The tensor ``key``: of shape ``want``, of ``dtype``'s kind (floating or integer) and,
        for floating weights, finite."""
        tensor = self.raw(key)
        if tuple(tensor.shape) != want:
            raise CheckpointError(
                f"tensor '{key}' in '{self.root}' has shape {list(tensor.shape)}, expected {list(want)} from "
                "config.json; fix config.json or the weights"
            )
        floating = jnp.issubdtype(dtype, jnp.floating)
        if jnp.issubdtype(tensor.dtype, jnp.floating) != floating:
            kind = "floating-point weights" if floating else "an integer table"
            raise CheckpointError(f"tensor '{key}' in '{self.root}' is {tensor.dtype}, expected {kind}; the weights are damaged")
        if floating and not np.isfinite(tensor).all():
            bad = int(tensor.size - np.isfinite(tensor).sum())
            raise CheckpointError(f"tensor '{key}' in '{self.root}' holds {bad} NaN/Inf values; the weights are damaged")
        self.used.add(key)
        return tensor

    def _missing(self, key: str) -> CheckpointError:
        return CheckpointError(f"tensor '{key}' is missing from '{self.root}'; the weights do not match its config.json")

    def read(self, prefix: str, wm: WeightMap, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The nnxtron value (``shape``: one layer, cast once to ``dtype``) of ``wm`` for the layer at HF ``prefix``."""
        in_dims = wm.linear_in_dims
        if not wm.per_expert:
            key = prefix + wm.hf_key
            if key not in self.handles and wm.fused_key and prefix + wm.fused_key in self.handles:
                key = prefix + wm.fused_key  # the same tensor under its transformers>=5 name
            if key not in self.handles:
                raise self._missing(prefix + wm.hf_key)
            if wm.split_parts > 1:  # one chunk of a tensor concatenated (or interleaved) along its last axis
                size = shape[-1]
                if wm.stacked_linear:  # [E, parts * out, in] -> nnxtron's [E, in, parts * out]
                    full = np.swapaxes(self._get(key, (*shape[:-2], wm.split_parts * size, shape[-2]), dtype), -1, -2)
                else:
                    full = self._get(key, (*shape[:-1], wm.split_parts * size), dtype)
                if wm.interleaved:
                    return np.ascontiguousarray(full[..., wm.split_part :: wm.split_parts]).astype(dtype)
                return full[..., wm.split_part * size : (wm.split_part + 1) * size].astype(dtype)
            if wm.stacked_linear:  # [E, out, in] -> [E, in, out]
                stacked = self._get(key, (*shape[:-2], shape[-1], shape[-2]), dtype)
                return np.ascontiguousarray(np.swapaxes(stacked, -1, -2)).astype(dtype, copy=False)
            want = _hf_shape(shape, in_dims, wm.conv1d)
            return _from_hf_tensor(self._get(key, want, dtype), shape, in_dims, wm.conv1d).astype(dtype, copy=False)
        experts, one = shape[0], tuple(shape[1:])
        keys = [prefix + wm.hf_key.format(e=e) for e in range(experts)]
        if wm.fused_key and keys[0] not in self.handles and prefix + wm.fused_key in self.handles:
            out_size, in_size = _hf_shape(one, in_dims)
            fused = self._get(prefix + wm.fused_key, (experts, wm.fused_parts * out_size, in_size), dtype)
            part = fused[:, wm.fused_part * out_size : (wm.fused_part + 1) * out_size]
            return np.stack([_from_hf_tensor(t, one, in_dims) for t in part]).astype(dtype, copy=False)
        missing = [k for k in keys if k not in self.handles]
        if missing:
            raise self._missing(missing[0])
        parts = [_from_hf_tensor(self._get(k, _hf_shape(one, in_dims), dtype), one, in_dims) for k in keys]
        return np.stack(parts).astype(dtype, copy=False)


def _hf_tensors(value: np.ndarray, prefix: str, wm: WeightMap) -> dict[str, np.ndarray]:
    """HF tensors (hub layout) of one layer's nnxtron ``value`` of ``wm``; a ``split_parts``
    chunk is returned under ``(key, part)`` for ``_join_split`` to concatenate."""
    if wm.split_parts > 1:
        return {(prefix + wm.hf_key, wm.split_part, wm.interleaved, wm.stacked_linear): value}
    if wm.stacked_linear:
        return {prefix + wm.hf_key: np.ascontiguousarray(np.swapaxes(value, -1, -2))}
    if not wm.per_expert:
        if np.issubdtype(value.dtype, np.integer):  # index tables (DeepSeek-V4 tid2eid) are int64 in HF
            value = value.astype(np.int64)
        return {prefix + wm.hf_key: _to_hf_tensor(value, wm.linear_in_dims, wm.conv1d)}
    return {prefix + wm.hf_key.format(e=e): _to_hf_tensor(value[e], wm.linear_in_dims) for e in range(value.shape[0])}


def _join_split(tensors: dict[Any, np.ndarray]) -> dict[str, np.ndarray]:
    """Concatenate the ``(key, part, interleaved, stacked_linear)`` chunks of split tensors along their last axis
    (interleaved: alternate their columns; stacked_linear: then swap the last two axes, HF's ``[E, out, in]``)."""
    out = {k: v for k, v in tensors.items() if isinstance(k, str)}
    parts: dict[str, dict[int, np.ndarray]] = {}
    interleaved: set[str] = set()
    linear: set[str] = set()
    for k, v in tensors.items():
        if not isinstance(k, str):
            parts.setdefault(k[0], {})[k[1]] = v
            if k[2]:
                interleaved.add(k[0])
            if k[3]:
                linear.add(k[0])
    for key, chunks in parts.items():
        ordered = [chunks[i] for i in range(len(chunks))]
        if key in interleaved:
            joined = np.stack(ordered, axis=-1).reshape(*ordered[0].shape[:-1], -1)
        else:
            joined = np.concatenate(ordered, axis=-1)
        out[key] = np.ascontiguousarray(np.swapaxes(joined, -1, -2) if key in linear else joined)
    return out


def _is_counter(variable: Any) -> bool:
    """Run-time statistics with no HF counterpart (MoE expert-load counters): start at zero."""
    return isinstance(variable, ExpertLoad) or getattr(variable, "type", None) is ExpertLoad


def _weight_files(root: Path) -> list[Path]:
    """The safetensors files of an HF directory: model.safetensors, else the sharded index."""
    if (root / WEIGHTS_FILE).is_file():
        return [root / WEIGHTS_FILE]
    index = root / INDEX_FILE
    if not index.is_file():
        raise CheckpointError(f"'{root}' has no {WEIGHTS_FILE} or {INDEX_FILE}; save the model with safe_serialization=True")
    try:
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError, TypeError) as err:
        raise CheckpointError(f"'{index}' is not a valid safetensors index ({err!r}); re-save the model") from None
    outside = [
        s for s in shards if not isinstance(s, str) or "\x00" in s or not (root / s).resolve().is_relative_to(root.resolve())
    ]
    if outside:
        raise CheckpointError(
            f"'{index}' names shard file {str(outside[0])[:200]!r} outside '{root}'; a model's files stay in its directory"
        )
    missing = [s for s in shards if not (root / s).is_file()]
    if missing:
        raise CheckpointError(f"'{root}' lacks shard file(s) {missing} listed in {INDEX_FILE}; download them again")
    return [root / s for s in shards]


def _open_all(stack: contextlib.ExitStack, files: list[Path]) -> dict[str, Any]:
    """HF key -> open safetensors handle holding it."""
    handles: dict[str, Any] = {}
    for file in files:
        try:
            handle = stack.enter_context(safe_open(str(file), "numpy"))
        except Exception as err:  # safetensors raises its own SafetensorError
            raise CheckpointError(f"'{file}' is not a readable safetensors file ({err}); download it again") from None
        for key in handle.keys():
            if key in handles:
                raise CheckpointError(f"tensor '{key}' appears in more than one file of '{file.parent}'; re-save the model")
            handles[key] = handle
    return handles


def hf_config(path: str | os.PathLike, dtype: str | None = None, **overrides: Any) -> Config:
    """The nnxtron config of an HF model directory: its ``config.json``, the tokenizer it
    holds (``tokenizer.json``, ``tokenizer.model``: see ``data/tokenizer_files.py``), then
    ``overrides``. ``dtype`` sets both ``dtype`` and ``weight_dtype`` (default float32)."""
    root = Path(path)
    dtype = dtype or "float32"
    mapped = _map_config(read_hf_config(root), root / CONFIG_FILE)
    values = {**mapped, "dtype": dtype, "weight_dtype": dtype, **tokenizer_values(root, overrides), **overrides}
    return load_config(values=values)


def check_tokenizer(path: str | os.PathLike, given: Mapping[str, Any]) -> None:
    """Before text is read or written with an HF directory's model: refuse a directory that holds
    no tokenizer file, unless ``given`` (the user's keys) chooses one: the byte tokenizer nnxtron
    would otherwise use is a guess at what the model's ids mean."""
    if "tokenizer_type" in given or "tokenizer_path" in given or detect_tokenizer(path) is not None:
        return
    raise CheckpointError(
        f"'{path}' holds no tokenizer file (tokenizer.json, tokenizer.model, *.tiktoken), so its token ids have no "
        "text; copy the model's tokenizer files into it, or pass tokenizer_type=... tokenizer_path=... "
        "(tokenizer_type=byte for a byte-level model)"
    )


def from_hf(path: str | os.PathLike, dtype: str | None = None, **overrides: Any) -> Decoder:
    """Load an HF model directory (any registered family) as a ``Decoder`` (``hf_config``:
    ``overrides`` such as ``scan_layers=False`` are applied last)."""
    return load_hf_weights(path, hf_config(path, dtype, **overrides))


def load_hf_weights(path: str | os.PathLike, cfg: Config) -> Decoder:
    """The ``Decoder`` of ``cfg`` (an HF directory's model in any layout) holding that
    directory's weights, cast to ``weight_dtype``."""
    root = Path(path)
    hf = read_hf_config(root)
    weight_dtype = jnp.dtype(cfg.weight_dtype)
    graphdef, state = nnx.split(abstract_model(cfg))
    params = dict(nnx.to_flat_state(state))
    filled: dict[ParamPath, Any] = {path: v.replace(jnp.zeros(v.shape, v.dtype)) for path, v in params.items() if _is_counter(v)}
    with contextlib.ExitStack() as stack:
        handles = _open_all(stack, _weight_files(root))
        file_keys: dict[str, str] = {}
        if hf["model_type"] in MULTIMODAL:  # read the text decoder; the vision tower is not imported
            renamed = {key: _text_key(key, hf["model_type"]) for key in handles}
            file_keys = {new: old for old, new in renamed.items() if new is not None}
            handles = {new: handles[old] for new, old in file_keys.items()}
        reader = _Reader(root, handles, file_keys)
        for mapped in weight_maps(cfg):
            variable = params.get(mapped.path)
            if variable is None:  # a family bug, not a user error
                raise RuntimeError(f"decoder_block {cfg.decoder_block}: weight map path {mapped.wm.path} is not in the model")
            shape = tuple(variable.shape[1:] if mapped.stacked else variable.shape)
            # parameters take weight_dtype; other variables (the float32 router bias) keep their own dtype
            dtype = weight_dtype if isinstance(variable, nnx.Param) else variable.dtype
            parts = [reader.read(prefix, mapped.wm, shape, dtype) for prefix in mapped.layer_prefixes]
            filled[mapped.path] = variable.replace(jnp.asarray(np.stack(parts) if mapped.stacked else parts[0]))
        _check_mtp_copies(reader, cfg)
        ignored = {"lm_head.weight"} if cfg.logits_via_embedding else set()  # HF ties it to the embedding
        extra = sorted(k for k in handles if k not in reader.used and k not in ignored and not k.endswith(IGNORED_SUFFIXES))
    if extra:
        shown = ", ".join(extra[:5]) + (f" (+{len(extra) - 5} more)" if len(extra) > 5 else "")
        raise CheckpointError(f"'{root}' holds tensors this config does not use: {shown}; check config.json matches the weights")
    _check_covered(params, set(filled), cfg.decoder_block)
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def _check_mtp_copies(reader: _Reader, cfg: Config) -> None:
    """An MTP layer's copies of the embedding and head must equal them: nnxtron shares them."""
    family = family_for(cfg.decoder_block)
    for prefix in mtp_prefixes(cfg, family):  # none unless the family has MTP weights (weight_maps refuses)
        for own, top in family.mtp_copies:
            key, source = prefix + own, _mtp_copy_source(cfg, top)
            if key in reader.handles and source in reader.handles:
                main = reader.raw(source)
                if not np.array_equal(reader._get(key, tuple(main.shape), main.dtype), main):
                    raise CheckpointError(
                        f"tensor '{key}' in '{reader.root}' differs from '{source}'; nnxtron's multi-token prediction "
                        "shares the model's embedding and head (set mtp_num_layers=0 to import without it)"
                    )


def to_hf(model: Decoder, path: str | os.PathLike, overwrite: bool = False, kept: Path | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (HF names, ``weight_dtype``) to ``path``,
    with the tokenizer, its chat template and ``generation_config.json``. ``kept``: the directory
    that keeps the model's tokenizer files (a run's ``tokenizer/``), read where the tokenizer has
    no files of its own (the byte tokenizer's chat template and generation settings)."""
    root = Path(path)
    if not overwrite and ((root / WEIGHTS_FILE).exists() or (root / INDEX_FILE).exists()):
        raise CheckpointError(
            f"'{root}' already holds an HF checkpoint; choose another directory or pass --overwrite (overwrite=True in Python)"
        )
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"'{root}' is a file, not a directory; choose a directory for the HF checkpoint")
    cfg: Config = model.config
    tokenizer = model_tokenizer(cfg)  # before anything is written: a tokenizer that does not fit is refused
    ids = special_ids(tokenizer) if tokenizer is not None else {}
    hf_values = {**family_for(cfg.decoder_block).config_to_hf(cfg), **ids}
    params = {p: v for p, v in nnx.to_flat_state(nnx.state(model)) if not _is_counter(v)}
    tensors: dict[Any, np.ndarray] = {}
    mapped: set[ParamPath] = set()
    for m in weight_maps(cfg):
        value = np.asarray(params[m.path][...])
        mapped.add(m.path)
        for i, prefix in enumerate(m.layer_prefixes):
            tensors.update(_hf_tensors(value[i] if m.stacked else value, prefix, m.wm))
    _check_covered(params, mapped, cfg.decoder_block)
    tensors = _join_split(tensors)
    if cfg.logits_via_embedding and not hf_values["tie_word_embeddings"]:  # a tied head HF's tied head is not
        tensors["lm_head.weight"] = _untied_head(model)
    family = family_for(cfg.decoder_block)
    for prefix in mtp_prefixes(cfg, family):  # the hub layout repeats the embedding and head in each MTP layer
        tensors.update({prefix + own: tensors.get(top, tensors[_mtp_copy_source(cfg, top)]) for own, top in family.mtp_copies})
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{WEIGHTS_FILE}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, root / WEIGHTS_FILE)
    (root / CONFIG_FILE).write_text(json.dumps(hf_values, indent=2) + "\n", encoding="utf-8")
    directories = [d for d in (_tokenizer_directory(tokenizer), kept) if d is not None]
    if tokenizer is not None:
        write_hf_tokenizer(tokenizer, root)
        template, _ = find_chat_template(directories, tokenizer)
        if template is not None and template_directory([root]) is None:  # written for tokenizers rebuilt as tokenizer.json
            write_chat_template(tokenizer, root, template.template)
    generation = generation_settings(cfg, ids, next((d for d in directories if (d / GENERATION_FILE).is_file()), None))
    (root / GENERATION_FILE).write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    return root


def _tokenizer_directory(tokenizer: Tokenizer | None) -> Path | None:
    """The directory of a tokenizer's files (a run's ``tokenizer/``, an HF directory); None for the byte tokenizer."""
    path = getattr(tokenizer, "path", None)
    return Path(path).parent if path else None


def generation_settings(cfg: Config, ids: dict[str, int], directory: Path | None) -> dict[str, Any]:
    """The ``generation_config.json`` of an export: the model's own, kept with its tokenizer
    (an HF source's, carried through runs), else the ids and ``decode_sampling_*``."""
    file = directory / GENERATION_FILE if directory is not None else None
    if file is None or not file.is_file():
        return {**ids, **sampling_settings(cfg)}
    try:
        kept = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"'{file}' is not readable JSON ({err}); repair or remove it") from None
    if not isinstance(kept, dict):
        raise CheckpointError(f"'{file}' holds no JSON object; repair or remove it")
    return {**ids, **kept}


def _untied_head(model: Decoder) -> np.ndarray:
    """HF's ``lm_head.weight`` [V, D] computing a tied head that is not HF's ``x @ E^T``
    (``normalize_embedding_logits``: ``layers/embed.py: tied_logit_scale``): ``E * scale / divisor``,
    the scaled table rounded to bfloat16 first with ``tied_head_bf16`` (MaxText's head), in float32,
    then ``weight_dtype``; the config says ``tie_word_embeddings=false``."""
    scale, divisor = model.tied_scale
    table = jnp.asarray(model.embed.embedding[...], jnp.float32) * scale
    if model.config.tied_head_bf16:
        table = table.astype(jnp.bfloat16).astype(jnp.float32)
    return np.asarray((table / divisor).astype(model.config.weight_dtype))


def model_tokenizer(cfg: Config) -> Tokenizer | None:
    """The tokenizer a model is exported with: the configured one, checked against the model's
    vocabulary; None for a model that has none (an HF checkpoint imported without tokenizer
    files, left on the byte default whose 259 ids do not fit its vocabulary)."""
    byte = ByteTokenizer.vocab_size
    if cfg.tokenizer_type == "byte" and not byte <= cfg.vocab_size <= BYTE_MODEL_VOCAB_LIMIT:
        return None
    return tokenizer_for(cfg)


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of the ids the tokenizer has."""
    ids = {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id, "pad": tokenizer.pad_id}
    return {f"{kind}_token_id": i for kind, i in ids.items() if i >= 0}


def sampling_settings(cfg: Config) -> dict[str, Any]:
    """``decode_sampling_*`` as HF ``generation_config.json`` settings (top_k=0 and top_p=1 are off)."""
    if cfg.decode_sampling_strategy == "greedy":
        return {"do_sample": False}
    top_k = cfg.decode_sampling_top_k if cfg.decode_sampling_strategy == "topk" else 0
    top_p = cfg.decode_sampling_nucleus_p if cfg.decode_sampling_strategy == "nucleus" else 1.0
    return {"do_sample": True, "temperature": cfg.decode_sampling_temperature, "top_k": top_k, "top_p": top_p}
