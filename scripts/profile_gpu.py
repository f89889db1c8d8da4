"""Where a decode step's time goes on the GPU: CPU work per step vs time waiting for the device, the
forward pass alone (graph replay) against its own floor (weights + the batch's K/V over the measured
bandwidth), and the top CUDA kernels of a window of decode steps from torch.profiler.

    python scripts/profile_gpu.py [--attention flash_attn] [--steps 30]
Uses the bench checkpoint and workload of scripts/bench_gpu.py."""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import QWEN3_0_6B, build_checkpoint, workload  # noqa: E402

from inferlab import LLM  # noqa: E402
from inferlab.floor import device_rates, model_cost  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--attention", default="flash_attn")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model-dir", default="/tmp/inferlab-bench-qwen3-0.6b-random")
    args = parser.parse_args()
    build_checkpoint(args.model_dir, QWEN3_0_6B["num_hidden_layers"])
    llm = LLM(args.model_dir, attention=args.attention, max_model_len=4096, dtype="bfloat16")
    prompts, params = workload(256, 1024, 1024)
    for prompt, p in zip(prompts, params):
        llm.add_request(prompt, p)
    while llm.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in llm.scheduler.running):
        llm.step()
    for _ in range(10):  # settle into steady decode
        llm.step()
    torch.cuda.synchronize()
    stats = llm.stats
    steps0, wait0, t0 = stats.num_steps, stats.wait_seconds, time.perf_counter()
    for _ in range(args.steps):
        llm.step()
    wall = time.perf_counter() - t0
    n = stats.num_steps - steps0
    wait = stats.wait_seconds - wait0
    print(f"decode steps: {wall / n * 1e3:.2f} ms each; waiting for the GPU {wait / n * 1e3:.2f} ms, "
          f"CPU work {(wall - wait) / n * 1e3:.2f} ms")

    # the forward pass alone: replay the captured graph of this batch size
    running = list(llm.scheduler.running)
    graphs = llm.runner.decode_graphs
    rates = device_rates(llm.runner.device, llm.runner.dtype)
    cost = model_cost(llm.hf_config, llm.runner.dtype)
    if graphs is not None:
        size = min(b for b in graphs.batch_sizes if b >= len(running))
        graph = graphs.graphs[size]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        replay_ms = start.elapsed_time(end) / 20
        context = sum(s.num_tokens for s in running)
        floor_ms = (cost.weight_bytes - llm.hf_config.vocab_size * llm.hf_config.hidden_size * 2
                    + cost.kv_bytes_per_token * context) / rates.bandwidth * 1e3
        print(f"graph replay, batch {len(running)} (padded {size}), {context} cached tokens: {replay_ms:.2f} ms; "
              f"its floor (weights but the LM head + K/V over {rates.bandwidth / 1e9:.0f} GB/s) {floor_ms:.2f} ms")

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            llm.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
    while not llm.is_finished():
        llm.step()


if __name__ == "__main__":
    main()
