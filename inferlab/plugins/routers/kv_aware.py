"""KV-aware routing after NVIDIA Dynamo's KV router: each request goes to the replica of least cost

    cost = overlap_weight * prefill_blocks + decode_blocks

where prefill_blocks are the blocks of prompt the replica would have to compute (those it has
queued, plus this prompt less the prefix its cache holds now) and decode_blocks the blocks its
requests hold. overlap_weight 0 balances load alone; higher values favour cache hits (TTFT) over
even load (ITL). Ties go to the lowest replica_id."""

import math
from dataclasses import dataclass

from inferlab.core.hookspecs import hookimpl


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
        uncached = request.num_prompt_tokens - replica.cached_prefix_tokens(request)
        prefill_blocks = (replica.num_queued_prompt_tokens + uncached) / replica.block_size
        decode_blocks = replica.num_blocks - replica.num_free_blocks
        return self.overlap_weight * prefill_blocks + decode_blocks

    def route(self, request, replicas, state):
        return min(replicas, key=lambda r: (self.cost(request, r), r.replica_id))


@hookimpl
def register_routers(register):
    register("kv_aware", KVAwareRouter, options=KVAwareOptions)
