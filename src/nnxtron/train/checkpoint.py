"""Orbax checkpoints of the train state, stored as a flat ``{"path": array}`` dict.

A checkpoint directory holds ``<step>/params`` (weights), ``<step>/train`` (optimizer
state, step, other variables; absent in converted HF checkpoints) and ``<step>/meta``
(JSON: format marker, step, data position, the config that wrote it, the ``layout`` it
was written with — scanned or layer-list layers, layer count, mesh shape — and a content
checksum of every array, ``train/checksum.py``). Only finite states are saved. Restoring
checks that the stored arrays match the model being restored key by key and shape by
shape, so a foreign directory gives one clear error instead of a deep traceback, and
that every array read back has its checksum and is finite: a damaged checkpoint is
``UnreadableCheckpoint`` (a resume then falls back to the previous one).

Restoring works across layouts. A different mesh needs nothing special: orbax reads
each array straight into the target's sharding. A different ``scan_layers`` is
converted: the arrays are read in the *stored* layout (targets derived from the
current ones, sharded like them with the layer axis added or dropped) and every key
with a layer group -- parameters, Adam moments, other state -- is stacked or unstacked
one group at a time straight into the current shardings (never gathered on one device).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from nnxtron.errors import CheckpointError
from nnxtron.errors import reason as error_reason
from nnxtron.params import LayerCounts, detect_layout, flatten_with_treedef, layer_groups
from nnxtron.train.checksum import checksums

FORMAT = "nnxtron-checkpoint-v1"
UNREADABLE_SUFFIX = ".unreadable"


def _write_replicas_once() -> None:
    """One process writes every shard of an array once, unsliced (orbax's ``ArrayHandler`` with
    ``use_replica_parallel=False``), where orbax's default splits each replicated shard among
    its replicas. That split spreads the writing over the processes holding the replicas; in one
    process it only adds work: an eager slicing program per replica and shape (deepseek3-tiny on 8
    CPU devices: 1,243 slices, 1.5 s of a 2.5 s save). Several processes keep orbax's default.
    Orbax's handler registry is global: the registration holds for this process."""
    if jax.process_count() == 1:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True
        )


class UnreadableCheckpoint(CheckpointError):
    """A step directory that cannot be read back (truncated, corrupted, half-written)."""


class Checkpointer:
    """Save and restore train states under ``directory`` (one sub-directory per step)."""

    def __init__(self, directory: str | Path, max_to_keep: int, *, create: bool = True):
        _quiet_background_errors()
        _write_replicas_once()
        self.directory = Path(directory).absolute()
        if not create and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory '{self.directory}' does not exist; check the path")
        try:
            self.manager = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create),
                item_handlers={
                    "params": ocp.StandardCheckpointHandler(),
                    "train": ocp.StandardCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler(),
                },
            )
        except Exception as err:  # orbax raises many types for unreadable directories
            raise CheckpointError(f"cannot open checkpoint directory '{self.directory}': {_one_line(err)}") from None

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """The committed steps, newest first (orbax never lists a half-written one)."""
        return sorted(self.manager.all_steps(), reverse=True)

    def set_aside(self, step: int) -> Path:
        """Rename an unreadable step directory to ``<step>.unreadable[-n]`` (kept, never deleted)
        so that neither a restore nor a later save of that step meets it."""
        source = self.directory / str(step)
        target = self.directory / f"{step}{UNREADABLE_SUFFIX}"
        n = 1
        while target.exists():
            n += 1
            target = self.directory / f"{step}{UNREADABLE_SUFFIX}-{n}"
        if jax.process_index() == 0:
            source.rename(target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"nnxtron set aside checkpoint {step}")
        self.manager.reload()
        return target

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Save a train state (or a params-only state) as the items ``params`` and ``train``.

        ``meta`` gets a ``layout`` record read from the arrays themselves (entries the
        caller passes in ``meta["layout"]`` are added to it).
        """
        flat = {"params": flatten_with_treedef(state["params"])[0]}
        others = {k: v for k, v in state.items() if k != "params"}
        if others:
            flat["train"] = flatten_with_treedef(others)[0]
        sums = {}
        for item, arrays in flat.items():
            sums[item], not_finite = checksums(arrays)
            if not_finite:  # the training guard stops before this; a caller passing NaN is a bug
                raise CheckpointError(f"refusing to save checkpoint {step}: {not_finite[0]} holds NaN or Inf values")
        layout = {**layout_of(flat["params"]), **meta.get("layout", {})}
        payload = {"format": FORMAT, "step": int(step), "items": sorted(flat), **meta, "layout": layout, "checksums": sums}
        items = {item: ocp.args.StandardSave(arrays) for item, arrays in flat.items()}
        with self._writing():
            self.manager.save(int(step), args=ocp.args.Composite(meta=ocp.args.JsonSave(payload), **items))

    def wait(self) -> None:
        """Wait for a save in flight; a failed one is a ``CheckpointError`` (one line)."""
        with self._writing():
            self.manager.wait_until_finished()

    def check_writable(self) -> None:
        """Raise one line now, before training, when no checkpoint could be written here."""
        probe = self.directory / f".nnxtron-write-probe-{os.getpid()}-{jax.process_index()}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise CheckpointError(
                f"cannot write checkpoints in '{self.directory}' ({err.strerror or err}); make it writable or choose "
                "another base_output_directory (the checkpoints already there are kept)"
            ) from None

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A failed write becomes one ``CheckpointError`` line naming the directory and the
        reason (a half-written save is never listed; ``_quiet_background_errors``)."""
        try:
            yield
        except Exception as err:  # orbax and tensorstore raise many types for a failed write
            newest = self.steps()
            kept = f"checkpoints up to step {newest[0]} are kept" if newest else "no checkpoint was written"
            raise CheckpointError(
                f"cannot write checkpoints in '{self.directory}' ({_write_error(err)}); "
                f"free space or fix the permissions of that disk, or choose another base_output_directory ({kept})"
            ) from None

    def read_meta(self, step: int) -> dict[str, Any]:
        path = self.directory / str(step) / "meta" / "metadata"
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            if (self.directory / str(step) / "params").is_dir():  # ours, but the meta is damaged
                raise UnreadableCheckpoint(
                    f"checkpoint '{self.directory / str(step)}' has no readable meta ({_one_line(err)})"
                ) from None
            meta = None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(
                f"'{self.directory / str(step)}' is not an nnxtron checkpoint (missing or foreign meta); "
                "point at a directory written by `nnxtron train` or `nnxtron convert from-hf`"
            )
        return meta

    def stored_layout(self, step: int, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """The layout ``step`` was written with: its ``layout`` record; for older checkpoints
        ``scan_layers`` of the config in its meta; else read from the stored array names."""
        meta = self.read_meta(step) if meta is None else meta
        layout = meta.get("layout")
        if isinstance(layout, dict) and isinstance(layout.get("scan_layers"), bool):
            return layout
        config = meta.get("config")
        if isinstance(config, dict) and isinstance(config.get("scan_layers"), bool):
            return {"scan_layers": config["scan_layers"], "num_layers": config.get("base_num_decoder_layers")}
        scanned, num_layers = detect_layout(self._stored_metadata(step, "params"))
        return {"scan_layers": scanned, "num_layers": num_layers}

    def restore(
        self, step: int, abstract_state: dict[str, Any], shardings: dict[str, Any], *, subset: bool = False
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore ``step`` into the structure and shardings of ``abstract_state``.

        ``abstract_state`` may hold only ``params`` (to load weights for generation or
        fine-tuning from a full training checkpoint or a converted HF one). ``subset``: the
        ``train`` item may hold more than ``abstract_state`` asks for (the model state
        ``rest`` of a full training checkpoint, without its optimizer state).
        """
        meta = self.read_meta(step)
        parts = {"params": ("params",), "train": tuple(k for k in abstract_state if k != "params")}
        parts = {item: keys for item, keys in parts.items() if keys}
        missing_items = sorted(set(parts) - set(meta.get("items", [])))
        if missing_items:
            raise CheckpointError(
                f"checkpoint '{self.directory / str(step)}' holds only {meta.get('items')} but "
                f"{missing_items} are needed (e.g. a converted HF checkpoint has no optimizer state); "
                "use it via load_parameters_path instead of resuming"
            )
        targets, treedefs = {}, {}
        for item, keys in parts.items():
            sub = abstract_state["params"] if item == "params" else {k: abstract_state[k] for k in keys}
            sub_sh = shardings["params"] if item == "params" else {k: shardings[k] for k in keys}
            flat, treedefs[item] = flatten_with_treedef(sub)
            flat_sh = flatten_with_treedef(sub_sh)[0]
            targets[item] = {
                key: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=flat_sh[key]) for key, value in flat.items()
            }
        scanned, num_layers = detect_layout(targets["params"])
        stored_scanned = self.stored_layout(step, meta).get("scan_layers") if scanned is not None else None
        convert = stored_scanned is not None and stored_scanned != scanned
        stored_targets = {}
        for item, target in targets.items():
            stored_targets[item] = _abstract_relayout(target, num_layers, stored_scanned) if convert else target
            self._check_structure(step, item, stored_targets[item], allow_extra=subset and item == "train")
        partial = {item: stored_targets.pop(item) for item in ("train",) if subset and item in stored_targets}
        try:
            restored = dict(
                self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        meta=ocp.args.JsonRestore(),
                        **{item: ocp.args.StandardRestore(target) for item, target in stored_targets.items()},
                    ),
                )
            )
            restored.update({item: self._restore_part(step, item, target) for item, target in partial.items()})
        except Exception as err:
            raise UnreadableCheckpoint(
                f"checkpoint '{self.directory / str(step)}' is unreadable ({_one_line(err)}); "
                "it may be corrupted: restore an older step or start a new run_name"
            ) from None
        arrays = {item: dict(restored[item]) for item in targets}
        del restored
        self._verify(step, meta, arrays)
        out: dict[str, Any] = {}
        for item, target in targets.items():
            values = _relayout(arrays.pop(item), target, num_layers, scanned) if convert else arrays.pop(item)
            tree = jax.tree_util.tree_unflatten(treedefs[item], [values[key] for key in target])
            out.update({"params": tree} if item == "params" else tree)
        return out, meta

    def _verify(self, step: int, meta: dict[str, Any], arrays: dict[str, dict[str, Any]]) -> None:
        """Every array read back has the checksum recorded at save and is finite (checkpoints
        written before checksums existed are only checked for finiteness)."""
        where = self.directory / str(step)
        recorded = meta.get("checksums")
        for item, values in arrays.items():
            sums, not_finite = checksums(values)
            if recorded is not None:
                expected = recorded.get(item) if isinstance(recorded, dict) else None
                if not isinstance(expected, dict):
                    raise UnreadableCheckpoint(f"checkpoint '{where}' has no checksums for its '{item}' arrays (damaged meta)")
                for key, value in sums.items():
                    if expected.get(key) != value:
                        raise UnreadableCheckpoint(
                            f"checkpoint '{where}' array {key} does not match its checksum (the files were changed or damaged)"
                        )
            if not_finite:
                raise UnreadableCheckpoint(f"checkpoint '{where}' array {not_finite[0]} holds NaN or Inf values")

    def _stored_metadata(self, step: int, item: str) -> dict[str, Any]:
        try:
            stored = self.manager.item_metadata(step)[item]
        except Exception as err:
            raise UnreadableCheckpoint(
                f"checkpoint '{self.directory / str(step)}' has no readable state ({_one_line(err)}); "
                "it may be corrupted: restore an older step or start a new run_name"
            ) from None
        if not stored:  # orbax's array metadata is gone (a deleted _METADATA)
            raise UnreadableCheckpoint(f"checkpoint '{self.directory / str(step)}' has no readable array metadata for '{item}'")
        return dict(stored)

    def _restore_part(self, step: int, item: str, target: dict[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
        """The arrays of ``target`` from ``item``, which may hold more (orbax's partial restore)."""
        args = {key: ocp.ArrayRestoreArgs(sharding=value.sharding, dtype=value.dtype) for key, value in target.items()}
        with ocp.PyTreeCheckpointer() as reader:
            return reader.restore(
                self.directory / str(step) / item, args=ocp.args.PyTreeRestore(target, restore_args=args, partial_restore=True)
            )

    def _check_structure(self, step: int, item: str, target: dict[str, jax.ShapeDtypeStruct], allow_extra: bool = False) -> None:
        stored = self._stored_metadata(step, item)
        stored_keys = set(stored)
        missing = sorted(set(target) - stored_keys)
        extra = [] if allow_extra else sorted(stored_keys - set(target))
        if missing or extra:
            what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
            raise CheckpointError(
                f"checkpoint '{self.directory / str(step)}' does not match this model ({what}, "
                f"{len(missing)} missing / {len(extra)} unexpected arrays); it was written for a different "
                "config: use the same model settings or a new run_name"
            )
        for key, want in target.items():
            shape = tuple(getattr(stored[key], "shape", ()) or ())
            if shape != tuple(want.shape):
                raise CheckpointError(
                    f"checkpoint '{self.directory / str(step)}' array {key} has shape {shape}, this model needs "
                    f"{tuple(want.shape)}: it was written for a different config; use a new run_name"
                )


def layout_of(flat_params: dict[str, Any]) -> dict[str, Any]:
    """The layout record of a flat parameter dict: scanned or not, layer count, mesh shape."""
    scanned, num_layers = detect_layout(flat_params)
    shardings = [getattr(v, "sharding", None) for v in flat_params.values()]
    mesh = next((s.mesh for s in shardings if isinstance(s, NamedSharding)), None)
    devices = next((len(s.device_set) for s in shardings if s is not None), None)
    return {
        "scan_layers": scanned,
        "num_layers": num_layers,
        "mesh_shape": None if mesh is None else {str(axis): int(size) for axis, size in mesh.shape.items()},
        "num_devices": devices,
    }


def _with_layer_axis(sharding: Any, add: bool) -> Any:
    """The sharding of the stacked (``add``) or per-layer array of a leaf sharded like ``sharding``:
    the layer axis is never split (added as None; a split one is dropped, i.e. gathered)."""
    if not isinstance(sharding, NamedSharding):
        return sharding  # single-device or fully replicated: valid for any rank
    spec = tuple(sharding.spec)
    spec = (None, *spec) if add else spec[1:]
    return NamedSharding(sharding.mesh, PartitionSpec(*spec), memory_kind=sharding.memory_kind)


def _abstract_relayout(target: dict[str, jax.ShapeDtypeStruct], num_layers: LayerCounts, scanned: bool) -> dict:
    """Restore targets of the other layout (shapes, dtypes and sharding) from the current targets."""
    out: dict[str, jax.ShapeDtypeStruct] = {}
    for new, old in _groups(target, num_layers, scanned):
        if new == old:
            out[new[0]] = target[old[0]]
        elif scanned:  # per-layer targets -> one stacked target
            first = target[old[0]]
            sharding = _with_layer_axis(first.sharding, add=True)
            out[new[0]] = jax.ShapeDtypeStruct((len(old), *first.shape), first.dtype, sharding=sharding)
        else:  # one stacked target -> per-layer targets
            whole = target[old[0]]
            sharding = _with_layer_axis(whole.sharding, add=False)
            part = jax.ShapeDtypeStruct(tuple(whole.shape[1:]), whole.dtype, sharding=sharding)
            out.update(dict.fromkeys(new, part))
    return out


def _relayout(
    stored: dict[str, jax.Array], target: dict[str, jax.ShapeDtypeStruct], num_layers: LayerCounts, scanned: bool
) -> dict:
    """Restored arrays of the other layout -> the current one, placed on the target shardings.

    One layer group at a time, each source dropped once converted, so at most one group's
    arrays exist twice."""
    out: dict[str, jax.Array] = {}
    for new, old in _groups(stored, num_layers, scanned):
        if new == old:
            out[new[0]] = stored.pop(old[0])
        elif scanned:
            parts = [stored.pop(k) for k in old]
            out[new[0]] = jax.jit(_stack, out_shardings=target[new[0]].sharding)(parts)
            del parts
        else:
            shardings = tuple(target[k].sharding for k in new)
            out.update(zip(new, jax.jit(_unstack, out_shardings=shardings)(stored.pop(old[0])), strict=True))
    return out


def _stack(parts: list[jax.Array]) -> jax.Array:
    return jnp.stack(parts)


def _unstack(whole: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(whole[i] for i in range(whole.shape[0]))


def _groups(flat: dict[str, Any], num_layers: LayerCounts, scanned: bool) -> list[tuple[list[str], list[str]]]:
    try:
        return layer_groups(flat, num_layers, scanned)
    except ValueError as err:
        raise CheckpointError(f"cannot convert the checkpoint's layer layout: {err}") from None


class _FromOrbax(logging.Filter):
    """Drops error records that orbax's background threads log for a failed read or write
    (the same failure reaches the caller as an exception, and becomes one line there)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        text = f"{record.pathname} {record.getMessage()} {record.exc_text or ''}"
        if record.exc_info and record.exc_info[2] is not None:
            text += " ".join(frame.f_code.co_filename for frame, _ in traceback.walk_tb(record.exc_info[2]))
        return "orbax" not in text


def _quiet_background_errors() -> None:
    """Once per process: orbax's background-thread error logs (absl, asyncio), the "Event
    loop is closed" errors its thread pools raise after a failed write and the coroutines
    of a failed read that Python collects at exit are not printed: the failure itself is
    raised where the save is waited for or the restore is called (one line there)."""
    if getattr(_quiet_background_errors, "done", False):
        return
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_FromOrbax())
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed":
            return
        code = getattr(unraisable.object, "cr_code", None)  # a coroutine of a failed read, collected at exit
        if code is not None and "orbax" in code.co_filename:
            return
        previous(unraisable)

    sys.unraisablehook = hook
    _quiet_background_errors.done = True


def _write_error(err: BaseException) -> str:
    """The reason of a failed write, with its errno name where the message gives it away."""
    text = str(err)
    for marker, reason in (
        ("No space left", "no space left on device: ENOSPC"),
        ("RESOURCE_EXHAUSTED", "no space left on device: ENOSPC"),
        ("Read-only file system", "read-only file system: EROFS"),
        ("Permission denied", "permission denied: EACCES"),
        ("Disk quota exceeded", "disk quota exceeded: EDQUOT"),
    ):
        if marker in text:
            return reason
    return _one_line(err)


def _one_line(err: BaseException) -> str:
    return error_reason(err)  # the whole first line of the cause (a TensorStore reason cut at 200 characters ended mid-word)
