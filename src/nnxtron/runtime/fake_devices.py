"""Child processes on N fake CPU devices (``nnxtron plan devices=N`` and ``plan --search``).

XLA reads ``--xla_force_host_platform_device_count`` once, when jax starts its backends, so
planning over another device count than the calling process has means a new process.
"""

from __future__ import annotations

import os
from pathlib import Path

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
SRC = Path(__file__).resolve().parents[2]  # the directory that holds the nnxtron package


def fake_device_env(devices: int) -> dict[str, str]:
    """XLA_FLAGS / JAX_PLATFORMS for ``devices`` fake CPU devices (other XLA flags kept)."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    return {"XLA_FLAGS": " ".join([*kept, f"{DEVICE_COUNT_FLAG}={devices}"]), "JAX_PLATFORMS": "cpu"}


def child_env(devices: int) -> dict[str, str]:
    """This process's environment for a child on ``devices`` fake CPU devices that imports
    this same nnxtron (its source directory first on PYTHONPATH)."""
    env = {**os.environ, **fake_device_env(devices)}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env
