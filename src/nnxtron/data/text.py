"""Finding the files of a dataset: files, directories and globs."""

from __future__ import annotations

import glob
import os
import pathlib
import sysconfig
from collections.abc import Sequence

from nnxtron.errors import DataError

__all__ = ["PYTHON_STDLIB", "expand_pattern", "resolve_paths"]

PYTHON_STDLIB = "{python_stdlib}"
_GLOB_CHARS = ("*", "?", "[")


def expand_pattern(pattern: str | os.PathLike) -> str:
    """``pattern`` with ``{python_stdlib}`` and ``~`` expanded."""
    text = os.fspath(pattern)
    if PYTHON_STDLIB in text:
        text = text.replace(PYTHON_STDLIB, sysconfig.get_paths()["stdlib"])
    return os.path.expanduser(text)


def _files_under(directory: str) -> list[str]:
    """Regular files under ``directory``, recursively; hidden ``.names`` skipped, as glob does."""
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found.extend(os.path.join(root, f) for f in files if not f.startswith("."))
    return [f for f in found if os.path.isfile(f)]


def _match(pattern: str) -> list[str]:
    """Files named by one expanded pattern: a file, a directory or a glob."""
    if any(c in pattern for c in _GLOB_CHARS):
        out: list[str] = []
        for hit in glob.glob(pattern, recursive=True):
            if os.path.isfile(hit):
                out.append(hit)
            elif os.path.isdir(hit):
                out.extend(_files_under(hit))
        if out or not os.path.exists(pattern):
            return out
        # an existing path whose name merely contains glob characters, e.g. "data[1]"
    if os.path.isfile(pattern):
        return [pattern]
    if os.path.isdir(pattern):
        return _files_under(pattern)
    return []


def resolve_paths(patterns: Sequence[str | os.PathLike] | str | os.PathLike) -> list[pathlib.Path]:
    """Sorted, de-duplicated absolute files named by ``patterns`` (files, directories or globs).

    ``**`` globs are recursive and ``{python_stdlib}`` expands to this Python's standard library
    directory. Raises DataError when there are no patterns or one of them matches no file.
    """
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    patterns = list(patterns)
    if not patterns:
        raise DataError("dataset_path is empty; give at least one file, directory or glob")
    seen: set[pathlib.Path] = set()
    for pattern in patterns:
        expanded = expand_pattern(pattern)
        hits = _match(expanded)
        if not hits:
            shown = repr(os.fspath(pattern))
            if expanded != os.fspath(pattern):
                shown += f" (= {expanded!r})"
            raise DataError(f"dataset_path {shown} matched no files; check the path or glob")
        seen.update(pathlib.Path(h).resolve() for h in hits)
    return sorted(seen, key=str)
