"""The server's Prometheus metrics (GET /metrics), in a registry of its own so that one process
can run several servers (tests do).

The engine's gauges (running and waiting requests, KV blocks, preemptions, prefix-cache tokens)
are read at scrape time from the snapshot the engine loop takes after each step; latencies and
token counts are recorded as requests finish and steps produce tokens.
"""

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from inferlab.core.request import Request

# Seconds: from a millisecond (a decode step on a GPU) to minutes (a long queue).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class EngineCollector:
    """The engine's state at scrape time, from the engine loop's latest snapshot."""

    def __init__(self, snapshot: Callable):
        self.snapshot = snapshot

    def collect(self):
        s = self.snapshot()
        yield GaugeMetricFamily("inferlab_requests_running", "Requests the engine is computing.", s.num_running)
        yield GaugeMetricFamily("inferlab_requests_waiting", "Requests waiting for admission.", s.num_waiting)
        yield GaugeMetricFamily("inferlab_kv_cache_blocks", "KV cache blocks in all.", s.num_blocks)
        yield GaugeMetricFamily("inferlab_kv_cache_free_blocks", "KV cache blocks no request holds.", s.num_free_blocks)
        usage = 1 - s.num_free_blocks / s.num_blocks if s.num_blocks else 0.0
        yield GaugeMetricFamily("inferlab_kv_cache_usage_ratio", "Fraction of KV blocks held by requests.", usage)
        yield CounterMetricFamily(
            "inferlab_preemptions", "Requests evicted and later recomputed.", value=s.num_preemptions
        )
        yield CounterMetricFamily(
            "inferlab_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", value=s.prefix_hit_tokens
        )
        yield CounterMetricFamily(
            "inferlab_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache.",
            value=s.prefix_queried_tokens,
        )


class ServerMetrics:
    """The metrics one server exports, in its own registry."""

    def __init__(self, snapshot: Callable):
        """snapshot: returns the engine loop's latest EngineSnapshot."""
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.ttft = Histogram(
            "inferlab_time_to_first_token_seconds",
            "From a request's arrival at the engine to its first output token.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "inferlab_time_per_output_token_seconds",
            "A request's mean time per output token after the first.",
            buckets=TPOT_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "inferlab_e2e_request_latency_seconds",
            "From a request's arrival at the engine to its finish.",
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter("inferlab_prompt_tokens", "Prompt tokens of requests added.", registry=registry)
        self.generation_tokens = Counter("inferlab_generation_tokens", "Output tokens generated.", registry=registry)
        self.finished = Counter(
            "inferlab_requests_finished", "Requests finished, by reason.", ["finish_reason"], registry=registry
        )
        self.http_errors = Counter(
            "inferlab_http_errors", "Requests answered with an error, by status.", ["status"], registry=registry
        )
        registry.register(EngineCollector(snapshot))

    def observe_finished(self, request: Request, reason: str) -> None:
        times = request.token_times
        if times:
            self.ttft.observe(times[0] - request.arrival_time)
            if len(times) > 1:
                self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))
        if request.finish_time is not None:
            self.e2e.observe(request.finish_time - request.arrival_time)
        self.finished.labels(reason).inc()

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
