"""Kernel timings behind BENCHMARKS.md's kernel tables, each replayed from a CUDA graph (so launch
costs do not count, as in the engine's decode graphs) against its own floor.

    python scripts/microbench_gpu.py [--only prefill,sampling] [--out results.json]

- prefill: prefill attention on a chunk like the bench's first step (29 prompts of 100..1024
  tokens, no cached prefix, Qwen3-0.6B's heads): the triton backend's paged kernel over its tile
  sizes and warps, flash-attn's paged varlen kernel when it imports, and torch's own varlen
  kernels (its FlashAttention and cuDNN's) over contiguous K/V. Floor: the FLOPs over the
  measured matmul rate.
- sampling: the default sampler's kernels over bf16 logits at decode batch sizes, against torch's
  argmax over the same logits. Floor: the logits' bytes over the measured bandwidth.
Prints tables; --out writes them as JSON."""

import argparse
import functools
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from inferlab.experiment.floor import device_rates  # noqa: E402
from inferlab.kernels.sampling import sample_tokens  # noqa: E402
from inferlab.plugins.attention.triton_kernels import paged_prefill  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, VOCAB = 16, 8, 128, 256, 151936
# the triton backend's prefill tiles and launch on CUDA: (block_m, block_n, warps, stages)
ENGINE_PREFILL_CONFIG = (32, 32, 4, 2)


def graph_time_us(fn, reps: int = 20, replays: int = 20) -> float:
    """Microseconds per fn() call: reps calls captured in one CUDA graph, replayed; median of replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return replay_time_us(graph, replays) / reps


def median_event_us(fn, repeats: int) -> float:
    """Microseconds of fn() between two CUDA events, median of repeats."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def event_time_us(fn, calls: int = 10, repeats: int = 3) -> float:
    """Microseconds per fn() call, eagerly, between two events around `calls` calls; median of repeats.
    For kernels a graph cannot capture; launch gaps count where the host is slower than the kernels."""
    for _ in range(3):
        fn()
    return median_event_us(lambda: [fn() for _ in range(calls)], repeats) / calls


def replay_time_us(graph, replays: int = 20) -> float:
    """Microseconds per replay of a captured CUDA graph, median of replays (after one untimed)."""
    graph.replay()
    torch.cuda.synchronize()
    return median_event_us(graph.replay, replays)


def back_to_back_us(fn, calls: int, warmup: int = 10) -> float:
    """Microseconds per fn() call (a graph's replay, say) over `calls` calls back to back between
    two CUDA events, after `warmup` untimed ones: each call's tail may overlap the next's start, as
    consecutive steps' graphs do in the engine."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1000


def prefill_bench(rates, results):
    """Prefill attention on one bench-like chunk: the triton backend's kernel over tiles and warps
    (programs over the whole GQA group, 2 stages), flash-attn's varlen and torch's own kernels."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(100, 1024, (29,), generator=gen)
    total = int(lens.sum())
    blocks_per_seq = (lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = int(blocks_per_seq.sum())
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    tables = torch.zeros(len(lens), int(blocks_per_seq.max()), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq.tolist()):
        tables[i, :nb] = torch.arange(used, used + nb)
        used += nb
    tables = tables.cuda()
    seq_lens = lens.to(torch.int32).cuda()
    query_start = torch.zeros(len(lens) + 1, dtype=torch.int32)
    query_start[1:] = torch.cumsum(lens, 0)
    query_start = query_start.cuda()
    q = torch.randn(total, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    flops = 4 * HEAD_DIM * NUM_HEADS * float((lens * (lens + 1) / 2).sum())
    floor_us = flops / rates.matmul_rate * 1e6
    max_len, scale = int(lens.max()), HEAD_DIM**-0.5
    print(
        f"\n== prefill attention, {len(lens)} prompts, {total} tokens, floor {floor_us:.1f} µs (FLOPs / matmul rate) =="
    )
    rows = []
    group = NUM_HEADS // NUM_KV_HEADS
    for block_m, block_n, num_warps in itertools.product((16, 32, 64), (16, 32, 64), (4, 8)):
        prefill = functools.partial(
            paged_prefill,
            q,
            cache,
            out,
            query_start,
            seq_lens,
            tables,
            max_len,
            scale,
            block_m,
            block_n,
            num_warps,
            2,
            group,
        )
        try:
            us = graph_time_us(prefill, reps=5, replays=10)
        except Exception as e:  # a tile too large for shared memory or registers on this GPU
            print(f"  skip triton m{block_m} n{block_n} w{num_warps}: {type(e).__name__}")
            continue
        rows.append({"kernel": "triton", "block_m": block_m, "block_n": block_n, "warps": num_warps, "us": us})
    if flash_attn_varlen_func is not None:
        us = graph_time_us(
            lambda: flash_attn_varlen_func(
                q,
                cache[0],
                cache[1],
                cu_seqlens_q=query_start,
                cu_seqlens_k=query_start,
                max_seqlen_q=max_len,
                max_seqlen_k=max_len,
                softmax_scale=scale,
                causal=True,
                block_table=tables,
            ),
            reps=5,
            replays=10,
        )
        rows.append({"kernel": "flash_attn", "us": us})
    rows += torch_prefill_rows(q, query_start, max_len, scale)
    rows.sort(key=lambda r: r["us"])

    def is_engine_config(row):
        return (row.get("block_m"), row.get("block_n"), row.get("warps"), 2) == ENGINE_PREFILL_CONFIG

    # the fastest eight, then every other kernel and the engine's own configuration
    for r in rows[:8] + [r for r in rows[8:] if r["kernel"] != "triton" or is_engine_config(r)]:
        name = r["kernel"]
        if name == "triton":
            name = f"triton m{r['block_m']} n{r['block_n']} w{r['warps']}" + (
                " (engine)" if is_engine_config(r) else ""
            )
        print(f"  {name:<28} {r['us']:>8.1f} µs  {flops / r['us'] / 1e6:>6.0f} TFLOP/s")
    results["prefill"] = {"floor_us": floor_us, "rows": rows}


def torch_prefill_rows(q, query_start, max_len, scale) -> list[dict]:
    """torch's own varlen attention kernels on the same chunk, with K/V contiguous as a fresh prompt's
    projection leaves them (no paged cache): its FlashAttention (GQA native) and cuDNN's. torch's
    varlen_attn refuses GQA with cuDNN, so cuDNN also gets K/V expanded to every query head (the
    expansion's copy timed in one row and not in the other)."""
    rows = []
    total = q.shape[0]
    k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, dtype=q.dtype, device=q.device)
    v = torch.randn_like(k)
    group = NUM_HEADS // NUM_KV_HEADS
    k_all, v_all = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

    def cudnn(keys, values):
        return torch.ops.aten._cudnn_attention_forward(
            q, keys, values, None, query_start, query_start, max_len, max_len, False, 0.0, True, False, scale=scale
        )

    candidates = {
        "cudnn (kv heads)": lambda: cudnn(k, v),
        "cudnn (expanded kv)": lambda: cudnn(k_all, v_all),
        "cudnn + expansion": lambda: cudnn(k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)),
        "torch flash varlen (gqa)": lambda: torch.ops.aten._flash_attention_forward(
            q, k, v, query_start, query_start, max_len, max_len, 0.0, True, False, scale=scale
        ),
    }
    reference = candidates["torch flash varlen (gqa)"]()[0].float()
    for name, fn in candidates.items():
        try:
            err = (fn()[0].float() - reference).abs().max().item()
            # cuDNN's ragged path fails to capture in a CUDA graph, and a failed capture spoils the
            # ones after it: cuDNN runs first, timed eagerly between events
            us = event_time_us(fn) if name.startswith("cudnn") else graph_time_us(fn, reps=5, replays=10)
        except Exception as e:  # not every torch build or GPU has each kernel
            print(f"  skip {name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        print(f"  {name:<28} {us:>8.1f} µs (largest difference from torch's FlashAttention: {err:.3g})")
        rows.append({"kernel": name, "us": us, "err": err})
    return rows


def sampling_bench(rates, results):
    """The default sampler's kernels, as the engine launches them, over bf16 logits at decode batch
    sizes; against torch's argmax over the same logits (one read of them and little else)."""
    print("\n== sampling over [batch, vocab] bf16 logits (µs) ==")
    rows = []
    for batch in (256, 128, 32, 8):
        logits = torch.randn(batch, VOCAB, dtype=torch.bfloat16, device="cuda")
        temperatures = torch.full((batch,), 0.6, device="cuda")
        seeds = torch.randint(0, 2**31, (batch,), device="cuda")
        steps = torch.randint(0, 1000, (batch,), device="cuda")
        row = {
            "batch": batch,
            "floor_us": batch * VOCAB * logits.element_size() / rates.bandwidth * 1e6,
            "sampler_us": graph_time_us(functools.partial(sample_tokens, logits, temperatures, seeds, steps)),
            "argmax_us": graph_time_us(functools.partial(torch.argmax, logits, dim=-1)),
        }
        print(
            f"  batch {batch:>3}: floor {row['floor_us']:.1f}; sampler {row['sampler_us']:.1f}; "
            f"torch argmax {row['argmax_us']:.1f}"
        )
        rows.append(row)
    results["sampling"] = rows


PARTS = {"prefill": prefill_bench, "sampling": sampling_bench}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {sorted(PARTS)}")
    parser.add_argument("--out", default=None, help="write the tables as JSON here")
    args = parser.parse_args()
    parts = args.only.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {sorted(PARTS)}")
    rates = device_rates(torch.device("cuda"), torch.bfloat16)
    print(f"{rates.name}: bandwidth {rates.bandwidth / 1e9:.0f} GB/s, matmul {rates.matmul_rate / 1e12:.0f} TFLOP/s")
    results = {"device": rates.name, "bandwidth_GBps": rates.bandwidth / 1e9, "matmul_TFLOPs": rates.matmul_rate / 1e12}
    with torch.inference_mode():
        for part in parts:
            PARTS[part](rates, results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
