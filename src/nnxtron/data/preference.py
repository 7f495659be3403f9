"""Preference (DPO) records: a prompt and two answers, the preferred ``chosen`` and the
``rejected`` one, each rendered into tokens with a mask of the answer's tokens.

A record (a JSON object or a Parquet row) is one of:

- ``{"prompt": "text", "chosen": "text", "rejected": "text"}``: plain text, each side
  ``[BOS] prompt answer [EOS]`` (as ``add_bos`` / ``add_eos``), the answer and EOS scored;
- ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``: conversations,
  each side ``prompt + answer`` rendered with the chat template (as ``data.sft`` renders
  them), the answer's assistant tokens scored;
- ``{"chosen": ..., "rejected": ...}`` without a prompt: whole texts or conversations that
  share their prompt. For conversations the prompt is the messages both begin with; for
  text it is the characters both begin with, cut back to the last whitespace (so that no
  word is split between prompt and answer).

A record whose two sides give the same tokens, or whose answer is missing or empty, is a
:class:`BadRecord` (counted and skipped with ``skip_bad_records``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from nnxtron.data.records import BadRecord
from nnxtron.data.sft import SFTFormat, format_record
from nnxtron.data.tokenizer import Tokenizer

__all__ = ["PreferencePair", "format_pair"]

SIDES = ("chosen", "rejected")


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """Tokens (int32) and scored-token masks (bool) of the chosen and the rejected side."""

    chosen: np.ndarray
    chosen_scored: np.ndarray
    rejected: np.ndarray
    rejected_scored: np.ndarray


def format_pair(record: Mapping[str, Any], tokenizer: Tokenizer, template_format: SFTFormat, add_bos: bool, add_eos: bool):
    """The :class:`PreferencePair` of one preference record (see the module docstring)."""
    missing = [side for side in SIDES if side not in record]
    if missing:
        shown = ", ".join(repr(k) for k in list(record)[:8])
        raise BadRecord(f"has no {' and no '.join(repr(m) for m in missing)} answer (it has {shown})")
    chosen, rejected = record["chosen"], record["rejected"]
    if chosen == rejected:
        raise BadRecord("has identical 'chosen' and 'rejected' answers: there is no preference to learn")
    if "prompt" in record:
        prompt = record["prompt"]
    else:
        prompt, chosen, rejected = _split_shared_prompt(chosen, rejected)
    format_ = dataclasses.replace(template_format, completion_only=True)  # DPO scores the answers only
    sides = []
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if not isinstance(answer, type(prompt)) or not isinstance(answer, (str, list)):
            raise BadRecord(
                f"has a 'prompt' ({type(prompt).__name__}) and a {name!r} answer ({type(answer).__name__}) that are not "
                "both strings or both lists of messages"
            )
        try:
            sides.append(format_record({"prompt": prompt, "completion": answer}, tokenizer, format_, add_bos, add_eos))
        except BadRecord as err:
            raise BadRecord(f"{name!r} side: {str(err).replace(repr('completion'), 'answer')}") from None
    (chosen_ids, chosen_scored), (rejected_ids, rejected_scored) = sides
    if np.array_equal(chosen_ids, rejected_ids):
        raise BadRecord("has identical 'chosen' and 'rejected' answers: there is no preference to learn")
    return PreferencePair(chosen_ids, chosen_scored, rejected_ids, rejected_scored)


def _split_shared_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen answer, rejected answer) of two whole texts or conversations."""
    if type(chosen) is not type(rejected) or not isinstance(chosen, (str, list)):
        raise BadRecord(
            f"has a 'chosen' ({type(chosen).__name__}) and a 'rejected' ({type(rejected).__name__}) answer that are not "
            "both strings or both lists of messages"
        )
    shorter = min(len(chosen), len(rejected))
    shared = 0
    while shared < shorter and chosen[shared] == rejected[shared]:
        shared += 1
    if isinstance(chosen, str) and shared < shorter:  # texts that differ: cut back to a word boundary
        while shared and not chosen[shared - 1].isspace():
            shared -= 1
    return chosen[:shared], chosen[shared:], rejected[shared:]
