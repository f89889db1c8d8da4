"""Earliest deadline first, preemptive: a request's deadline is metadata["deadline"], in seconds on
the engine's clock (or after its arrival, with relative=true); requests without one come last.
Waiting requests are admitted earliest deadline first, and one that finds no room displaces the
running request whose deadline is latest, if that deadline is later than its own."""

import math
from dataclasses import dataclass

from inferlab.core.hookspecs import hookimpl


@dataclass
class EDFOptions:
    relative: bool = False  # deadlines count from each request's arrival


class EarliestDeadlineFirst:
    metadata_fields = {"deadline": (int, float)}  # a request whose deadline is not a number is refused when added

    def __init__(self, relative: bool):
        self.relative = relative

    def deadline(self, view):
        deadline = view.metadata.get("deadline", math.inf)
        return (deadline + view.arrival_time if self.relative else deadline), view.arrival_time

    def admission_order(self, waiting, state):
        return sorted(waiting, key=self.deadline)

    def preemption_victim(self, running, state):
        return max(running, key=self.deadline)

    def preempts(self, request, running, state):
        latest = max(running, key=self.deadline)
        return latest if self.deadline(latest) > self.deadline(request) else None


@hookimpl
def register_schedulers(register):
    register("edf", EarliestDeadlineFirst, options=EDFOptions)
