"""Latency figures of a run, from one record per request, and their mean and spread over repeats.

Every time is in seconds on one clock (the driver's, e.g. perf_counter minus the run's start).
Per request:
- TTFT (`ttft_s`): first_token_s - arrival_s;
- TPOT (`tpot_s`): (finish_s - first_token_s) / (num_output_tokens - 1); a request with one output
  token has none;
- ITL (`itl_s`): each gap between consecutive output tokens' times (pooled over requests);
- E2E (`e2e_s`): finish_s - arrival_s; queue (`queue_s`): first_scheduled_s - arrival_s;
- normalized latency (`normalized_latency_s`): e2e / num_output_tokens, as Orca and vLLM report it.
Each is summarized as {mean, p50, p90, p99}; percentiles interpolate linearly between the two
nearest ranks (numpy's default, as vLLM's benchmark computes them).

Run figures: request_throughput = completed requests (finished by length or a stop, not aborted
or refused with an error) / wall_time_s, output_tokens_per_s = output tokens / wall_time_s;
num_failed_requests and num_aborted_requests count the others. With SLOs (bench.slo_ttft_s, bench.slo_tpot_s), a request attains them when its TTFT
and TPOT are at most the given bounds (one without TPOT meets any TPOT bound; one that produced no
token misses all); slo_attainment is the fraction that does and goodput the number that does per
second of the run (DistServe's goodput, as vLLM's serving benchmark computes it). jain_fairness is
Jain's index (sum x)^2 / (n sum x^2) over the requests' normalized latencies: 1 when every request
waits the same time per output token, towards 1/n when one request bears all the waiting.
When requests carry more than one priority, per_priority holds each priority's count, TTFT and
E2E, and with a request metadata key "tenant", per_tenant holds each tenant's.
"""

import json
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields

import numpy as np

PERCENTILES = (50, 90, 99)
UNSERVED = ("error", "abort")  # finish reasons of requests that did not complete
DISTRIBUTIONS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s", "normalized_latency_s")


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Build one from a dict with RequestRecord(**d)."""

    request_id: int | str
    arrival_s: float  # when it arrived (was due to be submitted)
    first_scheduled_s: float | None  # when a step first computed any of it; None if none ever did
    first_token_s: float | None  # when its first output token became known on the host; None if none did
    token_times_s: list[float]  # when each output token became known; the first is first_token_s
    finish_s: float  # when it finished (its last token known, or aborted / failed)
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache rather than computed
    num_preemptions: int = 0  # times it was evicted and recomputed
    priority: int = 0
    metadata: dict = field(default_factory=dict)
    finish_reason: str = "length"  # "length", "stop", "abort", or "error" (never served)
    error: str | None = None  # why it could not be served (finish_reason "error")

    def __post_init__(self):
        where = f"request {self.request_id!r}"
        if len(self.token_times_s) != self.num_output_tokens:
            raise ValueError(
                f"{where}: {len(self.token_times_s)} token times for {self.num_output_tokens} output tokens"
            )
        if self.num_output_tokens and (self.first_token_s is None or self.token_times_s[0] != self.first_token_s):
            raise ValueError(f"{where}: first_token_s {self.first_token_s} must equal its first token time")
        if not self.num_output_tokens and self.first_token_s is not None:
            raise ValueError(f"{where}: first_token_s is set but it has no output tokens")
        if self.first_token_s is not None and self.first_scheduled_s is None:
            raise ValueError(f"{where}: it has a first token but was never scheduled")
        times = [self.arrival_s, self.first_scheduled_s, *self.token_times_s, self.finish_s]
        known = [t for t in times if t is not None]
        if any(map(operator.gt, known, known[1:])):  # an earlier time after a later one
            raise ValueError(
                f"{where}: times must not go back: arrival {self.arrival_s} <= first scheduled "
                f"{self.first_scheduled_s} <= token times <= finish {self.finish_s}"
            )

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s

    @property
    def normalized_latency_s(self) -> float | None:
        return self.e2e_s / self.num_output_tokens if self.num_output_tokens else None


@dataclass(slots=True)
class StepRecord:
    """One engine step: when it ran and what its batch held."""

    start_s: float
    end_s: float
    num_prefill_tokens: int  # prompt tokens computed (prefix-cache hits are not)
    num_decode_tokens: int
    num_seqs: int  # requests in the batch


@dataclass
class RunRecords:
    """Everything one run of the workload recorded: its requests, its steps, and its wall time
    (from the run's start, t=0 of the arrival clock, to the end of the step that finished its
    last request)."""

    requests: list[RequestRecord]
    steps: list[StepRecord]
    wall_time_s: float


def distribution(values: Iterable[float]) -> dict:
    """{mean, p50, p90, p99} of values (every entry None when there are none)."""
    array = np.asarray(list(values), dtype=np.float64)
    if not array.size:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    percentiles = np.percentile(array, PERCENTILES)
    return {"mean": float(array.mean()), **{f"p{p}": float(v) for p, v in zip(PERCENTILES, percentiles)}}


def meets_slo(record: RequestRecord, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> bool:
    """Whether the request attained every SLO given (see the module's docstring)."""
    if record.first_token_s is None:
        return False
    if slo_ttft_s is not None and record.ttft_s > slo_ttft_s:
        return False
    tpot = record.tpot_s
    return slo_tpot_s is None or tpot is None or tpot <= slo_tpot_s


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index of non-negative values: 1 when all are equal, 1/n at the most unequal."""
    array = np.asarray(values, dtype=np.float64)
    if not array.size or not np.any(array):
        return None if not array.size else 1.0
    return float(array.sum() ** 2 / (array.size * np.square(array).sum()))


def latency_figures(
    records: Sequence[RequestRecord],
    wall_time_s: float,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
) -> dict:
    """The figures result.json holds for one run of the workload (wall_time_s: from the run's start
    to its end, RunRecords.wall_time_s); see the module's docstring."""
    if not records:
        raise ValueError("no request records: a run has at least one request")
    if not wall_time_s > 0:
        raise ValueError(f"wall_time_s must be > 0, got {wall_time_s}")
    num_prompt = sum(r.num_prompt_tokens for r in records)
    num_output = sum(r.num_output_tokens for r in records)
    num_cached = sum(r.num_cached_tokens for r in records)
    normalized = [r.normalized_latency_s for r in records if r.normalized_latency_s is not None]
    figures = {
        "num_requests": len(records),
        "num_requests_without_output": sum(1 for r in records if not r.num_output_tokens),
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "num_cached_tokens": num_cached,
        "prefix_cache_hit_rate": num_cached / num_prompt if num_prompt else None,
        "num_preemptions": sum(r.num_preemptions for r in records),
        "wall_time_s": wall_time_s,
        "num_failed_requests": sum(1 for r in records if r.finish_reason == "error"),
        "num_aborted_requests": sum(1 for r in records if r.finish_reason == "abort"),
        "request_throughput": sum(1 for r in records if r.finish_reason not in UNSERVED) / wall_time_s,
        "output_tokens_per_s": num_output / wall_time_s,
        "ttft_s": distribution(r.ttft_s for r in records if r.ttft_s is not None),
        "tpot_s": distribution(r.tpot_s for r in records if r.tpot_s is not None),
        "itl_s": distribution(np.concatenate([np.diff(r.token_times_s) for r in records])),
        "e2e_s": distribution(r.e2e_s for r in records),
        "queue_s": distribution(r.queue_s for r in records if r.queue_s is not None),
        "normalized_latency_s": distribution(normalized),
        "jain_fairness": jain_index(normalized),
    }
    if slo_ttft_s is not None or slo_tpot_s is not None:
        good = sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in records)
        figures["slo_attainment"] = good / len(records)
        figures["goodput"] = good / wall_time_s
    priorities, tenants = {}, {}
    for record in records:
        priorities.setdefault(str(record.priority), []).append(record)
        if "tenant" in record.metadata:
            tenants.setdefault(str(record.metadata["tenant"]), []).append(record)
    if len(priorities) > 1:
        figures["per_priority"] = {p: _group_figures(priorities[p]) for p in sorted(priorities, key=int)}
    if tenants:
        figures["per_tenant"] = {tenant: _group_figures(group) for tenant, group in sorted(tenants.items())}
    return figures


def _group_figures(group: list[RequestRecord]) -> dict:
    return {
        "num_requests": len(group),
        "ttft_s": distribution(r.ttft_s for r in group if r.ttft_s is not None),
        "e2e_s": distribution(r.e2e_s for r in group),
    }


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _mean_and_std(values: list):
    """(mean, sample standard deviation) of one figure over repeats; dicts recurse. A figure that
    is None in any repeat is None; one that is not a number keeps its value when all repeats agree."""
    if all(isinstance(v, dict) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v))
        pairs = {k: _mean_and_std([v.get(k) for v in values]) for k in keys}
        return {k: m for k, (m, _) in pairs.items()}, {k: s for k, (_, s) in pairs.items() if s is not None}
    if all(_is_number(v) for v in values):
        if all(v == values[0] for v in values):
            return values[0], 0.0  # counts equal in every repeat stay exact integers
        array = np.asarray(values, dtype=np.float64)
        return float(array.mean()), float(array.std(ddof=1))
    if any(v is None for v in values):
        return None, None
    if all(v == values[0] for v in values):
        return values[0], None
    raise ValueError(f"repeats disagree on a figure that is not a number: {values!r}")


def aggregate_repeats(figures_per_repeat: Sequence[dict]) -> dict:
    """One result from the figures of several runs of the same workload. Each figure keeps its
    single-run place and shape and holds its mean over repeats (today's keys such as
    output_tokens_per_s stay top-level numbers); "std" mirrors that shape with the sample standard
    deviation (ddof=1) of every numeric figure; "num_repeats" counts the runs and "per_repeat" keeps
    each run's figures. One run's figures come back unchanged."""
    if not figures_per_repeat:
        raise ValueError("no repeats to aggregate")
    if len(figures_per_repeat) == 1:
        return dict(figures_per_repeat[0])
    means, stds = _mean_and_std(list(figures_per_repeat))
    return {**means, "std": stds, "num_repeats": len(figures_per_repeat), "per_repeat": list(figures_per_repeat)}


def request_line(record: RequestRecord, repeat: int) -> dict:
    """One line of requests.jsonl: the record less its token times, plus its latencies."""
    # Field by field, not asdict: asdict deep-copies every token time only for them to be dropped.
    line = {"repeat": repeat, **{f.name: getattr(record, f.name) for f in fields(record) if f.name != "token_times_s"}}
    line.update(ttft_s=record.ttft_s, tpot_s=record.tpot_s, e2e_s=record.e2e_s, queue_s=record.queue_s)
    return line


def write_requests_jsonl(path: str, records_per_repeat: Sequence[Sequence[RequestRecord]]) -> None:
    """requests.jsonl: one JSON object per request per repeat (request_line). Metadata values that
    JSON cannot hold are written as their str()."""
    with open(path, "w") as f:
        for repeat, records in enumerate(records_per_repeat):
            for record in records:
                f.write(json.dumps(request_line(record, repeat), default=str) + "\n")
