"""Paged KV blocks with prefix caching.

Each full block is named by a hash chained over every token before it, so equal prefixes share
blocks. A freed block keeps its hash and content until it is handed out again (least recently
freed first), so a later request can still reuse it. A hit is confirmed exactly, never on the
hash alone: the block's own tokens must match and so must its parent (the content it was computed
after, by a per-content id), so a hash collision costs a miss, never wrong K/V.
"""

from collections import OrderedDict

import numpy as np
import xxhash

from inferlab.core.hookspecs import hookimpl
from inferlab.core.sequence import Sequence


def chain_hash(parent: int, tokens: list[int]) -> int:
    h = xxhash.xxh64(parent.to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.intdigest()


class PagedKVCache:
    def __init__(self, config, num_blocks: int, **options):
        if options:
            raise TypeError(f"the paged KV cache takes no options, got {sorted(options)}")
        self.block_size = config.kvcache_block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = config.enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        # Exact identity of cached content: a fresh id per committed block, and its parent's id (0: none).
        self.block_content_id: list[int] = [0] * num_blocks
        self.block_parent_id: list[int] = [0] * num_blocks
        self.next_content_id = 1
        self.cached: dict[int, int] = {}  # hash -> block holding that content
        # Blocks nobody references, in eviction order (front goes first); cached ones keep content.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_committed: dict[int, int] = {}  # seq_id -> its leading blocks already hashed
        self.num_hit_tokens = 0
        self.num_queried_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1 - self.num_free_blocks / self.num_blocks

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """seq's chained block hashes for its first num_blocks full blocks (memoized on seq)."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else 0, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes[:num_blocks]

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        # Leave the last token uncached so that it is computed and yields logits.
        hits, parent_id = [], 0
        for i, h in enumerate(self._hashes(seq, (seq.num_tokens - 1) // bs)):
            block = self.cached.get(h)
            if (
                block is None
                or self.block_parent_id[block] != parent_id
                or self.block_tokens[block] != tuple(seq.token_ids[i * bs : (i + 1) * bs])
            ):
                break
            hits.append(block)
            parent_id = self.block_content_id[block]
        return hits

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        return len(self._prefix_hits(seq)) * self.block_size

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        bs = self.block_size
        if seq.block_table and seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * bs:
            return True  # fits in the blocks it has: most decode steps
        hits = []
        if not seq.block_table:
            hits = self._prefix_hits(seq)
            num_computed = len(hits) * bs
        else:
            num_computed = seq.num_computed_tokens
        blocks_needed = -(-(num_computed + num_new_tokens) // bs) - len(seq.block_table) - len(hits)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)  # hits taken out of the free queue
        if blocks_needed + revived > self.num_free_blocks:
            return False
        if not seq.block_table:
            for block in hits:
                if self.ref_counts[block] == 0:
                    del self.free_queue[block]
                self.ref_counts[block] += 1
            seq.block_table = list(hits)
            seq.num_computed_tokens = seq.num_cached_tokens = num_computed
            self.num_committed[seq.seq_id] = len(hits)
            self.num_hit_tokens += num_computed
            self.num_queried_tokens += seq.num_tokens
        for _ in range(max(0, blocks_needed)):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        self._evict(block)
        self.ref_counts[block] = 1
        return block

    def _evict(self, block: int) -> None:
        """Forgets the cached content of an unreferenced block."""
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = self.block_tokens[block] = None
            self.block_content_id[block] = self.block_parent_id[block] = 0

    def commit(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        start = self.num_committed.get(seq.seq_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(seq, num_full)
        for i in range(start, num_full):
            block = seq.block_table[i]
            if self.block_hash[block] is None:
                self.block_hash[block] = hashes[i]
                self.block_tokens[block] = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self.block_content_id[block] = self.next_content_id
                self.block_parent_id[block] = self.block_content_id[seq.block_table[i - 1]] if i else 0
                self.next_content_id += 1
                self.cached.setdefault(hashes[i], block)
        self.num_committed[seq.seq_id] = num_full

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block that nobody references (for benchmarks that repeat prompts)."""
        for block in self.free_queue:
            self._evict(block)

    def free(self, seq: Sequence) -> None:
        # Tail blocks first: a prompt's last blocks are the least likely to be shared again.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed more often than allocated (sequence {seq.seq_id})")
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                if self.block_hash[block] is None:
                    self.free_queue.move_to_end(block, last=False)  # nothing to keep: reuse it first
        seq.block_table = []
        seq.num_computed_tokens = 0
        self.num_committed.pop(seq.seq_id, None)


@hookimpl
def register_kv_caches(register):
    register("paged", PagedKVCache)
