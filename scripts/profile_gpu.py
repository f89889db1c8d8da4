"""Where the bench workload's time goes on the GPU.

    python scripts/profile_gpu.py [--attention triton] [--steps 30] [--no-timeline] [--no-kernels] [--runs 1]

1. Timeline: the whole workload once (after a warm-up run), with CUDA events around every step's
   launch. Steps are grouped (prefill/mixed, then decode by batch size); each group gets its wall
   time, the GPU's busy time (launch to launch-end events), the GPU's idle time between steps
   (where the CPU bounds the run) and its floor (weights + the batch's K/V over the measured
   bandwidth; FLOPs over the matmul rate for prefill).
   With --runs N the timeline repeats N times, one line a run: where a slow run's time went (GPU
   busy or idle, which steps), the garbage collector's pauses inside it, and the GPU's clocks,
   power and throttle reasons over it (nvidia-smi, sampled every 50 ms).
2. Kernels: torch.profiler's top CUDA kernels over a window of decode steps at full batch and
   again once the batch has fallen to --small-batch sequences.
Uses the bench checkpoint and workload of scripts/bench_gpu.py."""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import QWEN3_0_6B, GcPauses, GpuSampler, build_checkpoint, describe_conditions, workload  # noqa: E402

from inferlab import LLM, SamplingParams  # noqa: E402
from inferlab.core.model_cost import model_cost  # noqa: E402
from inferlab.experiment.floor import device_rates  # noqa: E402

BUCKETS = [(1, 16), (17, 32), (33, 64), (65, 128), (129, 192), (193, 256), (257, 512)]


def timeline(llm, prompts, params):
    """Runs the workload with an event pair around each launch; returns one record per step."""
    runner = llm.runner
    records = []
    launch = runner.launch

    def timed_launch(batch, *args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        handle = launch(batch, *args, **kwargs)
        end.record()
        records.append(
            {
                "seqs": len(batch.requests),
                "tokens": batch.total_tokens,
                "decode": batch.num_decode_tokens == batch.total_tokens,
                # every token the step attends over: each sequence's context plus its new tokens
                "kv_tokens": sum(s.num_computed_tokens + n for s, n in zip(batch.requests, batch.num_scheduled_tokens)),
                "start": start,
                "end": end,
            }
        )
        return handle

    runner.launch = timed_launch
    try:
        llm.reset_prefix_cache()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        runner.launch = launch
    for i, r in enumerate(records):
        r["gpu_ms"] = r["start"].elapsed_time(r["end"])
        r["idle_ms"] = records[i - 1]["end"].elapsed_time(r["start"]) if i else 0.0
    return records, wall


def describe_run(i, records, wall, conditions):
    """One line: the run's wall, GPU busy and idle time, then its GC pauses and GPU clocks."""
    busy = sum(r["gpu_ms"] for r in records) / 1e3
    idle = sum(r["idle_ms"] for r in records) / 1e3
    prefill = sum(r["gpu_ms"] for r in records if not r["decode"]) / 1e3
    worst_idle = max(r["idle_ms"] for r in records)
    print(
        f"run {i}: wall {wall:.3f} s, GPU busy {busy:.3f} s (prefill {prefill:.3f}, decode {busy - prefill:.3f}), "
        f"idle {idle:.3f} s (longest gap {worst_idle:.1f} ms); {describe_conditions(conditions)}",
        flush=True,
    )


def summarize(records, wall, cost, rates):
    def floor_ms(r):
        if r["decode"]:
            return (cost.weight_bytes + cost.kv_bytes_per_token * r["kv_tokens"]) / rates.bandwidth * 1e3
        return (
            r["tokens"] * (cost.flops_per_token - cost.head_flops_per_token) / rates.matmul_rate * 1e3
        )  # prefill rows skip the LM head

    groups = [("prefill/mixed", [r for r in records if not r["decode"]])]
    for lo, hi in BUCKETS:
        groups.append((f"decode {lo}-{hi}", [r for r in records if r["decode"] and lo <= r["seqs"] <= hi]))
    header = f"{'steps':<16} {'n':>5} {'GPU busy s':>10} {'GPU idle s':>10} {'floor s':>8} {'busy/floor':>10} {'ms/step':>8} {'idle ms/step':>12}"
    print(header)
    print("-" * len(header))
    total_busy = total_idle = total_floor = 0.0
    for name, rs in groups:
        if not rs:
            continue
        busy = sum(r["gpu_ms"] for r in rs) / 1e3
        idle = sum(r["idle_ms"] for r in rs) / 1e3
        floor = sum(floor_ms(r) for r in rs) / 1e3
        total_busy, total_idle, total_floor = total_busy + busy, total_idle + idle, total_floor + floor
        print(
            f"{name:<16} {len(rs):>5} {busy:>10.3f} {idle:>10.3f} {floor:>8.3f} {busy / floor:>10.2f} "
            f"{(busy + idle) / len(rs) * 1e3:>8.3f} {idle / len(rs) * 1e3:>12.3f}"
        )
    print(
        f"{'all':<16} {len(records):>5} {total_busy:>10.3f} {total_idle:>10.3f} {total_floor:>8.3f} "
        f"{total_busy / total_floor:>10.2f}   (wall {wall:.3f} s)"
    )


def profile_kernels(llm, steps: int, label: str):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    print(f"\n== kernels over {steps} steps, {label} ==")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--attention", default="triton")
    parser.add_argument("--steps", type=int, default=10, help="decode steps per kernel profile")
    parser.add_argument("--small-batch", type=int, default=32)
    parser.add_argument("--no-timeline", action="store_true")
    parser.add_argument("--no-kernels", action="store_true")
    parser.add_argument("--model-option", action="append", default=[], help="KEY=JSON, passed in model_options")
    parser.add_argument("--attention-option", action="append", default=[], help="KEY=JSON, passed in attention_options")
    parser.add_argument("--model-dir", default="/tmp/inferlab-bench-qwen3-0.6b-random")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the engine's kv_cache_dtype: auto or fp8")
    parser.add_argument("--runs", type=int, default=1, help="timeline runs, one summary line each (slow-run hunting)")
    args = parser.parse_args()
    import json

    parse = lambda items: {k: json.loads(v) for k, v in (i.split("=", 1) for i in items)}  # noqa: E731
    build_checkpoint(args.model_dir, QWEN3_0_6B["num_hidden_layers"])
    llm = LLM(
        args.model_dir,
        attention=args.attention,
        max_model_len=4096,
        dtype="bfloat16",
        kv_cache_dtype=args.kv_cache_dtype,
        model_options=parse(args.model_option),
        attention_options=parse(args.attention_option),
    )
    prompts, params = workload(256, 1024, 1024)
    rates = device_rates(llm.runner.device, llm.runner.dtype)
    cost = model_cost(llm.hf_config, llm.runner.dtype, llm.runner.kv_cache_dtype)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    if not args.no_timeline:
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: every shape compiled, every graph used
        gc_pauses, sampler = GcPauses(), GpuSampler(torch.cuda.current_device()) if args.runs > 1 else None
        for i in range(1, args.runs + 1):
            gc_pauses.reset()
            t0 = time.perf_counter()
            records, wall = timeline(llm, prompts, params)
            if i == 1:
                print(
                    f"\n== timeline: {args.attention}, {len(records)} steps, {wall:.3f} s, "
                    f"{sum(p.max_tokens for p in params) / wall:.0f} output tok/s =="
                )
                summarize(records, wall, cost, rates)
            if args.runs > 1:
                describe_run(i, records, wall, {**gc_pauses.summary(), **sampler.summary(t0, time.perf_counter())})
        if sampler is not None:
            sampler.close()
    if args.no_kernels:
        return
    llm.reset_prefix_cache()
    for prompt, p in zip(prompts, params):
        llm.add_request(prompt, p)
    profile_kernels(llm, 3, "the first 3 steps (prefill chunks)")
    while llm.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in llm.scheduler.running):
        llm.step()
    for _ in range(10):  # settle into steady decode
        llm.step()
    torch.cuda.synchronize()
    profile_kernels(
        llm,
        args.steps,
        f"batch {len(llm.scheduler.running)}, {sum(s.num_tokens for s in llm.scheduler.running)} cached tokens",
    )
    while len(llm.scheduler.running) > args.small_batch:
        llm.step()
    profile_kernels(
        llm,
        args.steps,
        f"batch {len(llm.scheduler.running)}, {sum(s.num_tokens for s in llm.scheduler.running)} cached tokens",
    )
    while not llm.is_finished():
        llm.step()


if __name__ == "__main__":
    main()
