"""Step-time profiles: what a simulated engine knows of the device it stands in for.

A profile is a JSON file: the device, the model shape, dtype, attention backend and tensor
parallel size it was measured with, the KV cache the engine had (bytes, block size, blocks), and
either the measured step times (`kind: measured`, written by `inferlab job=profile` on a GPU)
or the device's bandwidth and matmul rate (`kind: roofline`). Profiles measured on an H200 ship
in `inferlab/sim/profiles/`; give one by name (`h200-qwen3-8b-triton`) or by path.
"""

import json
import os
from dataclasses import dataclass, field
from typing import Any

from inferlab.core.cuda_graphs import GraphLimits
from inferlab.floor import DeviceRates, model_cost
from inferlab.sim.cost_model import HostLaunchModel, MeasuredCostModel, RooflineCostModel

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
FORMAT = 1
# Devices a roofline profile can be made for without measuring: rates measured on the lent H200
# (BENCHMARKS.md, "The floor"), the middle of the machines' range, and its memory.
KNOWN_DEVICES = {
    "h200": {"name": "NVIDIA H200", "bandwidth": 4.18e12, "matmul_rate": 7.65e14, "memory_bytes": 150_000_000_000},
}
MODEL_FIELDS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "max_position_embeddings",
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

    def admission_seconds(self, num_prompt_tokens: int) -> float:
        return self.admission_s_per_request + self.admission_s_per_token * num_prompt_tokens

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
        return HostLaunchModel(self.measurements)

    def cost_model(self):
        if self.kind == "measured":
            return MeasuredCostModel(self.measurements)
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
        return f"{what}: {self.device}, {self.model.get('model_type', '?')} {self.dtype}, {self.attention}, TP {self.tensor_parallel_size}"

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


def shipped_profiles() -> list[str]:
    return sorted(name[: -len(".json")] for name in os.listdir(PROFILE_DIR) if name.endswith(".json"))


def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name, or a profile file by path."""
    path = name_or_path
    if not os.path.exists(path):
        path = os.path.join(PROFILE_DIR, f"{name_or_path}.json")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no step-time profile {name_or_path!r}: give a profile file's path (from `inferlab job=profile`) "
            f"or a shipped one: {shipped_profiles()}, or 'roofline'"
        )
    with open(path) as f:
        data = json.load(f)
    if data.pop("format", None) != FORMAT:
        raise ValueError(f"{path}: not a step-time profile of format {FORMAT}")
    try:
        return Profile(**data)
    except TypeError as e:
        raise ValueError(f"{path}: malformed step-time profile: {e}") from None


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
