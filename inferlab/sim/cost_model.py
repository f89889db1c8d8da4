"""Step-cost models: how long the GPU work of one engine step takes, from the step's composition,
and how long the host takes to launch it.

A step is described by what drives its cost: its prefill tokens and the (query, key) pairs their
attention covers (so cached context counts), its decode sequences and the cached tokens they read,
and whether it replays a CUDA graph. Two models predict a step's seconds from that:

- `MeasuredCostModel`, fitted to a profile's measurements of real steps (`inferlab job=profile`):
  a decode-only step costs a fixed part and a part per cached token read, both functions of the
  batch size interpolated between the measured sizes (they move from weight-bound to
  compute-bound as the batch grows, which no single line captures); a step with prefill run
  eagerly costs the longer of the host's time to launch it (a floor: small eager steps are
  bound by Python and kernel launches, not by the device) and the device's time, a fixed part, a
  part per prefill token, per attention pair and per decode request, fitted by least squares,
  plus its decode requests' K/V reads; one replayed from a CUDA graph, the same terms fitted apart
  with no floor, its tokens counted as the graph's padded size.
- `HostLaunchModel`, fitted to the same profile's host times: how long the host takes to launch
  a step, which the simulated executor puts on its clock (a device step hides the next launch;
  a step launched onto an idle device waits for its own).
- `RooflineCostModel`, from a device's memory bandwidth and matmul rate alone: the larger of the
  step's bytes over the bandwidth and its FLOPs over the matmul rate, plus a per-step overhead.
  It serves any model shape and device, as a floor rather than a prediction.
- `StepNoise`, from the spread of a profile's repeated measurements (`seconds_std`): a seeded draw
  around a step's predicted time, so that simulated repeats vary as measured ones do.
"""

import bisect
import math
import random
from dataclasses import dataclass

import numpy as np

from inferlab.core.cuda_graphs import GraphLimits, prefill_graph_capacity
from inferlab.core.model_cost import DeviceRates, ModelCost


@dataclass(frozen=True, slots=True)
class StepShape:
    """The composition of one step, as a cost model sees it."""

    prefill_tokens: int = 0
    prefill_pairs: int = 0  # (query, key) pairs of the prefill tokens' attention, cached context included
    prefill_requests: int = 0
    decode_requests: int = 0
    decode_context: int = 0  # cached tokens the decode requests read, their new token included
    graph: bool = False  # the step replays a CUDA graph
    # a step with prefill replaying a graph: the tokens the graph computes (its size, padding included)
    graph_tokens: int = 0

    @classmethod
    def from_measurement(cls, measurement: dict) -> "StepShape":
        """The shape a profile's measurement records (fields it lacks, from older profiles, at their
        defaults)."""
        return cls(**{name: measurement[name] for name in cls.__slots__ if name in measurement})

    @classmethod
    def of(cls, batch, graphs: GraphLimits | None = None) -> "StepShape":
        """The shape of a ScheduledBatch, read before the step advances its requests; graphs: which
        steps replay CUDA graphs (None: none)."""
        return cls.sampling(batch, graphs)[0]

    @classmethod
    def sampling(cls, batch, graphs: GraphLimits | None = None) -> tuple["StepShape", list[int]]:
        """of()'s shape, and the rows that sample a token in the step (those whose scheduled
        tokens reach the end of what they hold), in one pass over the batch."""
        graphs = graphs or GraphLimits()
        prefill_tokens = prefill_pairs = prefill_requests = decode_requests = decode_context = 0
        longest_decode = 0
        sample_rows = []
        for row, (request, num_tokens) in enumerate(zip(batch.requests, batch.num_scheduled_tokens)):
            context = request.num_computed_tokens
            remaining = len(request.token_ids) - context
            if num_tokens == 1 and remaining == 1:
                decode_requests += 1
                decode_context += context + 1
                if context >= longest_decode:
                    longest_decode = context + 1
                sample_rows.append(row)
            else:
                prefill_requests += 1
                prefill_tokens += num_tokens
                prefill_pairs += num_tokens * context + num_tokens * (num_tokens + 1) // 2
                if num_tokens == remaining:
                    sample_rows.append(row)
        if not prefill_tokens:
            return cls.decodes(decode_requests, decode_context, graphs), sample_rows
        tokens = prefill_tokens + decode_requests
        graph = tokens <= graphs.prefill_tokens and (
            not graphs.decode_context or longest_decode < graphs.decode_context
        )
        graph_tokens = prefill_graph_capacity(tokens, graphs.prefill_tokens) if graph else 0
        shape = cls(
            prefill_tokens, prefill_pairs, prefill_requests, decode_requests, decode_context, graph, graph_tokens
        )
        return shape, sample_rows

    @classmethod
    def decodes(cls, num: int, context: int, graphs: GraphLimits | None = None) -> "StepShape":
        """The shape of a decode-only step of num requests whose contexts (the new token included)
        sum to context."""
        return cls(0, 0, 0, num, context, 0 < num <= (graphs or GraphLimits()).decode_batch, 0)

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


# Fewer graphed steps with prefill than this in a profile: they cost the eager fit's device part.
MIN_GRAPH_PREFILL_MEASUREMENTS = 6


class MeasuredCostModel:
    """Fitted to measured step times: see the module docstring. `measurements` are dicts with the
    StepShape fields and `seconds`."""

    def __init__(self, measurements: list[dict]):
        if not measurements:
            raise ValueError("a measured cost model needs measurements; the profile has none")
        shapes = [(StepShape.from_measurement(m), device_part(m)) for m in measurements]
        self.decode = {
            graph: _DecodeFit([(s, t) for s, t in shapes if not s.prefill_tokens and s.graph == graph])
            for graph in (True, False)
        }
        if not self.decode[True].sizes and not self.decode[False].sizes:
            raise ValueError("the profile has no decode-only measurements")
        mixed = [(s, t) for s, t in shapes if s.prefill_tokens and not s.graph]
        if not mixed:
            raise ValueError("the profile has no measurements of eager steps with prefill")
        # A step with prefill runs one eager forward over all its tokens: a fixed part, a part per
        # prefill token, per attention pair and per decode request, and the decode requests' K/V
        # reads at the rate decode-only steps of that batch size read it; never less than the
        # host's floor.
        rows, context = self._prefill_rows(mixed)
        self.host_floor_s, self.prefill_coefficients = fit_with_floor(rows, context, np.array([t for _, t in mixed]))
        # Replayed from a CUDA graph, the same terms (per token: the graph's size, padding included)
        # with coefficients of their own and no host floor (the eager fit's device part where the
        # profile measured too few such steps), fitted to relative errors: these steps' times span
        # more than a decade, and the small ones are the common ones.
        graphed = [(s, t) for s, t in shapes if s.prefill_tokens and s.graph]
        self.graph_prefill_coefficients = self.prefill_coefficients
        if len(graphed) >= MIN_GRAPH_PREFILL_MEASUREMENTS:
            rows, context = self._prefill_rows(graphed)
            seconds = np.array([t for _, t in graphed])
            self.graph_prefill_coefficients = nonnegative_least_squares(
                rows / seconds[:, None], (seconds - context) / seconds
            )

    def _prefill_rows(self, points: list[tuple[StepShape, float]]) -> tuple[np.ndarray, np.ndarray]:
        rows = np.array([[1.0, self._tokens(s), s.prefill_pairs, s.decode_requests] for s, _ in points])
        context = np.array([self._context_seconds(s.decode_requests, s.decode_context) for s, _ in points])
        return rows, context

    @staticmethod
    def _tokens(shape: StepShape) -> int:
        """The tokens whose per-token work a step with prefill pays: a graph computes its whole
        size, padding included (profiles older than graph_tokens record none: the step's own)."""
        if shape.graph and shape.graph_tokens:
            return shape.graph_tokens
        return shape.prefill_tokens

    def _fit(self, graph: bool) -> "_DecodeFit":
        return self.decode[graph] if self.decode[graph].sizes else self.decode[not graph]

    def _context_seconds(self, requests: int, context: int) -> float:
        return self._fit(True)._at(self._fit(True).per_token, requests) * context if requests else 0.0

    def decode_line(self, requests: int, graph: bool) -> tuple[float, float]:
        """(fixed, per context token) of a decode-only step of `requests` (> 0) requests: its
        seconds are fixed + per_token * decode_context, as __call__ computes them."""
        fit = self._fit(graph)
        return fit._at(fit.fixed, requests), fit._at(fit.per_token, requests)

    def __call__(self, shape: StepShape) -> float:
        if not shape.prefill_tokens:
            return self._fit(shape.graph)(shape.decode_requests, shape.decode_context) if shape.decode_requests else 0.0
        base, per_token, per_pair, per_decode = (
            self.graph_prefill_coefficients if shape.graph else self.prefill_coefficients
        )
        device = (
            base
            + per_token * self._tokens(shape)
            + per_pair * shape.prefill_pairs
            + per_decode * shape.decode_requests
            + self._context_seconds(shape.decode_requests, shape.decode_context)
        )
        return device if shape.graph else max(self.host_floor_s, device)

    def describe(self) -> dict:
        """The fitted coefficients, for results and docs."""

        def terms(coefficients):
            base, per_token, per_pair, per_decode = coefficients
            return {
                "base_s": base,
                "per_prefill_token_s": per_token,
                "per_pair_s": per_pair,
                "per_decode_request_s": per_decode,
            }

        return {
            "decode": {("graph" if g else "eager"): fit.describe() for g, fit in self.decode.items() if fit.sizes},
            "with_prefill": {"host_floor_s": self.host_floor_s, **terms(self.prefill_coefficients)},
            "with_prefill_graph": terms(self.graph_prefill_coefficients),
        }


def device_part(measurement: dict) -> float:
    """The seconds a measurement gives the device model. A decode-only step replayed from a CUDA
    graph takes the device's own time where the profile recorded it: the simulator puts the host's
    launch on its clock itself, and the interval between reads would count it again where it bounds
    the step, along with any slowness of the host's during the measurement (one composition measured
    on a slow host skews the fit of every batch size around it). Other steps keep the interval: an
    eager step's launch is its device work, and graphed steps with prefill run steadily above their
    bracketed device time."""
    device = measurement.get("device_seconds")
    if device and measurement.get("graph") and not measurement.get("prefill_tokens"):
        return float(device)
    return float(measurement["seconds"])


class _DecodeFit:
    """Decode-only steps: seconds = fixed(B) + per_token(B) * context, both piecewise linear in
    the batch size B between the measured sizes (and extrapolated linearly beyond them)."""

    def __init__(self, points: list[tuple[StepShape, float]]):
        by_size: dict[int, list[tuple[int, float]]] = {}
        for shape, seconds in points:
            by_size.setdefault(shape.decode_requests, []).append((shape.decode_context, seconds))
        self.sizes, self.fixed, self.per_token = [], [], []
        for size in sorted(by_size):
            context, seconds = map(np.array, zip(*by_size[size]))
            if len(set(context.tolist())) > 1:
                fixed, per_token = nonnegative_least_squares(np.stack([np.ones_like(context), context], 1), seconds)
            else:
                fixed, per_token = float(seconds.mean()), 0.0
            self.sizes.append(size)
            self.fixed.append(fixed)
            self.per_token.append(per_token)

    def _at(self, values: list[float], size: int) -> float:
        sizes = self.sizes
        if len(sizes) == 1:
            return values[0] * size / sizes[0] if size > sizes[0] else values[0]
        i = min(max(bisect.bisect_left(sizes, size), 1), len(sizes) - 1)
        lo, hi = sizes[i - 1], sizes[i]
        return max(0.0, values[i - 1] + (values[i] - values[i - 1]) * (size - lo) / (hi - lo))

    def __call__(self, requests: int, context: int) -> float:
        return self._at(self.fixed, requests) + self._at(self.per_token, requests) * context

    def describe(self) -> dict:
        return {"batch_sizes": self.sizes, "fixed_s": self.fixed, "per_context_token_s": self.per_token}


class HostLaunchModel:
    """The host's time to launch a step (prepare its inputs, launch or replay its kernels), fitted
    to a profile's `host_seconds`: a fixed part, more for a step with prefill, and parts per
    request, per prefill token and per decode context token, with their own coefficients for
    steps replayed from CUDA graphs and for eager ones, fitted to relative errors. Back to back
    the device hides it, but a step launched onto an idle device waits for it, as does reading
    the tokens of the step before, which comes after the next launch."""

    def __init__(self, measurements: list[dict]):
        self.coefficients = {}
        for graph in (True, False):
            points = [m for m in measurements if bool(m.get("graph")) == graph and m.get("host_seconds")]
            if points:
                rows = np.array([self._row(StepShape.from_measurement(m)) for m in points])
                host = np.array([m["host_seconds"] for m in points])
                fitted = nonnegative_least_squares(rows / host[:, None], np.ones_like(host))
                self.coefficients[graph] = tuple(float(c) for c in fitted)
        if not self.coefficients:
            raise ValueError("the profile's measurements hold no host_seconds")

    @staticmethod
    def _row(shape: StepShape) -> list[float]:
        return [
            1.0,
            1.0 if shape.prefill_tokens else 0.0,
            shape.prefill_requests + shape.decode_requests,
            shape.prefill_tokens,
            shape.decode_context,
        ]

    def __call__(self, shape: StepShape) -> float:
        base, with_prefill, per_request, per_prefill_token, per_context = self._coefficients(shape.graph)
        # summed left to right, term by term as _row lists them (decode_line's sums are its prefix)
        return (
            base
            + with_prefill * (1.0 if shape.prefill_tokens else 0.0)
            + per_request * (shape.prefill_requests + shape.decode_requests)
            + per_prefill_token * shape.prefill_tokens
            + per_context * shape.decode_context
        )

    def _coefficients(self, graph: bool) -> tuple[float, ...]:
        return self.coefficients.get(bool(graph)) or next(iter(self.coefficients.values()))

    def decode_line(self, requests: int, graph: bool) -> tuple[float, float]:
        """(fixed, per context token) of a decode-only step of `requests` requests: its launch
        takes fixed + per_token * decode_context, as __call__ computes it."""
        base, with_prefill, per_request, per_prefill_token, per_context = self._coefficients(graph)
        return base + with_prefill * 0.0 + per_request * requests + per_prefill_token * 0, per_context

    def describe(self) -> dict:
        names = ("base_s", "with_prefill_s", "per_request_s", "per_prefill_token_s", "per_decode_context_token_s")
        return {("graph" if g else "eager"): dict(zip(names, c)) for g, c in self.coefficients.items()}


class StepNoise:
    """A step's time as a draw around its predicted time: the prediction times a lognormal factor
    of mean 1 whose coefficient of variation is `scale` times that measured for the nearest
    composition of the same kind (decode-only or with prefill, replayed from a CUDA graph or
    eager; nearest in decode requests, or in prefill tokens, on a log scale). Measurements without
    `seconds_std` (profiles older than it) give no spread; scale 0 gives none at all."""

    def __init__(self, measurements: list[dict], scale: float, seed: int = 0):
        self.scale = scale
        self.spreads: dict[tuple[bool, bool], tuple[list[float], list[float]]] = {}
        points: dict[tuple[bool, bool], dict[float, list[float]]] = {}
        for m in measurements:
            if m.get("seconds_std") is None:
                continue
            shape = StepShape.from_measurement(m)
            points.setdefault(self._kind(shape), {}).setdefault(self._size(shape), []).append(
                m["seconds_std"] / m["seconds"]
            )
        for kind, by_size in points.items():
            sizes = sorted(by_size)
            self.spreads[kind] = (sizes, [float(np.median(by_size[s])) for s in sizes])
        self._cv_cache: dict[tuple[bool, bool, float], float] = {}
        self.rng = random.Random(seed)

    @property
    def active(self) -> bool:
        return self.scale > 0 and bool(self.spreads)

    def reseed(self, seed: int) -> None:
        self.rng.seed(seed)

    @staticmethod
    def _kind(shape: StepShape) -> tuple[bool, bool]:
        return bool(shape.prefill_tokens), bool(shape.graph)

    @staticmethod
    def _size(shape: StepShape) -> float:
        return math.log(max(1, shape.prefill_tokens if shape.prefill_tokens else shape.decode_requests))

    def cv(self, shape: StepShape) -> float:
        """The coefficient of variation of the step's time (before `scale`)."""
        kind, size = self._kind(shape), self._size(shape)
        key = (*kind, size)
        cached = self._cv_cache.get(key)
        if cached is not None:
            return cached
        sizes, spreads = self.spreads.get(kind) or self.spreads.get((kind[0], not kind[1])) or ([0.0], [0.0])
        i = bisect.bisect_left(sizes, size)
        nearest = min((j for j in (i - 1, i) if 0 <= j < len(sizes)), key=lambda j: abs(sizes[j] - size))
        self._cv_cache[key] = spreads[nearest]
        return spreads[nearest]

    def __call__(self, shape: StepShape, seconds: float) -> float:
        cv = self.scale * self.cv(shape)
        if cv <= 0:
            return seconds
        sigma = math.sqrt(math.log1p(cv * cv))
        return seconds * self.rng.lognormvariate(-sigma * sigma / 2, sigma)

    def describe(self) -> dict:
        names = {(False, True): "decode_graph", (False, False): "decode_eager"}
        names.update({(True, True): "prefill_graph", (True, False): "prefill_eager"})
        return {
            "scale": self.scale,
            "median_cv": {names[k]: float(np.median(v[1])) for k, v in self.spreads.items()},
        }


class RooflineCostModel:
    """The larger of bytes / bandwidth and FLOPs / matmul rate, plus a fixed overhead per step."""

    def __init__(self, cost: ModelCost, rates: DeviceRates, step_overhead_s: float = 0.0):
        self.cost, self.rates, self.step_overhead_s = cost, rates, step_overhead_s

    def __call__(self, shape: StepShape) -> float:
        cost = self.cost
        tokens = shape.prefill_tokens + shape.decode_requests
        context_bytes = cost.kv_bytes_per_token * (shape.decode_context + shape.prefill_tokens)
        flops = (
            tokens * (cost.flops_per_token - cost.head_flops_per_token)
            + (shape.decode_requests + shape.prefill_requests) * cost.head_flops_per_token
            + cost.attention_flops_per_pair * (shape.prefill_pairs + shape.decode_context)
        )
        compute = max((cost.weight_bytes + context_bytes) / self.rates.bandwidth, flops / self.rates.matmul_rate)
        return self.step_overhead_s + compute

    def describe(self) -> dict:
        return {
            "bandwidth_GBps": self.rates.bandwidth / 1e9,
            "matmul_TFLOPs": self.rates.matmul_rate / 1e12,
            "step_overhead_s": self.step_overhead_s,
        }


def fit_with_floor(rows: np.ndarray, fixed: np.ndarray, seconds: np.ndarray) -> tuple[float, list[float]]:
    """(floor, coefficients) of seconds = max(floor, rows @ coefficients + fixed). The floor is
    chosen among 0 and the measured times as the one that explains the measurements best (least
    squared log error), the coefficients fitted to the measurements above it; steps at the floor
    tell nothing about the device."""
    best = None
    for floor in [0.0, *sorted(set(seconds.tolist()))]:
        above = seconds > floor
        if floor and above.sum() < rows.shape[1]:  # too few left to fit the device's part
            break
        coefficients = nonnegative_least_squares(rows[above], seconds[above] - fixed[above])
        predicted = np.maximum(floor, rows @ np.array(coefficients) + fixed)
        error = float(np.sum(np.log(np.maximum(predicted, 1e-12) / seconds) ** 2))
        if best is None or error < best[0] - 1e-12:
            best = (error, floor, coefficients)
    return best[1], best[2]


def nonnegative_least_squares(rows: np.ndarray, targets: np.ndarray) -> list[float]:
    """Least squares with every coefficient >= 0 (a cost never falls as work grows): solve, drop
    the most negative coefficient, repeat."""
    active = list(range(rows.shape[1]))
    while True:
        solution = np.zeros(rows.shape[1])
        if active:
            solution[active] = np.linalg.lstsq(rows[:, active], targets, rcond=None)[0]
        negative = [i for i in active if solution[i] < 0]
        if not negative:
            return [float(x) for x in solution]
        active.remove(min(negative, key=lambda i: solution[i]))
