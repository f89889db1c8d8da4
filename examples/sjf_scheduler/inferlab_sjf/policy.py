"""Shortest job first: waiting requests are admitted smallest job first, where a job's size is the
max_tokens its client asked for (plus its prompt, with include_prompt=true). When KV blocks run
out, the running request with the most work left is preempted."""

from dataclasses import dataclass

from inferlab.core.hookspecs import hookimpl


@dataclass
class SJFOptions:
    include_prompt: bool = False  # `inferlab scheduler=sjf scheduler.include_prompt=true`


class ShortestJobFirst:
    metadata_fields = {}  # it reads no metadata

    def __init__(self, include_prompt: bool):
        self.include_prompt = include_prompt

    def work_left(self, view):
        prompt_left = view.num_prompt_tokens - min(view.num_computed_tokens, view.num_prompt_tokens)
        return view.max_tokens - view.num_output_tokens + (prompt_left if self.include_prompt else 0)

    def admission_order(self, waiting, state):
        return sorted(waiting, key=self.work_left)  # stable: equal jobs keep their queue order

    def preemption_victim(self, running, state):
        return max(running, key=self.work_left)


@hookimpl
def register_schedulers(register):
    register("sjf", ShortestJobFirst, options=SJFOptions)
