"""Property-based: what a user gives is read as given, or refused in one line (issue 48).

``test_fuzz.py`` checks that random input never gives a traceback; these check the other half of
"no silent failure": a config value, a command-line option or an HF ``config.json`` field that is
accepted holds exactly the value given (no bool read as 1, no 4.5 heads read as 4, no nan budget),
and nothing hangs. Each test stops where the input is settled: configs are loaded, not trained;
commands run up to the step that would load or compile a model (patched to raise ``Reached``).
Derandomized, so CI sees the same examples every run; the file takes about 15 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nnxtron.cli import build_parser, main
from nnxtron.config.loader import load_config, parse_overrides
from nnxtron.config.schema import Config
from nnxtron.convert.hf import hf_config
from nnxtron.errors import UserError
from tests.integration.conftest import assert_clean_exit

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "golden"
# derandomized (the same examples in every CI run); a deadline of 10 s per example catches a hang
FUZZ = settings(
    derandomize=True, deadline=10_000, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
ODD_NUMBERS = ["true", "false", "nan", "inf", "-inf", "1e-300", "1e-45", "1e39", "1e999", "4.5", "-1", "0", "0.0", "-0", "1_000",
               "0x10", "9" * 30, "", " ", "null", "[1]", "yes"]  # fmt: skip
# pydantic's lax reading of a string as a bool
TRUTH = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False, "1": True, "0": False,
         "t": True, "f": False, "y": True, "n": False}  # fmt: skip


def _element(annotation: Any) -> st.SearchStrategy[str]:
    """Override values (text after ``key=``) for one schema type: valid ones and odd ones."""
    if annotation is bool:
        return st.sampled_from([*TRUTH, "2", "maybe", "", "null"])
    if annotation is int:
        return st.one_of(st.integers(-(2**64), 2**64).map(str), st.sampled_from(ODD_NUMBERS))
    if annotation is float:
        return st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.sampled_from(ODD_NUMBERS))
    if get_origin(annotation) is not None and str(get_origin(annotation)) == "typing.Literal":
        return st.one_of(st.sampled_from([str(c) for c in get_args(annotation)]), st.text(max_size=6))
    return st.one_of(st.text(max_size=10), st.sampled_from(ODD_NUMBERS))


def _value(annotation: Any) -> st.SearchStrategy[str]:
    if get_origin(annotation) is tuple and get_args(annotation)[-1] is Ellipsis:
        element = get_args(annotation)[0]
        return st.one_of(_element(element), st.lists(_element(element), max_size=3).map(lambda xs: f"[{', '.join(xs)}]"))
    return _element(annotation)


FIELDS = {key: field.annotation for key, field in Config.model_fields.items() if key != "logical_axis_rules"}
overrides = st.sampled_from(sorted(FIELDS)).flatmap(lambda key: _value(FIELDS[key]).map(lambda v: f"{key}={v}"))


def _as_given(annotation: Any, given_value: Any, got: Any) -> bool:
    """Whether ``got`` (the config's value) is ``given_value`` (the parsed override) read as ``annotation``."""
    if get_origin(annotation) is tuple:
        items = given_value if isinstance(given_value, list) else [given_value]
        return len(items) == len(got) and all(_as_given(get_args(annotation)[0], g, v) for g, v in zip(items, got))
    if annotation is bool:
        return given_value is got or TRUTH.get(str(given_value).strip().lower()) is got
    if annotation in (int, float):
        if isinstance(given_value, bool):
            return False  # a truth value is never a number
        number = float(given_value.replace("_", "")) if isinstance(given_value, str) else given_value
        if annotation is float:  # an integer given for a float key is read as the nearest float (10**30 - 1 as 1e30)
            number = float(number)
        return number == got and math.isfinite(got)
    return given_value == got or str(given_value) == str(got)


@settings(FUZZ, max_examples=300)
@given(item=overrides)
def test_a_config_value_is_read_as_given_or_refused(item):
    """One ``key=value`` over the defaults: one error line, or the config holds that value."""
    key = item.partition("=")[0]
    try:
        cfg = load_config(overrides=[item])
    except UserError as err:
        assert "\n" not in str(err).strip(), str(err)
        return
    assert _as_given(FIELDS[key], parse_overrides([item])[key], getattr(cfg, key)), (item, getattr(cfg, key))


class Reached(Exception):
    """The command got past its argument checks to the step that loads or compiles a model."""


HEAVY = [
    ("nnxtron.train.loop", "train"), ("nnxtron.convert.runs", "load_model"), ("nnxtron.convert.hf", "from_hf"),
    ("nnxtron.convert.maxtext", "load_maxtext_model"), ("nnxtron.convert.lora_adapter", "export_adapter"),
    ("nnxtron.serve.server", "listen"), ("nnxtron.tools.bench", "run_bench"), ("nnxtron.tools.bench", "run_decode_bench"),
    ("nnxtron.tools.plan", "make_plan"), ("nnxtron.tools.search", "search"), ("nnxtron.cli", "_rerun_plan_with_devices"),
]  # fmt: skip
SUBPARSERS = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
OPTION_VALUES = st.one_of(st.sampled_from(ODD_NUMBERS), st.integers(-(2**40), 2**40).map(str), st.text(max_size=6))
POSITIONALS = st.sampled_from(["/nonexistent", str(GOLDEN / "llama2"), "x.yml", "steps=2", "devices=8"])


@st.composite
def command_lines(draw) -> list[str]:
    """A subcommand, its positionals and up to four of its options with odd values."""
    name = draw(st.sampled_from(sorted(SUBPARSERS)))
    parser = SUBPARSERS[name]
    argv = [name]
    for action in parser._actions:
        if not action.option_strings and action.nargs is None:  # a required positional
            choices = sorted(action.choices) if action.choices else None
            argv.append(draw(st.sampled_from(choices) if choices else POSITIONALS))
        elif not action.option_strings and action.nargs == "*":  # [FILE] [key=value ...]
            argv += draw(st.lists(POSITIONALS, max_size=2))
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    for action in draw(st.lists(st.sampled_from(options), max_size=4, unique_by=lambda a: a.dest)):
        argv.append(action.option_strings[-1])
        if action.nargs != 0:
            argv.append(draw(OPTION_VALUES))
    return argv


@settings(FUZZ, max_examples=300)
@given(argv=command_lines())
@example(argv=["plan", "--search", "devices=8", "--time-budget", "nan"])  # issue 48's finds, always tried
@example(argv=["plan", "devices=8", "--device-memory-gib", "inf"])
@example(argv=["eval", "/nonexistent", "--tasks", "arc_easy", "--limit", "-1", "--num-fewshot", "-3"])
@example(argv=["train", "--peer-timeout=-1", "--distributed"])
def test_every_subcommand_reads_its_options_as_given_or_refuses_them(argv, monkeypatch, capsys):
    """Any subcommand with odd option values: exit 0, or 2 with one error line, or on to the
    model with every number option finite and not negative (no nan budget, no -1 limit)."""
    import jax

    def reached(*args, **kwargs):
        raise Reached

    for module, name in HEAVY:
        monkeypatch.setattr(f"{module}.{name}", reached)
    monkeypatch.setattr(jax.distributed, "initialize", reached)
    try:
        code = main(argv)
    except Reached:
        ns = build_parser().parse_known_args(argv)[0]
        numbers = [v for v in vars(ns).values() if isinstance(v, int | float) and not isinstance(v, bool)]
        assert all(math.isfinite(v) and v >= 0 for v in numbers), argv
        capsys.readouterr()
        return
    except SystemExit as exit_:  # --help, --version
        code = exit_.code
    assert_clean_exit(argv, code, *capsys.readouterr())


# HF config.json field -> the config key that holds it unchanged, per family
HF_FIELDS = {
    "llama2": {"num_attention_heads": "base_num_query_heads", "num_key_value_heads": "base_num_kv_heads",
               "hidden_size": "base_emb_dim", "intermediate_size": "base_mlp_dim", "num_hidden_layers": "base_num_decoder_layers",
               "vocab_size": "vocab_size", "head_dim": "head_dim", "rms_norm_eps": "normalization_layer_epsilon",
               "max_position_embeddings": "max_position_embeddings"},
    "mixtral": {"num_local_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok",
                "num_attention_heads": "base_num_query_heads", "intermediate_size": "base_moe_mlp_dim"},
    "gpt2": {"n_head": "base_num_query_heads", "n_embd": "base_emb_dim", "n_layer": "base_num_decoder_layers",
             "n_inner": "base_mlp_dim", "layer_norm_epsilon": "normalization_layer_epsilon"},
    "qwen3": {"num_key_value_heads": "base_num_kv_heads", "head_dim": "head_dim", "vocab_size": "vocab_size"},
}  # fmt: skip
# 0 read as "not given" (the family's default), as transformers, which keeps 0 but reads it nowhere
# for these RoPE types (models/hf_common.py: optional_size); null is "not given" for every optional field
ZERO_IS_UNSET = {"max_position_embeddings"}
OPTIONAL = {"head_dim", "num_key_value_heads", "n_inner", "max_position_embeddings"}
HF_VALUES = st.one_of(
    st.integers(-8, 600),
    st.sampled_from([True, False, 4.5, 64.0, 1e-300, 1e300, -1.5, "4", "1e-5", "true", "", None, [4], 2**63]),
    st.floats(allow_nan=False, allow_infinity=False, min_value=-1e3, max_value=1e3),
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hf-given")


@settings(FUZZ, max_examples=200)
@given(family=st.sampled_from(sorted(HF_FIELDS)), data=st.data())
def test_an_hf_config_field_is_read_as_given_or_refused(hf_dir, family, data):
    """One field of a golden ``config.json`` changed: one error line, or the nnxtron config
    holds exactly that value (a float count is never truncated, true is never 1)."""
    field = data.draw(st.sampled_from(sorted(HF_FIELDS[family])), label="field")
    value = data.draw(HF_VALUES, label="value")
    config = json.loads((GOLDEN / family / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, field: value}))
    try:
        cfg = hf_config(hf_dir)
    except UserError as err:
        assert "\n" not in str(err).strip(), str(err)
        return
    got = getattr(cfg, HF_FIELDS[family][field])
    if value is None and field in OPTIONAL or value == 0 and field in ZERO_IS_UNSET and not isinstance(value, bool):
        return
    assert not isinstance(value, bool | list | str) and value is not None, (field, value, got)  # a number was read
    assert got == value, (field, value, got)


@pytest.mark.parametrize(
    "family, field, value, read",
    [
        ("llama2", "head_dim", 0, None),  # transformers' Llama builds 0-wide projections: refused
        ("qwen3", "head_dim", 0, None),
        ("mistral", "head_dim", 0, 16),  # MistralAttention reads `head_dim or hidden_size // heads`
        ("mixtral", "head_dim", 0, 16),
        ("llama2", "head_dim", None, 16),  # null: hidden_size // heads, as LlamaConfig
        ("llama2", "head_dim", False, None),
        ("llama2", "num_key_value_heads", 0, None),  # HF divides the heads by it
        ("llama2", "num_key_value_heads", False, None),
        ("llama2", "num_key_value_heads", None, 4),  # null: one per query head
        ("gpt2", "n_inner", 0, None),  # HF builds a 0-wide MLP
        ("gpt2", "n_inner", None, 256),  # null: 4 x n_embd
        ("llama2", "max_position_embeddings", 0, 8192),  # kept by HF, read nowhere: nnxtron's default
        ("llama2", "max_position_embeddings", False, None),
        ("llama2", "num_attention_heads", "4", None),  # a quoted number: refused, as transformers' typed configs do
        ("llama2", "rms_norm_eps", "1e-5", None),
        ("llama2", "tie_word_embeddings", "false", None),  # not read as a non-empty string (true)
    ],
)
def test_hf_optional_fields_are_read_as_transformers_reads_them(hf_dir, family, field, value, read):
    """0 / false / null of the fields whose absence has a default: read as transformers reads them
    (``read``: the value nnxtron holds) or refused in one line naming the field (``read`` None);
    before, 0 and false were "not given" everywhere and "4" was the number 4."""
    config = json.loads((GOLDEN / family / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, field: value}))
    key = {**HF_FIELDS["llama2"], **HF_FIELDS["gpt2"], "tie_word_embeddings": "logits_via_embedding"}[field]
    if read is None:
        with pytest.raises(UserError) as err:
            hf_config(hf_dir)
        assert f"{field}=" in str(err.value) and "\n" not in str(err.value) and "fix config.json" in str(err.value)
    else:
        assert getattr(hf_config(hf_dir), key) == read
