"""Prefix-aware routing: SGLang's router's cache_aware policy.

The router keeps its own approximate record of what each replica has cached: a tree of the
prompts it sent there (block by block, each node the chained hash of a prompt's leading blocks,
inferlab.core.blocks), not the replicas' actual caches. For each request:

- when the load is imbalanced, (max - min) > balance_abs_threshold and max > min *
  balance_rel_threshold (load: a replica's waiting plus running requests), it goes to the least
  loaded replica;
- otherwise to the replica whose tree matches the longest prefix of the prompt, if that match
  covers more than cache_threshold of the prompt; else to the replica with the smallest tree (the
  most cache to spare).

The prompt is then recorded under the chosen replica. Every eviction_interval_s (on the cluster's
clock) each replica's tree is cut back to max_tree_size blocks, least recently used first; a
prefix is used whenever a longer prompt under it is, so leaves go before their ancestors. Ties go
to the lowest replica_id.
"""

import math
from collections import OrderedDict
from dataclasses import dataclass

from inferlab.core.hookspecs import hookimpl
from inferlab.core.routing import decode_replica_by_room


@dataclass
class PrefixAwareOptions:
    cache_threshold: float = 0.3  # the share of the prompt a match must exceed to be followed
    balance_abs_threshold: int = 64  # imbalanced when max - min load exceeds this ...
    balance_rel_threshold: float = 1.5  # ... and max exceeds min times this
    max_tree_size: int = 65536  # blocks kept per replica at each eviction
    eviction_interval_s: float = 120.0

    def __post_init__(self):
        def number(value) -> bool:
            return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)

        if not (number(self.cache_threshold) and 0 <= self.cache_threshold <= 1):
            raise ValueError(f"router.cache_threshold must be in [0, 1], got {self.cache_threshold!r}")
        if not (isinstance(self.balance_abs_threshold, int) and self.balance_abs_threshold >= 0):
            raise ValueError(
                f"router.balance_abs_threshold must be an integer >= 0, got {self.balance_abs_threshold!r}"
            )
        if not (number(self.balance_rel_threshold) and self.balance_rel_threshold >= 1):
            raise ValueError(f"router.balance_rel_threshold must be a number >= 1, got {self.balance_rel_threshold!r}")
        if not (isinstance(self.max_tree_size, int) and self.max_tree_size >= 1):
            raise ValueError(f"router.max_tree_size must be an integer >= 1 (blocks), got {self.max_tree_size!r}")
        if not (number(self.eviction_interval_s) and self.eviction_interval_s > 0):
            raise ValueError(
                f"router.eviction_interval_s must be a number of seconds > 0, got {self.eviction_interval_s!r}"
            )


class PrefixAwareRouter:
    def __init__(
        self,
        cache_threshold: float,
        balance_abs_threshold: int,
        balance_rel_threshold: float,
        max_tree_size: int,
        eviction_interval_s: float,
    ):
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.eviction_interval_s = eviction_interval_s
        self.tree: dict[int, dict[int, float]] = {}  # block name -> {replica_id: last use}
        self.owned: dict[int, OrderedDict] = {}  # replica_id -> its block names, least recently used first
        self.next_eviction = eviction_interval_s
        self.offered: tuple = ((), [], frozenset())  # (the replicas last offered, their replica_ids, as a set)

    def route(self, request, replicas, state):
        if state.now >= self.next_eviction:
            self.evict()
            self.next_eviction = state.now + self.eviction_interval_s
        block_size = replicas[0].block_size
        names = request.prompt_block_hashes(block_size)
        loads = [r.num_waiting + r.num_running for r in replicas]
        low, high = min(loads), max(loads)
        if high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold:
            choice = replicas[loads.index(low)]
        else:
            matched, best = self.longest_match(names, replicas)
            if best is not None and matched * block_size > self.cache_threshold * request.num_prompt_tokens:
                choice = best
            else:
                owned = self.owned  # the smallest tree, the lowest replica_id among equals (replicas come in its order)
                sizes = [len(owned.get(replica_id, ())) for replica_id in self.offered_ids(replicas)[0]]
                choice = replicas[sizes.index(min(sizes))]
        self.insert(names, choice.replica_id, state.now)
        return choice

    def route_pair(self, request, prefill, decode, state):
        """Disaggregated: the prefill replica as route picks one, the decode replica by KV room and
        load (inferlab.core.routing.decode_replica_by_room)."""
        return self.route(request, prefill, state), decode_replica_by_room(request, decode)

    def longest_match(self, names, replicas):
        """(blocks matched, the replica whose tree holds the longest prefix, most recently used
        among equals), or (0, None)."""
        candidates = self.offered_ids(replicas)[1]
        depth, node = 0, None
        for name in names:
            tenants = self.tree.get(name)
            common = candidates & tenants.keys() if tenants else None
            if not common:
                break
            candidates, node, depth = common, tenants, depth + 1
        if node is None:
            return 0, None
        best = max(candidates, key=lambda replica_id: (node[replica_id], -replica_id))
        return depth, next(r for r in replicas if r.replica_id == best)

    def offered_ids(self, replicas) -> tuple[list[int], frozenset[int]]:
        """The replicas' replica_ids, in order and as a set: read again only when the cluster offers
        another tuple (it offers one until a replica dies)."""
        if replicas is not self.offered[0] or type(replicas) is not tuple:
            ids = [r.replica_id for r in replicas]
            self.offered = (replicas, ids, frozenset(ids))
        return self.offered[1], self.offered[2]

    def insert(self, names, replica_id: int, now: float) -> None:
        owned = self.owned.setdefault(replica_id, OrderedDict())
        tree, touch = self.tree, owned.move_to_end
        for name in reversed(names):  # the shortest prefix touched last: the most recently used
            tenants = tree.get(name)
            if tenants is None:
                tree[name] = {replica_id: now}
            else:
                tenants[replica_id] = now
            if name in owned:
                touch(name)
            else:
                owned[name] = None

    def evict(self) -> None:
        for replica_id, owned in self.owned.items():
            while len(owned) > self.max_tree_size:
                name, _ = owned.popitem(last=False)
                tenants = self.tree[name]
                del tenants[replica_id]
                if not tenants:
                    del self.tree[name]


@hookimpl
def register_routers(register):
    register("prefix_aware", PrefixAwareRouter, options=PrefixAwareOptions)
