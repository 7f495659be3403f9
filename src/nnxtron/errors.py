"""User-facing errors: the CLI prints them as one line and exits with status 2."""

from __future__ import annotations

import re


class UserError(Exception):
    """A problem with the user's input (config, data, checkpoint, command line).

    The message must name the problem and the fix in one line.
    """


class ConfigError(UserError):
    """Invalid configuration (unknown key, wrong type, inconsistent combination)."""


class DataError(UserError):
    """Unusable data (missing path, empty or undecodable file)."""


class CheckpointError(UserError):
    """Unreadable, corrupted or foreign checkpoint directory."""


class TrainingError(UserError):
    """Training cannot go on (a non-finite loss or gradient); the message says what to change."""


MAX_REASON = 500  # characters of a reason quoted in an error line
# what TensorStore appends to its messages: its JSON spec and C++ source locations, not the reason
_TENSORSTORE_DETAIL = re.compile(r"\s*\[(?:tensorstore_spec|source locations)=.*$")


def reason(err: BaseException) -> str:
    """Why ``err`` happened, as one whole line for an error message: ``Type: first line`` of the
    innermost exception it was raised from (a wrapper such as orbax's says where, its cause says
    why), without TensorStore's spec dumps; a line over ``MAX_REASON`` characters ends at a word, with "…"."""
    for _ in range(20):  # a cause chain is short; never loop on a cycle
        if err.__cause__ is None:
            break
        err = err.__cause__
    lines = str(err).strip().splitlines()
    text = _TENSORSTORE_DETAIL.sub("", lines[0]) if lines else ""
    if len(text) > MAX_REASON:
        text = text[:MAX_REASON].rsplit(" ", 1)[0] + " …"
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
