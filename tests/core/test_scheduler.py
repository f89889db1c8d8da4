"""The core scheduler carries out a policy's decisions: budgets, chunked prefill, KV allocation,
recompute preemption, finishing, and the checks on what a policy returns. Driven without a model."""

import pytest

from inferlab.core.config import EngineConfig
from inferlab.core.plugins import get_registry
from inferlab.core.request import Request, RequestStatus
from inferlab.core.sampling_params import SamplingParams
from inferlab.core.scheduler import PolicyError, Scheduler
from inferlab.plugins.kv_cache.paged import PagedKVCache

BS = 16


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(policy="fcfs", num_blocks=16, decode=None, **settings):
    config = EngineConfig(kvcache_block_size=BS, **settings)
    kv = PagedKVCache(config, num_blocks)
    if isinstance(policy, str):
        policy = get_registry().create("scheduler", policy)
    clock = Clock()
    decode = decode or (lambda ids: " ".join(map(str, ids)))
    scheduler = Scheduler(config, kv, policy, policy_name="test", clock=clock, decode=decode)
    return scheduler, kv, clock


def request(i, tokens, priority=0, eos=None, max_model_len=None, arrival=0.0, **params):
    return Request(
        i,
        list(tokens),
        SamplingParams(**params),
        priority=priority,
        eos_token_id=eos,
        max_model_len=max_model_len,
        arrival_time=arrival,
    )


def step(scheduler, sample=1):
    """One step without overlap: schedule, then advance and resolve with `sample` as every new token."""
    batch = scheduler.schedule()
    tokens = [
        sample if r.num_computed_tokens + n == r.num_tokens else None
        for r, n in zip(batch.requests, batch.num_scheduled_tokens)
    ]
    finished = scheduler.resolve(scheduler.advance(batch, tokens), tokens)
    return batch, finished


def test_preemption_recomputes_the_newest_first():
    scheduler, kv, _ = make(num_blocks=4)
    a = request(0, range(32), max_tokens=20, ignore_eos=True)
    b = request(1, range(100, 132), max_tokens=20, ignore_eos=True)
    scheduler.add(a)
    scheduler.add(b)
    batch, _ = step(scheduler)  # each now holds two full blocks and needs a third; none is free
    assert batch.requests == [a, b]
    batch = scheduler.schedule()
    assert batch.requests == [a] and scheduler.num_preemptions == 1 and b.num_preemptions == 1
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and not kv.block_table(b)
    assert scheduler.waiting[0] is b


def test_running_requests_go_first_and_the_last_admitted_gets_a_chunk():
    scheduler, _, _ = make(num_blocks=32, max_num_batched_tokens=40)
    first = request(0, range(30), max_tokens=5)
    scheduler.add(first)
    step(scheduler, sample=7)
    second = request(1, range(200, 260), max_tokens=5)
    scheduler.add(second)
    batch = scheduler.schedule()
    assert batch.requests == [first, second] and batch.num_scheduled_tokens == [1, 39]


def test_max_num_seqs_limits_admission():
    scheduler, _, _ = make(num_blocks=32, max_num_seqs=2)
    for i in range(5):
        scheduler.add(request(i, [i + 1] * 5))
    assert len(scheduler.schedule()) == 2


def test_abort_and_finish_free_the_blocks_wherever_the_request_is():
    scheduler, kv, clock = make(num_blocks=8, max_num_seqs=1)
    running, waiting = request(0, range(40)), request(1, range(10))
    scheduler.add(running)
    scheduler.add(waiting)
    scheduler.schedule()
    clock.now = 2.5
    assert scheduler.abort(running) and running.finish_reason == "abort" and running.finish_time == 2.5
    assert scheduler.abort(waiting) and not scheduler.abort(waiting)
    assert not scheduler.has_unfinished() and kv.num_free_blocks == kv.num_blocks


def test_stop_conditions_are_decided_in_one_place():
    scheduler, _, _ = make(decode=lambda ids: "".join(chr(97 + t) for t in ids))
    eos = request(0, [1, 2, 3], eos=0, max_tokens=10)
    stop_id = request(1, [1, 2, 3], eos=0, max_tokens=10, stop_token_ids=[9])
    ignore = request(2, [1, 2, 3], eos=0, max_tokens=10, ignore_eos=True)
    length = request(3, [1, 2, 3], eos=0, max_model_len=4, max_tokens=10)
    stop_string = request(4, [1, 2, 3], eos=0, max_tokens=10, stop=["hf"])  # tokens 7, 5 decode to "hf"
    for r in (eos, stop_id, ignore, length, stop_string):
        scheduler.add(r)
    batch = scheduler.schedule()
    tokens = [0, 9, 0, 5, 7]
    finished = scheduler.resolve(scheduler.advance(batch, tokens), tokens)
    assert finished == [eos, stop_id, length]
    assert [r.finish_reason for r in finished] == ["stop", "stop", "length"]
    batch = scheduler.schedule()
    tokens = [4 if r is ignore else 5 for r in batch.requests]
    assert scheduler.resolve(scheduler.advance(batch, tokens), tokens) == [stop_string]
    assert stop_string.finish_reason == "stop" and not ignore.is_finished


def test_overlap_placeholders_resolve_and_length_stops_at_once():
    """Under overlap, advance appends placeholders; a request at max_tokens finishes then (so it
    is not scheduled again) and is reported when resolve fills its token; an EOS decides 'stop'."""
    scheduler, kv, clock = make()
    short = request(0, [1, 2], eos=0, max_tokens=1)
    long = request(1, [3, 4], eos=0, max_tokens=5)
    scheduler.add(short)
    scheduler.add(long)
    batch = scheduler.schedule()
    appended = scheduler.advance(batch, [-1, -2])
    assert short.is_finished and short.finish_reason == "length" and not kv.block_table(short)
    assert long.token_ids[-1] == -2
    clock.now = 1.0
    next_batch = scheduler.schedule()  # launched before the placeholders are known
    assert next_batch.requests == [long]
    assert scheduler.resolve(appended, [0, 8]) == [short]
    assert short.finish_reason == "stop" and short.token_ids == [1, 2, 0]
    assert long.token_ids == [3, 4, 8] and long.token_times == [1.0] and long.first_token_time == 1.0


def test_timings_are_recorded():
    scheduler, _, clock = make(max_num_batched_tokens=4)
    r = request(0, range(6), arrival=0.5, max_tokens=2, ignore_eos=True)
    scheduler.add(r)
    clock.now = 1.0
    step(scheduler)  # a chunk of 4: no token yet
    assert r.first_scheduled_time == 1.0 and r.token_times == []
    clock.now = 2.0
    step(scheduler)
    clock.now = 3.0
    _, finished = step(scheduler)
    assert finished == [r] and r.token_times == [2.0, 3.0] and r.finish_time == 3.0


class Declining:
    def admission_order(self, waiting, state):
        return []

    def preemption_victim(self, running, state):
        return running[-1]


class Foreign:
    """Returns views that are not the ones it was given."""

    def __init__(self):
        self.other = make()[0]

    def admission_order(self, waiting, state):
        stranger = request(99, [1])
        self.other.add(stranger)
        return [stranger.view]

    def preemption_victim(self, running, state):
        return running[0]


def test_a_policy_may_decline_to_admit():
    scheduler, _, _ = make(Declining())
    scheduler.add(request(0, [1, 2]))
    assert not scheduler.schedule().requests and len(scheduler.waiting) == 1


def test_a_policy_returning_a_foreign_request_is_an_error():
    scheduler, _, _ = make(Foreign())
    scheduler.add(request(0, [1, 2]))
    with pytest.raises(PolicyError, match="scheduler 'test': admission_order returned .* not one of the waiting"):
        scheduler.schedule()


class Returning:
    """Returns whatever it was built with from admission_order."""

    def __init__(self, make_order):
        self.make_order = make_order

    def admission_order(self, waiting, state):
        return self.make_order(waiting)

    def preemption_victim(self, running, state):
        return running[-1]


def test_an_admission_order_that_is_not_a_list_of_views_is_an_error_naming_the_policy():
    scheduler, _, _ = make(Returning(lambda waiting: None))
    scheduler.add(request(0, [1, 2]))
    with pytest.raises(PolicyError, match="scheduler 'test': admission_order returned None, not the waiting"):
        scheduler.schedule()
    assert len(scheduler.waiting) == 1 and not scheduler.running


def test_a_request_listed_twice_is_an_error_that_says_so_and_leaves_the_queues_consistent():
    scheduler, _, _ = make(Returning(lambda waiting: [waiting[0], waiting[1], waiting[0]]))
    for i in range(3):
        scheduler.add(request(i, [1, 2]))
    with pytest.raises(PolicyError, match="scheduler 'test': admission_order listed request 0 twice"):
        scheduler.schedule()
    # the two admitted before the repeat are running, and no longer waiting
    assert [r.request_id for r in scheduler.running] == [0, 1]
    assert [r.request_id for r in scheduler.waiting] == [2]


class SmallSteps:
    """A BudgetPolicy: 8 tokens a step, prefill chunks of at most 3."""

    def admission_order(self, waiting, state):
        return waiting

    def preemption_victim(self, running, state):
        return running[-1]

    def token_budget(self, state):
        return 8

    def chunk_size(self, request, budget_left):
        return 3


def test_a_budget_policy_sets_the_budget_and_chunks():
    scheduler, _, _ = make(SmallSteps())
    for i in range(4):
        scheduler.add(request(i, range(10)))
    batch = scheduler.schedule()
    assert batch.num_scheduled_tokens == [3, 3, 2]


def test_a_victim_already_scheduled_is_taken_out_of_the_step():
    """A policy may preempt a request that was scheduled earlier in the same step: it leaves the
    batch and its tokens go back to the budget."""

    class OldestVictim:
        def admission_order(self, waiting, state):
            return waiting

        def preemption_victim(self, running, state):
            return running[0]

    scheduler, kv, _ = make(OldestVictim(), num_blocks=4)
    a = request(0, range(32), max_tokens=20, ignore_eos=True)
    b = request(1, range(100, 132), max_tokens=20, ignore_eos=True)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    batch = scheduler.schedule()  # a is scheduled, then b needs a block and a is the victim
    assert batch.requests == [b] and batch.num_scheduled_tokens == [1]
    assert a.status is RequestStatus.WAITING and not kv.block_table(a) and a.num_preemptions == 1


def test_views_are_read_only():
    scheduler, _, _ = make()
    r = request(0, [1, 2, 3], priority=2)
    r.metadata["tenant"] = "a"
    scheduler.add(r)
    view = r.view
    assert (view.request_id, view.priority, view.num_prompt_tokens, view.status) == (0, 2, 3, "waiting")
    with pytest.raises(AttributeError):
        view.priority = 0
    with pytest.raises(TypeError):
        view.metadata["tenant"] = "b"


def test_a_block_aligned_manager_is_asked_to_allocate_and_commit_only_where_a_row_leaves_or_fills_a_block():
    """With a BlockAligned KV manager, a running request whose new tokens stay in the block of its
    last computed token is not asked to allocate (the call would change nothing), and a commit is
    asked only of a request whose step filled a block; the books are those of asking every time."""
    books = []
    for stride in (BS, 0):  # 0: every request asked every step
        scheduler, kv, _ = make(num_blocks=16)
        scheduler.commit_stride = stride
        calls = {"allocate": [], "commit": []}
        kv.allocate, kv.commit = counted(kv.allocate, calls["allocate"]), counted(kv.commit, calls["commit"])
        requests = [request(i, range(n), max_tokens=40, ignore_eos=True) for i, n in ((0, 20), (1, 30))]
        for r in requests:
            scheduler.add(r)
        for _ in range(30):
            step(scheduler)
        books.append(([(r.token_ids, r.num_computed_tokens) for r in requests], dict(kv.tables), dict(kv.cached)))
        # the prompts (20 and 30 tokens) are computed in the first step, then each step computes one token a
        # request: the one at c computed goes past its block where c is a multiple of BS, fills one where c + 1 is
        decodes = [(i, c) for k in range(29) for i, c in ((0, 20 + k), (1, 30 + k))]
        if stride:
            assert calls["allocate"] == [(0, 0), (1, 0)] + [(i, c) for i, c in decodes if c % BS == 0]
            assert calls["commit"] == [(0, 20), (1, 30)] + [(i, c + 1) for i, c in decodes if (c + 1) % BS == 0]
        else:
            assert calls["allocate"] == [(0, 0), (1, 0), *decodes]
            assert calls["commit"] == [(0, 20), (1, 30)] + [(i, c + 1) for i, c in decodes]
    assert books[0] == books[1]


def counted(method, calls: list):
    """method, listing (request id, tokens computed) of each call's request first."""

    def call(request, *args):
        calls.append((request.request_id, request.num_computed_tokens))
        return method(request, *args)

    return call
