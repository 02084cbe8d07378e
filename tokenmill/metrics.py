"""Prometheus metrics of one server, in a registry of its own (several servers can share a process).

Engine state (running / waiting requests, KV usage of live requests and of the prefix cache,
preemptions, prefix-cache hit rate) is read from ``Engine.stats()`` at scrape time; tokens,
finish reasons and latencies are recorded by the server per engine request through a
:class:`RequestTracker`. ``render`` blocks on the engine thread for a snapshot: call it off the
event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.engine.engine import Engine, EngineDeadError
from tokenmill.request import RequestOutput

Stats = dict[str, Any]


def _hit_rate(stats: Stats) -> float:
    cache = stats["cache"]
    return cache["prefix_hit_tokens"] / cache["prefix_query_tokens"] if cache["prefix_query_tokens"] else 0.0


# name, help, family, value from Engine.stats()
_ENGINE_METRICS: list[tuple[str, str, type[Metric], Callable[[Stats], float]]] = [
    ("tokenmill_num_requests_running", "Sequences being computed.", GaugeMetricFamily, lambda s: s["running"]),
    ("tokenmill_num_requests_waiting", "Sequences waiting to be admitted.", GaugeMetricFamily, lambda s: s["waiting"]),
    (
        "tokenmill_kv_cache_usage_ratio",
        "Fraction of KV pages held by live requests (0 when idle; prefix-cache-only pages are reclaimable, not used).",
        GaugeMetricFamily,
        lambda s: s["kv_usage"],
    ),
    (
        "tokenmill_prefix_cache_usage_ratio",
        "Fraction of KV pages held only by the prefix cache (reclaimable: evicted when live requests need them).",
        GaugeMetricFamily,
        lambda s: s["kv_prefix_cache_usage"],
    ),
    (
        "tokenmill_prefix_cache_hit_rate",
        "Prompt tokens served from the prefix cache / prompt tokens looked up.",
        GaugeMetricFamily,
        _hit_rate,
    ),
    (
        "tokenmill_num_preemptions",
        "Sequences preempted for lack of KV pages.",
        CounterMetricFamily,
        lambda s: s["scheduler"]["preemptions"],
    ),
]


class _EngineCollector(Collector):
    """Reads one ``Engine.stats()`` snapshot per scrape; reports nothing once the engine is dead."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def describe(self) -> Iterable[Metric]:
        engine = [family(name, doc) for name, doc, family, _ in _ENGINE_METRICS]
        return engine + _speculation_metrics(None) + _tier_metrics(None) + _lora_metrics(None)

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self._engine.stats()
        except EngineDeadError:
            return []
        engine = [family(name, doc, value=value(stats)) for name, doc, family, value in _ENGINE_METRICS]
        return engine + _speculation_metrics(stats) + _tier_metrics(stats) + _lora_metrics(stats)


# name, help, family, the counter's key in a tier's snapshot (engine stats' "host_tier", "disk_tier")
_TIER_METRICS: list[tuple[str, str, type[Metric], str]] = [
    (
        "tokenmill_kv_tier_hit_tokens",
        "Prompt tokens served from a KV cache tier (device: the prefix cache; host: copied back from "
        "memory; disk: read back from files).",
        CounterMetricFamily,
        "hit_tokens",
    ),
    (
        "tokenmill_kv_tier_query_tokens",
        "Prompt tokens looked up in a KV cache tier (the host and disk tiers see those past the device's match).",
        CounterMetricFamily,
        "query_tokens",
    ),
    ("tokenmill_kv_tier_bytes", "Bytes a KV cache tier's blocks take.", GaugeMetricFamily, "bytes"),
    ("tokenmill_kv_tier_read_bytes", "Bytes read back from a tier.", CounterMetricFamily, "read_bytes"),
    ("tokenmill_kv_tier_read_seconds", "Seconds reading them.", CounterMetricFamily, "read_seconds"),
    ("tokenmill_kv_tier_write_bytes", "Bytes written to a tier.", CounterMetricFamily, "write_bytes"),
    ("tokenmill_kv_tier_write_seconds", "Seconds writing them (disk).", CounterMetricFamily, "write_seconds"),
    (
        "tokenmill_kv_tier_dropped_writes",
        "Blocks not written (writer queue full, disk full, write error): requests never wait for a write.",
        CounterMetricFamily,
        "dropped_writes",
    ),
    (
        "tokenmill_kv_tier_rejected_files",
        "Corrupt, truncated or foreign block files deleted instead of served.",
        CounterMetricFamily,
        "rejected_files",
    ),
    (
        "tokenmill_kv_tier_evicted_blocks",
        "Blocks the host tier dropped past its byte budget (the disk tier, if any, still holds them).",
        CounterMetricFamily,
        "evicted_blocks",
    ),
]


def _tier_metrics(stats: Stats | None) -> list[Metric]:
    """Per tier (label ``tier``): the device's prefix cache (hits and lookups), and the host and disk
    tiers (the counters each keeps; no samples without the tier). ``stats`` None: the families only."""
    families = {name: family(name, doc, labels=["tier"]) for name, doc, family, _ in _TIER_METRICS}
    if stats is not None:
        cache = stats["cache"]
        families["tokenmill_kv_tier_hit_tokens"].add_metric(["device"], cache["prefix_hit_tokens"])
        families["tokenmill_kv_tier_query_tokens"].add_metric(["device"], cache["prefix_query_tokens"])
        for tier in ("host", "disk"):
            counters = stats[f"{tier}_tier"] or {}
            for name, _, _, key in _TIER_METRICS:
                if key in counters:
                    families[name].add_metric([tier], counters[key])
    return list(families.values())


def _lora_metrics(stats: Stats | None) -> list[Metric]:
    """LoRA adapters loaded, holding a slot, and slot loads (no samples without ``enable_lora``;
    ``stats`` None: the families only)."""
    lora = stats["lora"] if stats is not None else None
    families = [
        GaugeMetricFamily("tokenmill_lora_adapters_loaded", "LoRA adapters loaded (requests may name them)."),
        GaugeMetricFamily("tokenmill_lora_adapters_resident", "LoRA adapters holding one of the max_loras slots."),
        CounterMetricFamily("tokenmill_lora_slot_loads", "Adapters put into a slot (first use, or after an eviction)."),
    ]
    if lora is not None:
        for family, key in zip(families, ("loaded", "resident", "slot_loads")):
            family.add_metric([], lora[key])
    return families


def _speculation_metrics(stats: Stats | None) -> list[Metric]:
    """Proposed and accepted tokens and the acceptance rate, labelled by the proposer's method (no
    samples while speculative decoding is off; ``stats`` None: the families only)."""
    spec = stats["speculative"] if stats is not None else None
    families = [
        CounterMetricFamily("tokenmill_spec_decode_num_draft_tokens", "Tokens proposed.", labels=["method"]),
        CounterMetricFamily("tokenmill_spec_decode_num_accepted_tokens", "Proposed tokens emitted.", labels=["method"]),
        GaugeMetricFamily(
            "tokenmill_spec_decode_acceptance_rate", "Accepted / proposed tokens since start.", labels=["method"]
        ),
    ]
    if spec is not None:
        proposed, accepted = spec["proposed_tokens"], spec["accepted_tokens"]
        for family, value in zip(families, (proposed, accepted, accepted / proposed if proposed else 0.0)):
            family.add_metric([spec["method"]], value)
    return families


class ServerMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.prompt_tokens = Counter("tokenmill_prompt_tokens", "Prompt tokens of served requests.", registry=reg)
        self.generation_tokens = Counter("tokenmill_generation_tokens", "Generated tokens.", registry=reg)
        self.finished = Counter(
            "tokenmill_finished_completions",
            "Completions (choices) finished, by finish reason.",
            ["finish_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            "tokenmill_time_to_first_token_seconds",
            "From request arrival to its first token.",
            registry=reg,
            buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40),
        )
        self.itl = Histogram(
            "tokenmill_inter_token_latency_seconds",
            "Between consecutive outputs of a request.",
            registry=reg,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.e2e = Histogram(
            "tokenmill_e2e_request_latency_seconds",
            "From request arrival to its last token.",
            registry=reg,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300),
        )
        reg.register(_EngineCollector(engine))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (blocks for an engine snapshot)."""
        return generate_latest(self.registry)


class RequestTracker:
    """Tokens, finish reasons and latencies of one engine request, fed its deltas as they arrive.

    ``arrival`` is the ``time.monotonic()`` at which the server received the HTTP request.
    ``close`` counts the completions that never finished (the client went away) as aborted.
    """

    def __init__(self, metrics: ServerMetrics, arrival: float, prompt_tokens: int, n: int) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self._last_output: float | None = None
        self._unfinished = n
        metrics.prompt_tokens.inc(prompt_tokens)

    def observe(self, delta: RequestOutput) -> None:
        m, t = self._metrics, time.monotonic()
        tokens = sum(len(out.token_ids) for out in delta.outputs)
        if tokens:
            m.generation_tokens.inc(tokens)
            if self._last_output is None:
                m.ttft.observe(t - self._arrival)
            else:
                m.itl.observe(t - self._last_output)
            self._last_output = t
        for out in delta.outputs:
            if out.finish_reason is not None:
                m.finished.labels(out.finish_reason).inc()
                self._unfinished -= 1
        if delta.finished:
            m.e2e.observe(t - self._arrival)

    def close(self) -> None:
        if self._unfinished > 0:
            self._metrics.finished.labels("abort").inc(self._unfinished)
            self._unfinished = 0
