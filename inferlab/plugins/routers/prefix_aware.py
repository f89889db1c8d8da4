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

The tree is kept as one dict from a block's name to the replicas holding it (a bit per replica_id),
and per replica a dict of the names it holds with their last use, least recently used first: a
prompt's blocks are recorded with a few whole-prompt dict operations, and a match walks the bits.
"""

import math
from collections import deque
from dataclasses import dataclass
from itertools import compress, islice, repeat
from operator import is_

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
        self.tree: dict[int, int] = {}  # block name -> the replicas holding it, bit replica_id set for each
        self.owned: dict[int, dict[int, float]] = {}  # replica_id -> {block name: last use}, least recently used first
        self.next_eviction = eviction_interval_s
        # (the replicas last offered, their replica_ids, the bits of those ids)
        self.offered: tuple = ((), [], 0)

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
            matched, holders = self.longest_match(names, replicas)
            if matched and matched * block_size > self.cache_threshold * request.num_prompt_tokens:
                choice = self.most_recent(holders, names[matched - 1], replicas)
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

    def longest_match(self, names, replicas) -> tuple[int, int]:
        """(blocks matched, the bits of the offered replicas whose trees hold that prefix), or (0, 0)."""
        tree, holders = self.tree, self.offered_ids(replicas)[1]
        depth = 0
        for name in names:
            common = holders & tree.get(name, 0)
            if not common:
                break
            holders, depth = common, depth + 1
        return depth, holders if depth else 0

    def most_recent(self, holders: int, name: int, replicas):
        """Of the replicas whose bits are set in holders, the one that used block `name` last
        (the lowest replica_id among equals)."""
        best, best_key = None, None
        while holders:
            bit = holders & -holders
            holders ^= bit
            replica_id = bit.bit_length() - 1
            key = (self.owned[replica_id][name], -replica_id)
            if best_key is None or key > best_key:
                best, best_key = replica_id, key
        return next(r for r in replicas if r.replica_id == best)

    def offered_ids(self, replicas) -> tuple[list[int], int]:
        """The replicas' replica_ids, in order, and their bits: read again only when the cluster
        offers another tuple (it offers one until a replica dies)."""
        if replicas is not self.offered[0] or type(replicas) is not tuple:
            ids = [r.replica_id for r in replicas]
            self.offered = (replicas, ids, sum(1 << replica_id for replica_id in set(ids)))
        return self.offered[1], self.offered[2]

    def insert(self, names, replica_id: int, now: float) -> None:
        owned = self.owned.get(replica_id)
        if owned is None:
            owned = self.owned[replica_id] = {}
        # the names it holds leave their places and all come back last, the shortest prefix
        # last: the most recently used (as touching the blocks from the prompt's last one would)
        last_uses = list(map(owned.pop, names, repeat(None)))
        size = len(owned)
        owned.update(zip(reversed(names), repeat(now)))
        if len(owned) - size != len(names):  # a name repeats (a hash collision): its first place in the prompt counts
            deque(map(owned.pop, names, repeat(None)), maxlen=0)
            owned.update(zip(reversed(dict.fromkeys(names)), repeat(now)))
        # the names it did not hold get its bit: most are new to every tree, so one setdefault each
        tree, bit = self.tree, 1 << replica_id
        fresh = (
            names if last_uses.count(None) == len(names) else list(compress(names, map(is_, last_uses, repeat(None))))
        )
        holders = list(map(tree.setdefault, fresh, repeat(bit)))
        if holders.count(bit) != len(holders):  # some were held by other replicas
            for name, others in zip(fresh, holders):
                if others != bit:
                    tree[name] = others | bit

    def evict(self) -> None:
        tree = self.tree
        for replica_id, owned in self.owned.items():
            excess = len(owned) - self.max_tree_size
            if excess > 0:
                keep = ~(1 << replica_id)
                for name in list(islice(owned, excess)):
                    del owned[name]
                    holders = tree[name] & keep
                    if holders:
                        tree[name] = holders
                    else:
                        del tree[name]


@hookimpl
def register_routers(register):
    register("prefix_aware", PrefixAwareRouter, options=PrefixAwareOptions)
