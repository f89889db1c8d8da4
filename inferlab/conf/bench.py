"""The bench job's settings (`bench.*`) and what makes them unable to run, checked when the config
is composed, before any model loads; and the trace formats `bench.trace` accepts."""

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# What a trace line may say of its request beyond Mooncake's keys; each wins over its class's.
TRACE_REQUEST_KEYS = ("class", "priority", "slo_ttft_s", "slo_tpot_s", "tenant")


@dataclass
class RequestClass:
    """One class of requests (`bench.classes`): its share of a workload's requests (weight), the
    SLOs its requests are held to, the priority they get and metadata every policy sees (tenant,
    deadline, ...)."""

    name: str = ""
    weight: float = 1.0
    slo_ttft_s: float | None = None  # None: bench.slo_ttft_s
    slo_tpot_s: float | None = None  # None: bench.slo_tpot_s
    priority: int = 0  # lower is served first by policies that use it
    metadata: dict[str, Any] = field(default_factory=dict)


CLASS_FIELDS = tuple(f.name for f in fields(RequestClass))


@dataclass
class BenchConfig:
    """`inferlab job=bench`: a workload (nano-vllm's bench.py by default, generated arrivals, or a
    trace) and what to measure of it. validate_bench says which
    combinations can run; compose() and the command check them before any model loads."""

    # Generated workloads (arrival burst, poisson, gamma): bench.py's draws.
    num_seqs: int = 256
    min_len: int = 100  # prompt lengths uniform in [min_len, max_len] (bench.py's 100..1024)
    max_len: int = 1024
    min_output_len: int | None = None  # None: min_len, as in bench.py
    max_output_len: int | None = None  # None: max_len
    seed: int = 0  # prompts, lengths and arrivals (each from its own stream)
    temperature: float = 0.6
    ignore_eos: bool = True  # output lengths are exact only with it
    shared_prefix_len: int = 0  # > 0: each prompt starts with one of num_prefixes random prefixes this long
    num_prefixes: int = 1
    warmup: bool = True
    # When requests arrive: burst (all at t=0), poisson, gamma, or trace.
    arrival: str = "burst"
    request_rate: float | None = None  # requests/s, for poisson and gamma
    burstiness: float = 1.0  # gamma's shape: 1 is Poisson, below 1 burstier, above more regular
    num_priorities: int = 1  # > 1: each request's priority uniform in 0..num_priorities-1 (lower first)
    # Traces (arrival=trace): a Mooncake JSONL or Azure CSV file, its format read from its content.
    trace: str | None = None
    time_scale: float = 1.0  # multiplies the trace's inter-arrival times: 0.5 replays twice as fast
    max_requests: int | None = None  # the trace's first requests only; None: all
    trace_copies: int = 1  # K superimposed copies of the trace, each with its own users (disjoint hash ids)
    # Every workload: lengths fitted to max_model_len. clip: prompts to max_model_len - 1, then
    # outputs to what is left; scale: every length times the factor that makes the longest fit.
    fit: str = "clip"
    # What to measure: SLOs for slo_attainment and goodput, repeats of the whole workload (mean and
    # std of every figure), and a Perfetto timeline of the run.
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # Classes of requests, each with its weight, SLOs, priority and metadata (RequestClass): each
    # request is assigned one by weight (seeded), unless its trace line names its own.
    classes: list[RequestClass] = field(default_factory=list)
    # Runs of the workload: repeat i draws arrivals, lengths, sampling seeds and classes from
    # seed + i (a trace keeps its timestamps and lengths); figures are their means, with ci95.
    repeats: int = 1
    timeline: bool = False
    # Every output token's time (ITL); false keeps the first and last of each request, for runs of
    # a million requests whose token times would not fit in memory.
    record_token_times: bool = True
    # A running server (`inferlab job=serve`) to send the workload to over HTTP, e.g.
    # http://127.0.0.1:8000, instead of building an engine here (inferlab.experiment.http_client).
    url: str | None = None


ARRIVALS = ("burst", "poisson", "gamma", "trace")
FITS = ("clip", "scale")
# Python's generator draws about 2.5 million token ids a second: past this, a generated workload
# would take longer to draw than any plausible run (1e12 tokens simply hung).
MAX_DRAWN_TOKENS = 2**28


# What a generated workload draws and a trace replaces: a trace run must leave these at their
# defaults, or a sweep over them would vary nothing.
GENERATED_ONLY = (
    "num_seqs",
    "min_len",
    "max_len",
    "min_output_len",
    "max_output_len",
    "shared_prefix_len",
    "num_prefixes",
)


class BenchConfigError(ValueError):
    """bench settings that cannot work together; raised before any model loads."""


def bench_problems(bench) -> list[str]:
    """What is wrong with the bench settings (a BenchConfig or its Hydra node), as messages that name
    the setting and the allowed values; empty when they can run. A setting that the chosen arrival
    would ignore is a problem too, so that a sweep never varies something that has no effect."""
    problems = []

    def check(bad: bool, message: str) -> None:
        if bad:
            problems.append(message)

    arrival = bench.arrival
    check(arrival not in ARRIVALS, f"bench.arrival must be one of {', '.join(ARRIVALS)}; got {arrival!r}")
    check(bench.fit not in FITS, f"bench.fit must be one of {', '.join(FITS)}; got {bench.fit!r}")
    check(
        not isinstance(bench.repeats, int) or bench.repeats < 1,
        f"bench.repeats must be >= 1 (a whole number of runs of the workload), got {bench.repeats!r}",
    )
    check(bench.num_priorities < 1, f"bench.num_priorities must be >= 1, got {bench.num_priorities}")
    for name in ("slo_ttft_s", "slo_tpot_s"):
        value = getattr(bench, name)
        check(value is not None and not value > 0, f"bench.{name} must be a positive number of seconds, got {value}")
    # written so that NaN fails too; an infinite gap or scale made arrivals NaN, which hung the run
    check(
        not 0 < bench.burstiness < math.inf,
        f"bench.burstiness must be a finite number > 0 (1 is Poisson), got {bench.burstiness}",
    )
    check(
        not 0 < bench.time_scale < math.inf,
        f"bench.time_scale must be a finite number > 0 (0.5 replays twice as fast), got {bench.time_scale}",
    )
    check(
        bench.max_requests is not None and bench.max_requests < 1,
        f"bench.max_requests must be >= 1 or null, got {bench.max_requests}",
    )
    check(bench.trace_copies < 1, f"bench.trace_copies must be >= 1, got {bench.trace_copies}")
    check(
        bench.trace_copies != 1 and arrival in ARRIVALS and arrival != "trace",
        f"bench.trace_copies applies to arrival=trace, not {arrival}",
    )
    if arrival in ("poisson", "gamma"):
        check(
            bench.request_rate is None or not 0 < bench.request_rate < math.inf,
            f"bench.arrival={arrival} needs bench.request_rate, a finite number > 0 (requests/s, or arrival=burst "
            f"for all at once), got {bench.request_rate}",
        )
    else:
        check(
            bench.request_rate is not None and arrival in ARRIVALS,
            f"bench.request_rate applies to arrival=poisson or gamma, not {arrival}"
            + (" (set bench.time_scale to replay a trace faster or slower)" if arrival == "trace" else ""),
        )
    check(
        arrival in ARRIVALS and arrival != "gamma" and bench.burstiness != 1,
        f"bench.burstiness={bench.burstiness} applies to arrival=gamma, not {arrival}"
        + (" (poisson is gamma with burstiness 1)" if arrival == "poisson" else ""),
    )
    class_names, class_problems = class_settings(bench.classes)
    problems += class_problems
    check(
        bool(class_names) and bench.num_priorities > 1,
        "bench.num_priorities draws each request's priority, and bench.classes gives each class its own: "
        "use one or the other",
    )
    if arrival == "trace":
        defaults = BenchConfig()
        for name in GENERATED_ONLY:
            check(
                getattr(bench, name) != getattr(defaults, name),
                f"bench.{name} applies to generated workloads (burst, poisson, gamma): a trace brings its own "
                f"requests and lengths (bench.max_requests takes its first ones)",
            )
        if bench.trace is None:
            problems.append("bench.arrival=trace needs bench.trace=PATH (a Mooncake .jsonl or Azure .csv trace)")
        elif not os.path.isfile(bench.trace):
            problems.append(f"bench.trace: no file {bench.trace!r}")
        else:
            try:
                detect_trace_format(bench.trace)
                problems += [f"bench.trace: {p}" for p in trace_class_problems(bench.trace, class_names)]
            except (OSError, ValueError) as e:
                problems.append(f"bench.trace: {e}")
    elif arrival in ARRIVALS:
        check(bench.trace is not None, f"bench.trace is set but bench.arrival={arrival}: use bench.arrival=trace")
        check(bench.time_scale != 1, f"bench.time_scale applies to arrival=trace, not {arrival}")
        check(
            bench.max_requests is not None,
            "bench.max_requests applies to arrival=trace; a generated workload has bench.num_seqs requests",
        )
        min_out = bench.min_len if bench.min_output_len is None else bench.min_output_len
        max_out = bench.max_len if bench.max_output_len is None else bench.max_output_len
        check(bench.num_seqs < 1, f"bench.num_seqs must be >= 1, got {bench.num_seqs}")
        check(
            not 1 <= bench.min_len <= bench.max_len,
            f"bench needs 1 <= min_len <= max_len, got {bench.min_len}, {bench.max_len}",
        )
        check(
            not 1 <= min_out <= max_out, f"bench needs 1 <= min_output_len <= max_output_len, got {min_out}, {max_out}"
        )
        check(bench.shared_prefix_len < 0, f"bench.shared_prefix_len must be >= 0, got {bench.shared_prefix_len}")
        check(bench.num_prefixes < 1, f"bench.num_prefixes must be >= 1, got {bench.num_prefixes}")
        most_tokens = bench.num_seqs * bench.max_len + bench.num_prefixes * max(bench.shared_prefix_len, 0)
        check(
            most_tokens > MAX_DRAWN_TOKENS,
            f"bench draws up to {most_tokens:,} prompt tokens (num_seqs x max_len + num_prefixes x "
            f"shared_prefix_len), more than the {MAX_DRAWN_TOKENS:,} it can draw in minutes",
        )
    return problems


def class_settings(classes) -> tuple[list[str], list[str]]:
    """(the class names, what is wrong with them) of bench.classes: a list of RequestClass, or of
    mappings of its fields (from Python or the command line)."""
    if classes is None:
        return [], []
    if isinstance(classes, (str, bytes, Mapping)) or not hasattr(classes, "__iter__"):
        return [], [f"bench.classes must be a list of classes (each with {', '.join(CLASS_FIELDS)}), got {classes!r}"]
    names, problems = [], []
    total_weight = 0.0
    for i, spec in enumerate(classes):
        where = f"bench.classes[{i}]"
        if isinstance(spec, RequestClass):
            values = {f: getattr(spec, f) for f in CLASS_FIELDS}
        elif isinstance(spec, Mapping) or hasattr(spec, "items"):
            values = dict(spec.items())
            unknown = [k for k in values if k not in CLASS_FIELDS]
            if unknown:
                problems.append(
                    f"{where}: unknown field {', '.join(map(repr, unknown))}; a class has {', '.join(CLASS_FIELDS)}"
                )
                continue
            values = {**{f.name: getattr(RequestClass(), f.name) for f in fields(RequestClass)}, **values}
        else:
            problems.append(f"{where} must be a class (a mapping of {', '.join(CLASS_FIELDS)}), got {spec!r}")
            continue
        name = values["name"]
        if not isinstance(name, str) or not name:
            problems.append(f"{where}.name must be a non-empty name, got {name!r}")
        elif name in names:
            problems.append(f"{where}.name {name!r} is given twice: class names must differ")
        else:
            names.append(name)
        weight = values["weight"]
        if not _number(weight) or not 0 <= weight < math.inf:
            problems.append(f"{where}.weight must be a finite number >= 0 (its share of requests), got {weight!r}")
        else:
            total_weight += weight
        for slo in ("slo_ttft_s", "slo_tpot_s"):
            value = values[slo]
            if value is not None and not (_number(value) and 0 < value < math.inf):
                problems.append(f"{where}.{slo} must be a positive number of seconds (or null), got {value!r}")
        if not isinstance(values["priority"], int) or isinstance(values["priority"], bool):
            problems.append(f"{where}.priority must be an integer (lower is served first), got {values['priority']!r}")
        if not isinstance(values["metadata"], Mapping) and not hasattr(values["metadata"], "items"):
            problems.append(f"{where}.metadata must be a mapping (tenant, deadline, ...), got {values['metadata']!r}")
    weights_ok = not any(".weight" in p for p in problems)
    if names and weights_ok and not total_weight > 0:
        problems.append(f"bench.classes: the weights must sum to a positive number, got {total_weight:g}")
    return names, problems


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


CLASS_IN_LINE = re.compile(r'"class"\s*:')


def trace_class_problems(path: str, class_names: list[str]) -> list[str]:
    """The lines of a Mooncake trace naming a class that bench.classes does not define (the first
    few), read before anything runs."""
    if detect_trace_format(path) != "mooncake":
        return []
    problems = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not CLASS_IN_LINE.search(line):
                continue
            try:
                name = json.loads(line).get("class")
            except (json.JSONDecodeError, AttributeError):
                continue  # reading the trace names the line
            if name is not None and name not in class_names:
                defined = f"defined: {', '.join(class_names)}" if class_names else "none is defined"
                problems.append(f"line {number}: class {name!r} is not defined in bench.classes ({defined})")
                if len(problems) >= 3:
                    break
    return problems


def validate_bench(bench) -> None:
    """Raises BenchConfigError listing every problem of the bench settings (see bench_problems)."""
    problems = bench_problems(bench)
    if problems:
        raise BenchConfigError("; ".join(problems))


def detect_trace_format(path: str) -> str:
    """ "mooncake" or "azure", from the file's first line (a JSON object, or a CSV header); raises
    ValueError naming the formats when it is neither, and OSError when the file cannot be read."""
    with open(path, encoding="utf-8") as f:
        first = next((line.strip() for line in f if line.strip()), "")
    if first.startswith("{"):
        try:
            record = json.loads(first)
        except json.JSONDecodeError as e:
            raise ValueError(f"trace {path!r}: line 1 is not JSON ({e})") from None
        missing = [key for key in MOONCAKE_KEYS if key not in record]
        if not missing:
            return "mooncake"
        raise ValueError(
            f"trace {path!r}: a JSONL trace needs Mooncake's keys {list(MOONCAKE_KEYS)}; line 1 lacks {missing}"
        )
    columns = [column.strip() for column in first.split(",")]
    if all(column in columns for column in AZURE_COLUMNS):
        return "azure"
    raise ValueError(
        f"trace {path!r} is in no known format: expected Mooncake JSONL (objects with {', '.join(MOONCAKE_KEYS)}, "
        f"hash_ids) or an Azure CSV (header {','.join(AZURE_COLUMNS)}); its first line is {first[:120]!r}"
    )
