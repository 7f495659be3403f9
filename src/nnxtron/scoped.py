"""A context variable set for the length of a ``with`` block (the trace-time switches of the
layers, the sharding context, the per-layer dropout keys...)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def scoped(variable: contextvars.ContextVar[T], value: T) -> Iterator[None]:
    """``variable`` holds ``value`` inside the block and its previous value after it."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)
