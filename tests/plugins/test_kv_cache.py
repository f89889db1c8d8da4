"""The paged block manager's books: reference counts, the free queue, prefix reuse and eviction."""

import random
from itertools import count

from colliding_names import collide_block_names
from engine_books import assert_kv_books

from inferlab.core.blocks import block_identity
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


class NamedFromTokens(PagedKVCache):
    """The paged manager with each committed block's identity made from its tokens when committed
    (block_identity), as it was before commits read the identities memoized with the names: the
    reference they must match book for book."""

    def commit(self, request):
        num_full = request.num_computed_tokens // self.block_size
        start = self.num_committed.get(request.request_id, 0)
        hashes = self._names(request, num_full)[0]
        table = self.tables[request.request_id]
        for i in range(start, num_full):
            block = table[i]
            if self.block_hash[block] is None:  # named from its tokens, as block_identity does
                h = self.block_hash[block] = hashes[i]
                self.block_tokens[block] = block_identity(request.token_ids, i * BS, (i + 1) * BS)
                self.block_content_id[block], self.next_content_id = self.next_content_id, self.next_content_id + 1
                self.block_parent_id[block] = self.block_content_id[table[i - 1]] if i else 0
                if h not in self.cached:
                    self.cached[h] = block
                    if self.kv_events is not None:
                        self.kv_events[h] = True
                self.cache_version += 1
        self.num_committed[request.request_id] = max(start, num_full)


def books(kv) -> tuple:
    return (
        list(kv.free_queue),
        list(kv.cached.items()),
        kv.block_hash,
        kv.block_tokens,
        kv.block_content_id,
        kv.block_parent_id,
        kv.ref_counts,
        kv.cache_version,
        dict(kv.tables),
        kv.kv_events,
    )


def test_commits_reading_memoized_identities_keep_the_books_of_identities_made_at_commit():
    """Prompts behind shared prefixes, decoding past their prompts (blocks named from outputs
    too), freed in a shuffled order on a small cache: hits, evictions and revivals along the way."""

    rng = random.Random(7)
    config = EngineConfig(kvcache_block_size=BS, enable_prefix_caching=True)
    fast, slow = PagedKVCache(config, 40), NamedFromTokens(config, 40)
    fast.take_kv_events(), slow.take_kv_events()  # record events too
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([16, 40, 64]))] for _ in range(4)]
    live: list[tuple[Request, Request]] = []
    seen = {"evictions": 0, "hits": 0}
    for step in range(400):
        if live and (rng.random() < 0.35 or len(live) > 5):
            pair = live.pop(rng.randrange(len(live)))
            fast.free(pair[0]), slow.free(pair[1])
        elif live and rng.random() < 0.5:  # decode a few tokens past the prompt, committing each step
            a, b = live[rng.randrange(len(live))]
            for _ in range(rng.randrange(1, 20)):
                grew = [fast.allocate(a, 1), slow.allocate(b, 1)]
                assert grew[0] == grew[1]
                if not grew[0]:
                    break
                for r in (a, b):
                    r.token_ids.append(step % 97)
                    r.num_computed_tokens += 1
                fast.commit(a), slow.commit(b)
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 50))]
            a, b = seq_of(tokens), seq_of(tokens)
            b.request_id = a.request_id
            version = fast.cache_version
            if admit(fast, a) != admit(slow, b):
                raise AssertionError(f"step {step}: the two managers admitted differently")
            if fast.block_table(a):
                seen["hits"] += a.num_cached_tokens > 0
                for r, kv in ((a, fast), (b, slow)):
                    r.num_computed_tokens = r.num_tokens
                    kv.commit(r)
                live.append((a, b))
                seen["evictions"] += fast.cache_version - version > fast.num_committed[a.request_id] - len(
                    fast.block_table(a)[: a.num_cached_tokens // BS]
                )
        assert books(fast) == books(slow), f"step {step}"
    assert seen["evictions"] > 10 and seen["hits"] > 10
