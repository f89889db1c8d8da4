"""Fair share across tenants with the Virtual Token Counter (Sheng et al., OSDI 2024). Each tenant
(metadata["tenant"]) has a counter of the service it received: input_weight per prompt token and
output_weight per output token computed. Waiting requests are admitted from the tenant with the
smallest counter first, counting each admission's prompt as it goes; a tenant with nothing running
is lifted to the smallest counter among running tenants, so that idling earns no credit."""

import heapq
from dataclasses import dataclass

from inferlab.core.hookspecs import hookimpl


@dataclass
class VTCOptions:
    input_weight: float = 1.0
    output_weight: float = 2.0


def tenant(view) -> str:
    return str(view.metadata.get("tenant", ""))


class VirtualTokenCounter:
    metadata_fields = {"tenant": (str, int)}  # what it reads; other types are refused when a request is added

    def __init__(self, input_weight: float, output_weight: float):
        self.input_weight, self.output_weight = input_weight, output_weight
        self.counters: dict[str, float] = {}

    def observe(self, scheduled, state):
        for view, num_tokens in scheduled:
            prompt = min(num_tokens, max(0, view.num_prompt_tokens - view.num_computed_tokens))
            cost = self.input_weight * prompt + self.output_weight * (num_tokens - prompt)
            self.counters[tenant(view)] = self.counters.get(tenant(view), 0.0) + cost

    def admission_order(self, waiting, state):
        queues: dict[str, list] = {}
        for view in waiting:
            queues.setdefault(tenant(view), []).append(view)
        running = {tenant(view) for view in state.running}
        floor = min((self.counters.get(t, 0.0) for t in running), default=0.0)
        for t in queues.keys() - running:
            self.counters[t] = max(self.counters.get(t, 0.0), floor)
        heap = [(self.counters[t], t, 0) for t in queues]
        heapq.heapify(heap)
        order = []
        while heap:
            counter, t, i = heapq.heappop(heap)
            order.append(queues[t][i])
            if i + 1 < len(queues[t]):
                heapq.heappush(heap, (counter + self.input_weight * queues[t][i].num_prompt_tokens, t, i + 1))
        return order

    def preemption_victim(self, running, state):
        return max(running, key=lambda view: (self.counters.get(tenant(view), 0.0), view.arrival_time))


@hookimpl
def register_schedulers(register):
    register("vtc", VirtualTokenCounter, options=VTCOptions)
