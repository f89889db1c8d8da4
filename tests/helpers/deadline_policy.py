"""A scheduler policy for the per-request fault tests (tests/core, tests/server)."""

import math


class Deadlines:
    """Earliest deadline first, preemptive, as examples/edf_scheduler, but declaring nothing it reads
    (as a user's policy might): a deadline that is not a number makes its comparisons raise."""

    def key(self, view):
        return view.metadata.get("deadline", math.inf), view.arrival_time

    def admission_order(self, waiting, state):
        return sorted(waiting, key=self.key)

    def preemption_victim(self, running, state):
        return max(running, key=self.key)

    def preempts(self, request, running, state):
        latest = max(running, key=self.key)
        return latest if self.key(latest) > self.key(request) else None
