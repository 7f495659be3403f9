"""The device mesh built from ici_*_parallelism."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from nnxtron.config.derived import MESH_AXES, mesh_shape
from nnxtron.config.schema import Config


def make_mesh(cfg: Config, devices: list | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axis types (GSPMD propagation)."""
    devices = list(jax.devices()) if devices is None else list(devices)
    shape = mesh_shape(cfg, len(devices))
    sizes = tuple(shape[axis] for axis in MESH_AXES)
    if len(devices) == len(jax.devices()):
        return jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
