"""First come, first served: waiting requests are admitted in queue order (arrival order, with
preempted requests in front so they resume first), and when KV blocks run out the most recently
admitted running request is preempted, as in nano-vllm and vLLM."""

from inferlab.core.hookspecs import hookimpl


class FCFSPolicy:
    admission_order_is_pure = True  # inferlab.core.protocols.PureAdmissionOrder: it reads its arguments only
    admission_order_is_fixed = True  # inferlab.core.protocols.FixedAdmissionOrder: it keeps the queue's order

    def admission_order(self, waiting, state):
        return waiting

    def preemption_victim(self, running, state):
        return running[-1]


@hookimpl
def register_schedulers(register):
    register("fcfs", FCFSPolicy)
