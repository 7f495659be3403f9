"""Every place in ``src/nnxtron`` that reads a config key: ``nnxtron config readers [KEY ...]``.

A read site is an attribute read, found in the AST (not by a regex over ``cfg.``), of

- a ``Config`` (kind ``attribute``; ``getattr(cfg, "key")``: ``getattr``): a parameter
  annotated ``Config``, a ``cfg`` / unannotated ``config`` parameter, a name assigned from
  one (``c = cfg``) or from a function annotated to return a Config (``load_config``), any
  ``X.config`` / ``X.cfg`` attribute, ``self`` inside ``Config``, and a lambda given where
  a ``Callable[[Config], ...]`` field is (``inert.ReadOnlyWhen``);
- a ``Config`` property (kind ``property``: ``cfg.pipeline_stages`` reads the keys its body
  reads, found in ``schema.py``);
- an object built from the config (kind ``derived``): an attribute of a
  :data:`~nnxtron.tools.read_carriers.CARRIERS` class carries the keys that table gives it
  (``spec.scan_repeats`` reads ``scan_pipeline_repeats``); its holders are found the same
  way (annotations, builder results such as ``pipeline_spec(cfg)``, ``X.from_config(cfg)``,
  ``self.spec`` of a class that stores one).

Reads whose key is not in the source are listed too, with key ``*``: ``getattr(cfg, name)``
(kind ``dynamic``) and the whole config at once (``model_dump``, ``dict(cfg)``: ``whole``).
Each site has the file, line, column and the qualified function (``Class.method``,
``outer.inner``; ``<module>`` at top level); sites sort by key, file, line, column.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from nnxtron.tools.read_carriers import GENERIC_ONLY
from nnxtron.tools.read_scan import KEYS, Site, scan

__all__ = ["KEYS", "Site", "format_sites", "keys_without_sites", "package_sources", "read_sites", "scan", "sites_json"]

PACKAGE = Path(__file__).resolve().parents[1]  # src/nnxtron


def package_sources(package: Path = PACKAGE) -> dict[str, str]:
    """Every module of the package, by its path as shown (``src/nnxtron/...`` in a checkout)."""
    base = package.parent.parent if package.parent.name == "src" else package.parent
    return {p.relative_to(base).as_posix(): p.read_text() for p in sorted(package.rglob("*.py"))}


def read_sites(keys: Iterable[str] = ()) -> list[Site]:
    """The read sites of the package, sorted; with ``keys``, those keys' only (no ``*`` reads)."""
    wanted = set(keys)
    return [s for s in scan(package_sources()) if not wanted or s.key in wanted]


def keys_without_sites(sites: Iterable[Site], keys: Iterable[str] = ()) -> list[str]:
    """Config keys (of ``keys``, default all) that no site names: read only through ``*`` reads, or unread."""
    return sorted(set(keys or KEYS) - {s.key for s in sites})


def format_sites(sites: list[Site], keys: Iterable[str] = ()) -> list[str]:
    """The text table, one site a line: KEY  FILE:LINE  FUNCTION  READ  [kind: via] (an attribute
    read shows no kind); then each key no site names, with why; then the counts."""
    rows = [
        (s.key, f"{s.file}:{s.line}", s.function, s.expr if len(s.expr) <= 60 else s.expr[:57] + "...",
         "" if s.kind == "attribute" else f"[{s.kind}{': ' + s.via if s.via else ''}]")
        for s in sites
    ]  # fmt: skip
    widths = [max((len(r[i]) for r in rows), default=0) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, [*widths, 0])).rstrip() for row in rows]
    for key in keys_without_sites(sites, keys):
        lines.append(f"{key}  (no read site names it: {GENERIC_ONLY.get(key, 'UNREAD, no reason listed')})")
    named = [s for s in sites if s.key != "*"]
    keys_named = len({s.key for s in named})
    anything = f", {len(sites) - len(named)} reads of any key (key *)" if not keys else ""
    lines.append(f"# {_count(len(named), 'read site')} of {_count(keys_named, 'key')}{anything} (nnxtron/tools/read_sites.py)")
    return lines


def sites_json(sites: list[Site], keys: Iterable[str] = ()) -> str:
    """The sites as one JSON object: ``sites`` (key null for a read of any key, ``id`` =
    file:line:col:key) and ``keys_without_sites`` (key -> why, null when unread)."""
    return json.dumps(
        {
            "sites": [{"id": s.id, **asdict(s), "key": None if s.key == "*" else s.key} for s in sites],
            "keys_without_sites": {key: GENERIC_ONLY.get(key) for key in keys_without_sites(sites, keys)},
        },
        indent=1,
    )


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"
