"""Least load: each request goes to the replica with the fewest outstanding tokens (prompt tokens
not yet computed plus output tokens still to generate), the lowest replica_id among equals."""

from inferlab.core.hookspecs import hookimpl
from inferlab.core.routing import decode_replica_by_room


class LeastLoadRouter:
    def route(self, request, replicas, state):
        return min(replicas, key=lambda r: (r.num_outstanding_tokens, r.replica_id))

    def route_pair(self, request, prefill, decode, state):
        """Disaggregated: the prefill replica as route picks one, the decode replica by KV room and
        load (inferlab.core.routing.decode_replica_by_room)."""
        return self.route(request, prefill, state), decode_replica_by_room(request, decode)


@hookimpl
def register_routers(register):
    register("least_load", LeastLoadRouter)
