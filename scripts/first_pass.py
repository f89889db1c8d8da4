"""Start-up and the first pass, as a user on a fresh machine meets them (run on the GPU machine).

    python3 scripts/bench_gpu.py --build-only --shape 0.6b --model-dir /tmp/q06
    python3 scripts/first_pass.py /tmp/q06

Builds the engine (its log lines time each start-up phase), then runs nano-vllm bench.py's
workload twice in the one process (the first pass, then a warm one over other token ids, so no
prefix-cache hits) and one sequence decoding 1,024 tokens. Every Triton compile is timed and
counted per phase: with compile_at_start, the passes should compile nothing."""

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


def main(path: str) -> None:
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
    main(sys.argv[1])
