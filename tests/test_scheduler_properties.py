"""Property tests of every registered scheduler over the paged KV manager, no model needed.

Random add / step (schedule + postprocess with random sampled tokens, sometimes interrupted
between the two) / finish / abort sequences under small KV budgets and batch limits (so that
sequences are preempted and recomputed) must keep the block books exact, give every sequence
the K/V of its own prefix, respect the batch limits, make progress every step, and finish every
admitted request.
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
from inferlab.core.plugins import get_registry
from inferlab.core.sampling_params import SamplingParams
from inferlab.core.sequence import Sequence, SequenceStatus
from inferlab.plugins.kv_cache import paged

EOS = 0
TOKENS = st.integers(0, 3)  # tiny alphabet: shared prefixes, repeated blocks, and EOS now and then
MAX_MODEL_LEN = 48


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def blocks_needed(seq: Sequence, block_size: int) -> int:
    """The most blocks seq can hold: its last token is sampled, never computed."""
    most_tokens = min(seq.num_prompt_tokens + seq.params.max_tokens, MAX_MODEL_LEN) - 1
    return ceil_div(max(seq.num_prompt_tokens, most_tokens), block_size)


class SchedulerMachine(RuleBasedStateMachine):
    scheduler_name = "fcfs"
    seen = Counter()  # across all examples: proof that the interesting paths were taken

    def __init__(self):
        super().__init__()
        self.live: list[Sequence] = []  # added, not finished
        self.all: list[Sequence] = []
        self.content: dict[int, tuple[int, ...]] = {}  # block -> token prefix whose K/V it holds

    @initialize(
        block_size=st.sampled_from([2, 4, 16]),
        num_blocks=st.integers(1, 10),
        max_num_seqs=st.integers(1, 4),
        max_num_batched_tokens=st.integers(1, 32),
        prefix_caching=st.booleans(),
    )
    def make_scheduler(self, block_size, num_blocks, max_num_seqs, max_num_batched_tokens, prefix_caching):
        self.config = EngineConfig(
            kvcache_block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            enable_prefix_caching=prefix_caching,
        )
        registry = get_registry()
        self.kv = registry.create("kv_cache", "paged", self.config, num_blocks)
        self.scheduler = registry.create("scheduler", self.scheduler_name, self.config, self.kv)
        self.bs = block_size

    # -- rules ------------------------------------------------------------------------------

    @rule(data=st.data(), num_requests=st.integers(1, 3))
    def add(self, data, num_requests):
        for _ in range(num_requests):
            prefix = []
            if self.all and data.draw(st.booleans(), label="share a prefix"):
                base = data.draw(st.sampled_from(self.all)).token_ids
                prefix = base[: data.draw(st.integers(0, len(base)))]
            tokens = (prefix + data.draw(st.lists(TOKENS, max_size=24)))[:MAX_MODEL_LEN]
            params = SamplingParams(max_tokens=data.draw(st.integers(1, 10)), ignore_eos=data.draw(st.booleans()))
            seq = Sequence(tokens, params, EOS, MAX_MODEL_LEN)
            if tokens and blocks_needed(seq, self.bs) <= self.kv.num_blocks:  # else the engine rejects it
                self.scheduler.add(seq)
                self.live.append(seq)
                self.all.append(seq)

    @rule(data=st.data())
    def step(self, data):
        self._step(
            lambda: data.draw(TOKENS, label="sampled"),
            interrupted=data.draw(st.integers(0, 9), label="interrupted") == 0,
        )

    def _step(self, sample, interrupted=False) -> bool:
        preemptions = self.scheduler.num_preemptions
        batch = self.scheduler.schedule()
        self.seen["preemption"] += self.scheduler.num_preemptions > preemptions
        if not self.live:
            assert not batch.seqs
            return False
        assert batch.seqs, "requests are pending but the scheduler scheduled nothing"
        assert len(batch.seqs) == len(set(map(id, batch.seqs))) <= self.config.max_num_seqs
        assert batch.total_tokens <= self.config.max_num_batched_tokens
        for seq, num_tokens in zip(batch.seqs, batch.num_scheduled_tokens):
            assert seq in self.live and seq.status == SequenceStatus.RUNNING
            assert 1 <= num_tokens <= seq.num_uncomputed_tokens
            assert len(seq.block_table) * self.bs >= seq.num_computed_tokens + num_tokens
        if interrupted:  # the forward pass raised: nothing computed, nothing advanced
            self.seen["interrupted"] += 1
            return True
        sampled = [
            sample() if seq.num_computed_tokens + n == seq.num_tokens else None
            for seq, n in zip(batch.seqs, batch.num_scheduled_tokens)
        ]
        for seq, num_tokens in zip(batch.seqs, batch.num_scheduled_tokens):  # the runner writes K/V
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_tokens
            for i in range(start // self.bs, ceil_div(end, self.bs)):
                self.content[seq.block_table[i]] = tuple(seq.token_ids[: min((i + 1) * self.bs, end)])
        finished = self.scheduler.postprocess(batch, sampled)
        for seq in finished:
            assert seq.is_finished and seq.finish_reason in ("stop", "length") and not seq.block_table
            self.live.remove(seq)
        assert not any(s.is_finished for s in self.live)
        return True

    @precondition(lambda self: self.live)
    @rule(data=st.data(), how=st.sampled_from(["abort", "stop"]))
    def end_early(self, data, how):
        """An abort, or what the engine does when a stop string matches."""
        seq = data.draw(st.sampled_from(self.live))
        if how == "abort":
            assert self.scheduler.abort(seq.seq_id) is seq
            assert self.scheduler.abort(seq.seq_id) is None  # a second abort finds nothing
        else:
            self.scheduler.finish(seq, "stop")
        assert seq.is_finished and seq.finish_reason == how and not seq.block_table
        self.live.remove(seq)

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def books_are_exact(self):
        assert_kv_books(self.kv, self.live)

    @invariant()
    def sequences_read_their_own_prefix(self):
        assert_prefixes_readable(self.live, self.content, self.bs)

    @invariant()
    def queues_match_the_live_requests(self):
        assert self.scheduler.is_finished() == (not self.live)
        running = [s for s in self.live if s.status == SequenceStatus.RUNNING]
        assert len(running) <= self.config.max_num_seqs
        for seq in self.live:
            assert seq.status in (SequenceStatus.WAITING, SequenceStatus.RUNNING)
            if seq.status == SequenceStatus.WAITING:  # recompute preemption: a waiting sequence holds nothing
                assert not seq.block_table and seq.num_computed_tokens == 0
        assert self.scheduler.num_preemptions == sum(s.num_preemptions for s in self.all)

    def check_books(self):
        self.books_are_exact()
        self.sequences_read_their_own_prefix()
        self.queues_match_the_live_requests()

    def teardown(self):
        """Every admitted request finishes: the oldest running sequence is never preempted, so each
        step advances it, and the work left is bounded by the tokens every request may compute."""
        if not hasattr(self, "scheduler"):
            return
        bound = sum(s.num_prompt_tokens + s.params.max_tokens for s in self.live) + 1
        tokens = iter(range(1, 10**9))
        for _ in range(bound):
            if not self._step(lambda: 1 + next(tokens) % 3):  # never EOS: run to max_tokens/max_model_len
                break
            self.check_books()
        assert not self.live, f"{len(self.live)} requests still pending after {bound} steps"
        assert self.scheduler.is_finished()
        assert self.kv.num_free_blocks == self.kv.num_blocks and not any(self.kv.ref_counts)
        for seq in self.all:
            assert seq.is_finished and not seq.block_table
            if seq.finish_reason == "length":
                assert seq.num_completion_tokens == seq.params.max_tokens or seq.num_tokens >= MAX_MODEL_LEN


def weak_chain_hash(parent: int, tokens: list[int]) -> int:
    return sum(tokens) % 3


@pytest.mark.parametrize("hash_kind", ["xxhash", "colliding"])
@pytest.mark.parametrize("scheduler_name", get_registry().names("scheduler"))
def test_scheduler_state_machine(scheduler_name, hash_kind, monkeypatch):
    if hash_kind == "colliding":
        monkeypatch.setattr(paged, "chain_hash", weak_chain_hash)
    machine = type(
        f"{scheduler_name}Machine", (SchedulerMachine,), {"scheduler_name": scheduler_name, "seen": Counter()}
    )
    run_state_machine_as_test(machine)
    assert machine.seen["preemption"] > 0 and machine.seen["interrupted"] > 0
