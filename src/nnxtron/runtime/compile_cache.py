"""The persistent compilation cache: compiled executables are stored on disk, keyed by JAX
on the program, devices, compile options and versions, so a restarted run (or a second
``bench``) loads its train step instead of compiling it again.

``enable_compilation_cache(cfg)`` points this process's JAX at ``compilation_cache_dir``
(``""`` = off) before anything compiles; the CLI's ``train``, ``bench`` and ``generate``
call it, and so does every ``Trainer``. JAX builds its cache once per process, at the
first compile after a directory is set; a later config with another directory resets it
(``compilation_cache.reset_cache``), so the configured directory is always the one used.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError
from nnxtron.runtime.private_api import compilation_cache_dir


def resolve_cache_dir(cfg: Config) -> str | None:
    """The cache directory of ``cfg``: absolute with ``~`` expanded, a URL (``gs://...``)
    verbatim, or None when the cache is off."""
    value = cfg.compilation_cache_dir
    if not value:
        return None
    return value if "://" in value else str(Path(value).expanduser().absolute())


def _check_writable(directory: str, cfg: Config) -> None:
    """Create ``directory`` and write a probe file in it, or raise one ConfigError line.
    A URL is left to JAX (it needs ``etils[epath]``, checked here)."""
    if "://" in directory:
        if not _epath_installed():
            raise ConfigError(
                f"compilation_cache_dir={directory!r} is a URL, which JAX reads through etils[epath]; "
                "install it (pip install 'etils[epath]') or set a local directory"
            )
        return
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".nnxtron-probe-"):
            pass
    except OSError as err:
        raise ConfigError(
            f"compilation_cache_dir={cfg.compilation_cache_dir!r}: cannot write to '{directory}' "
            f"({err.strerror or err}); set compilation_cache_dir to a writable directory, or to '' to turn the cache off"
        ) from None


def enable_compilation_cache(cfg: Config) -> str | None:
    """Apply ``compilation_cache_dir`` and ``compilation_cache_min_compile_seconds`` to JAX.

    Returns the directory in use (None: off). Idempotent; call it before the first compile
    that should be stored. Raises ConfigError when the directory cannot be created or
    written, or when JAX's ``jax_enable_compilation_cache`` has been turned off."""
    directory = resolve_cache_dir(cfg)
    if directory is None:
        _point_jax_at(None)
        return None
    if not jax.config.jax_enable_compilation_cache:
        raise ConfigError(
            f"compilation_cache_dir={cfg.compilation_cache_dir!r} asks for the compilation cache but JAX's "
            "jax_enable_compilation_cache is false (JAX_ENABLE_COMPILATION_CACHE); set compilation_cache_dir='' "
            "to run without it, or re-enable it"
        )
    _check_writable(directory, cfg)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", cfg.compilation_cache_min_compile_seconds)
    _point_jax_at(directory)
    return directory


def _point_jax_at(path: str | None) -> None:
    """Set JAX's cache directory; a cache JAX already built for another directory is dropped
    (the next compile builds it again for ``path``)."""
    if jax.config.jax_compilation_cache_dir == path and compilation_cache_dir() in (None, path):
        return
    jax.config.update("jax_compilation_cache_dir", path)
    compilation_cache.reset_cache()


def _epath_installed() -> bool:
    """Whether ``etils.epath``, through which JAX reads a cache directory that is a URL, imports
    (JAX makes the same test when it loads)."""
    try:
        from etils import epath  # noqa: F401
    except ImportError:
        return False
    return True


# JAX's monitoring events (jax/_src/compiler.py, compilation_cache.py) -> our names
CACHE_EVENTS = {
    "/jax/compilation_cache/compile_requests_use_cache": "requests",  # compiles that looked in the cache
    "/jax/compilation_cache/cache_hits": "hits",  # ... and loaded an executable from it
    "/jax/compilation_cache/cache_misses": "writes",  # compiled and stored (JAX records this on a write)
}


@contextmanager
def count_cache_events() -> Iterator[dict[str, int]]:
    """Count persistent-cache requests, hits and writes of the compiles inside the block."""
    counts = dict.fromkeys(CACHE_EVENTS.values(), 0)

    def listen(event: str, **_: str | int) -> None:
        if event in CACHE_EVENTS:
            counts[CACHE_EVENTS[event]] += 1

    jax.monitoring.register_event_listener(listen)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_listener(listen)
