"""HuggingFace chat templates (Jinja), rendered as ``transformers``' ``apply_chat_template(..., tokenize=False)`` does."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nnxtron.errors import UserError

__all__ = ["TEMPLATE_FILE", "ChatTemplate"]

TEMPLATE_FILE = "chat_template.jinja"  # next to tokenizer_config.json; HF prefers it to the config's chat_template
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # HF fills the first two from whichever is given
SpecialToken = str | Mapping[str, Any] | None  # as in tokenizer_config.json: a string or an AddedToken dict with "content"


class ChatTemplate:
    """A chat template and the special tokens it sees (bos_token, eos_token, ... and any other ``*_token``)."""

    def __init__(self, template: str, special_tokens: Mapping[str, SpecialToken] | None = None) -> None:
        self.template = template
        self.special_tokens = {name: _token_text(name, tok) for name, tok in (special_tokens or {}).items() if tok is not None}
        try:
            self._compiled = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as exc:
            raise UserError(f"chat template does not parse: {_one_line(exc.message or '')} (template line {exc.lineno})") from exc

    @classmethod
    def from_directory(cls, path: str | Path) -> ChatTemplate:
        """The template of a tokenizer directory (``chat_template.jinja``, else tokenizer_config.json's ``chat_template``)."""
        directory = Path(path)
        if not directory.is_dir():
            raise UserError(f"tokenizer directory {directory} does not exist: pass a directory holding tokenizer_config.json")
        config = _read_json(directory / "tokenizer_config.json")
        if "added_tokens_decoder" not in config:  # as HF's legacy path: special_tokens_map.json overrides the config's tokens
            config.update(_read_json(directory / "special_tokens_map.json"))
        file = directory / TEMPLATE_FILE
        text = file.read_text(encoding="utf-8") if file.is_file() else _config_template(config.get("chat_template"), directory)
        # HF passes every named special token: the standard ones and any other string (or AddedToken) under a "*_token" key
        tokens = {k: v for k, v in config.items() if k.endswith("_token") and (isinstance(v, str) or _is_added_token(v))}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        if isinstance(extra, Mapping):  # a dict of named model-specific tokens (a list names none)
            tokens.update(extra)
        return cls(text, tokens)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text of ``messages``; ``extra`` (tools, documents, enable_thinking, ...) reaches the template."""
        context = {**self.special_tokens, "tools": None, "documents": None, **extra}  # extra overrides special tokens, as in HF
        context.update(messages=_checked_messages(messages), add_generation_prompt=add_generation_prompt)
        try:
            return self._compiled.render(context)
        except jinja2.TemplateError as exc:
            raise UserError(f"chat template failed to render: {_one_line(str(exc))}") from exc
        except (TypeError, ValueError, ArithmeticError, LookupError) as exc:  # a template's own bad operation, e.g. "a" + 1
            raise UserError(f"chat template failed to render: {type(exc).__name__}: {_one_line(str(exc))}") from exc


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for HF's assistant-token mask; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """HF's ``namespace``: attributes starting with "_" are refused (they could reach Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        attrs = dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(args[0], attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold underscore-prefixed attributes: {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)  # no HTML escapes


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace)
    return env


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
        raise UserError(f"cannot read {path}: {_one_line(str(exc))}") from exc
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _one_line(text: str) -> str:
    return " ".join(text.split())
