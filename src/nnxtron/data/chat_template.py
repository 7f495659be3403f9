"""HuggingFace chat templates (Jinja), rendered as ``transformers``' ``apply_chat_template(..., tokenize=False)`` does.

Where a template comes from (a tokenizer directory, a file) and what it is given (the messages,
checked; the special tokens; the assistant spans SFT trains on). A template is code from a model
directory, so it is rendered in Jinja's sandbox *and* in a child process under time, memory and
output limits (``template_render.py``: ``RenderLimits``); a template that breaks one, or that
recurses too deeply, is a one-line :class:`UserError` naming the limit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nnxtron.data.template_render import (
    DEFAULT_LIMITS,
    MARKING,
    MARKS,
    RenderLimits,
    TemplateTimeout,
    compile_template,
    one_line,
    render,
)
from nnxtron.errors import UserError
from nnxtron.scoped import scoped

__all__ = ["TEMPLATE_FILE", "ChatTemplate", "RenderLimits", "Span", "TemplateTimeout", "find_chat_template", "template_directory"]

TEMPLATE_FILE = "chat_template.jinja"  # next to tokenizer_config.json; HF prefers it to the config's chat_template
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # HF fills the first two from whichever is given
SpecialToken = str | Mapping[str, Any] | None  # as in tokenizer_config.json: a string or an AddedToken dict with "content"
Span = tuple[int, int]  # [start, end) characters of a rendered text
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class ChatTemplate:
    """A chat template and the special tokens it sees (bos_token, eos_token, ... and any other
    ``*_token``), rendered under ``limits``."""

    def __init__(
        self, template: str, special_tokens: Mapping[str, SpecialToken] | None = None, limits: RenderLimits = DEFAULT_LIMITS
    ) -> None:
        self.template = template
        self.special_tokens = {name: _token_text(name, tok) for name, tok in (special_tokens or {}).items() if tok is not None}
        self.limits = limits
        self._compiled = compile_template(template)
        self._timed_out: str | None = None  # the message of an assistant_spans rendering that ran out of time

    @classmethod
    def from_directory(
        cls, path: str | Path, defaults: Mapping[str, SpecialToken] | None = None, limits: RenderLimits = DEFAULT_LIMITS
    ) -> ChatTemplate:
        """The template of a tokenizer directory (``chat_template.jinja``, else tokenizer_config.json's
        ``chat_template``); ``defaults``: special tokens the config does not name (the tokenizer's own
        BOS / EOS, as HF's Llama tokenizer has ``<s>`` / ``</s>`` without a tokenizer_config.json)."""
        directory = Path(path)
        if not directory.is_dir():
            raise UserError(f"tokenizer directory {directory} does not exist: pass a directory holding tokenizer_config.json")
        config = _read_json(directory / "tokenizer_config.json")
        if "added_tokens_decoder" not in config:  # as HF's legacy path: special_tokens_map.json overrides the config's tokens
            config.update(_read_json(directory / "special_tokens_map.json"))
        file = directory / TEMPLATE_FILE
        text = file.read_text(encoding="utf-8") if file.is_file() else _config_template(config.get("chat_template"), directory)
        # HF passes every named special token: the standard ones and any other string (or AddedToken) under a "*_token" key
        tokens = dict(defaults or {})
        tokens.update({k: v for k, v in config.items() if k.endswith("_token") and (isinstance(v, str) or _is_added_token(v))})
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        if isinstance(extra, Mapping):  # a dict of named model-specific tokens (a list names none)
            tokens.update(extra)
        return cls(text, tokens, limits)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text of ``messages``; ``extra`` (tools, documents, enable_thinking, ...) reaches the template."""
        context = {**self.special_tokens, "tools": None, "documents": None, **extra}  # extra overrides special tokens, as in HF
        context.update(messages=_checked_messages(messages), add_generation_prompt=add_generation_prompt)
        return render(self.template, context, MARKING.get(), self.limits)

    @property
    def marks_generation(self) -> bool:
        """The template marks assistant text with ``{% generation %}`` (what HF's assistant-token mask reads)."""
        return bool(_GENERATION_TAG.search(self.template))

    def assistant_spans(self, messages: Sequence[Mapping[str, Any]], **extra: Any) -> tuple[str, list[Span]]:
        """The text of the whole conversation (no generation prompt) and the character spans of
        the assistant's answers, one per assistant message, in order.

        A template with ``{% generation %}`` blocks gives their bodies, exactly the characters
        HF's ``return_assistant_tokens_mask`` marks. Without them, assistant message ``i`` is
        the text that rendering the first ``i + 1`` messages adds to the first ``i`` rendered
        with the generation prompt (its answer and the template's end of turn); that needs a
        template whose shorter conversations render to prefixes of longer ones.

        Training renders every record with this: once a rendering has run out of time, later
        calls raise the same :class:`TemplateTimeout` at once instead of waiting again."""
        if self._timed_out is not None:
            raise TemplateTimeout(self._timed_out)
        try:
            return self._assistant_spans(messages, **extra)
        except TemplateTimeout as err:
            self._timed_out = str(err)
            raise

    def _assistant_spans(self, messages: Sequence[Mapping[str, Any]], **extra: Any) -> tuple[str, list[Span]]:
        chat = _checked_messages(messages)
        assistants = [i for i, m in enumerate(chat) if m["role"] == "assistant"]
        if any(mark in json.dumps(chat, ensure_ascii=False) for mark in MARKS):
            raise UserError("chat messages hold the private-use characters U+F0000/U+F0001; remove them")
        if self.marks_generation:
            with scoped(MARKING, True):
                marked = self.render(chat, add_generation_prompt=False, **extra)
            text, spans = _unmark(marked)
            if len(spans) != len(assistants):
                raise UserError(
                    f"the chat template marks {len(spans)} {{% generation %}} blocks for {len(assistants)} assistant messages; "
                    "each assistant message needs exactly one"
                )
            return text, spans
        text = self.render(chat, add_generation_prompt=False, **extra)
        spans = []
        for i in assistants:
            if i == 0:
                raise UserError("the conversation starts with an assistant message; put a user (or system) message first")
            before = self.render(chat[:i], add_generation_prompt=True, **extra)
            through = self.render(chat[: i + 1], add_generation_prompt=False, **extra)
            if not (through.startswith(before) and text.startswith(through)):
                raise UserError(
                    f"the chat template renders the first {i} messages (with the generation prompt) to text that does not "
                    f"begin the rendering of the first {i + 1} and of the whole conversation, so assistant message {i}'s "
                    "tokens cannot be found; add {% generation %}...{% endgeneration %} around the assistant's text "
                    "(as HF's assistant-token mask needs) or pass a template with chat_template_path"
                )
            spans.append((len(before), len(through)))
        return text, spans


def _unmark(marked: str) -> tuple[str, list[Span]]:
    """The text without the generation marks, and the spans they enclosed."""
    start_mark, end_mark = MARKS
    pieces, spans, length, start = [], [], 0, None
    for piece in re.split(f"({start_mark}|{end_mark})", marked):
        if piece == start_mark:
            if start is not None:
                raise UserError("the chat template nests {% generation %} blocks; mark each assistant answer once")
            start = length
        elif piece == end_mark:
            spans.append((start, length))
            start = None
        else:
            pieces.append(piece)
            length += len(piece)
    return "".join(pieces), spans


def _checked_messages(messages: Any) -> list[dict[str, Any]]:
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence) or not messages:
        raise UserError(f"chat messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got {messages!r:.80}")
    chat = []
    for index, message in enumerate(messages):
        if (problem := _message_problem(message)) is not None:
            raise UserError(f"chat message {index} {problem}")
        message = {key: value for key, value in message.items() if value is not None}  # as HF: a None field is left out
        if (reasoning := next((message[key] for key in REASONING_FIELDS if key in message), None)) is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def _message_problem(message: Any) -> str | None:
    if not isinstance(message, Mapping):
        return f"is a {type(message).__name__}, not a dict with 'role' and 'content'"
    if not isinstance(message.get("role"), str):
        return f"has no 'role' string (got {message.get('role')!r:.40})"
    content = message.get("content")
    if content is None:
        return None if message.get("tool_calls") else "has no 'content' (a string or a list of text parts)"
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return f"has 'content' of type {type(content).__name__}: give a string or a list of {{'type': 'text', 'text': ...}} parts"
    for part_index, part in enumerate(content):
        if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            return f"content part {part_index} is not a {{'type': 'text', 'text': str}} dict (got {part!r:.60})"
    return None


def _token_text(name: str, token: SpecialToken) -> str:
    if isinstance(token, str) or _is_added_token(token):
        return token if isinstance(token, str) else token["content"]
    raise UserError(f"special token {name} must be a string or a {{'content': str}} dict, got {token!r:.60}")


def _is_added_token(value: Any) -> bool:
    return isinstance(value, Mapping) and isinstance(value.get("content"), str)


def _config_template(value: Any, directory: Path) -> str:
    if isinstance(value, list | Mapping):  # named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = (
            value if isinstance(value, Mapping) else {e.get("name"): e.get("template") for e in value if isinstance(e, Mapping)}
        )
        value = named.get("default")
        where = f"chat templates {sorted(map(str, named))} but no 'default'"
    else:
        where = f"neither {TEMPLATE_FILE} nor a chat_template in tokenizer_config.json"
    if not isinstance(value, str):
        raise UserError(f"no chat template in {directory} ({where}): pass one with chat_template=...")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {one_line(str(exc))}") from exc
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _has_template(directory: Path) -> bool:
    if (directory / TEMPLATE_FILE).is_file():
        return True
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return False
    try:
        return "chat_template" in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return True  # unreadable: ChatTemplate.from_directory reports it


def template_directory(directories: Sequence[Path]) -> Path | None:
    """The first of ``directories`` that holds a chat template (None: none does)."""
    return next((directory for directory in directories if _has_template(directory)), None)


def find_chat_template(
    directories: Sequence[Path], tokenizer: Any, file: str | None = None, limits: RenderLimits = DEFAULT_LIMITS
) -> tuple[ChatTemplate | None, str]:
    """The chat template of the first of ``directories`` that has one (``file``: a Jinja file
    that replaces it, seeing the directories' special tokens), rendered under ``limits``:
    (template, "") or (None, why there is none). A template that is there but broken is an error."""
    if file is not None:
        special = _special_tokens(directories, tokenizer)
        return ChatTemplate(Path(file).read_text(encoding="utf-8"), special, limits), ""
    directory = template_directory(directories)
    if directory is not None:
        return ChatTemplate.from_directory(directory, _special_tokens([], tokenizer), limits), ""
    where = " or ".join(str(d) for d in directories)
    return None, f"no {TEMPLATE_FILE} and no chat_template in tokenizer_config.json in {where}"


def _special_tokens(directories: Sequence[Path], tokenizer: Any) -> dict[str, Any]:
    """The special tokens a template file sees: tokenizer_config.json's ``*_token`` entries, else the tokenizer's BOS / EOS."""
    tokens: dict[str, Any] = {}
    for kind, token_id in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id)):
        if token_id >= 0:
            tokens[f"{kind}_token"] = tokenizer.token_text(token_id)
    for directory in directories:
        config = directory / "tokenizer_config.json"
        try:
            data = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            for key, value in data.items():
                if key.endswith("_token") and (isinstance(value, str) or isinstance(value, dict) and "content" in value):
                    tokens[key] = value
            break
    return tokens
