"""How the values of an HF ``config.json`` reach the families' mappers (``Family.config_from_hf``).

A mapper reads a size or a count as ``int(hf["num_attention_heads"])`` and a float as
``float(...)``. Python would truncate ``4.5`` to 4, read ``true`` as 1 and parse the string
``"4"`` as 4, where transformers (whose configs are typed: ``num_attention_heads: int``)
refuses all three. So before the mapper sees them, ``marked`` wraps every such value of the
file in a type that behaves as the value wherever it is read as what it is, and raises a
``ValueError`` naming the field where it would be read as a number it is not:

- ``_Fractional``: a number with a fractional part; ``int()`` of it raises (``float()`` reads it);
- ``_Flag``: true / false; ``int()`` and ``float()`` of it raise (truth tests read it);
- ``_Quoted``: a string; ``int()`` and ``float()`` of it raise, and so does its truth value or
  a repetition (``4 * "64"``) when it reads as a number or true / false (``"4"``, ``"false"``:
  the JSON value was quoted by mistake), so ``x or default`` cannot pass it on either.

``unmarked`` turns them back into plain values (what the config holds). ``convert/hf.py``
reports the ``ValueError`` as one line naming ``config.json``.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["marked", "unmarked"]


class _Fractional(float):
    """A ``config.json`` number with a fractional part: a float wherever a float is read, but
    ``int()`` of it (a size or a count: ``num_attention_heads: 4.5``) raises rather than truncating."""

    key: str

    def __new__(cls, value: float, key: str) -> _Fractional:
        number = super().__new__(cls, value)
        number.key = key
        return number

    def __int__(self) -> int:
        raise ValueError(f"{self.key}={float(self)!r} where a whole number (a size or a count) belongs")


class _Flag(int):
    """A ``config.json`` true/false: a truth value wherever one is read, but ``int()`` or
    ``float()`` of it (``num_attention_heads: true``) raises rather than giving 1."""

    key: str

    def __new__(cls, value: bool, key: str) -> _Flag:
        flag = super().__new__(cls, int(value))
        flag.key = key
        return flag

    def __int__(self) -> int:
        raise ValueError(f"{self.key}={'true' if self else 'false'} where a number belongs")

    __float__ = __int__  # type: ignore[assignment]


class _Quoted(str):
    """A ``config.json`` string: a string wherever one is read (a name, a type), but never a
    number: ``int()`` / ``float()`` of it (``num_attention_heads: "4"``) raise rather than parsing
    it; one that reads as a number or true / false also raises when tested for truth or repeated."""

    key: str
    looks_like_value: bool  # "4", "1e-5", "true": a JSON number or literal written in quotes

    def __new__(cls, value: str, key: str) -> _Quoted:
        text = super().__new__(cls, value)
        text.key = key
        try:
            text.looks_like_value = not isinstance(json.loads(value.strip().lower()), str)
        except ValueError:
            text.looks_like_value = False
        return text

    def _refuse(self, *_: Any) -> Any:
        shown = json.dumps(str.__str__(self))
        fix = f"write it without quotes: {self.strip()}" if self.looks_like_value else "write the number (or true/false) it means"
        raise ValueError(f"{self.key}={shown} is a string where a number or true/false belongs; {fix}")

    __int__ = __float__ = __mul__ = __rmul__ = _refuse  # type: ignore[assignment]

    def __bool__(self) -> bool:
        if self.looks_like_value:
            self._refuse()
        return bool(len(self))


def marked(value: Any, key: str = "") -> Any:
    """``value`` with every true/false a ``_Flag``, every number with a fractional part a
    ``_Fractional`` and every string a ``_Quoted`` (in nested dicts and lists)."""
    if isinstance(value, dict):
        return {k: marked(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [marked(v, key) for v in value]
    if isinstance(value, bool):
        return _Flag(value, key)
    if isinstance(value, float) and math.isfinite(value) and not value.is_integer():
        return _Fractional(value, key)
    if isinstance(value, str):
        return _Quoted(value, key)
    return value


def unmarked(value: Any) -> Any:
    """``value`` with every marked value plain again (what the config holds)."""
    if isinstance(value, dict):
        return {k: unmarked(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(unmarked(v) for v in value)
    if isinstance(value, _Flag):
        return bool(value)
    if isinstance(value, _Quoted):
        return str.__str__(value)
    return float(value) if isinstance(value, _Fractional) else value
