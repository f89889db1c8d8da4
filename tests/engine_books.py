"""Checks of an engine's block books, shared by the engine reliability and fuzz tests, and a
fixture that keeps torch to one thread for them."""
import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread, and OpenMP threads that spin-wait on a loaded
    machine make each step 30x slower."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def assert_books_clean(llm) -> None:
    """Nothing pending and every KV block free: no leak, no reference left behind."""
    kv = llm.kv_cache
    assert llm.scheduler.is_finished() and not llm.requests
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} blocks leaked"
    assert not any(kv.ref_counts), "reference counts left behind"
    assert sorted(kv.free_queue) == list(range(kv.num_blocks))


def assert_books_exact(llm) -> None:
    """Mid-run: reference counts equal a recount over the pending requests' block tables."""
    kv = llm.kv_cache
    recount = [0] * kv.num_blocks
    for seq in llm.requests.values():
        for block in seq.block_table:
            recount[block] += 1
    assert kv.ref_counts == recount
    assert set(kv.free_queue) == {b for b in range(kv.num_blocks) if recount[b] == 0}
