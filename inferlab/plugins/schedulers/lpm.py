"""Longest prefix match: FCFS, except that waiting requests are admitted in order of how many of
their tokens the prefix cache already holds, most first (SGLang's cache-aware `lpm` policy).

Serving the requests whose prefix is cached first reuses those blocks before admitting other
requests evicts them, so a workload whose prompts share a few long prefixes computes each prefix
fewer times. When nothing waiting is cached the order is arrival order (the sort is stable), so
lpm is FCFS on workloads without shared prefixes. Running requests and preemption are FCFS's.
"""

from collections import deque
from dataclasses import dataclass

from inferlab.core.hookspecs import hookimpl
from inferlab.plugins.schedulers.fcfs import FCFSScheduler


@dataclass
class LPMOptions:
    # Longer queues are admitted in arrival order: ranking costs one prefix lookup per waiting
    # request each step (SGLang falls back to FCFS above 128 for the same reason).
    max_sort_waiting: int = 1024


class LPMScheduler(FCFSScheduler):
    def __init__(self, config, kv_cache, max_sort_waiting: int = LPMOptions.max_sort_waiting):
        super().__init__(config, kv_cache)
        if not isinstance(max_sort_waiting, int) or isinstance(max_sort_waiting, bool) or max_sort_waiting < 0:
            raise ValueError(f"lpm's max_sort_waiting must be an integer >= 0, got {max_sort_waiting!r}")
        self.max_sort_waiting = max_sort_waiting

    def order_waiting(self) -> None:
        waiting = self.waiting
        if len(waiting) < 2 or len(waiting) > self.max_sort_waiting or len(self.running) >= self.max_num_seqs:
            return  # nothing to reorder, too many to rank, or nobody can be admitted this step
        cached = [self.kv.num_cached_prefix_tokens(seq) for seq in waiting]
        if not any(cached):
            return
        order = sorted(range(len(waiting)), key=cached.__getitem__, reverse=True)  # stable: ties keep arrival order
        self.waiting = deque(waiting[i] for i in order)


@hookimpl
def register_schedulers(register):
    register("lpm", LPMScheduler)


@hookimpl
def register_config_nodes(register):
    register("scheduler", "lpm", LPMOptions)
