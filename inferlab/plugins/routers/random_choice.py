"""Random: each request goes to a replica drawn uniformly from those offered, from a generator
seeded with `router.seed` (the baseline every load-aware router must beat)."""

import random
from dataclasses import dataclass

from inferlab.core.hookspecs import hookimpl


@dataclass
class RandomOptions:
    seed: int = 0


class RandomRouter:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def route(self, request, replicas, state):
        return replicas[self.rng.randrange(len(replicas))]

    def route_pair(self, request, prefill, decode, state):
        """Disaggregated: both replicas drawn at random (the baseline)."""
        return self.route(request, prefill, state), self.route(request, decode, state)


@hookimpl
def register_routers(register):
    register("random", RandomRouter, options=RandomOptions)
