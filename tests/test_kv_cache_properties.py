"""Property tests of the paged KV manager against a model of what each block holds.

The model records, for every block a step computed, the exact token prefix whose K/V it holds.
Random admit / compute / append / preempt / finish / interrupted-step sequences must keep the
reference counts equal to a recount over the live block tables, the free queue the exact
complement of the referenced blocks, and every block a sequence reads hold its own prefix, also
when the chain hash is forced to collide.
"""

from collections import Counter

import hypothesis_profiles  # noqa: F401  (loads the profile)
import pytest
from engine_books import assert_kv_books, assert_prefixes_readable
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from inferlab.core.config import EngineConfig
from inferlab.core.sampling_params import SamplingParams
from inferlab.core.sequence import Sequence
from inferlab.plugins.kv_cache import paged

# A tiny alphabet so that prompts share prefixes and whole blocks repeat at other positions.
TOKENS = st.integers(0, 3)


def weak_chain_hash(parent: int, tokens: list[int]) -> int:
    """Ignores the parent and almost all of the content: collisions everywhere."""
    return sum(tokens) % 3


def snapshot(kv) -> tuple:
    return (
        list(kv.ref_counts),
        list(kv.free_queue),
        dict(kv.cached),
        list(kv.block_hash),
        list(kv.block_tokens),
        list(kv.block_content_id),
        list(kv.block_parent_id),
        dict(kv.num_committed),
    )


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheMachine(RuleBasedStateMachine):
    seen = Counter()  # across all examples: proof that the interesting paths were taken

    def __init__(self):
        super().__init__()
        self.pending: list[Sequence] = []  # no blocks: new, or preempted
        self.running: list[Sequence] = []  # hold blocks
        self.content: dict[int, tuple[int, ...]] = {}  # block -> token prefix whose K/V it holds

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 12), prefix_caching=st.booleans())
    def make_cache(self, block_size, num_blocks, prefix_caching):
        config = EngineConfig(kvcache_block_size=block_size, enable_prefix_caching=prefix_caching)
        self.kv = paged.PagedKVCache(config, num_blocks)
        self.bs = block_size

    # -- rules ------------------------------------------------------------------------------

    @rule(data=st.data())
    def new_request(self, data):
        prefix = []
        live = self.pending + self.running
        if live and data.draw(st.booleans(), label="share a prefix"):
            base = data.draw(st.sampled_from(live)).token_ids
            prefix = base[: data.draw(st.integers(0, len(base)))]
        tokens = prefix + data.draw(st.lists(TOKENS, max_size=20))
        if tokens:
            self.pending.append(Sequence(tokens, SamplingParams()))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def admit(self, data):
        seq = data.draw(st.sampled_from(self.pending))
        before = snapshot(self.kv)
        num_cached = self.kv.num_cached_prefix_tokens(seq)
        assert snapshot(self.kv) == before, "num_cached_prefix_tokens changed the cache"
        assert num_cached % self.bs == 0 and 0 <= num_cached <= seq.num_tokens - 1
        num_new = data.draw(st.integers(1, seq.num_tokens - num_cached), label="prefill chunk")
        if not self.kv.allocate(seq, num_new):
            assert snapshot(self.kv) == before, "a failed allocate changed the cache"
            assert not seq.block_table and seq.num_computed_tokens == 0
            self.seen["failed allocate"] += 1
            return
        self.pending.remove(seq)
        self.running.append(seq)
        assert seq.num_computed_tokens == seq.num_cached_tokens == num_cached
        assert len(seq.block_table) == ceil_div(num_cached + num_new, self.bs)
        for i in range(num_cached // self.bs):  # every prefix hit holds exactly this prefix
            assert self.content.get(seq.block_table[i]) == tuple(seq.token_ids[: (i + 1) * self.bs])
        self.seen["prefix hit"] += num_cached > 0
        self._compute(seq, num_new, data)

    @precondition(lambda self: any(s.num_computed_tokens < s.num_tokens for s in self.running))
    @rule(data=st.data())
    def compute(self, data):
        seq = data.draw(st.sampled_from([s for s in self.running if s.num_computed_tokens < s.num_tokens]))
        num_new = data.draw(st.integers(1, seq.num_uncomputed_tokens), label="tokens")
        before = snapshot(self.kv)
        table = list(seq.block_table)
        if not self.kv.allocate(seq, num_new):
            assert snapshot(self.kv) == before and seq.block_table == table, "a failed allocate changed the cache"
            return
        assert seq.block_table[: len(table)] == table, "allocate rewrote blocks the sequence already had"
        assert len(seq.block_table) == max(len(table), ceil_div(seq.num_computed_tokens + num_new, self.bs))
        self._compute(seq, num_new, data)

    def _compute(self, seq: Sequence, num_new: int, data):
        """What a step does after allocating: the runner writes K/V (sometimes it is interrupted
        first), the scheduler advances and commits, and the sampler may add a token."""
        if data.draw(st.integers(0, 9), label="interrupted") == 0:
            return  # allocated, never computed: the next allocate must cope
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        for i in range(start // self.bs, ceil_div(end, self.bs)):
            self.content[seq.block_table[i]] = tuple(seq.token_ids[: min((i + 1) * self.bs, end)])
        seq.num_computed_tokens = end
        self.kv.commit(seq)
        if end == seq.num_tokens:
            seq.append_token(data.draw(TOKENS, label="sampled"))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        """Finish (the sequence leaves) or preempt (it waits to be recomputed from scratch)."""
        seq = data.draw(st.sampled_from(self.running))
        self.kv.free(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0
        self.running.remove(seq)
        if preempt:
            self.pending.append(seq)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def drop_pending(self, data):
        self.pending.remove(data.draw(st.sampled_from(self.pending)))

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def books_are_exact(self):
        for seq in self.pending:
            assert seq.block_table == []
        assert_kv_books(self.kv, self.running)
        assert all(len(set(s.block_table)) == len(s.block_table) for s in self.running), "a block twice in one table"

    @invariant()
    def sequences_read_their_own_prefix(self):
        assert_prefixes_readable(self.running, self.content, self.bs)

    @invariant()
    def cached_blocks_are_full_and_labelled(self):
        kv = self.kv
        for h, block in kv.cached.items():
            assert kv.block_hash[block] == h
        for block, tokens in enumerate(kv.block_tokens):
            if tokens is not None:
                assert len(tokens) == self.bs and self.content[block][-self.bs :] == tokens


@pytest.mark.parametrize("hash_kind", ["xxhash", "colliding"])
def test_paged_kv_cache_state_machine(hash_kind, monkeypatch):
    if hash_kind == "colliding":
        monkeypatch.setattr(paged, "chain_hash", weak_chain_hash)
    KVCacheMachine.seen.clear()
    run_state_machine_as_test(KVCacheMachine)
    assert KVCacheMachine.seen["prefix hit"] > 0 and KVCacheMachine.seen["failed allocate"] > 0


def test_colliding_hash_never_serves_another_prefix(monkeypatch):
    """A block equal in tokens but computed after another prefix must not be served."""
    monkeypatch.setattr(paged, "chain_hash", weak_chain_hash)
    kv = paged.PagedKVCache(EngineConfig(kvcache_block_size=2), 8)
    first = Sequence([1, 1, 0, 0, 1], SamplingParams())
    assert kv.allocate(first, 5)
    first.num_computed_tokens = 5
    kv.commit(first)
    kv.free(first)
    # [0, 0] is cached, but its K/V was computed after [1, 1], at positions 2..3
    second = Sequence([0, 0, 1], SamplingParams())
    assert kv.num_cached_prefix_tokens(second) == 0
    # the same prefix is still served
    third = Sequence([1, 1, 0, 0, 2], SamplingParams())
    assert kv.num_cached_prefix_tokens(third) == 4
