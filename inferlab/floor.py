"""The hardware floor of a generation workload: the time no engine can beat on this device.

Every decode step must read all weights and every cached K/V of the running sequences once
(bytes / memory bandwidth); prefill must do its FLOPs (over the matmul rate). Bandwidth and matmul
rate are measured once per device and cached, not taken from a datasheet.

With tensor parallelism the ranks work side by side, each on its share of the weights, K/V and
FLOPs, so the floor is one rank's: its share over one device's rates. The collectives between
the ranks are not counted; they are part of what an engine adds above the floor.
"""

import json
import os
from dataclasses import asdict, dataclass

import numpy as np
import torch

from inferlab.tiny_model import CACHE_DIR


@dataclass
class DeviceRates:
    name: str
    bandwidth: float  # bytes/s, a large device-to-device copy counting bytes read + written
    matmul_rate: float  # FLOP/s, a large square matmul in the model's dtype


@dataclass
class ModelCost:
    weight_bytes: int
    kv_bytes_per_token: int
    flops_per_token: float  # the matmuls' 2 * parameters, lm_head included
    head_flops_per_token: float  # the lm_head's share: prefill pays it once a request, for the last prompt token
    attention_flops_per_pair: float  # QK^T and PV for one (query, key) pair over all layers


def model_cost(
    hf_config, dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None, tensor_parallel_size: int = 1
) -> ModelCost:
    """The costs, on one of `tensor_parallel_size` ranks, of a model whose weights are in dtype and
    K/V cache in kv_cache_dtype (default dtype). A rank holds its share of the attention heads, of
    the MLP's intermediate features and of the (padded) vocabulary; with fewer KV heads than ranks
    it holds a replica of one KV head. The norms' weights are too small to count."""
    c, ranks = hf_config, tensor_parallel_size
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    heads = c.num_attention_heads // ranks
    kv_heads = max(1, c.num_key_value_heads // ranks)
    per_layer = (
        c.hidden_size * (heads + 2 * kv_heads) * head_dim
        + heads * head_dim * c.hidden_size
        + 3 * c.hidden_size * c.intermediate_size // ranks
    )
    head = -(-c.vocab_size // ranks) * c.hidden_size
    tied = bool(getattr(c, "tie_word_embeddings", False))
    params = c.num_hidden_layers * per_layer + head * (1 if tied else 2)
    size = dtype.itemsize
    kv_size = (kv_cache_dtype or dtype).itemsize
    return ModelCost(
        weight_bytes=params * size,
        kv_bytes_per_token=2 * c.num_hidden_layers * kv_heads * head_dim * kv_size,
        flops_per_token=2.0 * (c.num_hidden_layers * per_layer + head),
        head_flops_per_token=2.0 * head,
        attention_flops_per_pair=4.0 * c.num_hidden_layers * heads * head_dim,
    )


def workload_floor(prompt_lens, output_lens, cost: ModelCost, rates: DeviceRates) -> dict:
    """Floor of generating output_lens[i] tokens after prompt_lens[i], all requests at once."""
    prompts, outputs = np.asarray(prompt_lens, np.float64), np.asarray(output_lens, np.int64)
    # logits only for each prompt's last token, which samples output token 0
    prefill_flops = float(
        (
            prompts * (cost.flops_per_token - cost.head_flops_per_token)
            + cost.head_flops_per_token
            + cost.attention_flops_per_pair * prompts * (prompts + 1) / 2
        ).sum()
    )
    prefill_s = prefill_flops / rates.matmul_rate
    decode_s = decode_bytes = decode_flops = 0.0
    # decode step t computes token t of every request with more than t outputs (token 0 came from prefill)
    for t in range(1, int(outputs.max()) if len(outputs) else 0):
        active = outputs > t
        context = prompts[active] + t
        step_bytes = cost.weight_bytes + cost.kv_bytes_per_token * context.sum()
        step_flops = active.sum() * cost.flops_per_token + cost.attention_flops_per_pair * context.sum()
        decode_s += float(max(step_bytes / rates.bandwidth, step_flops / rates.matmul_rate))
        decode_bytes += step_bytes
        decode_flops += step_flops
    total = prefill_s + decode_s
    # A step that mixes prefill with memory-bound decode can hide prefill FLOPs behind the reads:
    # the strict bound takes the workload's bytes and FLOPs as wholes, whichever takes longer.
    strict = float(max(decode_bytes / rates.bandwidth, (decode_flops + prefill_flops) / rates.matmul_rate))
    return {
        "floor_seconds": total,
        "strict_floor_seconds": strict,
        "floor_prefill_seconds": prefill_s,
        "floor_decode_seconds": decode_s,
        "floor_output_tokens_per_s": float(outputs.sum()) / total if total else 0.0,
        "bandwidth_GBps": rates.bandwidth / 1e9,
        "matmul_TFLOPs": rates.matmul_rate / 1e12,
    }


def _time(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            import time

            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _time_copy(copy_bytes: int, device: torch.device, repeats: int) -> float:
    # A function of its own so that both buffers are freed before the matmul allocates.
    src = torch.randn(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    return _time(lambda: dst.copy_(src), device, repeats)


def measure_rates(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> DeviceRates:
    cuda = device.type == "cuda"
    copy_bytes = (2 << 30) if cuda else (64 << 20)
    bandwidth = 2 * copy_bytes / _time_copy(copy_bytes, device, 20 if cuda else 3)
    n = 8192 if cuda else 512
    dtype = dtype if cuda else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    seconds = _time(lambda: a @ b, device, 20 if cuda else 3)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    return DeviceRates(name=name, bandwidth=bandwidth, matmul_rate=2 * n**3 / seconds)


def device_rates(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> DeviceRates:
    """Measured once per device, dtype and torch version, then read from the cache."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    key = f"{name}|{dtype}|{torch.__version__}"
    path = os.path.join(CACHE_DIR, "device_rates.json")
    cache = {}
    if os.path.exists(path):
        with open(path) as f:
            cache = json.load(f)
    if key not in cache:
        cache[key] = asdict(measure_rates(device, dtype))
        os.makedirs(CACHE_DIR, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(cache, f, indent=1)
        os.replace(path + ".tmp", path)
    return DeviceRates(**cache[key])
