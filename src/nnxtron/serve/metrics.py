"""Prometheus text-format metrics for ``nnxtron serve`` (no client library).

``Metrics`` holds the server's own counters and latency distributions; ``render`` writes
them, together with the engine's gauges (``Engine.stats()``), in the Prometheus text
exposition format 0.0.4. Latencies are exported twice: as a histogram (cumulative
buckets, ``_sum``, ``_count``: aggregatable across servers) and as a summary of the most
recent observations with the quantiles 0.5, 0.9 and 0.99 (``..._recent_seconds``).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["LATENCY_BUCKETS", "QUANTILES", "Counter", "Histogram", "Metrics", "TokenRate"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
QUANTILES = (0.5, 0.9, 0.99)
RECENT = 1024  # observations the quantiles are computed over
RATE_WINDOW_S = 10.0  # tokens/s is the mean over this window

# engine stats key -> (metric name, type, help); other numeric keys are exported as nnxtron_engine_<key> gauges
ENGINE_STATS = {
    "queue_depth": ("nnxtron_queue_depth", "gauge", "Sequences waiting for a slot in the running batch."),
    "running": ("nnxtron_running_sequences", "gauge", "Sequences in the running batch."),
    "blocks_in_use": ("nnxtron_kv_blocks_in_use", "gauge", "KV cache blocks held by sequences (all block groups)."),
    "blocks_capacity": ("nnxtron_kv_blocks_capacity", "gauge", "KV cache blocks that can be handed out (all block groups)."),
    "growing_blocks_in_use": (
        "nnxtron_kv_growing_blocks_in_use",
        "gauge",
        "Blocks held in the caches that grow with their sequences (global caches).",
    ),
    "growing_blocks_capacity": (
        "nnxtron_kv_growing_blocks_capacity",
        "gauge",
        "Blocks of the caches that grow with their sequences (global caches).",
    ),
    "tokens_generated": ("nnxtron_generated_tokens_total", "counter", "Tokens the engine has sampled since it started."),
    "preemptions": ("nnxtron_preemptions_total", "counter", "Sequences preempted (blocks freed, recomputed later)."),
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{key}="{_escape(str(value))}"' for key, value in labels.items()) + "}"


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


class Counter:
    """A monotonic count per label set."""

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()):
        self.name, self.help, self.label_names = name, help_text, tuple(label_names)
        self.values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1, **labels: str) -> None:
        key = tuple(str(labels[name]) for name in self.label_names)
        with self._lock:
            self.values[key] = self.values.get(key, 0) + amount

    def value(self, **labels: str) -> float:
        return self.values.get(tuple(str(labels[name]) for name in self.label_names), 0)

    def lines(self) -> list[str]:
        out = _header(self.name, "counter", self.help)
        with self._lock:
            items = sorted(self.values.items())
        if not items and not self.label_names:
            items = [((), 0)]
        for key, value in items:
            out.append(f"{self.name}{_labels(dict(zip(self.label_names, key)))} {_number(value)}")
        return out


class Histogram:
    """Cumulative buckets, sum and count of every observation, and the quantiles of the last
    ``RECENT`` observations (exported as a summary named ``<base>_recent_seconds``)."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float] = LATENCY_BUCKETS, recent: int = RECENT):
        if not name.endswith("_seconds"):
            raise ValueError(f"histogram {name} must be in seconds (name ending in _seconds)")
        self.name, self.help, self.buckets = name, help_text, tuple(sorted(buckets))
        self.counts = [0] * len(self.buckets)
        self.sum, self.count = 0.0, 0
        self.recent: deque[float] = deque(maxlen=recent)
        self._lock = threading.Lock()

    @property
    def summary_name(self) -> str:
        return self.name.removesuffix("_seconds") + "_recent_seconds"

    def observe(self, value: float) -> None:
        with self._lock:
            self.sum += value
            self.count += 1
            self.recent.append(value)
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self.counts[i] += 1

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile of the recent observations (NaN if there are none)."""
        with self._lock:
            values = sorted(self.recent)
        if not values:
            return math.nan
        return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]

    def lines(self) -> list[str]:
        with self._lock:
            counts, total, count = list(self.counts), self.sum, self.count
        out = _header(self.name, "histogram", self.help)
        for bound, n in zip(self.buckets, counts):
            out.append(f'{self.name}_bucket{{le="{_number(float(bound))}"}} {n}')
        out += [f'{self.name}_bucket{{le="+Inf"}} {count}', f"{self.name}_sum {_number(total)}", f"{self.name}_count {count}"]
        recent = self.summary_name
        out += _header(recent, "summary", f"{self.help} Quantiles of the last {self.recent.maxlen} requests.")
        for q in QUANTILES:
            out.append(f'{recent}{{quantile="{q}"}} {_number(self.quantile(q))}')
        with self._lock:
            values = list(self.recent)
        out += [f"{recent}_sum {_number(float(sum(values)))}", f"{recent}_count {len(values)}"]
        return out


class TokenRate:
    """Tokens per second over the last ``window`` seconds (0.1 s buckets)."""

    def __init__(self, window: float = RATE_WINDOW_S, clock=time.monotonic):
        self.window, self.clock = window, clock
        self.started = clock()
        self.buckets: deque[list[float]] = deque()  # [bucket start, tokens]
        self._lock = threading.Lock()

    def add(self, tokens: int) -> None:
        now = self.clock()
        start = math.floor(now * 10) / 10
        with self._lock:
            if self.buckets and self.buckets[-1][0] == start:
                self.buckets[-1][1] += tokens
            else:
                self.buckets.append([start, tokens])
            self._prune(now)

    def _prune(self, now: float) -> None:
        while self.buckets and self.buckets[0][0] < now - self.window:
            self.buckets.popleft()

    def rate(self) -> float:
        now = self.clock()
        with self._lock:
            self._prune(now)
            tokens = sum(n for _, n in self.buckets)
        span = min(self.window, max(now - self.started, 1e-3))
        return tokens / span


class Metrics:
    """The server's metrics (updated on the event loop; safe from any thread)."""

    def __init__(self) -> None:
        self.requests = Counter(
            "nnxtron_requests_total", "HTTP requests answered, by endpoint and status code.", ("endpoint", "status")
        )
        self.finished = Counter(
            "nnxtron_sequences_finished_total",
            "Generated sequences (choices) by how they ended: stop, length, cancelled (client gone), timeout, error.",
            ("reason",),
        )
        self.prompt_tokens = Counter("nnxtron_prompt_tokens_total", "Prompt tokens of the requests the engine accepted.")
        self.completion_tokens = Counter("nnxtron_completion_tokens_total", "Tokens delivered to requests.")
        self.ttft = Histogram(
            "nnxtron_time_to_first_token_seconds", "Time from a request's arrival to its first generated token."
        )
        self.latency = Histogram("nnxtron_request_latency_seconds", "Time from a request's arrival to its last generated token.")
        self.rate = TokenRate()
        self.in_flight = 0  # generation requests being answered

    def render(self, stats: Mapping[str, float] | None = None) -> str:
        """All metrics in the Prometheus text format (``stats``: ``Engine.stats()``)."""
        out: list[str] = []
        for counter in (self.requests, self.finished, self.prompt_tokens, self.completion_tokens):
            out += counter.lines()
        out += _header("nnxtron_requests_in_flight", "gauge", "Completion requests being answered.")
        out.append(f"nnxtron_requests_in_flight {self.in_flight}")
        out += _header(
            "nnxtron_generation_tokens_per_second", "gauge", f"Tokens delivered per second over the last {RATE_WINDOW_S:g} s."
        )
        out.append(f"nnxtron_generation_tokens_per_second {_number(self.rate.rate())}")
        out += self.ttft.lines() + self.latency.lines()
        out += _engine_lines((stats or {}).items())
        return "\n".join(out) + "\n"


def _engine_lines(stats: Iterable[tuple[str, float]]) -> list[str]:
    out: list[str] = []
    for key, value in stats:
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        name, kind, help_text = ENGINE_STATS.get(key, (f"nnxtron_engine_{key}", "gauge", f"Engine statistic {key}."))
        out += _header(name, kind, help_text)
        out.append(f"{name} {_number(value)}")
    return out
