"""Longest prefix match: waiting requests are admitted in order of how many of their tokens the
prefix cache already holds, most first (SGLang's cache-aware `lpm` policy); preemption is FCFS's.

Serving the requests whose prefix is cached first reuses those blocks before admitting other
requests evicts them, so a workload whose prompts share a few long prefixes computes each prefix
fewer times. When nothing waiting is cached the order is queue order (the sort is stable), so
lpm is FCFS on workloads without shared prefixes.
"""

from dataclasses import dataclass

from inferlab.core.hookspecs import hookimpl


@dataclass
class LPMOptions:
    # Longer queues are admitted in queue order: ranking costs one prefix lookup per waiting
    # request each step (SGLang falls back to FCFS above 128 for the same reason).
    max_sort_waiting: int = 1024

    def __post_init__(self):
        if self.max_sort_waiting < 0:
            raise ValueError(f"lpm's max_sort_waiting must be >= 0, got {self.max_sort_waiting}")


class LPMPolicy:
    admission_order_is_pure = True  # inferlab.core.protocols.PureAdmissionOrder: it reads its arguments only

    def __init__(self, max_sort_waiting: int = LPMOptions.max_sort_waiting):
        self.max_sort_waiting = max_sort_waiting

    def admission_order(self, waiting, state):
        if len(waiting) < 2 or len(waiting) > self.max_sort_waiting:
            return waiting
        cached = [view.num_cached_prefix_tokens for view in waiting]
        if not any(cached):
            return waiting
        order = sorted(range(len(waiting)), key=cached.__getitem__, reverse=True)  # stable: ties keep queue order
        return [waiting[i] for i in order]

    def preemption_victim(self, running, state):
        return running[-1]


@hookimpl
def register_schedulers(register):
    register("lpm", LPMPolicy, options=LPMOptions)
