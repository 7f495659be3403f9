"""MaxText's scanned tree of a ``ScannableBlock`` with its local layers nested (Qwen3-Next, Gemma 4) <-> the
unscanned names ``decoder/layers_{i}/...``.

Such a block (one cycle of ``cycle`` layers, the global layer last) stores ``decoder/{group}/local_layers/...``
with two layer axes, the block at axis 1 and the position in the block at axis 2 (MaxText's inner scan stacks at
``param_scan_axis`` = 1, then the outer one at 1 again), ``decoder/{group}/global_layer/...`` with the block at
axis 1, and ``decoder/layers_remainder/local_layers/...`` the last ``L % cycle`` layers (local ones only) on axis 1.
``group`` is ``layers`` (Qwen3-Next) or ``scanned_blocks`` (Gemma 4). ``nested_scan`` gives a ``MaxTextMap``'s
``unscan`` and ``scan`` for one family.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from nnxtron.config.schema import Config
from nnxtron.errors import CheckpointError

AXIS = 1  # MaxText's param_scan_axis: the block axis, and (local layers) the position in the block after it
_REMAINDER = re.compile(r"^decoder/layers_remainder/local_layers/(.*)$")
_LAYER = re.compile(r"^decoder/layers_(\d+)/(.*)$")
Tree = Callable[[dict, Config], dict]


def nested_scan(group: str, cycle_of: Callable[[Config], int]) -> tuple[Tree, Tree]:
    """``(unscan, scan)`` of the nested tree under ``decoder/{group}`` whose blocks hold ``cycle_of(cfg)`` layers."""
    local, glob = re.compile(rf"^decoder/{group}/local_layers/(.*)$"), re.compile(rf"^decoder/{group}/global_layer/(.*)$")

    def layer_axes(key: str, value: np.ndarray, axes: int, cfg: Config) -> None:
        if value.ndim < AXIS + axes:
            raise CheckpointError(
                f"MaxText array '{key}' has shape {list(value.shape)}: a scanned {cfg.decoder_block} layer parameter "
                f"needs {axes} layer axis(es) from axis {AXIS}; the checkpoint does not match the config"
            )

    def unscan(flat: dict, cfg: Config) -> dict:
        """The scanned tree under the unscanned names ``decoder/layers_{i}/...``."""
        cycle = cycle_of(cfg)
        blocks = cfg.base_num_decoder_layers // cycle
        out: dict = {}
        for key, value in flat.items():
            if m := local.match(key):
                layer_axes(key, value, 2, cfg)
                for b in range(value.shape[AXIS]):
                    block = np.take(value, b, axis=AXIS)
                    for j in range(block.shape[AXIS]):
                        out[f"decoder/layers_{b * cycle + j}/{m[1]}"] = np.take(block, j, axis=AXIS)
            elif m := glob.match(key):
                layer_axes(key, value, 1, cfg)
                for b in range(value.shape[AXIS]):
                    out[f"decoder/layers_{b * cycle + cycle - 1}/{m[1]}"] = np.take(value, b, axis=AXIS)
            elif m := _REMAINDER.match(key):
                layer_axes(key, value, 1, cfg)
                for j in range(value.shape[AXIS]):
                    out[f"decoder/layers_{blocks * cycle + j}/{m[1]}"] = np.take(value, j, axis=AXIS)
            else:
                out[key] = value
        return out

    def scan(flat: dict, cfg: Config) -> dict:
        """The inverse of ``unscan``."""
        cycle = cycle_of(cfg)
        blocks = cfg.base_num_decoder_layers // cycle
        nested: dict[str, dict[int, dict[int, np.ndarray]]] = {}
        other: dict[str, dict[int, np.ndarray]] = {}
        out: dict = {}
        for key, value in flat.items():
            m = _LAYER.match(key)
            if not m:
                out[key] = value
                continue
            block, position = divmod(int(m[1]), cycle)
            if block >= blocks:
                other.setdefault(f"decoder/layers_remainder/local_layers/{m[2]}", {})[position] = value
            elif position == cycle - 1:
                other.setdefault(f"decoder/{group}/global_layer/{m[2]}", {})[block] = value
            else:
                nested.setdefault(f"decoder/{group}/local_layers/{m[2]}", {}).setdefault(block, {})[position] = value
        for key, parts in other.items():
            out[key] = np.stack([parts[i] for i in range(len(parts))], axis=AXIS)
        for key, blocks_of in nested.items():
            stacked = [np.stack([blocks_of[b][j] for j in range(len(blocks_of[b]))], axis=AXIS) for b in range(len(blocks_of))]
            out[key] = np.stack(stacked, axis=AXIS)
        return out

    return unscan, scan
