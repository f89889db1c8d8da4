"""One sequence decoding 1,024 tokens after a 256-token prompt, three times in one process: tok/s,
and per decode step the engine's wall time, its wait on the device's tokens, and the host time of
each part (timers wrapped around the scheduler's and runner's calls; none replaces the sampler,
which would turn the sampling graphs off). Then the device alone: the batch-1 decode graph replayed
500 times back to back, and the batch-1 sampling graph (LM head and sampler) likewise.

    python3 scripts/one_sequence_gpu.py MODEL_DIR [MAX_MODEL_LEN]    # default 4096
"""

import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from microbench_gpu import back_to_back_us  # noqa: E402

from inferlab import LLM, SamplingParams  # noqa: E402

llm = LLM(sys.argv[1], attention="triton", max_model_len=int(sys.argv[2]) if len(sys.argv) > 2 else 4096)
runner, sched = llm.runner, llm.scheduler
spent = defaultdict(float)


def timed(obj, name, label):
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[label] += time.perf_counter() - t

    setattr(obj, name, wrapper)


timed(sched, "schedule", "schedule")
timed(sched, "resolve", "resolve")
timed(sched, "advance", "advance")
timed(runner, "launch", "launch (all)")
timed(runner, "prepare_inputs", "launch: prepare_inputs")
timed(runner, "upload", "launch: upload")
timed(runner, "sampling_tensors", "launch: sampling_tensors")
timed(runner.decode_graphs, "run", "launch: graph fill + replay")
timed(runner.sampling_graphs, "run", "launch: sampling graph")
one = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1024)
llm.generate([[7] * 256], one, use_tqdm=False)
for k in range(3):
    s0 = (llm.stats.num_steps, llm.stats.decode_seconds, llm.stats.wait_seconds)
    spent.clear()
    t = time.perf_counter()
    llm.generate([[(13 * i + k) % 10000 for i in range(256)]], one, use_tqdm=False)
    wall = time.perf_counter() - t
    steps = llm.stats.num_steps - s0[0]
    dec, wait = llm.stats.decode_seconds - s0[1], llm.stats.wait_seconds - s0[2]
    print(
        f"run {k}: {1024 / wall:.0f} tok/s, {steps} steps, {wall / steps * 1e6:.0f} us a step wall, "
        f"decode step {dec / steps * 1e6:.0f} us of which waiting {wait / steps * 1e6:.0f} us",
        flush=True,
    )
    print("   host per step (us): " + ", ".join(f"{k2} {v / steps * 1e6:.1f}" for k2, v in spent.items()), flush=True)

for label, fn in (
    ("decode graph, batch 1", runner.decode_graphs.graphs[1].replay),
    ("sampling graph (LM head and sampler), batch 1", runner.sampling_graphs.graphs[1, "sampled"].replay),
):
    print(f"device: {label}: {back_to_back_us(fn, 500, warmup=20):.1f} us", flush=True)
