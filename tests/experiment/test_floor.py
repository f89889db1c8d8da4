"""The workload floor: bytes and FLOPs counted from the model's shapes, over measured rates."""

import random

import pytest
import torch
from transformers import Qwen3Config

from inferlab.core.model_cost import DeviceRates, model_cost
from inferlab.experiment.floor import device_rates, workload_floor

QWEN3_06B = Qwen3Config(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
)


def test_qwen3_06b_cost():
    cost = model_cost(QWEN3_06B, torch.bfloat16)
    assert cost.weight_bytes == 2 * 595_984_384  # 0.6B parameters, embedding tied
    assert cost.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2
    assert cost.head_flops_per_token == 2 * 151936 * 1024


def test_an_fp8_kv_cache_halves_the_kv_bytes_only():
    bf16, fp8 = model_cost(QWEN3_06B, torch.bfloat16), model_cost(QWEN3_06B, torch.bfloat16, torch.float8_e4m3fn)
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert (fp8.weight_bytes, fp8.flops_per_token) == (bf16.weight_bytes, bf16.flops_per_token)


def test_a_tensor_parallel_rank_holds_its_share():
    """Every cost of Qwen3-0.6B divides evenly over 2 ranks; over 16 ranks (8 KV heads) each rank
    keeps a replica of one KV head, so its K/V share stops shrinking at 8."""
    one = model_cost(QWEN3_06B, torch.bfloat16)
    two = model_cost(QWEN3_06B, torch.bfloat16, tensor_parallel_size=2)
    assert (2 * two.weight_bytes, 2 * two.kv_bytes_per_token) == (one.weight_bytes, one.kv_bytes_per_token)
    assert 2 * two.flops_per_token == one.flops_per_token
    assert 2 * two.attention_flops_per_pair == one.attention_flops_per_pair
    eight = model_cost(QWEN3_06B, torch.bfloat16, tensor_parallel_size=8)
    sixteen = model_cost(QWEN3_06B, torch.bfloat16, tensor_parallel_size=16)
    assert sixteen.kv_bytes_per_token == eight.kv_bytes_per_token == one.kv_bytes_per_token // 8
    assert 2 * sixteen.attention_flops_per_pair == eight.attention_flops_per_pair
    # a vocabulary that does not divide is padded, as VocabParallelEmbedding pads it
    odd = model_cost(
        Qwen3Config(**{**QWEN3_06B.to_dict(), "vocab_size": 151937}), torch.bfloat16, tensor_parallel_size=2
    )
    assert odd.head_flops_per_token == 2 * 75969 * 1024


def test_prefill_pays_the_lm_head_once_a_request():
    cost = model_cost(QWEN3_06B, torch.bfloat16)
    rates = DeviceRates("x", 1e12, 1e15)
    one, many = workload_floor([1], [1], cost, rates), workload_floor([1000], [1], cost, rates)
    layers = cost.flops_per_token - cost.head_flops_per_token
    extra = (999 * layers + cost.attention_flops_per_pair * (1000 * 1001 / 2 - 1)) / rates.matmul_rate
    assert many["floor_prefill_seconds"] - one["floor_prefill_seconds"] == pytest.approx(extra)


def test_floor_of_the_bench_workload_on_h200_rates():
    random.seed(0)
    prompts = []
    for _ in range(256):
        prompts.append(len([random.randint(0, 10000) for _ in range(random.randint(100, 1024))]))
    outputs = [random.randint(100, 1024) for _ in range(256)]
    assert sum(outputs) == 133_966
    floor = workload_floor(prompts, outputs, model_cost(QWEN3_06B, torch.bfloat16), DeviceRates("h200", 4.3e12, 790e12))
    # DESIGN.md: about 3.7 s, about 36,000 output tokens/s
    assert floor["floor_seconds"] == pytest.approx(3.7, abs=0.1)
    assert floor["floor_output_tokens_per_s"] == pytest.approx(36_000, rel=0.03)
    assert floor["floor_decode_seconds"] > 10 * floor["floor_prefill_seconds"]


def test_floor_scales_with_bandwidth():
    cost = model_cost(QWEN3_06B, torch.bfloat16)
    slow = workload_floor([100] * 8, [50] * 8, cost, DeviceRates("x", 1e12, 1e15))
    fast = workload_floor([100] * 8, [50] * 8, cost, DeviceRates("x", 2e12, 1e15))
    assert slow["floor_decode_seconds"] == pytest.approx(2 * fast["floor_decode_seconds"])


def test_rates_are_measured_once_and_cached(tmp_path, monkeypatch):
    import inferlab.experiment.floor as floor

    monkeypatch.setattr(floor, "CACHE_DIR", str(tmp_path))
    calls = []
    real = floor.measure_rates
    monkeypatch.setattr(floor, "measure_rates", lambda *a: calls.append(1) or real(*a))
    first = device_rates(torch.device("cpu"))
    second = device_rates(torch.device("cpu"))
    assert first == second and len(calls) == 1
    assert first.bandwidth > 1e8 and first.matmul_rate > 1e8


def test_the_strict_floor_lets_prefill_flops_hide_behind_decode_reads():
    """Per step, prefill adds its FLOP time to decode's read time; the strict bound takes the
    workload's bytes and FLOPs as wholes (the larger of the two), so it is lower."""
    rates = DeviceRates("test", bandwidth=4.0e12, matmul_rate=7.5e14)
    cost = model_cost(QWEN3_06B, torch.bfloat16)
    floor = workload_floor([1000] * 64, [200] * 64, cost, rates)
    assert floor["strict_floor_seconds"] < floor["floor_seconds"]
    reads = sum(cost.weight_bytes + cost.kv_bytes_per_token * 64 * (1000 + t) for t in range(1, 200)) / rates.bandwidth
    assert floor["strict_floor_seconds"] == pytest.approx(reads, rel=1e-9)  # memory-bound: the reads decide
