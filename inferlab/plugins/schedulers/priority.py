"""Preemptive priority: the lowest priority value is served first, first come first served among
equals (vLLM's `priority` policy). A waiting request admits ahead of every lower-priority one and
displaces the lowest-priority running request when it finds no KV blocks or sequence slot; that
request is also the one preempted when the running requests run out of blocks."""

from inferlab.core.hookspecs import hookimpl


def rank(view):
    return view.priority, view.arrival_time


class PriorityPolicy:
    admission_order_is_pure = True  # inferlab.core.protocols.PureAdmissionOrder: it reads its arguments only
    admission_order_is_fixed = True  # inferlab.core.protocols.FixedAdmissionOrder: it reads arrival and priority only

    def admission_order(self, waiting, state):
        return sorted(waiting, key=rank)

    def preemption_victim(self, running, state):
        return max(running, key=rank)

    def preempts(self, request, running, state):
        victim = max(running, key=rank)
        return victim if rank(victim) > rank(request) else None


@hookimpl
def register_schedulers(register):
    register("priority", PriorityPolicy)
