"""Where a batch-1 decode step's device time goes: one sequence decoding after a 256-token prompt,
under torch.profiler (CUDA activity: kernels inside graph replays included). Each step's kernels
in launch order with their median duration and their median addition to the step's critical path
(end minus the latest earlier end: under PDL a kernel starts before its predecessor ends).

    python3 scripts/one_sequence_profile_gpu.py MODEL_DIR [MAX_MODEL_LEN]    # default 4096
"""

import statistics
import sys
import time
from collections import defaultdict

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from inferlab import LLM, SamplingParams

path = sys.argv[1]
llm = LLM(path, attention="triton", max_model_len=int(sys.argv[2]) if len(sys.argv) > 2 else 4096)
sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=400)
llm.generate([[7] * 256], sp, use_tqdm=False)
t = time.perf_counter()
llm.generate(
    [[(11 * i + 3) % 10000 for i in range(256)]],
    SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1024),
    use_tqdm=False,
)
print(f"one sequence {1024 / (time.perf_counter() - t):.0f} tok/s", flush=True)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    llm.generate(
        [[(13 * i + 5) % 10000 for i in range(256)]],
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=120),
        use_tqdm=False,
    )
kernels = sorted(
    (
        e
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()
    ),
    key=lambda e: e.time_range.start,
)
# steps: split where the graph-input fill kernel runs
steps, current = [], []
for e in kernels:
    if e.name.startswith("_fill_kernel") and current:
        steps.append(current)
        current = []
    current.append(e)
steps.append(current)
steps = [s for s in steps[5:-2] if s[0].name.startswith("_fill_kernel")]
lengths = defaultdict(int)
for s in steps:
    lengths[len(s)] += 1
n = max(lengths, key=lengths.get)
steps = [s for s in steps if len(s) == n]
print(f"{len(steps)} decode steps of {n} kernels (lengths seen {dict(lengths)})")
spans = [s[-1].time_range.end - s[0].time_range.start for s in steps]
gaps_to_next = []
print(f"step span median {statistics.median(spans):.1f} us")
rows = []
for i in range(n):
    durs = [s[i].time_range.end - s[i].time_range.start for s in steps]
    adds = [s[i].time_range.end - max([s[0].time_range.start] + [x.time_range.end for x in s[:i]]) for s in steps]
    rows.append((s[i].name[:60], statistics.median(durs), statistics.median(adds)))
by_name = defaultdict(lambda: [0, 0.0, 0.0])
for name, d, a in rows:
    by_name[name][0] += 1
    by_name[name][1] += d
    by_name[name][2] += a
print(f"{'kernel':60} {'count':>5} {'sum dur':>9} {'sum add':>9}")
for name, (c, d, a) in sorted(by_name.items(), key=lambda kv: -kv[1][2]):
    print(f"{name:60} {c:5d} {d:9.1f} {a:9.1f}")
print("first 24 kernels of a step (median dur, add):")
for name, d, a in rows[:24]:
    print(f"  {name:60} {d:7.2f} {a:7.2f}")
print("last 8:")
for name, d, a in rows[-8:]:
    print(f"  {name:60} {d:7.2f} {a:7.2f}")
