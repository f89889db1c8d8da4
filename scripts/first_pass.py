"""Start-up and the first pass, as a user on a fresh machine meets them (run on the GPU machine).

    python3 scripts/bench_gpu.py --build-only --shape 0.6b --model-dir /tmp/q06
    python3 scripts/first_pass.py /tmp/q06
    python3 scripts/first_pass.py /tmp/q06 --online mooncake_conversation_trace.jsonl

Builds the engine (its log lines time each start-up phase), then runs nano-vllm bench.py's
workload twice in the one process (the first pass, then a warm one over other token ids, so no
prefix-cache hits) and one sequence decoding 1,024 tokens. Every Triton compile is timed and
counted per phase: with compile_at_start, the passes should compile nothing.

With --online TRACE, the online workload instead: Poisson arrivals at 20 requests/s carrying the
trace's first 600 requests' lengths (prompts clipped to 3,000 tokens, outputs to 512), served
right after start-up, then again after one offline pass of the bench workload: TTFT and TPOT p99
of the first against the second (the fresh process against the warmed one)."""

import argparse
import logging
import os
import sys
import time

import triton.compiler

COMPILES: list[tuple[str, str, float]] = []
PHASE = ["import"]
_compile = triton.compiler.compile


def _timed_compile(src, *args, **kwargs):
    start = time.perf_counter()
    kernel = _compile(src, *args, **kwargs)
    name = getattr(getattr(src, "fn", None), "__name__", str(src)[:40])
    COMPILES.append((PHASE[0], name, time.perf_counter() - start))
    return kernel


triton.compiler.compile = _timed_compile  # Triton's JIT binds it at a kernel's first launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import workload  # noqa: E402

from inferlab import LLM, SamplingParams  # noqa: E402


def report(phase: str) -> None:
    rows = [c for c in COMPILES if c[0] == phase]
    by_kernel: dict[str, list[float]] = {}
    for _, name, seconds in rows:
        by_kernel.setdefault(name, []).append(seconds)
    print(f"== compiles in {phase}: {len(rows)}, {sum(r[2] for r in rows):.2f} s of compiling")
    for name, times in sorted(by_kernel.items(), key=lambda item: -sum(item[1])):
        print(f"   {name:40s} {len(times):3d} x  {sum(times):6.2f} s")


def online_workload(trace: str, vocab_size: int):
    """(requests, SamplingParams) of the online workload (see the module's docstring)."""
    from inferlab.conf import BenchConfig
    from inferlab.experiment.workload import arrival_times, build_workload

    bench = BenchConfig(arrival="trace", trace=trace, max_requests=600)
    requests = build_workload(bench, vocab_size, 4096).requests
    for request, arrival in zip(requests, arrival_times(len(requests), "poisson", 20.0)):
        request.arrival_s = float(arrival)
        request.prompt_token_ids = request.prompt_token_ids[:3000]
        request.output_len = min(request.output_len, 512)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=r.output_len) for r in requests]
    return requests, params


def serve_online(llm, requests, params, name: str) -> dict:
    from inferlab.experiment.bench import measure

    PHASE[0] = name
    llm.reset_prefix_cache()
    figures, _ = measure(llm, requests, params)
    ttft, tpot = figures["ttft_s"], figures["tpot_s"]
    print(
        f"ONLINE {name}: TTFT p50 {ttft['p50'] * 1e3:.1f} p99 {ttft['p99'] * 1e3:.1f} ms, TPOT p50 "
        f"{tpot['p50'] * 1e3:.2f} p99 {tpot['p99'] * 1e3:.2f} ms, {figures['output_tokens_per_s']:.0f} tok/s"
    )
    report(name)
    return figures


def main(path: str, trace: str | None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(message)s")
    PHASE[0] = "start-up"
    start = time.time()
    llm = LLM(path, enforce_eager=False, max_model_len=4096)
    print(f"START-UP {time.time() - start:.1f} s")
    report("start-up")
    prompts, params = workload(256, 1024, 1024)
    PHASE[0] = "warm-up generate"
    llm.generate(["Benchmark: "], SamplingParams())
    report("warm-up generate")
    if trace is not None:
        online = online_workload(trace, llm.hf_config.vocab_size)
        fresh = serve_online(llm, *online, "online, fresh process")
        PHASE[0] = "offline pass"
        llm.generate(prompts, params, use_tqdm=False)
        report("offline pass")
        warmed = serve_online(llm, *online, "online, warmed")
        for key in ("ttft_s", "tpot_s"):
            print(f"ONLINE {key} p99 fresh / warmed: {fresh[key]['p99'] / warmed[key]['p99']:.2f}x")
        return
    total = sum(p.max_tokens for p in params)
    for shift, name in ((0, "first pass"), (1, "warm pass")):
        PHASE[0] = name
        start = time.time()
        llm.generate([[(i + shift * 5003) % 10001 for i in p] for p in prompts], params, use_tqdm=False)
        seconds = time.time() - start
        print(f"PASS {name}: {total / seconds:.0f} tok/s ({seconds:.2f} s)")
        report(name)
    PHASE[0] = "one sequence"
    start = time.time()
    one = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1024)
    llm.generate([[(i + 2 * 5003) % 10001 for i in prompts[0][:256]]], one, use_tqdm=False)
    print(f"ONE SEQUENCE {1024 / (time.time() - start):.0f} tok/s")
    report("one sequence")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a checkpoint directory (scripts/bench_gpu.py --build-only makes one)")
    parser.add_argument("--online", metavar="TRACE", help="serve the online workload of this Mooncake trace instead")
    args = parser.parse_args()
    main(args.model, args.online)
