"""FCFS scheduler invariants, driven without a model: budgets hold, preemption recomputes, no
block leaks, and every request finishes."""

import random

from inferlab.core.config import EngineConfig
from inferlab.core.sampling_params import SamplingParams
from inferlab.core.sequence import Sequence, SequenceStatus
from inferlab.plugins.kv_cache.paged import PagedKVCache
from inferlab.plugins.schedulers.fcfs import FCFSScheduler


def make(num_blocks=16, **settings):
    config = EngineConfig(kvcache_block_size=16, **settings)
    kv = PagedKVCache(config, num_blocks)
    return FCFSScheduler(config, kv), kv, config


def run_to_completion(scheduler, kv, config, rng, max_steps=10_000):
    """Drives the scheduler with random tokens; checks the invariants after every step."""
    for _ in range(max_steps):
        if scheduler.is_finished():
            return
        batch = scheduler.schedule()
        assert batch.seqs, "pending requests but nothing scheduled"
        assert batch.total_tokens <= config.max_num_batched_tokens
        assert len(scheduler.running) <= config.max_num_seqs
        assert len({s.seq_id for s in batch.seqs}) == len(batch.seqs)
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens):
            assert n >= 1 and seq.num_computed_tokens + n <= seq.num_tokens
            assert len(seq.block_table) * kv.block_size >= seq.num_computed_tokens + n
        sampled = [rng.randrange(1, 500) if ok else None for ok in batch.samples]
        scheduler.postprocess(batch, sampled)
        live = [*scheduler.running, *scheduler.waiting]
        counts = [0] * kv.num_blocks
        for seq in live:
            for block in seq.block_table:
                counts[block] += 1
        assert kv.ref_counts == counts
        assert all(not s.block_table for s in scheduler.waiting)
    raise AssertionError("did not finish")


def test_every_request_finishes_and_no_block_leaks():
    scheduler, kv, config = make(num_blocks=20, max_num_seqs=4, max_num_batched_tokens=64)
    rng = random.Random(0)
    seqs = [
        Sequence(
            [rng.randrange(1, 50) for _ in range(rng.randrange(1, 60))],
            SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True),
        )
        for _ in range(30)
    ]
    for seq in seqs:
        scheduler.add(seq)
    run_to_completion(scheduler, kv, config, rng)
    assert all(s.status == SequenceStatus.FINISHED for s in seqs)
    assert all(s.num_completion_tokens == s.params.max_tokens for s in seqs)
    assert kv.num_free_blocks == kv.num_blocks and all(r == 0 for r in kv.ref_counts)


def test_preemption_recomputes_newest_first():
    scheduler, kv, config = make(num_blocks=4)
    a = Sequence(list(range(32)), SamplingParams(max_tokens=20, ignore_eos=True))
    b = Sequence(list(range(100, 132)), SamplingParams(max_tokens=20, ignore_eos=True))
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    assert batch.seqs == [a, b]
    scheduler.postprocess(batch, [1, 1])  # each now needs a third block; only 0 are free
    batch = scheduler.schedule()
    assert batch.seqs == [a] and scheduler.num_preemptions == 1
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and not b.block_table
    assert scheduler.waiting[0] is b
    run_to_completion(scheduler, kv, config, random.Random(1))
    assert b.num_completion_tokens == 20


def test_decodes_run_before_new_prefills():
    scheduler, kv, config = make(num_blocks=32, max_num_batched_tokens=40)
    first = Sequence(list(range(30)), SamplingParams(max_tokens=5))
    scheduler.add(first)
    scheduler.postprocess(scheduler.schedule(), [7])
    second = Sequence(list(range(200, 260)), SamplingParams(max_tokens=5))
    scheduler.add(second)
    batch = scheduler.schedule()
    assert batch.seqs == [first, second] and batch.num_scheduled_tokens == [1, 39]


def test_max_num_seqs_limits_admission():
    scheduler, kv, config = make(num_blocks=32, max_num_seqs=2)
    for i in range(5):
        scheduler.add(Sequence([i + 1] * 5, SamplingParams()))
    assert len(scheduler.schedule()) == 2


def test_abort_frees_blocks_wherever_the_request_is():
    scheduler, kv, config = make(num_blocks=8, max_num_seqs=1)
    running = Sequence(list(range(40)), SamplingParams())
    waiting = Sequence(list(range(10)), SamplingParams())
    scheduler.add(running)
    scheduler.add(waiting)
    scheduler.schedule()
    assert scheduler.abort(running.seq_id) is running and running.finish_reason == "abort"
    assert scheduler.abort(waiting.seq_id) is waiting
    assert scheduler.abort(12345) is None
    assert scheduler.is_finished() and kv.num_free_blocks == kv.num_blocks


def test_stop_conditions():
    scheduler, kv, config = make()
    eos = Sequence([1, 2, 3], SamplingParams(max_tokens=10), eos_token_id=0)
    stop_id = Sequence([1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[9]), eos_token_id=0)
    ignore = Sequence([1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True), eos_token_id=0)
    length = Sequence([1, 2, 3], SamplingParams(max_tokens=10), eos_token_id=0, max_model_len=4)
    for seq in (eos, stop_id, ignore, length):
        scheduler.add(seq)
    finished = scheduler.postprocess(scheduler.schedule(), [0, 9, 0, 5])
    assert finished == [eos, stop_id, length]
    assert [s.finish_reason for s in finished] == ["stop", "stop", "length"]
    assert not ignore.is_finished
