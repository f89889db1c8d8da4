"""Step-time profiles: what a simulated engine knows of the device it stands in for.

A profile is a JSON file: the device, the model shape, dtype, attention backend and tensor
parallel size it was measured with, the KV cache the engine had (bytes, block size, blocks), and
either the measured step times (`kind: measured`, written by `inferlab job=profile` on a GPU)
or the device's bandwidth and matmul rate (`kind: roofline`). Profiles measured on an H200 ship
in `inferlab/sim/profiles/`; give one by name (`h200-qwen3-8b-triton`) or by path.
"""

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inferlab.core.cuda_graphs import GraphLimits
from inferlab.core.model_cost import DeviceRates, model_cost
from inferlab.sim.cost_model import HostLaunchModel, MeasuredCostModel, RooflineCostModel

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
FORMAT = 1
# Fitted measured models by their measurements' text: a fleet's replicas load one profile each, and
# a fitted model is never changed after its fit.
_FITTED: dict[tuple[str, str], Any] = {}
# Devices a roofline profile can be made for without measuring: the middle of the measured machines'
# rates (BENCHMARKS.md, "The floor") and the card's memory.
KNOWN_DEVICES = {
    "h200": {"name": "NVIDIA H200", "bandwidth": 4.18e12, "matmul_rate": 7.65e14, "memory_bytes": 150_000_000_000},
}
# The model fields a profile's costs and KV cache size come from: a measured profile serves only these.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
MODEL_FIELDS = ("architectures", "model_type", *SIZE_FIELDS, "tie_word_embeddings", "max_position_embeddings")
KINDS = ("measured", "roofline")
DTYPES = ("bfloat16", "float16", "float32")
KV_CACHE_DTYPES = (*DTYPES, "float8_e4m3fn")
# A measurement's step composition (StepShape's fields) and the times measured for it.
SHAPE_COUNTS = (
    "prefill_tokens",
    "prefill_pairs",
    "prefill_requests",
    "decode_requests",
    "decode_context",
    "graph_tokens",
)
MEASURED_TIMES = ("seconds", "host_seconds", "device_seconds")
# The host's costs a profile may carry besides its step times: each a finite number of seconds >= 0,
# absent (0) in profiles measured before they were.
HOST_COSTS = (
    "admission_s_per_request",
    "admission_s_per_token",
    "step_host_s_per_step",
    "step_host_s_per_request",
    "step_host_s_per_prefill_token",
    "sampling_setup_s_per_step",
    "sampling_setup_s_per_row",
)


@dataclass
class Profile:
    kind: str  # "measured" or "roofline"
    device: str
    model: dict[str, Any]  # the HF config fields that set the costs
    dtype: str
    kv_cache_dtype: str
    attention: str
    tensor_parallel_size: int
    kv_cache_bytes: int  # what the real engine gave its KV cache (per rank)
    graph_batch_limit: int  # the largest decode batch the engine captures in a CUDA graph (0: eager)
    # Steps with prefill of at most this many tokens replayed CUDA graphs (0: none did), while their
    # decodes held fewer than graph_decode_limit tokens (0: any decodes)
    graph_prefill_tokens: int = 0
    graph_decode_limit: int = 0
    measurements: list[dict] = field(default_factory=list)
    rates: dict[str, float] = field(default_factory=dict)  # roofline: bandwidth (B/s) and matmul_rate (FLOP/s)
    step_overhead_s: float = 0.0  # roofline: a fixed cost per step
    source: dict[str, Any] = field(default_factory=dict)  # commit, date, command, settings
    # The host's time to admit a request (add_request: validate, queue), per request and per prompt
    # token; on the engine's thread, so a burst's first step waits for all of its admissions.
    admission_s_per_request: float = 0.0
    admission_s_per_token: float = 0.0
    # The measured model's name (its checkpoint directory's), which a simulated server serves
    # under when given no checkpoint; "" in older profiles.
    model_name: str = ""
    # The engine's own host work for a step besides launching it (scheduling, KV book-keeping,
    # finishing requests), per step, per request in the batch and per prefill token (hashing blocks).
    step_host_s_per_step: float = 0.0
    step_host_s_per_request: float = 0.0
    step_host_s_per_prefill_token: float = 0.0
    # The runner's rebuild of its per-row sampling settings, paid by a launch whose sampling rows
    # are not the previous launch's (a request joined or left), per launch and per row.
    sampling_setup_s_per_step: float = 0.0
    sampling_setup_s_per_row: float = 0.0
    # The host's launch time in a run over what relaunching one batch back to back (the grid's
    # host_seconds) says: between a run's launches the engine's other work cools the host's caches.
    launch_in_run_factor: float = 1.0
    # What a step launched onto an idle engine costs beyond one launched after another step:
    # [idle seconds, extra seconds] pairs, by increasing idle time (a host and a device waking up).
    idle_wake: list = field(default_factory=list)

    def __post_init__(self):
        problems = self._problems()
        if problems:
            raise ValueError("; ".join(problems))

    def _problems(self) -> list[str]:
        """What makes the profile unusable, one line a field: each says what is allowed."""
        problems = []

        def check(name: str, value, ok: bool, allowed: str) -> None:
            if not ok:
                problems.append(f"{name} must be {allowed}, got {value!r}")

        check("kind", self.kind, self.kind in KINDS, f"one of {list(KINDS)}")
        for name in ("device", "attention"):
            value = getattr(self, name)
            check(name, value, isinstance(value, str) and value != "", "a name")
        check("dtype", self.dtype, self.dtype in DTYPES, f"one of {list(DTYPES)}")
        check(
            "kv_cache_dtype",
            self.kv_cache_dtype,
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"one of {list(KV_CACHE_DTYPES)}",
        )
        check(
            "tensor_parallel_size",
            self.tensor_parallel_size,
            _count(self.tensor_parallel_size, 1),
            "a whole number > 0",
        )
        check("kv_cache_bytes", self.kv_cache_bytes, _count(self.kv_cache_bytes, 1), "a whole number > 0")
        for name in ("graph_batch_limit", "graph_prefill_tokens", "graph_decode_limit"):
            check(name, getattr(self, name), _count(getattr(self, name), 0), "a whole number >= 0")
        for name in ("step_overhead_s", *HOST_COSTS):
            check(name, getattr(self, name), finite_number(getattr(self, name), 0.0), "a finite number >= 0")
        check(
            "launch_in_run_factor",
            self.launch_in_run_factor,
            finite_number(self.launch_in_run_factor, 0.0) and self.launch_in_run_factor > 0,
            "a finite number > 0",
        )
        check(
            "idle_wake",
            self.idle_wake,
            isinstance(self.idle_wake, list)
            and all(
                isinstance(p, (list, tuple)) and len(p) == 2 and all(finite_number(x, 0.0) for x in p)
                for p in self.idle_wake
            )
            and all(a[0] < b[0] for a, b in zip(self.idle_wake, self.idle_wake[1:])),
            "a list of [idle seconds, extra seconds] pairs of finite numbers >= 0, by increasing idle seconds",
        )
        check("source", self.source, isinstance(self.source, dict), "an object")
        check("model_name", self.model_name, isinstance(self.model_name, str), "a string")
        if not isinstance(self.model, dict):
            problems.append(f"model must be an object of the model's config fields, got {self.model!r}")
        else:
            for name in SIZE_FIELDS:
                check(f"model.{name}", self.model.get(name), _count(self.model.get(name), 1), "a whole number > 0")
        if self.kind == "measured":
            problems += self._measurement_problems()
        elif self.kind == "roofline":
            if not isinstance(self.rates, dict) or set(self.rates) != {"bandwidth", "matmul_rate"}:
                problems.append(f"rates must hold bandwidth and matmul_rate (a roofline's), got {self.rates!r}")
            else:
                for name, value in self.rates.items():
                    check(f"rates.{name}", value, finite_number(value, 0.0) and value > 0, "a finite number > 0")
        return problems

    def _measurement_problems(self) -> list[str]:
        if not isinstance(self.measurements, list) or not self.measurements:
            return [f"a measured profile needs measurements (a list of measured steps), got {self.measurements!r}"]
        problems = []
        for i, m in enumerate(self.measurements):
            if not isinstance(m, dict):
                problems.append(f"measurements[{i}] must be an object (a step's shape and times), got {m!r}")
                continue
            if "seconds" not in m:
                problems.append(f"measurements[{i}] has no seconds (the step's measured time)")
            for name in MEASURED_TIMES:
                # a step takes time: zero, negative or non-finite times come from a broken file
                if name in m and not (finite_number(m[name], 0.0) and m[name] > 0):
                    problems.append(f"measurements[{i}].{name} must be a finite number > 0, got {m[name]!r}")
            if "seconds_std" in m and not finite_number(m["seconds_std"], 0.0):
                problems.append(f"measurements[{i}].seconds_std must be a finite number >= 0, got {m['seconds_std']!r}")
            for name in SHAPE_COUNTS:
                if name in m and not _count(m[name], 0):
                    problems.append(f"measurements[{i}].{name} must be a whole number >= 0, got {m[name]!r}")
            if "graph" in m and not isinstance(m["graph"], bool):
                problems.append(f"measurements[{i}].graph must be true or false, got {m['graph']!r}")
            if not any(_count(m.get(name), 1) for name in ("prefill_tokens", "decode_requests")):
                problems.append(
                    f"measurements[{i}] is a step of no work: it needs prefill_tokens or decode_requests > 0"
                )
            if len(problems) >= 5:  # a file broken throughout: its first few lines say enough
                break
        return problems

    def admission_seconds(self, num_prompt_tokens: int) -> float:
        return self.admission_s_per_request + self.admission_s_per_token * num_prompt_tokens

    def step_host_seconds(self, num_requests: int, num_prefill_tokens: int) -> float:
        """The engine's host work for a step of num_requests requests and num_prefill_tokens
        prefill tokens, besides its launch."""
        return (
            self.step_host_s_per_step
            + self.step_host_s_per_request * num_requests
            + self.step_host_s_per_prefill_token * num_prefill_tokens
        )

    def sampling_setup_seconds(self, num_rows: int) -> float:
        return self.sampling_setup_s_per_step + self.sampling_setup_s_per_row * num_rows

    def idle_wake_seconds(self, idle_s: float) -> float:
        """The extra time of a step launched after the engine idled idle_s seconds: linear between
        the measured idle times (from nothing at no idle time), the last one's beyond them."""
        points = self.idle_wake
        if not points or idle_s <= 0:
            return 0.0
        idle = [0.0] + [p[0] for p in points]
        extra = [0.0] + [p[1] for p in points]
        return float(np.interp(idle_s, idle, extra))

    def graph_limits(self, config) -> GraphLimits:
        """Which steps an engine of `config` (its settings) replays from CUDA graphs on this profile's device."""
        if config.enforce_eager:
            return GraphLimits()
        prefill_tokens = min(self.graph_prefill_tokens, config.max_num_batched_tokens)
        if config.graph_prefill_tokens is not None:  # the profile holds the limit its engine resolved
            prefill_tokens = min(prefill_tokens, config.graph_prefill_tokens)
        return GraphLimits(min(self.graph_batch_limit, config.max_num_seqs), prefill_tokens, self.graph_decode_limit)

    def host_launch_model(self) -> HostLaunchModel | None:
        """The host's launch time of a step, where the profile measured it (None: a roofline
        estimate, or a profile older than host_seconds, whose steps launch in no time)."""
        if self.kind != "measured" or not any(m.get("host_seconds") for m in self.measurements):
            return None
        return fitted(HostLaunchModel, self.measurements)

    def cost_model(self):
        if self.kind == "measured":
            return fitted(MeasuredCostModel, self.measurements)
        import torch

        cost = model_cost(
            config_namespace(self.model),
            getattr(torch, self.dtype),
            getattr(torch, self.kv_cache_dtype),
            self.tensor_parallel_size,
        )
        return RooflineCostModel(cost, DeviceRates(self.device, **self.rates), self.step_overhead_s)

    def label(self) -> str:
        """How results name the profile: measured ones by their device, roofline ones as such."""
        what = "roofline estimate" if self.kind == "roofline" else "measured"
        dtypes = self.dtype if self.kv_cache_dtype == self.dtype else f"{self.dtype} (KV cache {self.kv_cache_dtype})"
        return f"{what}: {self.device}, {self.model.get('model_type', '?')} {dtypes}, {self.attention}, TP {self.tensor_parallel_size}"

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"format": FORMAT, **self.__dict__}, f, indent=1)


def config_namespace(model: dict):
    """An object with the model's config fields as attributes, as floor.model_cost reads them."""
    from types import SimpleNamespace

    return SimpleNamespace(**model)


def model_fields(hf_config) -> dict[str, Any]:
    fields = {name: getattr(hf_config, name, None) for name in MODEL_FIELDS}
    fields["head_dim"] = fields["head_dim"] or hf_config.hidden_size // hf_config.num_attention_heads
    fields["num_key_value_heads"] = fields["num_key_value_heads"] or hf_config.num_attention_heads
    fields["tie_word_embeddings"] = bool(fields["tie_word_embeddings"])
    return fields


def _count(value, least: int) -> bool:
    """Whether value is a whole number (not a bool, nor a float such as 1e9) of at least `least`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def finite_number(value, least: float) -> bool:
    """Whether value is a finite int or float (not a bool) of at least `least`."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= least


def shipped_profiles() -> list[str]:
    return sorted(name[: -len(".json")] for name in os.listdir(PROFILE_DIR) if name.endswith(".json"))


def fitted(model, measurements: list[dict]):
    """model(measurements), fitted once for equal measurements (the key is their text, so a
    profile whose measurements were changed is fitted again)."""
    key = (model.__name__, repr(measurements))
    if key not in _FITTED:
        _FITTED[key] = model(measurements)
    return _FITTED[key]


def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name, or a profile file by path."""
    path = name_or_path
    if not os.path.isfile(path):
        path = os.path.join(PROFILE_DIR, f"{name_or_path}.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no step-time profile {name_or_path!r}: give a profile file's path (from `inferlab job=profile`) "
            f"or a shipped one: {shipped_profiles()}, or 'roofline'"
        )
    try:
        with open(path) as f:
            data = json.load(f)
    except ValueError as e:  # not JSON, or not text
        raise ValueError(f"{path}: not JSON, so not a step-time profile ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a step-time profile is a JSON object, got a JSON {type(data).__name__}")
    if data.pop("format", None) != FORMAT:
        raise ValueError(f"{path}: not a step-time profile of format {FORMAT}")
    try:
        profile = Profile(**data)
        # fitted here too, so that measurements the cost models cannot use name the file
        profile.cost_model()
        profile.host_launch_model()
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: malformed step-time profile: {e}") from None
    return profile


def roofline_profile(
    hf_config,
    device: str,
    dtype: str,
    kv_cache_dtype: str,
    tensor_parallel_size: int,
    gpu_memory_utilization: float,
    step_overhead_s: float,
) -> Profile:
    """A profile from a known device's rates, for any model shape (labelled as an estimate)."""
    if device not in KNOWN_DEVICES:
        raise ValueError(f"no rates for device {device!r} to build a roofline profile; known: {sorted(KNOWN_DEVICES)}")
    spec = KNOWN_DEVICES[device]
    import torch

    model = model_fields(hf_config)
    weights = model_cost(config_namespace(model), getattr(torch, dtype), None, tensor_parallel_size).weight_bytes
    kv_bytes = int(spec["memory_bytes"] * gpu_memory_utilization) - weights
    if kv_bytes <= 0:
        raise ValueError(
            f"the model's weights ({weights / 1e9:.1f} GB a rank) do not fit in {device}'s memory at "
            f"gpu_memory_utilization={gpu_memory_utilization}"
        )
    return Profile(
        kind="roofline",
        device=spec["name"],
        model=model,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        attention="any",
        tensor_parallel_size=tensor_parallel_size,
        kv_cache_bytes=kv_bytes,
        graph_batch_limit=512,
        rates={"bandwidth": spec["bandwidth"], "matmul_rate": spec["matmul_rate"]},
        step_overhead_s=step_overhead_s,
    )
