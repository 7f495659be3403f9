"""Write docs/maxtext.md from the MaxText key table (src/nnxtron/config/maxtext_keys.py).

    python scripts/maxtext_keys_table.py          # rewrite docs/maxtext.md
    python scripts/maxtext_keys_table.py --check  # exit 1 when docs/maxtext.md is out of date

tests/unit/test_maxtext_config.py runs the check, so the page and the table cannot drift.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from nnxtron.config.maxtext_keys import HONOURED, IGNORED, KEYS, KINDS, MAXTEXT_VERSION, NOT_IN_BASE, REFUSED, TRANSLATED

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "maxtext.md"

INTRO = f"""# MaxText configs in nnxtron

nnxtron reads MaxText {MAXTEXT_VERSION}'s config files and `key=value` arguments:

```
nnxtron train path/to/maxtext/configs/base.yml model_name=deepseek3-tiny steps=20 ...
nnxtron config show path/to/maxtext/configs/base.yml ...   # the resolved config, ignored keys in a comment block
```

**What is a MaxText config.** A YAML file with a `base_config:` key, or one that holds a key of
the table below that nnxtron's schema does not have. `base_config:` is followed as MaxText's
pyconfig does (a relative path is relative to the file's directory; the child's keys win).

**Which values apply.** A MaxText config means MaxText's values: every key of MaxText's
`base.yml` starts at MaxText's default (so `dtype=bfloat16`, `remat_policy=full`,
`per_device_batch_size=12` ... where nnxtron's own base.yml says otherwise), then the files,
then the command line. `model_name` selects nnxtron's preset of that name (the presets carry
MaxText's model names), which overrides the files as MaxText's model configs do — except
`dtype`, which MaxText's model configs leave to the config file. A command-line key that the
preset sets to another value is an error unless `override_model_config=true` (MaxText's rule;
in nnxtron the preset's keys stand for MaxText's model config). nnxtron-only keys keep
nnxtron's defaults, except `sample_after_training=0` (MaxText's trainer samples nothing), and
may be set in the file or on the command line. Without a MaxText config file, MaxText-only keys
on the command line are handled by the same table; keys both have keep nnxtron's meaning.

**The four classes.**

- **honoured** — the same name and meaning in nnxtron; the value is passed on.
- **translated** — the value becomes nnxtron key(s): another name, or MaxText's sentinel for
  "unset" (`-1`, `None`, `""`) mapped to nnxtron's; some values are refused (said in the row).
- **ignored** — MaxText infrastructure nnxtron does not have (cloud storage, profilers, metrics
  upload, serving), or a kernel / sharding / remat choice that computes the same function.
  Accepted with any value; `nnxtron train` prints them in one start-up line and
  `nnxtron config show` lists them — never silently. On MoE models the start-up also says which
  path runs: nnxtron's routed experts are a dropless `jax.lax.ragged_dot` grouped matmul on every
  backend (CPU included), whatever `sparse_matmul` / `megablox` ask for — the same function.
- **refused** — a value whose computation nnxtron does not implement is one `error:` line (exit
  2) naming the key, why, and what to use. MaxText's default is accepted (the feature is off),
  as are the values listed under "accepted", and any value while the key that reads it is off.

The data pipelines are nnxtron's own: with real data the documents come in another order than
MaxText's Grain pipeline gives them. Step-for-step parity with MaxText is issue 24's later part.
"""


PIPE = "\\|"  # a | inside a Markdown table cell


def _value(value) -> str:
    return "—" if value is NOT_IN_BASE else f"`{value!r}`".replace("|", PIPE)


def _row(key: str) -> str:
    rule = KEYS[key]
    if rule.kind == HONOURED:
        what = ""
    elif rule.kind == REFUSED:
        extra = []
        if rule.accept:
            extra.append("also " + ", ".join(f"`{a!r}`" for a in rule.accept))
        if rule.gate:
            values = rule.gate[1] if len(rule.gate[1]) <= 4 else ("one of nnxtron's",)
            extra.append(f"any value while `{rule.gate[0]}` is {' or '.join(f'`{v!r}`' for v in values)}")
        if rule.check is not None:
            extra.append("see why")
        what = f"{rule.note}; {rule.use}" + (f" (accepted: default, {'; '.join(extra)})" if extra else "")
    else:
        what = rule.note
    what = what.replace("|", PIPE)
    return f"| `{key}` | {_value(rule.default)} | {rule.kind} | {what} |"


def render() -> str:
    in_base = [k for k, r in KEYS.items() if r.default is not NOT_IN_BASE]
    extra = [k for k, r in KEYS.items() if r.default is NOT_IN_BASE]
    counts = Counter(KEYS[k].kind for k in in_base)
    lines = [INTRO, f"## Counts ({len(in_base)} keys of MaxText {MAXTEXT_VERSION}'s base.yml)", ""]
    lines += ["| class | keys |", "|---|---|"] + [f"| {kind} | {counts[kind]} |" for kind in KINDS] + [""]
    for kind in (HONOURED, TRANSLATED, REFUSED, IGNORED):
        keys = sorted(k for k in in_base if KEYS[k].kind == kind)
        lines += [
            f"## {kind.capitalize()} ({len(keys)})",
            "",
            "| key | MaxText default | class | what nnxtron does |",
            "|---|---|---|---|",
        ]
        lines += [_row(k) for k in keys] + [""]
    lines += [
        f"## Keys not in MaxText {MAXTEXT_VERSION}'s base.yml ({len(extra)})",
        "",
        "MaxText's Linen switches, unknown to MaxText 0.2.5 as well (its Linen path is gone).",
        "",
        "| key | MaxText default | class | what nnxtron does |",
        "|---|---|---|---|",
    ]
    lines += [_row(k) for k in extra] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/maxtext.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is out of date: run python scripts/maxtext_keys_table.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
