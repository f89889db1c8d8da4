"""Round robin: each request goes to the next replica after the one chosen last, by replica_id,
skipping replicas that are not offered (one that died)."""

from inferlab.core.hookspecs import hookimpl
from inferlab.core.routing import decode_replica_by_room


class RoundRobinRouter:
    def __init__(self):
        self.last = -1  # replica_id chosen last

    def route(self, request, replicas, state):
        choice = next((r for r in replicas if r.replica_id > self.last), replicas[0])
        self.last = choice.replica_id
        return choice

    def route_pair(self, request, prefill, decode, state):
        """Disaggregated: the prefill replica as route picks one, the decode replica by KV room and
        load (inferlab.core.routing.decode_replica_by_room)."""
        return self.route(request, prefill, state), decode_replica_by_room(request, decode)


@hookimpl
def register_routers(register):
    register("round_robin", RoundRobinRouter)
