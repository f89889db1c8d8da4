"""Property tests of the paged KV manager: the public conformance machine (inferlab.testing)
plus white-box invariants of the paged books (reference counts, the free queue, cached block
labels), also when the chain hash is forced to collide."""

from collections import Counter

import pytest
from colliding_names import collide_block_names
from engine_books import assert_kv_books
from hypothesis import settings
from hypothesis.stateful import invariant, run_state_machine_as_test
from hypothesis_profiles import QUICK_EXAMPLES, quick_and_thorough  # (loads the profile)

from inferlab.core.config import EngineConfig
from inferlab.core.request import Request
from inferlab.core.sampling_params import SamplingParams
from inferlab.plugins.kv_cache import paged
from inferlab.testing.kv_cache import KVCacheMachine


def weak_chain_hash(parent: int, tokens: list[int]) -> int:
    """Ignores the parent and almost all of the content: collisions everywhere."""
    return sum(tokens) % 3


class PagedMachine(KVCacheMachine):
    kv_cache = "paged"
    seen = Counter()

    @invariant()
    def books_are_exact(self):
        if hasattr(self, "kv"):
            assert_kv_books(self.kv, self.running)

    @invariant()
    def cached_blocks_are_full_and_labelled(self):
        if not hasattr(self, "kv"):
            return
        kv = self.kv
        for h, block in kv.cached.items():
            assert kv.block_hash[block] == h
        for block, tokens in enumerate(kv.block_tokens):
            if tokens is not None:
                assert len(tokens) == self.bs and self.content[block][-self.bs :] == tokens

    @invariant()
    def per_request_state_only_for_live_requests(self):
        if hasattr(self, "kv"):
            live = {r.request_id for r in self.running}
            assert set(self.kv.tables) == live and set(self.kv.num_committed) <= live


@pytest.mark.parametrize("examples", quick_and_thorough(QUICK_EXAMPLES, settings().max_examples))
@pytest.mark.parametrize("hash_kind", ["chained", "colliding"])
def test_paged_kv_cache_state_machine(hash_kind, examples, monkeypatch):
    if hash_kind == "colliding":
        collide_block_names(monkeypatch, weak_chain_hash)
    PagedMachine.seen.clear()
    run_state_machine_as_test(PagedMachine, settings=settings(max_examples=examples))
    assert PagedMachine.seen["prefix hit"] > 0 and PagedMachine.seen["refused allocate"] > 0


def test_colliding_hash_never_serves_another_prefix(monkeypatch):
    """A block equal in tokens but computed after another prefix must not be served."""
    collide_block_names(monkeypatch, weak_chain_hash)
    kv = paged.PagedKVCache(EngineConfig(kvcache_block_size=2), 8)
    first = Request(0, [1, 1, 0, 0, 1], SamplingParams())
    assert kv.allocate(first, 5)
    first.num_computed_tokens = 5
    kv.commit(first)
    kv.free(first)
    # [0, 0] is cached, but its K/V was computed after [1, 1], at positions 2..3
    assert kv.num_cached_prefix_tokens(Request(1, [0, 0, 1], SamplingParams())) == 0
    # the same prefix is still served
    assert kv.num_cached_prefix_tokens(Request(2, [1, 1, 0, 0, 2], SamplingParams())) == 4
