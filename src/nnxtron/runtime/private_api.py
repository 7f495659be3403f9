"""The private JAX and qwix symbols nnxtron uses, in one place, each with why no public API serves.

Checked against the versions in ``CHECKED_VERSIONS``. ``tests/unit/test_private_api.py``
asserts that those are the installed versions and that every symbol here still exists and
behaves as used, so an upgrade turns that test red instead of breaking a run: after an
upgrade, check each function against the new sources and update ``CHECKED_VERSIONS``.

The imports are inside the functions: the CLI imports ``runtime.distributed`` (and so this
module) before it loads JAX, to answer ``nnxtron --help`` and a bad key fast.

Other private uses, reached through public objects, that the same test pins:
``qwix.QtProvider._get_current_rule_and_op_id`` (``models/quant.py`` asks whether the
current op has a weight qtype).
"""

from __future__ import annotations

from typing import Any

CHECKED_VERSIONS = {"jax": "0.10.2", "qwix": "0.1.8"}


def backends_are_initialized() -> bool:
    """Whether JAX has started its backends in this process (``jax._src.xla_bridge``).

    Public ``jax.devices()`` / ``jax.extend.backend.backends()`` answer by starting them,
    after which the platform and device-count flags can no longer change; ``nnxtron plan``
    must know whether they still can (``cli._jax_has_cpu_devices``)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def compilation_cache_dir() -> str | None:
    """The directory of the persistent compilation cache JAX has built in this process (None:
    not built yet), from ``jax._src.compilation_cache._cache``.

    The public ``jax.experimental.compilation_cache`` sets the directory and resets the cache,
    but does not say which directory a built cache reads: ``runtime/compile_cache.py`` resets
    it only when that differs from the configured one."""
    from jax._src import compilation_cache

    cache = compilation_cache._cache
    return None if cache is None else str(cache._path)


def coordination_client() -> Any:
    """The ``jax.distributed`` coordination-service client (``jax._src.distributed.global_state``),
    None before ``jax.distributed.initialize``.

    Public ``jax.distributed`` exposes initialize / shutdown only; the peer watch of
    ``runtime/distributed.py`` needs the client's key-value store (``key_value_set``,
    ``key_value_try_get``) for its heartbeats."""
    from jax._src import distributed

    return distributed.global_state.client


def qwix_module_path() -> tuple[str, ...]:
    """The path of the module qwix is intercepting now (``qwix._src.utils.flax_util``); the
    quantization pass records which ops it quantized per module path (``models/quant.py``).
    qwix exports no public equivalent."""
    from qwix._src.utils import flax_util

    return flax_util.get_current_module_path()


def qwix_find_param(x: Any) -> str | None:
    """The name of the current module's parameter that is the array ``x``, or None
    (``qwix._src.utils.flax_util.find_param``): ``models/quant.py`` quantizes a matmul only
    when exactly one operand is a weight. qwix exports no public equivalent."""
    from qwix._src.utils import flax_util

    return flax_util.find_param(x)
