"""Latency figures of a run, from one record per request, and their mean and spread over repeats.

Every time is in seconds on one clock (the driver's, e.g. perf_counter minus the run's start).
Per request:
- TTFT (`ttft_s`): first_token_s - arrival_s;
- TPOT (`tpot_s`): (finish_s - first_token_s) / (num_output_tokens - 1); a request with one output
  token has none;
- ITL (`itl_s`): each gap between consecutive output tokens' times (pooled over requests);
- E2E (`e2e_s`): finish_s - arrival_s; queue (`queue_s`): first_scheduled_s - arrival_s;
- normalized latency (`normalized_latency_s`): e2e / num_output_tokens, as Orca and vLLM report it.
Each is summarized as {mean, std, p50, p90, p99}; percentiles interpolate linearly between the two
nearest ranks (numpy's default, as vLLM's benchmark computes them).

Run figures: request_throughput = completed requests (finished by length or a stop, not aborted
or refused with an error) / wall_time_s, output_tokens_per_s = output tokens / wall_time_s;
num_failed_requests and num_aborted_requests count the others. With SLOs, a request attains them
when its TTFT and TPOT are at most its bounds (one without TPOT meets any TPOT bound; one that
produced no token misses all): a request's own bounds are its metadata's "slo_ttft_s" and
"slo_tpot_s" (from its class or its trace line), else the run's (bench.slo_ttft_s,
bench.slo_tpot_s); slo_attainment is the fraction that does and goodput the number that does per
second of the run (DistServe's goodput, as vLLM's serving benchmark computes it). Under
prefill/decode disaggregation, kv_transfer_s summarizes how long each request's K/V took to move to
its decode replica, kv_transfer_bytes sums the bytes moved and num_kv_transfers counts the moves.
jain_fairness is
Jain's index (sum x)^2 / (n sum x^2) over the requests' normalized latencies: 1 when every request
waits the same time per output token, towards 1/n when one request bears all the waiting.
When requests carry more than one priority, per_priority holds each priority's count, TTFT and
E2E. With a request metadata key "tenant", per_tenant holds each tenant's, with its service (the
prompt and output tokens its requests were served) and service rate (its service over the time it
had requests in the system), and tenant_fairness is Jain's index over the tenants' service rates:
1 when every tenant with work waiting was served at the same rate. With a metadata key "class"
(bench.classes), classes holds each class's num_requests, TTFT, TPOT, slo_attainment and goodput.

Over repeats (aggregate_repeats) every figure is the mean of the repeats', and the statistics a
reader compares carry `ci95`: the half-width of a 95% confidence interval of that mean (Student's
t over the repeats), inside each distribution (`ttft_s["ci95"]["p99"]`) and, for the rates,
under the result's own `ci95` (`ci95["output_tokens_per_s"]`).
"""

import json
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields

import numpy as np

PERCENTILES = (50, 90, 99)
UNSERVED = ("error", "abort")  # finish reasons of requests that did not complete
# what requests.jsonl leaves out (or writes when set): token times, and a cluster's or a KV move's fields
LINE_SKIPS = ("token_times_s", "all_token_times", "replica_id", "kv_transfer_s", "kv_transfer_bytes")
DISTRIBUTIONS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s", "normalized_latency_s")
# The figures whose mean over repeats gets a 95% confidence interval (ci95): distributions carry
# theirs inside, the rates and attainment under their dict's "ci95".
CI_DISTRIBUTIONS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")
CI_RATES = (
    "output_tokens_per_s",
    "request_throughput",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "goodput",
    "slo_attainment",
)
# Student's t at 0.975 for 1..30 degrees of freedom; beyond, its expansion in 1/df
T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788, 2.1604,
        2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555,
        2.0518, 2.0484, 2.0452, 2.0423)  # fmt: skip


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Build one from a dict with RequestRecord(**d)."""

    request_id: int | str
    arrival_s: float  # when it arrived (was due to be submitted)
    first_scheduled_s: float | None  # when a step first computed any of it; None if none ever did
    first_token_s: float | None  # when its first output token became known on the host; None if none did
    # when each output token became known, the first being first_token_s (the first and last only,
    # with all_token_times False: bench.record_token_times=false; ITL then skips the request)
    token_times_s: list[float]
    finish_s: float  # when it finished (its last token known, or aborted / failed)
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache rather than computed
    num_preemptions: int = 0  # times it was evicted and recomputed
    priority: int = 0
    metadata: dict = field(default_factory=dict)
    finish_reason: str = "length"  # "length", "stop", "abort", or "error" (never served)
    error: str | None = None  # why it could not be served (finish_reason "error")
    replica_id: int | None = None  # the cluster replica that served it (None: a single engine)
    all_token_times: bool = True  # False: token_times_s keeps the first and last only
    # disaggregated: how long its prompt's K/V took to move to its decode replica, and the bytes moved
    kv_transfer_s: float | None = None
    kv_transfer_bytes: int = 0

    def __post_init__(self):
        where = f"request {self.request_id!r}"
        kept = self.num_output_tokens if self.all_token_times else min(self.num_output_tokens, 2)
        if len(self.token_times_s) != kept:
            raise ValueError(
                f"{where}: {len(self.token_times_s)} token times for {self.num_output_tokens} output tokens"
                + ("" if self.all_token_times else " (the first and last kept)")
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


# A requests.jsonl line's fields of the record, in its order, and their values read in one call
LINE_FIELDS = tuple(f.name for f in fields(RequestRecord) if f.name not in LINE_SKIPS)
LINE_VALUES = operator.attrgetter(*LINE_FIELDS)


@dataclass(slots=True)
class StepRecord:
    """One engine step: when it ran and what its batch held."""

    start_s: float
    end_s: float
    num_prefill_tokens: int  # prompt tokens computed (prefix-cache hits are not)
    num_decode_tokens: int
    num_seqs: int  # requests in the batch
    replica_id: int | None = None  # the cluster replica that stepped (None: a single engine)


@dataclass
class RunRecords:
    """Everything one run of the workload recorded: its requests, its steps, and its wall time
    (from the run's start, t=0 of the arrival clock, to the end of the step that finished its
    last request)."""

    requests: list[RequestRecord]
    steps: list[StepRecord]
    wall_time_s: float


def distribution(values: Iterable[float]) -> dict:
    """{mean, std, p50, p90, p99} of values, std their standard deviation (numpy's, as vLLM's
    benchmark reports it); every entry None when there are none."""
    array = np.asarray(list(values), dtype=np.float64)
    if not array.size:
        return {"mean": None, "std": None, **{f"p{p}": None for p in PERCENTILES}}
    percentiles = np.percentile(array, PERCENTILES)
    return {
        "mean": float(array.mean()),
        "std": float(array.std()),
        **{f"p{p}": float(v) for p, v in zip(PERCENTILES, percentiles)},
    }


def request_slos(record: RequestRecord, slo_ttft_s: float | None, slo_tpot_s: float | None) -> tuple:
    """(TTFT bound, TPOT bound) of a request: its metadata's own, else the run's."""
    metadata = record.metadata
    return metadata.get("slo_ttft_s", slo_ttft_s), metadata.get("slo_tpot_s", slo_tpot_s)


def meets_slo(record: RequestRecord, slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> bool:
    """Whether the request attained every SLO it has: its own (metadata "slo_ttft_s",
    "slo_tpot_s"), else the ones given (see the module's docstring)."""
    if record.first_token_s is None:
        return False
    slo_ttft_s, slo_tpot_s = request_slos(record, slo_ttft_s, slo_tpot_s)
    if slo_ttft_s is not None and record.ttft_s > slo_ttft_s:
        return False
    tpot = record.tpot_s
    return slo_tpot_s is None or tpot is None or tpot <= slo_tpot_s


def has_slos(records: Sequence[RequestRecord], slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    return (
        slo_ttft_s is not None
        or slo_tpot_s is not None
        or any("slo_ttft_s" in r.metadata or "slo_tpot_s" in r.metadata for r in records)
    )


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
        "itl_s": distribution(np.concatenate([[], *(np.diff(r.token_times_s) for r in records if r.all_token_times)])),
        "e2e_s": distribution(r.e2e_s for r in records),
        "queue_s": distribution(r.queue_s for r in records if r.queue_s is not None),
        "normalized_latency_s": distribution(normalized),
        "jain_fairness": jain_index(normalized),
    }
    moved = [r for r in records if r.kv_transfer_s is not None]
    if moved:
        figures["num_kv_transfers"] = len(moved)
        figures["kv_transfer_s"] = distribution(r.kv_transfer_s for r in moved)
        figures["kv_transfer_bytes"] = sum(r.kv_transfer_bytes for r in moved)
    slos = has_slos(records, slo_ttft_s, slo_tpot_s)
    if slos:
        good = sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in records)
        figures["slo_attainment"] = good / len(records)
        figures["goodput"] = good / wall_time_s
    priorities, tenants, classes = {}, {}, {}
    for record in records:
        priorities.setdefault(str(record.priority), []).append(record)
        if "tenant" in record.metadata:
            tenants.setdefault(str(record.metadata["tenant"]), []).append(record)
        if "class" in record.metadata:
            classes.setdefault(str(record.metadata["class"]), []).append(record)
    if len(priorities) > 1:
        figures["per_priority"] = {p: _group_figures(priorities[p]) for p in sorted(priorities, key=int)}
    if tenants:
        figures["per_tenant"] = {tenant: _tenant_figures(group) for tenant, group in sorted(tenants.items())}
        figures["tenant_fairness"] = jain_index([t["service_rate"] for t in figures["per_tenant"].values()])
    if classes:
        figures["classes"] = {
            name: _class_figures(group, wall_time_s, slo_ttft_s, slo_tpot_s, slos)
            for name, group in sorted(classes.items())
        }
    return figures


def _group_figures(group: list[RequestRecord]) -> dict:
    return {
        "num_requests": len(group),
        "ttft_s": distribution(r.ttft_s for r in group if r.ttft_s is not None),
        "e2e_s": distribution(r.e2e_s for r in group),
    }


def service_tokens(record: RequestRecord) -> int:
    """The tokens a request was served: its prompt, if a step ever computed it, and its outputs."""
    return (record.num_prompt_tokens if record.first_scheduled_s is not None else 0) + record.num_output_tokens


def backlogged_seconds(group: list[RequestRecord]) -> float:
    """The time some request of group was in the system (the union of arrival-to-finish spans)."""
    total, end = 0.0, -np.inf
    for record in sorted(group, key=lambda r: r.arrival_s):
        start = max(record.arrival_s, end)
        if record.finish_s > start:
            total += record.finish_s - start
        end = max(end, record.finish_s)
    return total


def _tenant_figures(group: list[RequestRecord]) -> dict:
    service = sum(service_tokens(r) for r in group)
    backlogged = backlogged_seconds(group)
    return {
        **_group_figures(group),
        "service_tokens": service,
        "service_rate": service / backlogged if backlogged > 0 else 0.0,
    }


def _class_figures(group, wall_time_s: float, slo_ttft_s, slo_tpot_s, slos: bool) -> dict:
    good = sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in group)
    return {
        "num_requests": len(group),
        "ttft_s": distribution(r.ttft_s for r in group if r.ttft_s is not None),
        "tpot_s": distribution(r.tpot_s for r in group if r.tpot_s is not None),
        "slo_attainment": good / len(group) if slos else None,
        "goodput": good / wall_time_s if slos else None,
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
    if all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1:  # a cluster's replicas
        items = [_mean_and_std([v[i] for v in values]) for i in range(len(values[0]))]
        return [m for m, _ in items], [s for _, s in items]
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


def t_975(degrees_of_freedom: int) -> float:
    """Student's t quantile at 0.975: the factor of a two-sided 95% interval's half-width."""
    if degrees_of_freedom <= len(T975):
        return T975[degrees_of_freedom - 1]
    z, df = 1.959964, degrees_of_freedom
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def ci95(values: list) -> float | None:
    """The half-width of a 95% confidence interval of the mean of values (one per repeat): None
    when any is missing or there is only one."""
    if len(values) < 2 or not all(_is_number(v) for v in values):
        return None
    array = np.asarray(values, dtype=np.float64)
    return float(t_975(len(array) - 1) * array.std(ddof=1) / np.sqrt(len(array)))


def _with_ci95(means: dict, figures_per_repeat: Sequence[dict], distributions, rates) -> dict:
    """means with the ci95 of the named distributions (inside each) and rates (under "ci95")."""
    result = dict(means)
    for name in distributions:
        if isinstance(result.get(name), dict):
            stats = [k for k in result[name] if k != "ci95"]
            result[name] = {
                **result[name],
                "ci95": {k: ci95([(f.get(name) or {}).get(k) for f in figures_per_repeat]) for k in stats},
            }
    intervals = {name: ci95([f.get(name) for f in figures_per_repeat]) for name in rates if name in result}
    if intervals:
        result["ci95"] = intervals
    return result


def aggregate_repeats(figures_per_repeat: Sequence[dict]) -> dict:
    """One result from the figures of several runs of the same workload. Each figure keeps its
    single-run place and shape and holds its mean over repeats (today's keys such as
    output_tokens_per_s stay top-level numbers); the distributions of CI_DISTRIBUTIONS and the
    rates of CI_RATES carry a ci95 (see the module's docstring), at the top and in each class;
    "std" mirrors the result's shape with the sample standard deviation (ddof=1) of every numeric
    figure; "num_repeats" counts the runs and "repeats" lists each run's own figures. One run's
    figures come back unchanged."""
    if not figures_per_repeat:
        raise ValueError("no repeats to aggregate")
    if len(figures_per_repeat) == 1:
        return dict(figures_per_repeat[0])
    means, stds = _mean_and_std(list(figures_per_repeat))
    result = _with_ci95(means, figures_per_repeat, CI_DISTRIBUTIONS, CI_RATES)
    if isinstance(result.get("classes"), dict):
        result["classes"] = {
            name: _with_ci95(
                figures,
                [(f.get("classes") or {}).get(name) or {} for f in figures_per_repeat],
                ("ttft_s", "tpot_s"),
                ("slo_attainment", "goodput"),
            )
            for name, figures in result["classes"].items()
        }
    return {**result, "std": stds, "num_repeats": len(figures_per_repeat), "repeats": list(figures_per_repeat)}


def request_line(record: RequestRecord, repeat: int) -> dict:
    """One line of requests.jsonl: the record less its token times, plus its latencies; replica_id
    only for a cluster's requests, its KV move's time and bytes only when it moved (disaggregated)."""
    # Field by field, not asdict: asdict deep-copies every token time only for them to be dropped.
    line = {"repeat": repeat, **dict(zip(LINE_FIELDS, LINE_VALUES(record)))}
    if record.replica_id is not None:
        line["replica_id"] = record.replica_id
    if record.kv_transfer_s is not None:
        line.update(kv_transfer_s=record.kv_transfer_s, kv_transfer_bytes=record.kv_transfer_bytes)
    line.update(ttft_s=record.ttft_s, tpot_s=record.tpot_s, e2e_s=record.e2e_s, queue_s=record.queue_s)
    return line


def write_requests_jsonl(path: str, records_per_repeat: Sequence[Sequence[RequestRecord]]) -> None:
    """requests.jsonl: one JSON object per request per repeat (request_line). Metadata values that
    JSON cannot hold are written as their str()."""
    encode = json.JSONEncoder(default=str).encode  # json.dumps(line, default=str), its encoder made once
    with open(path, "w") as f:
        for repeat, records in enumerate(records_per_repeat):
            f.writelines(encode(request_line(record, repeat)) + "\n" for record in records)
