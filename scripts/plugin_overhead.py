"""What the plugin machinery costs per step: the same workload on an engine whose scheduler, KV
manager and sampler came from the registry (entry points, hooks, Protocol checks) and on one whose
parts were built by calling their classes directly. After construction both call the same methods
on the same kind of objects, so the difference should be noise; this measures it.

The forward pass is replaced by a stub that returns fixed tokens, so that what is timed is the
engine's own per-step work (scheduler policy, core scheduler, KV manager), where plugin calls happen on the
host; attention and model calls run inside the forward pass (and inside CUDA graphs on GPU).

    python scripts/plugin_overhead.py [--repeats 15]"""

import argparse
import statistics
import time

import torch

from inferlab import LLM, SamplingParams
from inferlab.core.plugins import PluginRegistry
from inferlab.core.scheduler import Scheduler
from inferlab.plugins.kv_cache.paged import PagedKVCache
from inferlab.plugins.samplers.default_sampler import DefaultSampler
from inferlab.plugins.schedulers.fcfs import FCFSPolicy


class StubHandle:
    def __init__(self, batch):
        self.samples = [
            r.num_computed_tokens + n == r.num_tokens for r, n in zip(batch.requests, batch.num_scheduled_tokens)
        ]

    def tokens(self):
        return [7 if s else None for s in self.samples]

    def placeholders(self):
        return self.tokens()

    def logprobs(self):
        return None


def stub_forward(llm: LLM) -> LLM:
    llm.runner.launch = StubHandle
    return llm


def direct(llm: LLM) -> LLM:
    """The same engine with its plugins rebuilt by direct construction, no registry involved."""
    llm.kv_manager = PagedKVCache(llm.config, llm.runner.num_kv_blocks)
    llm.scheduler = Scheduler(
        llm.config, llm.kv_manager, FCFSPolicy(), policy_name="fcfs", clock=llm.clock, decode=llm.tokenizer.decode
    )
    llm.runner.sampler = DefaultSampler(llm.config)
    return llm


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=31)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    PluginRegistry()
    load_ms = (time.perf_counter() - start) * 1e3
    settings = dict(kvcache_block_size=16, num_kvcache_blocks=512, max_num_seqs=64, max_model_len=1024)
    # a second direct engine measures the noise: the same code against itself
    engines = {
        "registry": stub_forward(LLM(**settings)),
        "direct": stub_forward(direct(LLM(**settings))),
        "direct2": stub_forward(direct(LLM(**settings))),
    }
    prompts = [[(i * 7 + j) % 300 + 3 for j in range(20 + i % 40)] for i in range(64)]
    params = SamplingParams(temperature=0.7, max_tokens=512, ignore_eos=True, seed=1)
    times = {name: [] for name in engines}
    names = list(engines)
    for repeat in range(args.repeats):
        for name in names[repeat % 3 :] + names[: repeat % 3]:  # rotated, so order and drift hit all alike
            llm = engines[name]
            llm.reset_prefix_cache()
            steps = llm.stats.num_steps
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times[name].append((time.perf_counter() - t) / (llm.stats.num_steps - steps))
    median = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    spread = {name: (max(v) - min(v)) * 1e3 for name, v in times.items()}
    print(f"registry load (entry points + hooks + checks), once per process: {load_ms:.1f} ms")
    for name in engines:
        print(f"{name:>8}: {median[name]:.3f} ms a step (median of {args.repeats}; spread {spread[name]:.3f} ms)")
    print(
        f"registry vs direct: {100 * (median['registry'] / median['direct'] - 1):+.2f}%   "
        f"(noise, direct2 vs direct: {100 * (median['direct2'] / median['direct'] - 1):+.2f}%)"
    )


if __name__ == "__main__":
    main()
