"""`nnxtron plan --search`: the parallel configuration that fits and runs fastest.

``orchestrator`` runs the search (enumerate, prune, rank, compile best-first, report);
``space`` enumerates the candidates, ``cost`` is the step-time and memory model,
``hlo`` / ``hlo_cost`` read the collectives, FLOPs and memory traffic of a compiled
program, ``presets`` holds the device figures, ``pool`` + ``worker`` compile candidates in
parallel processes (``python -m nnxtron.tools.search.worker``), ``format`` prints the result.
"""

from __future__ import annotations

from nnxtron.tools.search.format import format_search
from nnxtron.tools.search.orchestrator import SearchRequest, search
from nnxtron.tools.search.presets import PRESETS, DevicePreset, measure_host_cpu, preset, with_memory

__all__ = ["PRESETS", "DevicePreset", "SearchRequest", "format_search", "measure_host_cpu", "preset", "search", "with_memory"]
