"""Orbax checkpoints of the train state, stored as a flat ``{"path": array}`` dict.

A checkpoint directory holds ``<step>/params`` (weights), ``<step>/train`` (optimizer
state, step, other variables; absent in converted HF checkpoints) and ``<step>/meta``
(JSON: format marker, step, data position, the config that wrote it). Restoring checks that the
stored arrays match the model being restored key by key and shape by shape, so a
foreign or corrupted directory gives one clear error instead of a deep traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from nnxtron.errors import CheckpointError
from nnxtron.params import flatten_with_treedef

FORMAT = "nnxtron-checkpoint-v1"


class Checkpointer:
    """Save and restore train states under ``directory`` (one sub-directory per step)."""

    def __init__(self, directory: str | Path, max_to_keep: int, *, create: bool = True):
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

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Save a train state (or a params-only state) as the items ``params`` and ``train``."""
        items = {"params": ocp.args.StandardSave(flatten_with_treedef(state["params"])[0])}
        others = {k: v for k, v in state.items() if k != "params"}
        if others:
            items["train"] = ocp.args.StandardSave(flatten_with_treedef(others)[0])
        payload = {"format": FORMAT, "step": int(step), "items": sorted(items), **meta}
        self.manager.save(int(step), args=ocp.args.Composite(meta=ocp.args.JsonSave(payload), **items))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def read_meta(self, step: int) -> dict[str, Any]:
        path = self.directory / str(step) / "meta" / "metadata"
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError):
            meta = None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(
                f"'{self.directory / str(step)}' is not an nnxtron checkpoint (missing or foreign meta); "
                "point at a directory written by `nnxtron train` or `nnxtron convert from-hf`"
            )
        return meta

    def restore(
        self, step: int, abstract_state: dict[str, Any], shardings: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore ``step`` into the structure and shardings of ``abstract_state``.

        ``abstract_state`` may hold only ``params`` (to load weights for generation or
        fine-tuning from a full training checkpoint or a converted HF one).
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
            self._check_structure(step, item, targets[item])
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    meta=ocp.args.JsonRestore(),
                    **{item: ocp.args.StandardRestore(target) for item, target in targets.items()},
                ),
            )
        except Exception as err:
            raise CheckpointError(
                f"checkpoint '{self.directory / str(step)}' is unreadable ({_one_line(err)}); "
                "it may be corrupted: restore an older step or start a new run_name"
            ) from None
        out: dict[str, Any] = {}
        for item, target in targets.items():
            tree = jax.tree_util.tree_unflatten(treedefs[item], [restored[item][key] for key in target])
            out.update({"params": tree} if item == "params" else tree)
        return out, meta

    def _check_structure(self, step: int, item: str, target: dict[str, jax.ShapeDtypeStruct]) -> None:
        try:
            stored = self.manager.item_metadata(step)[item]
        except Exception as err:
            raise CheckpointError(
                f"checkpoint '{self.directory / str(step)}' has no readable state ({_one_line(err)}); "
                "it may be corrupted: restore an older step or start a new run_name"
            ) from None
        stored_keys = set(stored.keys()) if stored is not None else set()
        missing = sorted(set(target) - stored_keys)
        extra = sorted(stored_keys - set(target))
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


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__
