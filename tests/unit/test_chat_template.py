"""Chat templates render exactly as transformers' apply_chat_template (tokenizer directories made here, nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from nnxtron.data.chat_template import ChatTemplate, RenderLimits
from nnxtron.errors import UserError
from tests import tokenizer_files

# Multi-line and indented without "-": trim_blocks and lstrip_blocks decide the whitespace.
CHATML = """{% if messages[0]['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message['content'] is string %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
    {% else %}
<|im_start|>{{ message['role'] }}
{% for part in message['content'] %}{{ part['text'] }}{% endfor %}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

GEMMA = """{{ bos_token }}
{%- set ns = namespace(prefix="", turns=0) -%}
{%- if messages[0]['role'] == 'system' -%}
    {%- set ns.prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {%- set ns.turns = ns.turns + 1 -%}
    {{ '<start_of_turn>' + role + '\\n' + (ns.prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {%- for item in message['content'] -%}
            {{ item['text'] | trim }}
        {%- endfor -%}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# Qwen 3 style: tools as JSON, tool calls, reasoning, enable_thinking and {% break %} (loopcontrols).
TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n" }}
    {{- tools[0] | tojson(indent=2, sort_keys=true) + "\\n" + tools | tojson(separators=(',', ':')) }}<|im_end|>
{% elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=0) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.reasoning_content is defined and loop.index0 > ns.last_user %}
        {{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}
    {%- endif %}
    {%- if message.content is defined %}{{- message.content }}{% endif %}
    {%- for tool_call in message.tool_calls | default([]) %}
        {%- if loop.index0 == 1 %}{% break %}{% endif %}
        {{- '<tool_call>\\n{"name": "' + tool_call.function.name + '", "arguments": ' + tool_call.function.arguments | tojson + '}\\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{% endif %}
{%- endif %}"""

# SmolLM 3 style: {% generation %} marks the assistant's text (HF's assistant mask); rendering keeps it.
GENERATION = """{% for message in messages %}
{{ '<|im_start|>' + message['role'] + '\\n' }}
{% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}
{% else %}
{{ message['content'] + '<|im_end|>' }}
{% endif %}

{% endfor %}
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""

TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "llama2": LLAMA2, "gemma": GEMMA, "tools": TOOLS, "generation": GENERATION}

SYSTEM = {"role": "system", "content": "You are terse.  "}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello there!"}],
    "system_user": [SYSTEM, {"role": "user", "content": " What is 2+2? "}],
    "multi_turn": [
        SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke <with> & \"quotes\" — ünïcödé."},
    ],
    "ends_with_assistant": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
    "text_parts": [{"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]}],
}  # fmt: skip
NO_PARTS = {"llama3", "llama2", "tools", "generation"}  # templates that concatenate content as a string
CASES = [(t, c) for t in TEMPLATES for c in CONVERSATIONS if not (c == "text_parts" and t in NO_PARTS)]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Température <en °C> & vent",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_CHAT = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant", "content": None, "reasoning": "Call the tool.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bern"}}},
        ],
    },
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "assistant", "content": "21 °C.", "thinking": "Report it."},
]  # fmt: skip


def make_directory(directory: Path, **config: object) -> Path:
    """A byte-level BPE directory whose tokenizer_config.json also holds ``config``."""
    tokenizer_files.write_bpe(directory, ["Hello there, a tiny corpus for a tiny tokenizer."] * 4, vocab_size=270)
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return directory


@pytest.fixture(scope="module")
def directories(tmp_path_factory) -> dict[str, Path]:
    return {name: make_directory(tmp_path_factory.mktemp(name), chat_template=t) for name, t in TEMPLATES.items()}


@pytest.fixture(scope="module")
def hf_tokenizers(directories):
    return {name: AutoTokenizer.from_pretrained(str(directory)) for name, directory in directories.items()}


def hf_render(tokenizer, messages, add_generation_prompt: bool, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize(("name", "conversation"), CASES)
def test_renders_as_transformers(name, conversation, add_generation_prompt, directories, hf_tokenizers):
    messages = CONVERSATIONS[conversation]
    text = ChatTemplate.from_directory(directories[name]).render(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf_render(hf_tokenizers[name], messages, add_generation_prompt)


def test_whitespace_control_matters():
    """The ChatML template's layout is decided by trim_blocks / lstrip_blocks: no blank or indented lines."""
    text = ChatTemplate(CHATML).render(CONVERSATIONS["system_user"])
    assert (
        text
        == "<|im_start|>system\nYou are terse.  <|im_end|>\n<|im_start|>user\n What is 2+2? <|im_end|>\n<|im_start|>assistant\n"
    )


def test_special_tokens_reach_the_template(directories):
    text = ChatTemplate.from_directory(directories["llama2"]).render(
        CONVERSATIONS["ends_with_assistant"], add_generation_prompt=False
    )
    assert text == "<s>[INST] Hi [/INST] Hello. </s>"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("extra", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_tools_tojson_and_extra_kwargs(extra, add_generation_prompt, directories, hf_tokenizers):
    """HF's tojson (no HTML escaping, non-ASCII kept, indent / sort_keys / separators), tool calls with content None, reasoning."""
    expected = hf_render(hf_tokenizers["tools"], TOOL_CHAT, add_generation_prompt, tools=[WEATHER], **extra)
    text = ChatTemplate.from_directory(directories["tools"]).render(TOOL_CHAT, add_generation_prompt, tools=[WEATHER], **extra)
    assert text == expected
    assert "Température <en °C> & vent" in text and '"arguments": {"city": "Zürich"}' in text and "Bern" not in text
    assert "<think>\nCall the tool.\n</think>" in text and "<think>\nReport it.\n</think>" in text  # read as reasoning_content


def test_date_from_strftime_now_or_given(directories, hf_tokenizers):
    template = ChatTemplate.from_directory(directories["llama3"])
    messages = CONVERSATIONS["system_user"]
    assert template.render(messages) == hf_render(hf_tokenizers["llama3"], messages, True)
    assert "Today Date: 26 Jul 2024\n" in template.render(messages, date_string="26 Jul 2024")


def test_special_tokens_as_hf_passes_them(tmp_path):
    """Strings or AddedToken dicts; any other "*_token" key and extra_special_tokens; None left undefined; tools defined as None."""
    added = {
        "__type": "AddedToken",
        "content": "<bos>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
    }
    template = "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token is defined }}|{{ image_token }}|{{ audio_token }}|{{ tools }}"
    config = {"bos_token": added, "pad_token": None, "image_token": "<img>", "extra_special_tokens": {"audio_token": "<aud>"}}
    directory = make_directory(tmp_path / "tok", chat_template=template, add_bos_token=True, **config)
    text = ChatTemplate.from_directory(directory).render(CONVERSATIONS["user"])
    assert text == hf_render(AutoTokenizer.from_pretrained(str(directory)), CONVERSATIONS["user"], True)
    assert text == "<bos>|</s>||False|<img>|<aud>|None"
    assert (
        ChatTemplate(template, {"bos_token": added, "eos_token": "E"})
        .render(CONVERSATIONS["user"], image_token="I")
        .startswith("<bos>|E||False|I|")
    )


def test_legacy_special_tokens_map_overrides_the_config(tmp_path):
    directory = make_directory(tmp_path / "tok", chat_template="{{ bos_token }}{{ eos_token }}")
    (directory / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<B>", "lstrip": False}}))
    text = ChatTemplate.from_directory(directory).render(CONVERSATIONS["user"])
    assert text == hf_render(AutoTokenizer.from_pretrained(str(directory)), CONVERSATIONS["user"], True) == "<B></s>"


def test_template_file_is_preferred_to_the_config(tmp_path):
    directory = make_directory(tmp_path / "tok", chat_template="from the config")
    (directory / "chat_template.jinja").write_text(GEMMA)
    messages = CONVERSATIONS["multi_turn"]
    text = ChatTemplate.from_directory(directory).render(messages)
    assert text == hf_render(AutoTokenizer.from_pretrained(str(directory)), messages, True)
    assert text.startswith("<s><start_of_turn>user\nYou are terse.  \n\nHi<end_of_turn>\n")


def test_named_templates_use_default(tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "default {{ messages | length }}"}]
    directory = make_directory(tmp_path / "tok", chat_template=named)
    assert ChatTemplate.from_directory(directory).render(CONVERSATIONS["multi_turn"]) == "default 4"
    make_directory(tmp_path / "other", chat_template=named[:1])
    with pytest.raises(
        UserError,
        match=r"^no chat template in .*other \(chat templates \['tool_use'\] but no 'default'\): pass one with chat_template=",
    ):
        ChatTemplate.from_directory(tmp_path / "other")


def test_missing_template_is_one_line(tmp_path):
    directory = make_directory(tmp_path / "tok")
    with pytest.raises(UserError) as info:
        ChatTemplate.from_directory(directory)
    assert str(directory) in str(info.value) and "chat_template=" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(UserError, match="does not exist"):
        ChatTemplate.from_directory(tmp_path / "nowhere")


@pytest.mark.parametrize("name", ["llama2", "gemma"])
def test_raise_exception_is_a_user_error(name, directories, hf_tokenizers):
    messages = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi again"}]
    message = "Conversation roles must alternate user/assistant/user/assistant/..."
    with pytest.raises(Exception, match=message):  # transformers raises jinja2's TemplateError
        hf_render(hf_tokenizers[name], messages, True)
    with pytest.raises(UserError) as info:
        ChatTemplate.from_directory(directories[name]).render(messages)
    assert str(info.value) == f"chat template failed to render: {message}"


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{{ messages[0].content.nope() }}", r"^chat template failed to render: .*nope"),
        ("{{ messages[0].content + 1 }}", r"^chat template failed to render: TypeError: "),
        ("{% set ns = namespace(_secret=1) %}", r"^chat template failed to render: .*cannot hold underscore-prefixed attributes: '_secret'"),
        ("{{ ''.__class__.__mro__ }}", r"^chat template failed to render: access to attribute '__class__' of 'str' object is unsafe"),
    ],
)  # fmt: skip
def test_template_errors_are_user_errors(template, match):
    with pytest.raises(UserError, match=match):
        ChatTemplate(template).render(CONVERSATIONS["user"])


def test_syntax_error_is_a_user_error():
    with pytest.raises(UserError, match=r"chat template does not parse: .*line 2"):
        ChatTemplate("{% for m in messages %}\n{{ m }\n{% endfor %}")


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("Hello", "non-empty list"),
        ({"role": "user", "content": "Hi"}, "non-empty list"),
        ([], "non-empty list"),
        ([{"role": "user", "content": "Hi"}, ["assistant", "Hi"]], r"^chat message 1 is a list, not a dict"),
        ([{"content": "Hi"}], r"^chat message 0 has no 'role' string"),
        ([{"role": 3, "content": "Hi"}], r"^chat message 0 has no 'role' string \(got 3\)"),
        ([{"role": "user"}], r"^chat message 0 has no 'content'"),
        ([{"role": "user", "content": None}], r"^chat message 0 has no 'content'"),
        ([{"role": "user", "content": 42}], r"^chat message 0 has 'content' of type int"),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}], r"^chat message 0 content part 1 is not"),
        ([{"role": "user", "content": [{"type": "image", "url": "x.png"}]}], r"^chat message 0 content part 0 is not"),
        ([{"role": "user", "content": [{"type": "text"}]}], r"^chat message 0 content part 0 is not"),
    ],
)  # fmt: skip
def test_malformed_messages(messages, match):
    with pytest.raises(UserError, match=match):
        ChatTemplate(CHATML).render(messages)


# ---- limits: a template is code from a model directory ------------------------------------

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{{ 'x' * 10**9 }}", "needs more than 512 MiB"),  # refused by the allocation, not after it
        ("{{ 'ab'|center(10**9) }}", "needs more than 512 MiB"),  # a filter with a constant argument: not run while compiling
        ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "512 MiB"),
        ("{% for i in range(20) %}{{ 'x' * 1000000 }}{% endfor %}", "output exceeds 16,777,216 characters"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recurses too deeply"),
        (LOOP, "did not finish rendering within 0.5 s"),
    ],
)  # fmt: skip
def test_rendering_is_bounded_in_time_memory_and_output(template, match):
    """Each is one UserError naming the limit, from the rendering process; this process neither
    allocates nor waits, and the next rendering works (a killed process is replaced). Only the
    endless loop meets the 0.5 s limit; the others get 10 s, so that copying hundreds of MiB on a
    loaded machine trips the limit named, not the clock (a full-suite run once did)."""
    seconds = 0.5 if template == LOOP else 10.0
    with pytest.raises(UserError, match=match):
        ChatTemplate(template, limits=RenderLimits(seconds=seconds)).render(CONVERSATIONS["user"])
    assert ChatTemplate(CHATML).render(CONVERSATIONS["user"]).startswith("<|im_start|>system")


BIG = "{% set pad = 'x' * 100000000 %}"  # 100 MB held while rendering, then nothing written


@pytest.mark.parametrize(
    "template, limits, flag",
    [
        ("{{ 'x' * 100 }}", RenderLimits(max_chars=99), "output exceeds 99 characters; fix the template (or pass another "
         "with --chat-template / chat_template_path), or raise the limit (--chat-template-max-chars / chat_template_max_chars)"),
        (BIG + "ok", RenderLimits(memory_mib=64), "needs more than 64 MiB to render (e.g. 'x' * 10**9); fix the template "
         "(or pass another with --chat-template / chat_template_path), or raise the limit (--chat-template-memory-mib / "
         "chat_template_memory_mib)"),
        (LOOP, RenderLimits(seconds=0.2), "did not finish rendering within 0.2 s (a loop that does not end, or one far "
         "too long for its input?); fix the template (or pass another with --chat-template / chat_template_path), or "
         "raise the limit (--chat-template-timeout / chat_template_timeout)"),
    ],
)  # fmt: skip
def test_each_rendering_limit_is_the_template_s_own_and_says_how_to_raise_it(template, limits, flag):
    """The limits were module constants; now each template carries its own (``serve``'s
    ``--chat-template-*`` flags, training's ``chat_template_*`` keys), and the error names both."""
    with pytest.raises(UserError) as err:
        ChatTemplate(template, limits=limits).render(CONVERSATIONS["user"])
    assert flag in str(err.value)
    if template != LOOP:  # within the default limits the same template renders
        assert ChatTemplate(template).render(CONVERSATIONS["user"]) == ("x" * 100 if template.startswith("{{") else "ok")


@pytest.mark.parametrize(
    "given, fragment",
    [({"seconds": 0.0}, "time limit .--chat-template-timeout / chat_template_timeout. must be a number of seconds > 0"),
     ({"seconds": float("nan")}, "seconds > 0"), ({"memory_mib": 63}, "at least 64 MiB"),
     ({"max_chars": 0}, "at least 1 character")],
)  # fmt: skip
def test_rendering_limits_that_cannot_work_are_one_line(given, fragment):
    with pytest.raises(UserError, match=fragment):
        RenderLimits(**given)


def test_a_template_nested_too_deeply_to_compile_is_a_user_error():
    with pytest.raises(UserError, match="nests too deeply to compile"):
        ChatTemplate("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")


def test_a_timed_out_template_is_not_retried_for_each_training_record():
    import time

    import nnxtron.data.chat_template as chat_template

    template = ChatTemplate(LOOP, limits=RenderLimits(seconds=0.3))
    with pytest.raises(chat_template.TemplateTimeout, match="within 0.3 s"):
        template.assistant_spans(CONVERSATIONS["user"])
    start = time.monotonic()
    with pytest.raises(chat_template.TemplateTimeout, match="within 0.3 s"):
        template.assistant_spans(CONVERSATIONS["user"])
    assert time.monotonic() - start < 0.2


def test_the_training_keys_default_to_the_rendering_defaults():
    """base.yml's chat_template_* values, the ones config/checks.py compares against (set without
    use_sft / use_dpo: refused), serve's flag defaults and RenderLimits' defaults are one set."""
    from nnxtron.cli import build_parser
    from nnxtron.config import load_config
    from nnxtron.config.checks import TEMPLATE_LIMITS

    cfg = load_config()
    assert TEMPLATE_LIMITS == {key: getattr(cfg, key) for key in TEMPLATE_LIMITS}
    assert RenderLimits(cfg.chat_template_timeout, cfg.chat_template_memory_mib, cfg.chat_template_max_chars) == RenderLimits()
    ns = build_parser().parse_args(["serve", "DIR"])
    assert RenderLimits(ns.chat_template_timeout, ns.chat_template_memory_mib, ns.chat_template_max_chars) == RenderLimits()
