"""The server's Prometheus metrics (GET /metrics), in a registry of its own so that one process
can run several servers (tests do).

The names and meanings are vLLM's (vllm/v1/metrics/loggers.py) with the `vllm:` prefix replaced
by `inferlab:`, so that a dashboard made for vLLM needs only the prefix changed; every series
carries vLLM's `model_name` and `engine` labels. docs/serving.md maps each name to vLLM's.

The engine's gauges (running and waiting requests, KV cache use, preemptions, prefix-cache
tokens) are read at scrape time from the snapshot the engine loop takes after each step. The
engine loop records generated tokens each step, and each request's times on the engine (queue,
prefill, decode, inference, between tokens) and lengths as it finishes. As in vLLM, where its
frontend handles the engine's outputs, TTFT and e2e are taken on the HTTP side (the event loop),
from the request's arrival at the HTTP server to its first and last tokens reaching its response.
"""

import threading
from bisect import bisect_left
from collections.abc import Callable, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from inferlab.core.request import Request

PREFIX = "inferlab:"
LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")

# Seconds. Each holds vLLM's own buckets, so that a dashboard's thresholds find theirs, and finer
# ones below, where a GPU's TTFTs and TPOTs lie: between vLLM's 1 ms and 10 ms a quantile
# interpolated within one bucket is off by up to half of it.
TTFT_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.06,
    0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_INTERVAL_BUCKETS = (
    0.0001, 0.0002, 0.0003, 0.0004, 0.0005, 0.0006, 0.0007, 0.0008, 0.0009, 0.001, 0.0011, 0.0012,
    0.0013, 0.0014, 0.0015, 0.00175, 0.002, 0.0025, 0.003, 0.0035, 0.004, 0.005, 0.006, 0.0075,
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5,
    5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def buckets_1_2_5(largest: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to largest (vLLM's buckets of token counts)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > largest:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class Histogram:
    """A Prometheus histogram kept as counts per bucket, so that a request's intervals between
    tokens are observed in one vectorized call instead of one Python call a token."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]):
        self.name = PREFIX + name
        self.documentation = documentation
        self.bounds = [float(b) for b in buckets]
        self.counts = np.zeros(len(self.bounds) + 1, dtype=np.int64)  # the last counts what lies above all bounds
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # Prometheus' buckets hold what is <= their bound
        self.sum += value

    def observe_many(self, values: np.ndarray) -> None:
        if len(values):
            where = np.searchsorted(self.bounds, values, side="left")
            self.counts += np.bincount(where, minlength=len(self.counts))
            self.sum += float(values.sum())

    def family(self, labels: list[str], name: str | None = None) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name or self.name, self.documentation, labels=LABELS)
        cumulative = np.cumsum(self.counts).tolist()
        buckets = [(floatToGoString(b), c) for b, c in zip(self.bounds, cumulative)]
        family.add_metric(labels, [*buckets, ("+Inf", cumulative[-1])], self.sum)
        return family


class ServerMetrics:
    """The metrics one server exports, in its own registry. The engine loop's thread and the
    event loop record them, under `lock`; scrapes read them on the event loop."""

    def __init__(
        self, snapshot: Callable, model_name: str, max_model_len: int, cache_config: dict[str, str] | None = None
    ):
        """snapshot: returns the engine loop's latest EngineSnapshot; cache_config: the labels of
        inferlab:cache_config_info (block_size, num_gpu_blocks, ...)."""
        self.snapshot = snapshot
        self.labels = [model_name, "0"]
        self.cache_config = dict(cache_config or {})
        self.lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        self.http_errors: dict[str, int] = {}
        lengths = buckets_1_2_5(max_model_len)
        self.ttft = Histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds: from the request's arrival at the HTTP server.",
            TTFT_BUCKETS,
        )
        self.inter_token = Histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TOKEN_INTERVAL_BUCKETS
        )
        self.request_tpot = Histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_INTERVAL_BUCKETS,
        )
        self.e2e = Histogram(
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds: from the request's arrival at the HTTP server.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = Histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = Histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = Histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = Histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = Histogram("request_prompt_tokens", "Number of prefill tokens processed.", lengths)
        self.request_generation_tokens = Histogram(
            "request_generation_tokens", "Number of generation tokens processed.", lengths
        )
        self.request_prefill_kv_computed_tokens = Histogram(
            "request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            lengths,
        )
        self.request_max_tokens = Histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", lengths
        )
        self.iteration_tokens = Histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS
        )
        self.histograms = [
            self.ttft,
            self.inter_token,
            self.request_tpot,
            self.e2e,
            self.queue,
            self.inference,
            self.prefill,
            self.decode,
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.request_prefill_kv_computed_tokens,
            self.request_max_tokens,
            self.iteration_tokens,
        ]
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)

    # -- recorded by the engine loop -------------------------------------------------------------

    def observe_step(self, num_tokens: int, num_generated: int) -> None:
        """One engine step: the tokens it computed, and the output tokens it made known."""
        with self.lock:
            self.iteration_tokens.observe(num_tokens)
            self.generation_tokens += num_generated

    def observe_finished(self, request: Request, reason: str) -> None:
        """A request ended (any reason): its times on the engine, as vLLM splits them, and its
        lengths."""
        times = request.token_times
        scheduled = request.first_scheduled_time
        with self.lock:
            self.request_success[reason] = self.request_success.get(reason, 0) + 1
            if scheduled is not None:
                self.queue.observe(scheduled - request.arrival_time)
                self.request_prefill_kv_computed_tokens.observe(request.num_prompt_tokens - request.num_cached_tokens)
            if times and scheduled is not None:
                self.prefill.observe(times[0] - scheduled)
                self.inference.observe(times[-1] - scheduled)
            if times:
                self.decode.observe(times[-1] - times[0])
            if len(times) > 1:
                self.inter_token.observe_many(np.diff(times))
                self.request_tpot.observe((times[-1] - times[0]) / (len(times) - 1))
            self.request_prompt_tokens.observe(request.num_prompt_tokens)
            self.request_generation_tokens.observe(len(times))
            self.request_max_tokens.observe(request.params.max_tokens)

    # -- recorded by the HTTP side, on the event loop ----------------------------------------------

    def observe_first_token(self, num_prompt_tokens: int, ttft: float) -> None:
        """A choice's first tokens reached its response, ttft seconds after the request reached
        the HTTP server."""
        with self.lock:
            self.ttft.observe(ttft)
            self.prompt_tokens += num_prompt_tokens

    def observe_e2e(self, seconds: float) -> None:
        """A choice's last tokens reached its response, this long after the request reached the
        HTTP server."""
        with self.lock:
            self.e2e.observe(seconds)

    def count_http_error(self, status: int) -> None:
        with self.lock:
            self.http_errors[str(status)] = self.http_errors.get(str(status), 0) + 1

    # -- read by scrapes -------------------------------------------------------------------------

    def collect(self):
        labels = self.labels
        s = self.snapshot()

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, documentation, labels=LABELS)
            family.add_metric(labels, value)
            return family

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, documentation, labels=LABELS)
            family.add_metric(labels, value)
            return family

        yield gauge("num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        usage = 1 - s.num_free_blocks / s.num_blocks if s.num_blocks else 0.0
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield counter("num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions)
        yield counter(
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_queried_tokens,
        )
        yield counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_hit_tokens
        )
        info = GaugeMetricFamily(
            PREFIX + "cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*LABELS, *self.cache_config],
        )
        info.add_metric([*labels, *self.cache_config.values()], 1)
        yield info
        with self.lock:  # a consistent copy: the engine loop's thread records while a scrape reads
            families = [
                counter("prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
                counter("generation_tokens", "Number of generation tokens processed.", self.generation_tokens),
            ]
            success = CounterMetricFamily(
                PREFIX + "request_success",
                "Count of successfully processed requests.",
                labels=[*LABELS, "finished_reason"],
            )
            for reason, count in self.request_success.items():
                success.add_metric([*labels, reason], count)
            errors = CounterMetricFamily(
                PREFIX + "http_errors", "Requests answered with an error, by HTTP status.", labels=[*LABELS, "status"]
            )
            for status, count in sorted(self.http_errors.items()):
                errors.add_metric([*labels, status], count)
            families += [success, errors, *(h.family(labels) for h in self.histograms)]
            # vLLM's older name for the same intervals, which dashboards made for vLLM still read
            families.append(self.inter_token.family(labels, PREFIX + "time_per_output_token_seconds"))
        yield from families

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
