"""Checks of the paged KV manager's books (its internals: these are the paged plugin's own white-box
checks; inferlab.testing checks any KV manager through its public interface), shared by the engine
reliability and fuzz tests and the KV manager's property tests."""


def assert_books_clean(llm) -> None:
    """Nothing pending and every KV block free: no leak, no reference left behind."""
    kv = llm.kv_manager
    assert not llm.scheduler.has_unfinished() and not llm.requests
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} blocks leaked"
    assert not any(kv.ref_counts), "reference counts left behind"
    assert sorted(kv.free_queue) == list(range(kv.num_blocks))
    assert not kv.tables and not kv.hashes and not kv.num_committed, "per-request state left behind"


def assert_books_exact(llm) -> None:
    """Mid-run: the KV manager's books match the pending requests (assert_kv_books)."""
    assert_kv_books(llm.kv_manager, llm.requests.values())


def assert_kv_books(kv, requests) -> None:
    """Reference counts equal a recount over the requests' block tables, and the free queue holds
    exactly the unreferenced blocks, each once."""
    recount = [0] * kv.num_blocks
    for request in requests:
        for block in kv.block_table(request):
            recount[block] += 1
    assert kv.ref_counts == recount
    free = list(kv.free_queue)
    assert len(free) == len(set(free)) == kv.num_free_blocks
    assert set(free) == {b for b in range(kv.num_blocks) if recount[b] == 0}


def assert_prefixes_readable(kv, requests, content, block_size: int) -> None:
    """Each request's computed tokens are in its own blocks: block i of its table holds (as
    content[block] records what was written there) its tokens up to the end of block i."""
    for request in requests:
        computed = request.num_computed_tokens
        full = -(-computed // block_size)
        table = kv.block_table(request)
        assert len(table) >= full
        for i in range(full):
            assert content.get(table[i]) == tuple(request.token_ids[: min((i + 1) * block_size, computed)])
