"""Shortest prompt first: admits waiting requests shortest prompt first (longest first with
longest_first=True). Everything else (budgets, chunked prefill, preemption) is FCFS's."""

from collections import deque
from dataclasses import dataclass

from inferlab.core.hookspecs import hookimpl
from inferlab.plugins.schedulers.fcfs import FCFSScheduler


@dataclass
class SPFOptions:
    """The scheduler's parameters: `inferlab scheduler=spf scheduler.longest_first=true`."""

    longest_first: bool = False


class ShortestPromptFirst(FCFSScheduler):
    def __init__(self, config, kv_cache, longest_first: bool = False):
        super().__init__(config, kv_cache)
        self.longest_first = longest_first

    def order_waiting(self) -> None:
        # Called each step before admitting; sorted() is stable, so equal lengths keep arrival order.
        self.waiting = deque(sorted(self.waiting, key=lambda seq: seq.num_prompt_tokens, reverse=self.longest_first))


@hookimpl
def register_schedulers(register):
    register("spf", ShortestPromptFirst)


@hookimpl
def register_config_nodes(register):
    register("scheduler", "spf", SPFOptions)
