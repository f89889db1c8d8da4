"""The requests a bench job submits, and when: `bench.arrival` picks the arrival process.

- `burst`: every request at t=0 (nano-vllm's bench.py; the default, whose prompts and lengths
  are bench.py's exact numbers);
- `poisson`: exponential inter-arrival times at `bench.request_rate` requests/s;
- `gamma`: gamma inter-arrival times with shape `bench.burstiness` and scale
  1 / (request_rate * burstiness), as vLLM's serving benchmark draws them: the same mean rate,
  burstier below 1, more regular above (1 is Poisson);
- `trace`: the arrivals and lengths of a Mooncake or Azure trace (inferlab.experiment.traces), with
  `bench.time_scale` stretching time, `bench.max_requests` taking the first requests and
  `bench.trace_copies` superimposing copies of it, each with users of its own (disjoint hash ids)
  at the same timestamps, to load a fleet from one trace.

Generated workloads (burst, poisson, gamma) draw the same prompts and output lengths for a seed,
so the arrival process is the only difference between them; arrivals come from a stream of
their own. With `bench.num_priorities` above 1 every request gets a priority drawn uniformly from
0 .. num_priorities - 1 (lower is served first by the priority policy), from a stream of its own.
With `bench.classes` every request is assigned a class by weight, from a stream of its own (a
trace line naming its class keeps it): the class's priority, and its metadata with the class's
name and SLOs, which policies see. Every workload is fitted to the model (`bench.fit`), and the
workload says how many requests that changed.

The seed is `bench.seed` plus the repeat: repeat i of a bench draws all of the above (and each
request's sampling seed) anew from bench.seed + i; a trace keeps its timestamps and lengths.
"""

import math
import random
from dataclasses import dataclass, field

import numpy as np

from inferlab.conf.bench import CLASS_FIELDS, FITS, BenchConfigError, RequestClass, validate_bench
from inferlab.core.blocks import BlockPrompt
from inferlab.core.engine import rarer_young_collections
from inferlab.core.sampling_params import SamplingParams
from inferlab.experiment.traces import MOONCAKE_BLOCK_SIZE, TOKEN_ID_RANGE, TraceTokens, read_trace

BENCH_TOKEN_RANGE = 10000  # bench.py draws token ids in [0, 10000]
# Streams of numpy's generator seeded with (the workload's seed, this), one for each draw that
# must not move the others: priorities, classes, sampling seeds.
PRIORITY_STREAM = 1
CLASS_STREAM = 2
SAMPLING_SEED_STREAM = 3


@dataclass(slots=True)
class WorkloadRequest:
    """One request to submit once the run's clock reaches arrival_s."""

    index: int  # position in the workload (arrival order)
    arrival_s: float
    prompt_token_ids: list[int] | BlockPrompt  # a trace's prompts are given by their hash blocks
    output_len: int  # max_tokens; with ignore_eos, the exact number of output tokens
    priority: int = 0  # for the engine's scheduler: lower is served first
    metadata: dict = field(default_factory=dict)  # passed to the engine with the request
    own: dict | None = None  # what its trace line says of it (class, priority, SLOs, tenant)


@dataclass
class Workload:
    arrival: str
    requests: list[WorkloadRequest]  # in arrival order
    num_fitted: int  # requests whose lengths bench.fit changed to fit max_model_len
    length_scale: float = 1.0  # bench.fit=scale's factor on every length (1: nothing scaled)
    trace_format: str | None = None
    seed: int = 0  # what it was drawn from: bench.seed + the repeat

    def sampling_params(self, bench) -> list:
        """Each request's SamplingParams: bench.temperature and bench.ignore_eos, max_tokens = its
        output length, and a sampling seed of its own drawn from the workload's seed."""
        temperature, ignore_eos = bench.temperature, bench.ignore_eos  # a config read costs microseconds
        seeds = np.random.default_rng([self.seed, SAMPLING_SEED_STREAM]).integers(0, 2**32, len(self.requests))
        return [
            SamplingParams(temperature=temperature, ignore_eos=ignore_eos, max_tokens=r.output_len, seed=seed)
            for r, seed in zip(self.requests, seeds.tolist())
        ]

    def summary(self) -> dict:
        """What result.json records of the workload. offered_request_rate is the arrival rate the
        workload asks for: requests after the first over the span of arrivals (None for a burst)."""
        span = self.requests[-1].arrival_s - self.requests[0].arrival_s
        classes = {}
        for request in self.requests:
            name = request.metadata.get("class")
            if name is not None:
                classes[name] = classes.get(name, 0) + 1
        return {
            "arrival": self.arrival,
            "seed": self.seed,
            "trace_format": self.trace_format,
            "num_requests": len(self.requests),
            "num_fitted": self.num_fitted,
            "length_scale": self.length_scale,
            "num_prompt_tokens": sum(len(r.prompt_token_ids) for r in self.requests),
            "num_output_tokens": sum(r.output_len for r in self.requests),
            "arrival_span_s": span,
            "offered_request_rate": (len(self.requests) - 1) / span if span > 0 else None,
            **({"classes": classes} if classes else {}),
        }


def arrival_times(
    num_requests: int, arrival: str, request_rate: float | None = None, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Arrival times (s) of a generated workload: the first request at 0, then num_requests - 1
    inter-arrival gaps drawn from numpy's generator seeded with seed."""
    if arrival == "burst":
        return np.zeros(num_requests)
    if arrival not in ("poisson", "gamma"):
        raise ValueError(f"arrival must be burst, poisson or gamma for generated arrivals, got {arrival!r}")
    if request_rate is None or not request_rate > 0:
        raise ValueError(f"arrival={arrival} needs request_rate > 0, got {request_rate}")
    shape = 1.0 if arrival == "poisson" else burstiness
    if not shape > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if not request_rate * shape > 0:
        raise ValueError(f"request_rate {request_rate} times burstiness {burstiness} underflows to 0")
    gaps = np.random.default_rng(seed).gamma(shape=shape, scale=1.0 / (request_rate * shape), size=num_requests - 1)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps)])
    if not np.isfinite(arrivals).all():
        raise ValueError(f"request_rate {request_rate} with burstiness {burstiness} draws arrivals beyond float range")
    return arrivals


def fit_lengths(
    input_lengths: list[int], output_lengths: list[int], max_model_len: int, fit: str
) -> tuple[list[int], list[int], float]:
    """(input lengths, output lengths, scale) that fit max_model_len, every length at least 1.
    clip: each prompt cut to max_model_len - 1, then each output to what is left (scale 1).
    scale: every length times one factor, the largest under which the longest request fits
    (prompt + output <= max_model_len, prompt <= max_model_len - 1), rounded down."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2 to hold a prompt token and an output token, got {max_model_len}")
    inputs = [max(1, n) for n in input_lengths]
    outputs = [max(1, n) for n in output_lengths]
    scale = 1.0
    if fit == "scale":
        scale = min(
            1.0,
            max_model_len / max(i + o for i, o in zip(inputs, outputs)),
            (max_model_len - 1) / max(inputs),
        )
        if scale < 1:
            inputs = [max(1, math.floor(n * scale)) for n in inputs]
            outputs = [max(1, math.floor(n * scale)) for n in outputs]
    elif fit != "clip":
        raise ValueError(f"fit must be one of {', '.join(FITS)}, got {fit!r}")
    inputs = [min(n, max_model_len - 1) for n in inputs]  # clip; for scale a guard against float rounding
    outputs = [min(o, max_model_len - i) for i, o in zip(inputs, outputs)]
    return inputs, outputs, scale


def _generated_lengths_and_prompts(
    bench, max_model_len: int, seed: int
) -> tuple[list[list[int]], list[int], list[int]]:
    """(prompts, their drawn lengths, output lengths): bench.py's draws, in its order:
    random.seed(seed), prompt lengths and token ids, then each request's output length; shared
    prefixes are drawn after them, so bench.py's numbers stay, whatever the model."""
    min_out = bench.min_len if bench.min_output_len is None else bench.min_output_len
    max_out = bench.max_len if bench.max_output_len is None else bench.max_output_len
    rng = random.Random(seed)  # the same stream as bench.py's random.seed(seed) + randint
    prompts, prompt_lengths = [], []
    for _ in range(bench.num_seqs):
        length = rng.randint(bench.min_len, bench.max_len)
        prompts.append(_drawn_tokens(rng, length, max_model_len))
        prompt_lengths.append(length)
    output_lengths = [rng.randint(min_out, max_out) for _ in range(bench.num_seqs)]
    if bench.shared_prefix_len:
        prefix_len = bench.shared_prefix_len
        prefixes = [_drawn_tokens(rng, prefix_len, max_model_len) for _ in range(bench.num_prefixes)]
        prompts = [prefixes[rng.randrange(bench.num_prefixes)] + prompt for prompt in prompts]
        prompt_lengths = [prefix_len + length for length in prompt_lengths]
    return prompts, prompt_lengths, output_lengths


def _drawn_tokens(rng: random.Random, length: int, max_model_len: int) -> list[int]:
    """length token ids from rng, of which only the first max_model_len are kept (no fit keeps
    more): the stream advances as bench.py's does, and a length far beyond the model costs time
    (bounded by MAX_DRAWN_TOKENS) but no memory."""
    kept = [rng.randint(0, BENCH_TOKEN_RANGE) for _ in range(min(length, max_model_len))]
    for _ in range(length - len(kept)):
        rng.randint(0, BENCH_TOKEN_RANGE)
    return kept


def build_workload(bench, vocab_size: int, max_model_len: int, repeat: int = 0) -> Workload:
    """The workload bench describes, drawn from bench.seed + repeat, with token ids valid for
    vocab_size (taken modulo it: a no-op for real vocabularies, where clipping would make a tiny
    vocabulary's prompts runs of one token) and lengths fitted to max_model_len. Raises
    BenchConfigError for settings that cannot work."""
    validate_bench(bench)
    seed = bench.seed + repeat
    with rarer_young_collections():  # a long trace's prompts are millions of ints in lists that live on
        workload = (
            _trace_workload(bench, vocab_size, max_model_len, seed)
            if bench.arrival == "trace"
            else _generated_workload(bench, vocab_size, max_model_len, seed)
        )
    workload.seed = seed
    if bench.num_priorities > 1:
        rng = np.random.default_rng([seed, PRIORITY_STREAM])
        for request, priority in zip(
            workload.requests, rng.integers(bench.num_priorities, size=len(workload.requests))
        ):
            request.priority = int(priority)
    assign_classes(workload.requests, request_classes(bench), seed)
    return workload


def request_classes(bench) -> list[RequestClass]:
    """bench.classes as RequestClass objects (they come as such, as dicts from Python, or as
    config nodes from the command line); validate_bench has checked them."""
    classes = []
    for spec in bench.classes or ():
        if isinstance(spec, RequestClass):
            classes.append(spec)
        else:
            values = {key: spec[key] for key in CLASS_FIELDS if key in spec}
            values["metadata"] = dict(values.get("metadata") or {})
            classes.append(RequestClass(**values))
    return classes


def assign_classes(requests: list[WorkloadRequest], classes: list[RequestClass], seed: int) -> None:
    """Gives each request its class and what it brings: the class a trace line names, else one
    drawn by weight (numpy's generator seeded with (seed, CLASS_STREAM)); its priority, and its
    metadata with "class" and the SLOs, the trace line's own priority, SLOs and tenant winning.
    A request of no class keeps its trace line's settings alone."""
    by_name = {c.name: c for c in classes}
    drawn = None
    if classes:
        weights = np.array([c.weight for c in classes], dtype=np.float64)
        rng = np.random.default_rng([seed, CLASS_STREAM])
        drawn = rng.choice(len(classes), size=len(requests), p=weights / weights.sum()).tolist()
    for i, request in enumerate(requests):
        own = request.own or {}
        name = own.get("class")
        spec = by_name.get(name) if name is not None else (classes[drawn[i]] if drawn is not None else None)
        if name is not None and spec is None:  # validate_bench read the trace: a line changed since
            raise BenchConfigError(f"bench.trace: request {i}: class {name!r} is not defined in bench.classes")
        metadata = dict(spec.metadata) if spec is not None else {}
        if spec is not None:
            metadata["class"] = spec.name
            request.priority = spec.priority
            for slo in ("slo_ttft_s", "slo_tpot_s"):
                if getattr(spec, slo) is not None:
                    metadata[slo] = getattr(spec, slo)
        for key in ("slo_ttft_s", "slo_tpot_s", "tenant"):
            if key in own:
                metadata[key] = own[key]
        if "priority" in own:
            request.priority = own["priority"]
        request.metadata.update(metadata)


def _generated_workload(bench, vocab_size: int, max_model_len: int, seed: int) -> Workload:
    prompts, prompt_lengths, output_lengths = _generated_lengths_and_prompts(bench, max_model_len, seed)
    inputs, outputs, scale = fit_lengths(prompt_lengths, output_lengths, max_model_len, bench.fit)
    arrivals = arrival_times(bench.num_seqs, bench.arrival, bench.request_rate, bench.burstiness, seed)
    requests = [
        WorkloadRequest(
            index=i,
            arrival_s=float(arrivals[i]),
            prompt_token_ids=[t % vocab_size for t in prompts[i][: inputs[i]]],
            output_len=outputs[i],
        )
        for i in range(bench.num_seqs)
    ]
    num_fitted = sum((n, o) != (i, fo) for n, o, i, fo in zip(prompt_lengths, output_lengths, inputs, outputs))
    return Workload(bench.arrival, requests, num_fitted, scale)


def _trace_workload(bench, vocab_size: int, max_model_len: int, seed: int) -> Workload:
    try:
        trace_format, trace = read_trace(bench.trace)
    except (OSError, ValueError) as e:  # validate_bench read only the first line
        raise BenchConfigError(f"bench.trace: {e}") from None
    trace = trace[: bench.max_requests]
    inputs, outputs, scale = fit_lengths(
        [r.input_length for r in trace], [r.output_length for r in trace], max_model_len, bench.fit
    )
    # Scaling shrinks the hash blocks with the prompts, so the requests still share the same fractions.
    block_size = math.ceil(MOONCAKE_BLOCK_SIZE * scale)
    time_scale, copies = bench.time_scale, bench.trace_copies  # a config read costs microseconds
    # Each prompt is its hash blocks (inferlab.core.blocks.BlockPrompt): a million prompts' ids would
    # not fit in memory, and only a runner that reads them makes them. Copy c of the trace has hash
    # ids and request keys of its own (its own users) at the same timestamps.
    stride = 1 + max((max(r.hash_ids) for r in trace if r.hash_ids), default=-1)
    sources = [TraceTokens(seed, vocab_size, block_size, c, stride, len(trace)) for c in range(copies)]
    namespaces = [("trace", seed, vocab_size, block_size, c) for c in range(copies)]
    bound = min(vocab_size, TOKEN_ID_RANGE)
    requests = []
    for i, r in enumerate(trace):
        arrival, keys = r.arrival_s * time_scale, r.hash_ids or ()
        for c in range(copies):
            prompt = BlockPrompt(namespaces[c], keys, block_size, inputs[i], i, sources[c], bound)
            requests.append(WorkloadRequest(len(requests), arrival, prompt, outputs[i], own=r.own))
    num_fitted = sum((r.input_length, r.output_length) != (i, o) for r, i, o in zip(trace, inputs, outputs))
    return Workload("trace", requests, num_fitted * copies, scale, trace_format)


def bench_workload(bench, vocab_size: int, max_model_len: int):
    """(prompt token ids, SamplingParams) of every request, arrival times aside: what one generate
    over the whole workload submits (the burst benchmark's input)."""
    workload = build_workload(bench, vocab_size, max_model_len)
    return [r.prompt_token_ids for r in workload.requests], workload.sampling_params(bench)
