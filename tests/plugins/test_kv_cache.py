"""The paged block manager's books: reference counts, the free queue, prefix reuse and eviction."""

from itertools import count

from colliding_names import collide_block_names
from engine_books import assert_kv_books

from inferlab.core.config import EngineConfig
from inferlab.core.request import Request
from inferlab.core.sampling_params import SamplingParams
from inferlab.plugins.kv_cache.paged import PagedKVCache

BS = 16
ids = count()


def make(num_blocks=8, prefix_caching=True):
    return PagedKVCache(EngineConfig(kvcache_block_size=BS, enable_prefix_caching=prefix_caching), num_blocks)


def seq_of(tokens):
    return Request(next(ids), list(tokens), SamplingParams())


def admit(kv, seq, num_new_tokens=None) -> bool:
    """What the core scheduler does to admit a request: take its cached prefix, then room for
    num_new_tokens more (all the rest by default)."""
    cached = kv.num_cached_prefix_tokens(seq)
    if num_new_tokens is None:
        num_new_tokens = seq.num_tokens - cached
    if not kv.allocate(seq, num_new_tokens, cached):
        return False
    seq.num_computed_tokens = seq.num_cached_tokens = cached
    return True


def compute_all(kv, seq):
    """What a step does to a fully scheduled prompt: compute it, then commit its full blocks."""
    if kv.block_table(seq):
        assert kv.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    else:
        assert admit(kv, seq)
    seq.num_computed_tokens = seq.num_tokens
    kv.commit(seq)


def test_allocate_and_free_exact_blocks():
    kv = make()
    seq = seq_of(range(40))
    assert kv.num_cached_prefix_tokens(seq) == 0
    assert admit(kv, seq, 40)
    assert len(kv.block_table(seq)) == 3 and kv.num_free_blocks == 5
    assert_kv_books(kv, [seq])
    kv.free(seq)
    assert kv.block_table(seq) == [] and kv.num_free_blocks == 8
    assert_kv_books(kv, [])


def test_allocate_refuses_without_side_effects():
    kv = make(num_blocks=2)
    seq = seq_of(range(40))
    assert not admit(kv, seq, 40)
    assert kv.block_table(seq) == [] and kv.num_free_blocks == 2


def test_shared_prefix_is_reused_and_ref_counted():
    kv = make()
    a = seq_of(list(range(32)) + [7])
    compute_all(kv, a)
    b = seq_of(list(range(32)) + [8, 9])
    assert kv.num_cached_prefix_tokens(b) == 32
    assert admit(kv, b, 2)
    assert b.num_computed_tokens == b.num_cached_tokens == 32
    assert kv.block_table(b)[:2] == kv.block_table(a)[:2] and kv.block_table(b)[2] != kv.block_table(a)[2]
    assert kv.ref_counts[kv.block_table(a)[0]] == 2
    assert_kv_books(kv, [a, b])
    kv.free(a)
    assert kv.ref_counts[kv.block_table(b)[0]] == 1
    assert_kv_books(kv, [b])


def test_prefix_hashes_chain_over_the_whole_prefix():
    kv = make()
    compute_all(kv, seq_of(list(range(16)) + list(range(100, 117))))
    # same second block, different first block: no hit at all
    other = seq_of(list(range(1, 17)) + list(range(100, 117)))
    assert kv.num_cached_prefix_tokens(other) == 0


def test_freed_blocks_stay_cached_until_evicted():
    kv = make(num_blocks=4)
    a = seq_of(range(33))
    compute_all(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    again = seq_of(range(33))
    assert kv.num_cached_prefix_tokens(again) == 32
    assert admit(kv, again, 1)
    assert again.num_computed_tokens == 32
    assert_kv_books(kv, [again])
    kv.free(again)
    # a different prompt needing every block evicts the cached ones
    big = seq_of(range(500, 564))
    assert admit(kv, big, 64)
    assert kv.num_cached_prefix_tokens(seq_of(range(33))) == 0
    assert_kv_books(kv, [big])


def test_uncached_blocks_are_reused_before_cached_ones():
    kv = make(num_blocks=4)
    cached = seq_of(range(17))
    compute_all(kv, cached)  # block 0 full and hashed, block 1 partial
    kv.free(cached)
    newcomer = seq_of(range(900, 910))
    assert admit(kv, newcomer, 10)
    assert kv.num_cached_prefix_tokens(seq_of(range(17))) == 16  # the hashed block survived


def test_fully_cached_prompt_leaves_last_token_to_compute():
    kv = make()
    compute_all(kv, seq_of(range(48)))
    exact = seq_of(range(48))  # three full blocks, all cached
    assert kv.num_cached_prefix_tokens(exact) == 32
    assert admit(kv, exact, 16)
    assert exact.num_computed_tokens == 32 and len(kv.block_table(exact)) == 3


def test_prefix_caching_off():
    kv = make(prefix_caching=False)
    compute_all(kv, seq_of(range(40)))
    assert kv.num_cached_prefix_tokens(seq_of(range(40))) == 0


def test_decode_growth_allocates_one_block_at_a_boundary():
    kv = make()
    seq = seq_of(range(16))
    compute_all(kv, seq)
    assert len(kv.block_table(seq)) == 1
    seq.token_ids.append(1)  # the 17th token needs a second block when it is computed
    assert kv.allocate(seq, 1)
    assert len(kv.block_table(seq)) == 2
    assert_kv_books(kv, [seq])


def test_collision_is_confirmed_against_tokens(monkeypatch):
    collide_block_names(monkeypatch, lambda parent, tokens: 42)  # every block collides
    kv = make()
    compute_all(kv, seq_of(range(17)))
    assert kv.num_cached_prefix_tokens(seq_of(range(100, 117))) == 0
    assert kv.num_cached_prefix_tokens(seq_of(range(17))) == 16


def test_reset_prefix_cache_keeps_referenced_blocks():
    kv = make()
    held, dropped = seq_of(range(33)), seq_of(range(200, 233))
    compute_all(kv, held)
    compute_all(kv, dropped)
    kv.free(dropped)
    kv.reset_prefix_cache()
    assert kv.num_cached_prefix_tokens(seq_of(range(200, 233))) == 0
    assert kv.num_cached_prefix_tokens(seq_of(range(33))) == 32
    assert_kv_books(kv, [held])
