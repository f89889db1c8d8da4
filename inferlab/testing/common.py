"""What the conformance suites share."""

from collections import Counter

from hypothesis.stateful import run_state_machine_as_test


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def run_machine(machine: type, hypothesis_settings, **attributes) -> Counter:
    """Runs a state machine with these class attributes set (the plugin under test); returns what
    its `seen` counter recorded across examples, proof that the interesting paths were taken."""
    configured = type(machine.__name__, (machine,), {**attributes, "seen": Counter()})
    run_state_machine_as_test(configured, settings=hypothesis_settings)
    return configured.seen


def assert_blocks_accounted(kv, requests, block_size: int, lost: str = "a KV block was lost") -> None:
    """Every block is free or held by these requests, and a block two of them share is full and
    computed for each (none of them writes into it any more)."""
    holders: dict[int, list] = {}
    for request in requests:
        for i, block in enumerate(kv.block_table(request)):
            holders.setdefault(block, []).append((request, i))
    assert kv.num_free_blocks == kv.num_blocks - len(holders), (
        f"{lost}: {kv.num_free_blocks} blocks free, but {len(holders)} of {kv.num_blocks} are held"
    )
    for block, owners in holders.items():
        if len(owners) > 1:
            for request, i in owners:
                assert (i + 1) * block_size <= request.num_computed_tokens, (
                    f"block {block} is shared by {[r for r, _ in owners]} but {request!r} still writes into it"
                )


def assert_own_prefixes(kv, requests, block_size: int, content: dict) -> None:
    """Each request's computed blocks hold its own prefix, as `content` (block id -> the tokens
    written there, kept by the test) records them."""
    for request in requests:
        computed, table = request.num_computed_tokens, kv.block_table(request)
        for i in range(ceil_div(computed, block_size)):
            want = tuple(request.token_ids[: min((i + 1) * block_size, computed)])
            assert content.get(table[i]) == want, (
                f"block {i} (id {table[i]}) of {request!r} holds {content.get(table[i])}, not its own prefix "
                f"{list(want)} (tokens {request.token_ids}, cached {request.num_cached_tokens}, "
                f"preempted {request.num_preemptions})"
            )
