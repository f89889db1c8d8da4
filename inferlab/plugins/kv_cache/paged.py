"""Paged KV blocks with prefix caching.

Each full block is named by a hash chained over every block before it (inferlab.core.blocks), so
equal prefixes share blocks. A freed block keeps its hash and content until it is handed out again
(least recently freed first), so a later request can still reuse it. A hit is confirmed exactly,
never on the hash alone: the block's own identity (its tokens, or the keys of a prompt given by
its blocks) must match and so must its parent (the content it was computed after, by a
per-content id), so a hash collision costs a miss, never wrong K/V. With take_kv_events, the
manager also records which hashes enter and leave the cache, for a router in another process.
"""

from collections import OrderedDict
from itertools import islice

from inferlab.core.blocks import block_hashes, block_identity
from inferlab.core.hookspecs import hookimpl
from inferlab.core.request import Request

NO_BLOCKS: list[int] = []  # the table of a request holding none; never changed


class PagedKVCache:
    block_aligned = True  # inferlab.core.protocols.BlockAligned: decode steps touch the books at block boundaries only

    def __init__(self, config, num_blocks: int):
        self.block_size = config.kvcache_block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = config.enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple | None] = [None] * num_blocks  # each block's identity
        # Exact identity of cached content: a fresh id per committed block, and its parent's id (0: none).
        self.block_content_id: list[int] = [0] * num_blocks
        self.block_parent_id: list[int] = [0] * num_blocks
        self.next_content_id = 1
        self.cached: dict[int, int] = {}  # hash -> block holding that content
        # Blocks nobody references, in eviction order (front goes first); cached ones keep content.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.tables: dict[int, list[int]] = {}  # request id -> its blocks
        self.hashes: dict[int, list[int]] = {}  # request id -> chained hashes of its leading full blocks
        self.num_committed: dict[int, int] = {}  # request id -> its leading blocks already in the cache
        self.num_hit_tokens = 0
        self.num_queried_tokens = 0
        # The core asks how much of a request is cached, then allocates with that answer: the
        # latest lookup is kept, valid while the request's length and the cached contents stand.
        self.cache_version = 0  # bumped whenever a block's cached content is registered or forgotten
        self.last_lookup: tuple[int, int, int, list[int]] | None = None  # (request id, tokens, version, hits)
        self.kv_events: dict[int, bool] | None = None  # hash -> cached now, since take_kv_events last ran

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def block_table(self, request: Request) -> list[int]:
        return self.tables.get(request.request_id, NO_BLOCKS)

    def could_ever_fit(self, num_tokens: int) -> bool:
        return -(-num_tokens // self.block_size) <= self.num_blocks

    def prefix_cache_stats(self) -> tuple[int, int]:
        return self.num_hit_tokens, self.num_queried_tokens

    def take_kv_events(self) -> dict[int, bool]:
        if self.kv_events is None:  # the first call: the whole cache, and the record starts
            self.kv_events = {}
            return dict.fromkeys(self.cached, True)
        events, self.kv_events = self.kv_events, {}
        return events

    def _names(self, request: Request, num_blocks: int) -> tuple[list[int], list]:
        """The request's chained block hashes, at least its first num_blocks full blocks' (as far
        as its tokens go), and the identities of those past its prompt's names (block i's at i -
        the number of prompt names), memoized until it is freed: a commit reads both, made once."""
        memo = self.hashes.get(request.request_id)
        if memo is None:  # the prompt's, as a router may have named them already
            memo = self.hashes[request.request_id] = (list(request.prompt_block_names(self.block_size)), [])
        hashes, extra = memo
        if len(hashes) < num_blocks:
            block_hashes(request.token_ids, self.block_size, num_blocks, hashes, extra)
        return memo

    def _prefix_hits(self, request: Request) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        bs, tokens = self.block_size, request.token_ids
        key = (request.request_id, len(tokens), self.cache_version)
        if self.last_lookup is not None and self.last_lookup[:3] == key:
            return self.last_lookup[3]
        # Leave the last token uncached so that it is computed and yields logits.
        hits, parent_id = [], 0
        identities = request.prompt_block_identities(bs)
        for i, h in enumerate(islice(self._names(request, (len(tokens) - 1) // bs)[0], (len(tokens) - 1) // bs)):
            block = self.cached.get(h)
            if (
                block is None
                or self.block_parent_id[block] != parent_id
                or self.block_tokens[block]
                != (identities[i] if i < len(identities) else block_identity(tokens, i * bs, (i + 1) * bs))
            ):
                break
            hits.append(block)
            parent_id = self.block_content_id[block]
        self.last_lookup = (*key, hits)
        return hits

    def cached_prefix_blocks(self, block_hashes) -> int:
        if not self.enable_prefix_caching:
            return 0
        hits, parent_id = 0, 0
        for h in block_hashes:
            block = self.cached.get(h)
            if block is None or self.block_parent_id[block] != parent_id:
                break
            hits += 1
            parent_id = self.block_content_id[block]
        return hits

    def num_cached_prefix_tokens(self, request: Request) -> int:
        return len(self._prefix_hits(request)) * self.block_size

    def num_unheld_prefix_blocks(self, request: Request, num_cached_tokens: int) -> int:
        ref_counts = self.ref_counts
        return sum(1 for b in self._prefix_hits(request)[: num_cached_tokens // self.block_size] if ref_counts[b] == 0)

    def allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        bs = self.block_size
        table = self.tables.get(request.request_id)
        if table:
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens <= len(table) * bs:
                return True  # fits in the blocks it has: most decode steps
            blocks_needed = -(-num_tokens // bs) - len(table)
            if blocks_needed > self.num_free_blocks:
                return False
            self._take_free_blocks(blocks_needed, table)
            return True
        hits = self._prefix_hits(request)[: num_cached_tokens // bs] if num_cached_tokens else []
        if len(hits) * bs != num_cached_tokens:
            raise ValueError(
                f"request {request.request_id}: {num_cached_tokens} cached tokens asked for, but the prefix "
                f"cache holds {len(hits) * bs} of its leading tokens now"
            )
        blocks_needed = -(-(num_cached_tokens + num_new_tokens) // bs) - len(hits)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)  # hits taken out of the free queue
        if blocks_needed + revived > self.num_free_blocks:
            return False
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1
        table = list(hits)
        self._take_free_blocks(blocks_needed, table)
        self.tables[request.request_id] = table
        self.num_committed[request.request_id] = len(hits)
        self.num_hit_tokens += num_cached_tokens
        self.num_queried_tokens += len(request.token_ids)
        return True

    def _take_free_blocks(self, num: int, table: list[int]) -> None:
        """Appends num blocks from the front of the free queue to table, their cached content
        forgotten (a prompt takes dozens at once)."""
        take, ref_counts, block_hash = self.free_queue.popitem, self.ref_counts, self.block_hash
        cached, events, block_tokens = self.cached, self.kv_events, self.block_tokens
        content_id, parent_id = self.block_content_id, self.block_parent_id
        forgotten = 0
        try:
            for _ in range(num):
                block, _ = take(last=False)
                h = block_hash[block]
                if h is not None:  # _evict(block), inlined: most blocks a prompt takes hold cached content
                    forgotten += 1
                    if cached.get(h) == block:
                        del cached[h]
                        if events is not None:
                            events[h] = False
                    block_hash[block] = block_tokens[block] = None
                    content_id[block] = parent_id[block] = 0
                ref_counts[block] = 1
                table.append(block)
        finally:
            self.cache_version += forgotten

    def _evict(self, block: int) -> None:
        """Forgets the cached content of an unreferenced block."""
        h = self.block_hash[block]
        if h is not None:
            self.cache_version += 1
            if self.cached.get(h) == block:
                del self.cached[h]
                if self.kv_events is not None:
                    self.kv_events[h] = False
            self.block_hash[block] = self.block_tokens[block] = None
            self.block_content_id[block] = self.block_parent_id[block] = 0

    def commit(self, request: Request) -> None:
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = request.num_computed_tokens // bs
        start = self.num_committed.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes, extra = self._names(request, num_full)
        table = self.tables[request.request_id]
        block_hash, content_id, cached, events = self.block_hash, self.block_content_id, self.cached, self.kv_events
        identities = request.prompt_block_identities(bs)  # the prompt's, named with it; then those past it
        num_named = len(hashes) - len(extra)
        next_id = self.next_content_id
        try:
            for i in range(start, num_full):
                block = table[i]
                if block_hash[block] is None:
                    h = block_hash[block] = hashes[i]
                    self.block_tokens[block] = identities[i] if i < num_named else extra[i - num_named]
                    content_id[block] = next_id
                    self.block_parent_id[block] = content_id[table[i - 1]] if i else 0
                    next_id += 1
                    if h not in cached:
                        cached[h] = block
                        if events is not None:
                            events[h] = True
                    self.cache_version += 1
        finally:
            self.next_content_id = next_id
        self.num_committed[request.request_id] = num_full

    def reset_prefix_cache(self) -> None:
        for block in self.free_queue:
            self._evict(block)

    def free(self, request: Request) -> None:
        request_id = request.request_id
        self.hashes.pop(request_id, None)
        self.num_committed.pop(request_id, None)
        # Tail blocks first: a prompt's last blocks are the least likely to be shared again.
        for block in reversed(self.tables.pop(request_id, NO_BLOCKS)):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed more often than allocated (request {request_id})")
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                if self.block_hash[block] is None:
                    self.free_queue.move_to_end(block, last=False)  # nothing to keep: reuse it first


@hookimpl
def register_kv_caches(register):
    register("paged", PagedKVCache)
