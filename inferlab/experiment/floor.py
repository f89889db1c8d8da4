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
from dataclasses import asdict

import numpy as np
import torch

from inferlab.core.model_cost import DeviceRates, ModelCost
from inferlab.tiny_model import CACHE_DIR


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
