"""``nnxtron config readers``: every read of a config key in the package (``tools/read_sites.py``).

The scan must find the reads issue 54 names (a second reader that the flag-sensitivity matrix
did not reach), name every key or give the reason it cannot, print the same thing every
time, and see reads through an alias and through an object built from the config. The
table of such objects (``tools/read_carriers.py``) is checked against the code that builds
them, by AST.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from nnxtron.cli import main
from nnxtron.tools.read_carriers import CARRIERS, GENERIC_ONLY, carried_keys, config_properties
from nnxtron.tools.read_sites import (
    KEYS,
    Site,
    format_sites,
    keys_without_sites,
    package_sources,
    read_sites,
    scan,
    sites_json,
)

SOURCES = package_sources()


@pytest.fixture(scope="module")
def sites() -> list[Site]:
    return read_sites()


def where(sites: list[Site], key: str) -> set[tuple[str, str]]:
    """(file, function) of each read of ``key``."""
    return {(s.file, s.function) for s in sites if s.key == key}


def test_finds_the_second_readers_of_issue_54(sites):
    pipeline = where(sites, "scan_pipeline_repeats")
    assert ("src/nnxtron/config/pipeline.py", "pipeline_spec") in pipeline  # the config-level reader
    assert ("src/nnxtron/parallel/pipeline.py", "_Run.rounds") in pipeline  # the schedule: `if self.spec.scan_repeats:`
    rounds = [s for s in sites if s.key == "scan_pipeline_repeats" and s.function == "_Run.rounds"]
    # two reads: one loop over every iteration (the same weights every round), else the rounds' loop
    assert [(s.kind, s.via) for s in rounds] == [("derived", "PipelineSpec.scan_repeats")] * 2
    lines = [SOURCES["src/nnxtron/parallel/pipeline.py"].splitlines()[s.line - 1] for s in rounds]
    assert any("if self.spec.scan_repeats:" in line for line in lines), lines

    cosine = {s.function for s in sites if s.key == "cosine_learning_rate_final_fraction" and s.file.endswith("schedules.py")}
    assert {"learning_rate_schedule", "maxtext_schedule"} <= cosine  # the default and the MaxText-convention cosine
    maxtext = next(s for s in sites if s.key == "cosine_learning_rate_final_fraction" and s.function == "maxtext_schedule")
    assert (
        "lr * cfg.cosine_learning_rate_final_fraction" in SOURCES["src/nnxtron/train/schedules.py"].splitlines()[maxtext.line - 1]
    )

    optimizer = {("src/nnxtron/train/optimizer.py", f) for f in ("base_optimizer", "_muon")}
    assert optimizer | {("src/nnxtron/config/checks.py", "check_optimization")} == where(sites, "adam_eps")


def test_every_key_is_named_by_a_site_or_listed_with_its_generic_reader(sites):
    assert set(GENERIC_ONLY) <= KEYS
    assert keys_without_sites(sites) == sorted(GENERIC_ONLY), "unread, or read only generically without a reason"


def test_getattr_names_resolve_where_the_ast_says(sites):
    """The per-activation remat choices are read by name only (parallel/remat.py); the scan
    follows the name to ACTIVATIONS and the shorthand table; a loop over an imported table too."""
    remat = {s.key for s in sites if s.kind == "dynamic" and s.function == "RematSpec.from_config"}
    assert {"query_proj", "context", "mlpwi_0", "mlpwo", "mlpwi", "qkv_proj"} <= remat
    optimization = {s.key for s in sites if s.kind == "dynamic" and s.function == "check_optimization"}
    assert {"lr_schedule_type", "opt_type", "adam_eps", "lion_b1", "wsd_decay_style"} <= optimization
    data = {(s.line, s.key) for s in sites if s.kind == "dynamic" and s.function == "check_data"}
    assert {key for _, key in data} >= {"use_sft", "use_dpo", "chat_template_timeout"}
    assert not {line for line, key in data if key == "use_sft"} & {line for line, key in data if key.startswith("chat_")}


def test_output_is_sorted_and_the_same_in_another_process(sites):
    assert sites == sorted(sites, key=lambda s: (s.key == "*", s.key, s.file, s.line, s.col, s.kind, s.via))
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    cmd = [sys.executable, "-c", "import sys; from nnxtron.cli import main; sys.exit(main(['config', 'readers', '--json']))"]
    other = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=True).stdout
    assert json.loads(other) == json.loads(sites_json(sites))


def test_command_lists_one_key_and_refuses_an_unknown_one(sites, capsys, monkeypatch):
    """The command's own lines (the scan itself: the fixture's; the real one runs in the test above)."""
    import nnxtron.tools.read_sites as module

    monkeypatch.setattr(module, "read_sites", lambda keys=(): [s for s in sites if s.key in set(keys) or not keys])
    assert main(["config", "readers", "scan_pipeline_repeats"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("src/nnxtron/parallel/pipeline.py:" in line and "[derived: PipelineSpec.scan_repeats]" in line for line in lines)
    assert all(line.startswith("scan_pipeline_repeats ") for line in lines[:-1])
    assert lines[-1].startswith("# ") and "read sites of 1 key " in lines[-1]
    assert main(["config", "readers", "--json", "adam_eps"]) == 0
    assert {s["key"] for s in json.loads(capsys.readouterr().out)["sites"]} == {"adam_eps"}
    assert main(["config", "readers", "scan_pipline_repeats"]) == 2
    assert "did you mean scan_pipeline_repeats" in capsys.readouterr().err


SNIPPET = """
from nnxtron.config.pipeline import pipeline_spec

def via_alias(cfg):
    c = cfg
    return c.steps

def via_spec(cfg):
    spec = pipeline_spec(cfg)
    return spec.scan_repeats, spec.repeats

class Holder:
    def __init__(self, model):
        self.spec = pipeline_spec(model.config)

    def later(self, flags: dict):
        return self.spec.delay, flags.steps  # a dict is no Config

def dynamic(cfg, name):
    return getattr(cfg, name), getattr(cfg, "adam_b1"), cfg.model_dump()

LIMITS = {"adam_b2": 0.9}

def resolved(cfg):
    for key in ("steps", "adam_eps"):
        key = f"{key}"
        getattr(cfg, key)
    return [k for k, off in LIMITS.items() if getattr(cfg, k) != off]
"""


def test_negative_control_an_alias_and_a_spec_attribute():
    context = {path: SOURCES[path] for path in ("src/nnxtron/config/pipeline.py", "src/nnxtron/config/schema.py")}
    found = {(s.key, s.function, s.kind) for s in scan({"snippet.py": textwrap.dedent(SNIPPET)}, context=context)}
    assert found == {
        ("steps", "via_alias", "attribute"),
        ("scan_pipeline_repeats", "via_spec", "derived"),
        ("pipeline_delay_activation_forwarding", "Holder.later", "derived"),
        ("adam_b1", "dynamic", "getattr"),
        ("*", "dynamic", "dynamic"),
        ("*", "dynamic", "whole"),
        ("steps", "resolved", "dynamic"),
        ("adam_eps", "resolved", "dynamic"),
        ("adam_b2", "resolved", "dynamic"),
    }


# ---- the carriers table against the code that builds the carriers --------------------------------------------------


TREES = {path: ast.parse(text) for path, text in SOURCES.items()}
FIELDS = {  # class -> its annotated fields, in order (a dataclass's positional arguments)
    node.name: [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    for tree in TREES.values()
    for node in ast.walk(tree)
    if isinstance(node, ast.ClassDef) and node.name in CARRIERS
}


def _keys_in(expr: ast.AST, fn: ast.AST, reads: list[Site], seen: frozenset[str] = frozenset()) -> set[str]:
    """The keys read inside ``expr``, following the local names it uses to their assignments in ``fn``."""
    start, end = (expr.lineno, expr.col_offset), (expr.end_lineno, expr.end_col_offset)
    keys = {s.key for s in reads if start <= (s.line, s.col) < end}
    for name in {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)} - seen:
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    targets = target.elts if isinstance(target, ast.Tuple) else [target]
                    values = node.value.elts if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) else None
                    for i, t in enumerate(targets):
                        if isinstance(t, ast.Name) and t.id == name:
                            keys |= _keys_in(values[i] if values else node.value, fn, reads, seen | {name})
    return keys


def constructions(sites: list[Site]) -> dict[tuple[str, str], set[str]]:
    """(carrier, attribute) -> the keys its constructions in the package assign it from."""
    out: dict[tuple[str, str], set[str]] = {}
    reads: dict[str, list[Site]] = {}
    for s in sites:
        if s.kind in ("attribute", "getattr", "property"):
            reads.setdefault(s.file, []).append(s)
    for path, tree in TREES.items():
        owners = {id(fn): c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for fn in c.body}
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)):
                name = owners.get(id(fn)) if call.func.id == "cls" else call.func.id
                if name not in CARRIERS:
                    continue
                given = [*zip(FIELDS[name], call.args), *((k.arg, k.value) for k in call.keywords if k.arg)]
                for spread in (k.value for k in call.keywords if k.arg is None and isinstance(k.value, ast.Dict)):
                    given += [(k.value, v) for k, v in zip(spread.keys, spread.values) if isinstance(k, ast.Constant)]
                for attr, value in given:
                    out.setdefault((name, attr), set()).update(_keys_in(value, fn, reads.get(path, [])))
    return out


def test_each_carried_attribute_is_assigned_from_its_keys(sites):
    built = constructions(sites)
    properties = config_properties(ast.parse(SOURCES["src/nnxtron/config/schema.py"]))
    for carrier, table in CARRIERS.items():
        assert any(keys for (c, _), keys in built.items() if c == carrier), f"{carrier}: no construction from a config found"
        for attr in table.carries:
            assert set(carried_keys(carrier, attr, properties)) == built.get((carrier, attr)), f"{carrier}.{attr}"
        unmapped = {attr for (c, attr), keys in built.items() if c == carrier and keys and attr not in table.carries}
        assert unmapped == set(table.unmapped), f"{carrier}: attributes assigned from keys, neither mapped nor explained"


def test_deepseek4_refuses_rope_interleave_false():
    """Found with the readers: DeepSeek-V4's RoPE specs (models/deepseek4/compressed.py: rope_specs)
    set interleave=True over what RopeSpec.from_config read, so rope_interleave=false was accepted
    and changed nothing; it is refused now, as a flag no code reads must be."""
    from nnxtron.config import load_config
    from nnxtron.errors import ConfigError

    assert load_config(values={"model_name": "deepseek4-test"}).rope_interleave
    with pytest.raises(ConfigError, match="rope_interleave=true"):
        load_config(values={"model_name": "deepseek4-test", "rope_interleave": False})


def test_docs_show_what_the_command_prints(sites):
    """docs/config.md's example output: the same sites (line numbers may move)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    shown = text.split("nnxtron config readers scan_pipeline_repeats\n```\n\n```text\n", 1)[1].split("```", 1)[0]
    printed = "\n".join(format_sites([s for s in sites if s.key == "scan_pipeline_repeats"], ["scan_pipeline_repeats"]))

    def loose(lines: str) -> list[str]:
        return [" ".join(re.sub(r"\.py:\d+", ".py:N", line).split()) for line in lines.strip().splitlines()]

    assert loose(shown) == loose(printed)
