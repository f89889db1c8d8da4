"""Checks of the KV block books, shared by the engine reliability and fuzz tests and the KV
manager's and schedulers' property tests."""


def assert_books_clean(llm) -> None:
    """Nothing pending and every KV block free: no leak, no reference left behind."""
    kv = llm.kv_cache
    assert llm.scheduler.is_finished() and not llm.requests
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} blocks leaked"
    assert not any(kv.ref_counts), "reference counts left behind"
    assert sorted(kv.free_queue) == list(range(kv.num_blocks))


def assert_books_exact(llm) -> None:
    """Mid-run: the KV manager's books match the pending requests (assert_kv_books)."""
    assert_kv_books(llm.kv_cache, llm.requests.values())


def assert_kv_books(kv, seqs) -> None:
    """Reference counts equal a recount over seqs' block tables, and the free queue holds exactly
    the unreferenced blocks, each once."""
    recount = [0] * kv.num_blocks
    for seq in seqs:
        for block in seq.block_table:
            recount[block] += 1
    assert kv.ref_counts == recount
    free = list(kv.free_queue)
    assert len(free) == len(set(free)) == kv.num_free_blocks
    assert set(free) == {b for b in range(kv.num_blocks) if recount[b] == 0}


def assert_prefixes_readable(seqs, content, block_size: int) -> None:
    """Each sequence's computed tokens are in its own blocks: block i of its table holds (as
    content[block] records what was written there) its tokens up to the end of block i."""
    for seq in seqs:
        computed = seq.num_computed_tokens
        full = -(-computed // block_size)
        assert len(seq.block_table) >= full
        for i in range(full):
            assert content.get(seq.block_table[i]) == tuple(seq.token_ids[: min((i + 1) * block_size, computed)])
