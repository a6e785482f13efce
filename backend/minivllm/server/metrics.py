"""Prometheus metrics with vLLM's names under a `minivllm:` prefix (prometheus_client).

Gauges and counters are read from the engine at scrape time, on the engine thread; latency
histograms are observed when a request served by the API finishes.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from minivllm.engine.api import EngineStats, RequestOutput
from minivllm.events.types import DiskTierStats, MemorySplit

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)


@dataclass
class EngineGauges:
    """An engine's stats at scrape time, labelled with the model's name (and the replica's index
    when replicas run: one EngineGauges each)."""

    model: str
    stats: EngineStats
    replica: str | None = None


class _Families:
    """Metric families filled one engine at a time: each series gets the engine's labels."""

    def __init__(self, replicas: bool) -> None:
        self.labels = ["model_name", "replica"] if replicas else ["model_name"]
        self.families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        self.key: list[str] = []

    def add(self, kind, name: str, doc: str, value: float, **extra: str) -> None:
        family = self.families.get(name)
        if family is None:
            family = self.families[name] = kind(f"minivllm:{name}", doc, labels=[*self.labels, *extra])
        family.add_metric([*self.key, *extra.values()], value)

    def gauge(self, name: str, doc: str, value: float, **extra: str) -> None:
        self.add(GaugeMetricFamily, name, doc, value, **extra)

    def counter(self, name: str, doc: str, value: float, **extra: str) -> None:
        self.add(CounterMetricFamily, name, doc, value, **extra)


class _EngineCollector(Collector):
    def __init__(self) -> None:
        self.values: list[EngineGauges] = []

    def collect(self):
        if not self.values:
            return
        out = _Families(replicas=self.values[0].replica is not None)
        for engine in self.values:
            out.key = [engine.model] + ([engine.replica] if engine.replica is not None else [])
            _engine_series(out, engine.stats)
        yield from out.families.values()


def _engine_series(out: _Families, v: EngineStats) -> None:
    gauge, counter = out.gauge, out.counter
    gauge("num_requests_running", "Requests in the running batch.", v.num_running)
    gauge("num_requests_waiting", "Requests waiting to be scheduled.", v.num_waiting)
    gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", v.kv_usage)
    counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", v.prefix_cache_queries)
    counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", v.prefix_cache_hits)
    counter("num_preemptions", "Preemptions since the engine was (re)configured.", v.num_preemptions)
    counter("prompt_tokens", "Prompt tokens computed (prefill).", v.prompt_tokens)
    counter("generation_tokens", "Tokens generated.", v.generation_tokens)
    # speculative decoding, with vLLM's names
    counter("spec_decode_num_drafts", "Verify steps with at least one drafted token.", v.spec_num_drafts)
    counter("spec_decode_num_draft_tokens", "Drafted tokens verified.", v.spec_num_draft_tokens)
    counter("spec_decode_num_accepted_tokens", "Drafted tokens accepted.", v.spec_num_accepted_tokens)
    for position, value in enumerate(v.spec_accepted_per_position):
        counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Drafted tokens accepted, by position in the draft (0 = first).",
            value,
            position=str(position),
        )
    if v.memory is not None:
        _memory(gauge, v.memory)
    if v.disk_tier is not None:
        _disk_tier(gauge, counter, v.disk_tier)


MEMORY_PARTS = ("weights", "kv_cache", "compiled", "torch", "libraries", "other")


def _disk_tier(gauge, counter, d: DiskTierStats) -> None:
    """The prefix cache's disk tier (--kv-offload-dir)."""
    counter("kv_disk_blocks_written", "KV blocks written to the disk tier.", d.blocks_written)
    counter("kv_disk_blocks_read", "KV blocks read back from the disk tier instead of recomputed.", d.blocks_read)
    counter("kv_disk_blocks_recomputed", "Blocks on disk recomputed: that measured cheaper.", d.blocks_recomputed)
    counter("kv_disk_write_errors", "Block writes that failed (a full disk): those stay RAM-only.", d.write_errors)
    counter("kv_disk_corrupt_files", "Block files that failed their checks: deleted and recomputed.", d.corrupt_files)
    gauge("kv_disk_bytes", "Bytes the disk tier holds.", d.bytes_on_disk)
    gauge("kv_disk_max_bytes", "The disk tier's bound (--kv-offload-size).", d.max_bytes)


def _memory(gauge, split: MemorySplit) -> None:
    """The RSS split (engine/memory_view.py): one series per part the platform can measure; they sum
    to process_resident_memory_bytes as of the split's sample (taken every few seconds)."""
    for part in MEMORY_PARTS:
        if (value := getattr(split, part)) is not None:
            gauge("memory_bytes", "Resident memory by part (sums to the RSS).", value, part=part)
    gauge("kv_cache_reserved_bytes", "The KV pool's allocation, resident or not.", split.kv_reserved)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, CPU seconds, open fds
        labels = ["model_name"]
        self.ttft = Histogram(
            "minivllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "minivllm:time_per_output_token_seconds",
            "Time per output token after the first.",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "minivllm:e2e_request_latency_seconds",
            "Request latency, arrival to finish.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue = Histogram(
            "minivllm:request_queue_time_seconds",
            "Time waiting before first scheduled.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.success = Counter(
            "minivllm:request_success",
            "Requests finished, by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )

    def observe(self, model: str, out: RequestOutput) -> None:
        """A request finished: record its latencies."""
        m = out.metrics
        if m.ttft is not None:
            self.ttft.labels(model).observe(m.ttft)
        if m.queue_time is not None:
            self.queue.labels(model).observe(m.queue_time)
        if m.e2e_latency is not None:
            self.e2e.labels(model).observe(m.e2e_latency)
        if m.finished_time is not None and m.first_token_time is not None:
            for o in out.outputs:
                if o.num_tokens > 1:
                    self.tpot.labels(model).observe((m.finished_time - m.first_token_time) / (o.num_tokens - 1))
        for o in out.outputs:
            self.success.labels(model, o.finish_reason or "unknown").inc()

    def render(self, gauges: EngineGauges | list[EngineGauges] | None) -> bytes:
        """`gauges`: the one engine's, or each replica's (None: no engine is running)."""
        self._engine.values = [gauges] if isinstance(gauges, EngineGauges) else gauges or []
        return generate_latest(self.registry)
