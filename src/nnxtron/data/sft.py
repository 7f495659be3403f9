"""Instruction (SFT) rows: a record's tokens and which of them the loss trains on.

A record (a JSON object or a Parquet row) is one of:

- ``{"messages": [{"role": ..., "content": ...}, ...]}``: a conversation, rendered with the
  model's chat template; the assistant's answers are trained on;
- ``{"prompt": [messages], "completion": [messages]}``: the same, trained on the
  completion's assistant messages only;
- ``{"prompt": "text", "completion": "text"}``: plain text, ``[BOS] prompt completion [EOS]``
  (BOS / EOS as ``add_bos`` / ``add_eos``), trained on the completion and the EOS.

A rendered conversation is tokenized whole, as HF's ``apply_chat_template`` does (the
template writes its own BOS and special tokens), and a token is an assistant token when its
characters overlap an assistant span (``ChatTemplate.assistant_spans``): HF's rule for
``return_assistant_tokens_mask``. With ``completion_only=False`` every token is
trained on. Problems with one record raise :class:`BadRecord` (counted and skipped with
``skip_bad_records``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nnxtron.data.chat_template import ChatTemplate, Span, TemplateTimeout
from nnxtron.data.records import BadRecord
from nnxtron.data.tokenizer import Tokenizer
from nnxtron.errors import DataError, UserError

__all__ = ["SFTFormat", "assistant_token_mask", "format_record"]


@dataclasses.dataclass(frozen=True)
class SFTFormat:
    """How instruction records become tokens: the chat template (None: only plain-text
    prompt/completion records are usable) and whether only the answers are trained on."""

    template: ChatTemplate | None
    completion_only: bool = True


def check_tokenizer(tokenizer: Tokenizer) -> None:
    """SFT needs each token's characters (to find the assistant's tokens in a rendered chat)."""
    if not hasattr(tokenizer, "encode_with_offsets"):
        raise DataError(
            f"use_sft=true needs a tokenizer that reports each token's characters; the {tokenizer.name} tokenizer does "
            "not: use tokenizer_type=hf (the model's tokenizer.json), sentencepiece or byte"
        )


def assistant_token_mask(offsets: np.ndarray, spans: Sequence[Span]) -> np.ndarray:
    """Tokens (given their ``[start, end)`` character offsets) that overlap an assistant span
    (HF's rule for ``return_assistant_tokens_mask``)."""
    mask = np.zeros(len(offsets), dtype=bool)
    for start, end in spans:
        mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return mask


def format_record(record: Mapping[str, Any], tokenizer: Tokenizer, spec: SFTFormat, add_bos: bool, add_eos: bool):
    """``(ids, trainable)`` of one instruction record: int32 ids and a bool per id."""
    if "messages" in record:
        return _conversation(record["messages"], 0, tokenizer, spec)
    if "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return _plain(prompt, completion, tokenizer, spec, add_bos, add_eos)
        if isinstance(prompt, list) and isinstance(completion, list):
            if not completion:
                raise BadRecord("has an empty 'completion': nothing to train on")
            return _conversation(prompt + completion, len(prompt), tokenizer, spec)
        raise BadRecord(
            f"has a 'prompt' ({type(prompt).__name__}) and a 'completion' ({type(completion).__name__}) that are not both "
            "strings or both lists of messages"
        )
    shown = ", ".join(repr(k) for k in list(record)[:8])
    raise BadRecord(f"has neither 'messages' nor 'prompt' and 'completion' (it has {shown})")


def _plain(prompt: str, completion: str, tokenizer: Tokenizer, spec: SFTFormat, add_bos: bool, add_eos: bool):
    if not completion.strip():
        raise BadRecord("has an empty 'completion': nothing to train on")
    head = [tokenizer.bos_id] if add_bos and tokenizer.bos_id >= 0 else []
    tail = [tokenizer.eos_id] if add_eos and tokenizer.eos_id >= 0 else []
    prompt_ids, completion_ids = tokenizer.encode(prompt), tokenizer.encode(completion)
    ids = np.concatenate([head, prompt_ids, completion_ids, tail]).astype(np.int32)
    trainable = np.zeros(ids.size, dtype=bool)
    trainable[len(head) + prompt_ids.size :] = True
    return ids, trainable if spec.completion_only else np.ones(ids.size, dtype=bool)


def _conversation(messages: Any, first_trained: int, tokenizer: Tokenizer, spec: SFTFormat):
    """A rendered conversation; the assistant messages from index ``first_trained`` on are trained on."""
    if spec.template is None:
        raise BadRecord(
            "is a conversation but the tokenizer has no chat template; give one with chat_template_path (a Jinja file)"
        )
    if not isinstance(messages, list):
        raise BadRecord(f"has 'messages' of type {type(messages).__name__}, not a list of {{'role', 'content'}} objects")
    try:
        text, spans = spec.template.assistant_spans(messages)
    except TemplateTimeout:
        raise  # the template's fault, not the record's: every record would wait for it
    except UserError as err:
        raise BadRecord(str(err)) from None
    roles = [m["role"] for m in messages]
    trained = [span for span, i in zip(spans, [i for i, r in enumerate(roles) if r == "assistant"]) if i >= first_trained]
    if spec.completion_only and not trained:
        raise BadRecord("has no assistant message to train on")
    ids, offsets = tokenizer.encode_with_offsets(text)
    if not spec.completion_only:
        return ids, np.ones(ids.size, dtype=bool)
    trainable = assistant_token_mask(offsets, trained)
    if not trainable.any():
        raise BadRecord("has assistant messages whose text is empty: nothing to train on")
    return ids, trainable
