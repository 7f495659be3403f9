"""Streaming text of a growing token sequence, as the tokenizer's ``decode`` would write it.

Decoding token by token and joining the pieces is wrong for most tokenizers: SentencePiece
drops the leading-space marker of a sequence's first piece (``▁is`` alone decodes to
``is``), byte-level BPE splits characters over tokens, and HF's clean-up rewrites spaces
before punctuation. ``TextStream`` decodes the whole sequence (prompt included) each time
and emits only the new suffix, holding back a trailing partial character (U+FFFD) and
trailing whitespace until a later token settles them. So the chunks it emits, joined, are
exactly ``decode(prompt + completion)``: the text HF's ``decode`` gives for the sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from nnxtron.data.tokenizer import Tokenizer

PARTIAL = "\ufffd"  # what an incomplete UTF-8 character decodes to


class TextStream:
    """The text of ``prompt_ids`` and the tokens pushed after them, emitted in pieces."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids = [int(i) for i in prompt_ids]
        self.prompt_text = tokenizer.decode(self.ids)
        self.emitted = ""

    def push(self, token_ids: Iterable[int] = ()) -> str:
        """Add tokens; the text that is now settled and was not emitted before ("" if none)."""
        self.ids.extend(int(i) for i in token_ids)
        text = self.tokenizer.decode(self.ids)
        settled = text.rstrip()
        while settled.endswith(PARTIAL):  # a character whose remaining bytes have not come yet
            settled = settled[:-1].rstrip()
        if not settled.startswith(self.emitted) or len(settled) <= len(self.emitted):
            return ""
        new, self.emitted = settled[len(self.emitted) :], settled
        return new

    def finish(self) -> str:
        """The rest of the text (held-back whitespace, a final partial character)."""
        text = self.tokenizer.decode(self.ids)
        new, self.emitted = text_after(text, self.emitted), text
        return new

    def text(self) -> str:
        """The whole text: ``decode(prompt + completion)``."""
        return self.tokenizer.decode(self.ids)

    def completion(self) -> str:
        """The text after the prompt's, as ``decode`` joins them."""
        return text_after(self.text(), self.prompt_text)


def text_after(text: str, prefix: str) -> str:
    """``text`` past ``prefix`` (past their common part, where ``prefix`` is not one)."""
    n = 0
    for x, y in zip(text, prefix):
        if x != y:
            break
        n += 1
    return text[n:]
