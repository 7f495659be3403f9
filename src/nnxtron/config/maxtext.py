"""Reading MaxText configs: detection, ``base_config:`` inheritance, translation through the one key
table (``config/maxtext_keys.py``) and the report of ignored keys. Pure Python: no JAX.

A config file is a **MaxText config** when it has a ``base_config:`` key or holds a key of the
MaxText table that nnxtron's schema does not have. In a MaxText config (and on the command line
next to one):

* MaxText's values apply: every key of MaxText 0.2.5's ``base.yml`` starts at MaxText's default
  (``dtype=bfloat16``, ``remat_policy=full`` ...), then the files, then the command line;
* nnxtron-only keys keep nnxtron's defaults, except ``NNXTRON_KEYS_UNDER_MAXTEXT`` (MaxText's
  ``train`` samples nothing at the end);
* ``model_name`` selects nnxtron's preset of that name, which overrides the files (MaxText's order:
  base < model config < command line) — except ``dtype``, which MaxText's model configs leave to
  the config file;
* a command-line key that the preset sets to another value is an error unless
  ``override_model_config=true`` (MaxText's rule);
* keys nnxtron's schema has and MaxText's table does not (``rope_scaling_factor`` ...) are taken
  as they are, after the translated ones.

Outside a MaxText config, MaxText-only keys on the command line are translated, ignored or refused
the same way; keys both have keep nnxtron's meaning.
"""

from __future__ import annotations

import difflib
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nnxtron.config.maxtext_keys import (
    IGNORED,
    KEYS,
    MAXTEXT_LLAMA31_SCALING,
    MAXTEXT_VERSION,
    NOT_IN_BASE,
    REFUSED,
    accepted,
    refusal,
    same,
)
from nnxtron.config.schema import Config
from nnxtron.errors import ConfigError

BASE_CONFIG = "base_config"
MAX_BASE_CONFIG_DEPTH = 16
MAXTEXT_ONLY = frozenset(key for key in KEYS if key not in Config.model_fields)
PRESET_KEYS_KEPT_FROM_FILE = (
    "dtype",
    "normalize_embedding_logits",
)  # MaxText's model configs leave these to base.yml / the config file, except MODEL_CONFIGS_SETTING's
# the MaxText 0.2.5 model configs (configs/models/<name>.yml) that set one of those keys themselves:
# MaxText's model config overrides base.yml there, so the preset's value (the same) is the model's
MODEL_CONFIGS_SETTING: dict[str, frozenset[str]] = {
    "normalize_embedding_logits": frozenset(
        {"gpt3-175b", "gpt3-22b", "gpt3-52k", "gpt3-6b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-14b", "qwen3-0.6b", "qwen3-8b"}
    ),
}


def preset_under_maxtext(model_name: str, preset: dict[str, Any]) -> dict[str, Any]:
    """The preset's values a MaxText config takes: without the keys MaxText's model config of
    ``model_name`` leaves to base.yml and the config file; a llama3 RoPE (MaxText's ``llama3.1``)
    with MaxText's fixed scaling (Llama 4's preset holds HF's 16 / 1 / 1, MaxText computes 8 / 1 / 4)."""
    kept = {
        k: v
        for k, v in preset.items()
        if k not in PRESET_KEYS_KEPT_FROM_FILE or model_name in MODEL_CONFIGS_SETTING.get(k, frozenset())
    }
    if kept.get("rope_type") == "llama3":
        kept.update(MAXTEXT_LLAMA31_SCALING)
    return kept


DEFAULTS = {key: rule.default for key, rule in KEYS.items() if rule.default is not NOT_IN_BASE}
MOE_KEYS = ("sparse_matmul", "megablox", "capacity_factor")  # reported together at start-up (Report.moe_line)
NNXTRON_KEYS_UNDER_MAXTEXT = {  # nnxtron-only keys whose MaxText behaviour differs (docs/maxtext.md)
    "sample_after_training": 0,  # MaxText's train does not sample
    "lr_schedule_convention": "maxtext",  # MaxText's schedule arithmetic (train/schedules.py)
    "weight_decay_mask": "all",  # MaxText's adamw_mask=[] decays every parameter (norm scales too)
    "tied_head_bf16": True,  # MaxText's tied head rounds the table to bfloat16 (attend_on_embedding)
    "load_balance_convention": "maxtext",  # per sequence, mean over the MoE layers (layers/router.py)
}


def is_maxtext_config(values: Mapping[str, Any]) -> bool:
    return BASE_CONFIG in values or any(key in MAXTEXT_ONLY for key in values)


def check_key(key: Any, origin: str) -> None:
    """A key of a MaxText config: MaxText's table or nnxtron's schema."""
    if key in KEYS or key in Config.model_fields:
        return
    close = difflib.get_close_matches(str(key), [*KEYS, *Config.model_fields], n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else "; docs/maxtext.md lists every MaxText key"
    raise ConfigError(
        f"unknown config key {str(key)!r} in {origin} (a MaxText config: neither a MaxText {MAXTEXT_VERSION} key nor "
        f"an nnxtron key){hint}"
    )


def read_chain(path: Path, read: Callable[[Path], dict[str, Any]], seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A MaxText config file with its ``base_config:`` ancestors merged under it. As MaxText's
    pyconfig: a relative ``base_config`` is relative to the file's directory."""
    values = read(path)
    parent = values.pop(BASE_CONFIG, None)
    if parent is None:
        return values
    if not isinstance(parent, str) or not parent:
        raise ConfigError(f"base_config in config file '{path}' must be a file path, got {parent!r}")
    parent_path = Path(parent) if Path(parent).is_absolute() else path.parent / parent
    if not parent_path.is_file():
        raise ConfigError(
            f"base_config {parent!r} of config file '{path}' is not a file (looked at '{parent_path}'); MaxText's own "
            "configs are in its wheel (maxtext/configs/): copy base.yml next to your file or give its path"
        )
    resolved = parent_path.resolve()
    if resolved in seen or len(seen) >= MAX_BASE_CONFIG_DEPTH:
        raise ConfigError(f"base_config of config file '{path}' leads back to '{parent_path}' (a cycle); fix base_config")
    return {**read_chain(parent_path, read, (*seen, path.resolve(), resolved)), **values}


@dataclass
class Report:
    """What a MaxText config (or MaxText keys on the command line) did: the ignored keys with
    their values, and whether the MaxText layering applied."""

    maxtext_file: bool = False
    ignored: dict[str, Any] = field(default_factory=dict)
    moe_kernels: dict[str, Any] = field(default_factory=dict)

    def startup_lines(self, cfg: Config) -> list[str]:
        lines = []
        if self.ignored:
            changed = [f"{k}={v!r}" for k, v in self.ignored.items() if not same(v, KEYS[k].default)]
            at_default = len(self.ignored) - len(changed)
            lines += _wrapped(
                "", [f"MaxText keys ignored ({len(self.ignored)}; infrastructure nnxtron does not have, or a kernel "
                     "choice computing the same function; docs/maxtext.md says why for each):"], "  "
            )  # fmt: skip
            values = f"{at_default} at MaxText's default values" + ("; set otherwise: " if changed else "")
            lines += _wrapped(f"  {values}", changed, "    ")
            for reason, keys in self.by_reason(lambda key, value: key).items():
                lines += _wrapped("  ", [f"{_short(reason)} ({len(keys)}):"], "  ")
                lines += _wrapped("    ", keys, "    ")
        if self.moe_kernels and cfg.num_experts > 1:
            lines.append(self.moe_line(cfg))
        return lines

    def moe_line(self, cfg: Config) -> str:
        """Which MoE computation MaxText's sparse_matmul / megablox / capacity_factor select."""
        asked = " ".join(f"{k}={self.moe_kernels[k]}" for k in MOE_KEYS if k in self.moe_kernels)
        if cfg.capacity_factor > 0:
            how = f"with expert capacity (capacity_factor={cfg.capacity_factor}, capacity_scope={cfg.capacity_scope})"
        else:
            how = "dropless"
        if cfg.moe_compute == "dense":
            kernel = "moe_compute=dense: every expert on every token with einsums, unrouted ones weighted by zero"
        else:
            kernel = (
                f"moe_compute=grouped grouped_matmul={cfg.grouped_matmul}: a grouped matmul over the routed tokens "
                "(ragged_dot on TPU, padded row blocks elsewhere); no Pallas megablox kernel"
            )
        line = f"MoE: {asked} — nnxtron computes the routed experts {how} ({kernel}): the same function"
        factor = self.moe_kernels.get("capacity_factor", -1)
        if isinstance(factor, (int, float)) and factor > 0 and cfg.capacity_factor <= 0:
            line += "; MaxText reads capacity_factor on its dense path only (sparse_matmul=false), so this run is dropless"
        return line

    def comment_block(self) -> list[str]:
        if not self.ignored:
            return []
        lines = [f"# MaxText keys ignored ({len(self.ignored)}; docs/maxtext.md says why for each):"]
        for reason, items in self.by_reason(lambda key, value: f"{key}={value!r}").items():
            lines += _wrapped("#   ", [f"{reason}:"], "#   ")
            lines += _wrapped("#     ", items, "#     ")
        return lines

    def by_reason(self, item: Callable[[str, Any], str]) -> dict[str, list[str]]:
        """``item(key, value)`` of each ignored key, grouped by the reason it is ignored (table order)."""
        groups: dict[str, list[str]] = {}
        for key, value in self.ignored.items():
            groups.setdefault(KEYS[key].note, []).append(item(key, value))
        return groups


REPORT_WIDTH = 80  # columns of the ignored-keys listing (start-up and `config show`): an 80-column terminal shows it unbroken


def _short(reason: str) -> str:
    """A reason's first clause: "MaxText's checkpoint storage and recovery machinery (Orbax, ...); ..."
    -> "MaxText's checkpoint storage and recovery machinery" (docs/maxtext.md has the whole reason)."""
    for stop in (" (", ";", ":"):
        reason = reason.split(stop, 1)[0]
    return reason


def _wrapped(first: str, items: list[str], indent: str) -> list[str]:
    """``items`` joined by ", " in lines of at most ``REPORT_WIDTH`` columns (longer only where
    a word is), the first starting with ``first``, the others with ``indent``; broken at spaces only."""
    text = ", ".join(items)
    return textwrap.wrap(
        text, REPORT_WIDTH, initial_indent=first, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    ) or [first.rstrip()]


UNITS_TRANSLATED = ("base_num_decoder_layers",)  # MaxText counts these in units of its own (Gemma 2: layer pairs)


def check_model_overrides(
    model_name: str, preset: Mapping[str, Any], cli: Mapping[str, Any], ctx: Mapping[str, Any], maxtext_meaning: bool = True
) -> None:
    """MaxText's rule: a command-line key the model config sets to another value needs
    ``override_model_config=true``. ``maxtext_meaning``: the command line's ``UNITS_TRANSLATED`` values are
    MaxText's (a MaxText config), compared in nnxtron's units with the preset's."""
    if ctx.get("override_model_config"):
        return
    for key, given in cli.items():
        value = given
        if maxtext_meaning and key in UNITS_TRANSLATED and KEYS[key].to is not None:
            value = KEYS[key].to(given, {**ctx, **preset})[key]
            given = f"{given!r} (MaxText's; {value} nnxtron layers)" if value != given else given
        if key in preset and not same(value, preset[key]):
            shown = given if isinstance(given, str) and given.endswith("layers)") else repr(given)
            raise ConfigError(
                f"model_name={model_name} sets {key}={preset[key]!r} and the command line sets {key}={shown}: MaxText "
                "refuses this unless override_model_config=true; add override_model_config=true to override the model"
            )


def check_refused(values: Mapping[str, Any], ctx: Mapping[str, Any]) -> None:
    """The first refused value among ``values`` (the winning MaxText-level values), in table order."""
    for key, rule in KEYS.items():
        if rule.kind == REFUSED and key in values and not accepted(key, values[key], ctx):
            raise refusal(key, values[key], rule.note, rule.use)


def translate(values: Mapping[str, Any], ctx: Mapping[str, Any], report: Report, maxtext_meaning: bool) -> dict[str, Any]:
    """nnxtron values for one layer of values. ``maxtext_meaning``: keys both have are MaxText's
    (a MaxText config); else they are nnxtron's and only MaxText-only keys are translated.
    Keys only nnxtron has are applied after the translated ones."""
    out: dict[str, Any] = {}
    native: dict[str, Any] = {}
    for key, value in values.items():
        if key not in KEYS or (key in Config.model_fields and not maxtext_meaning):
            native[key] = value
            continue
        rule = KEYS[key]
        if rule.kind == IGNORED:
            report.ignored[key] = value
        if key in MOE_KEYS:
            report.moe_kernels[key] = value
        if rule.to is not None:
            out.update(rule.to(value, ctx))
    return {**out, **native}
