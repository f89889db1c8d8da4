"""KV-aware routing after NVIDIA Dynamo's KV router: each request goes to the replica of least cost

    cost = overlap_weight * prefill_blocks + decode_blocks

where prefill_blocks are the blocks of this prompt the replica would have to compute (the prompt
less the prefix its cache holds now) and decode_blocks the blocks its requests occupy: those they
hold, and those its queued prompt tokens will take (Dynamo's active blocks, which count a request
from its routing on). overlap_weight 0 balances load alone; higher values favour cache hits (TTFT)
over even load (ITL). Ties go to the lowest replica_id."""

import math
from dataclasses import dataclass

from inferlab.core.hookspecs import hookimpl
from inferlab.core.routing import decode_replica_by_room


@dataclass
class KVAwareOptions:
    overlap_weight: float = 1.0  # `router.overlap_weight`: Dynamo's kv-overlap-score-weight

    def __post_init__(self):
        weight = self.overlap_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < math.inf:
            raise ValueError(f"router.overlap_weight must be a finite number >= 0, got {weight!r}")


class KVAwareRouter:
    def __init__(self, overlap_weight: float):
        self.overlap_weight = overlap_weight

    def cost(self, request, replica) -> float:
        block_size = replica.block_size
        prefill_blocks = (request.num_prompt_tokens - replica.cached_prefix_tokens(request)) / block_size
        decode_blocks = replica.num_blocks - replica.num_free_blocks + replica.num_queued_prompt_tokens / block_size
        return self.overlap_weight * prefill_blocks + decode_blocks

    def route(self, request, replicas, state):
        return min(replicas, key=lambda r: (self.cost(request, r), r.replica_id))

    def route_pair(self, request, prefill, decode, state):
        """Disaggregated: the prefill replica as route picks one, the decode replica by KV room and
        load (inferlab.core.routing.decode_replica_by_room)."""
        return self.route(request, prefill, state), decode_replica_by_room(request, decode)


@hookimpl
def register_routers(register):
    register("kv_aware", KVAwareRouter, options=KVAwareOptions)
