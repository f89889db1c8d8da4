"""Least load: each request goes to the replica with the fewest outstanding tokens (prompt tokens
not yet computed plus output tokens still to generate), the lowest replica_id among equals."""

from inferlab.core.hookspecs import hookimpl


class LeastLoadRouter:
    def route(self, request, replicas, state):
        return min(replicas, key=lambda r: (r.num_outstanding_tokens, r.replica_id))


@hookimpl
def register_routers(register):
    register("least_load", LeastLoadRouter)
