"""Conformance tests for a scheduler policy plugin, through public interfaces only.

    from inferlab.testing import SchedulerPolicySuite

    class TestMyPolicy(SchedulerPolicySuite):
        scheduler = "my_policy"        # the name it is registered under
        scheduler_options = {}          # its options, if any

A hypothesis state machine runs the core scheduler with the policy over a small paged KV cache
(so that requests are preempted and recomputed), the way the engine does: requests arriving with
random priorities and metadata, steps with and without overlap scheduling (placeholder tokens),
steps interrupted before they compute, aborts and stops. After every step it checks the batch
limits, that every request reads its own prefix and that no KV block is lost; at the end, that
every request finishes. A second test runs the policy in an engine on the embedded model.
"""

import random
from collections import Counter
from itertools import count

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inferlab.core.config import EngineConfig
from inferlab.core.plugins import get_registry
from inferlab.core.protocols import BudgetPolicy, FixedAdmissionOrder, PureAdmissionOrder, SchedulerState
from inferlab.core.request import Request, RequestStatus, RequestView
from inferlab.core.sampling_params import SamplingParams
from inferlab.core.scheduler import Scheduler
from inferlab.testing.common import assert_blocks_accounted, assert_own_prefixes, ceil_div, run_machine

EOS = 0
TOKENS = st.integers(0, 3)  # a tiny alphabet: shared prefixes, repeated blocks, and EOS now and then
MAX_MODEL_LEN = 48
TENANTS = ("a", "b", "c")


def request_metadata(rng: random.Random, arrival: float) -> dict:
    """What the suite's requests carry: a tenant and a deadline, for policies that read them."""
    return {"tenant": rng.choice(TENANTS), "deadline": arrival + rng.uniform(0.5, 20.0)}


class SchedulerMachine(RuleBasedStateMachine):
    """The state machine; SchedulerPolicySuite runs it against a registered policy."""

    scheduler = "fcfs"
    scheduler_options: dict = {}
    kv_cache = "paged"
    seen = Counter()

    def __init__(self):
        super().__init__()
        self.ids = count()
        self.now = 0.0
        self.live: list[Request] = []  # added, not yet reported finished
        self.all: list[Request] = []
        self.content: dict[int, tuple[int, ...]] = {}  # block -> the token prefix whose K/V it holds
        self.pending = None  # (appended, tokens) of a launched step not yet resolved (overlap)

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
        self.kv = registry.create("kv_cache", self.kv_cache, self.config, num_blocks)
        policy = registry.create("scheduler", self.scheduler, options=self.scheduler_options)
        self.budgeted = isinstance(policy, BudgetPolicy)
        self.core = Scheduler(
            self.config, self.kv, policy, policy_name=self.scheduler, clock=lambda: self.now, decode=str
        )
        self.bs = block_size
        self.rng = random.Random(0)

    # -- rules ------------------------------------------------------------------------------

    @rule(data=st.data(), num_requests=st.integers(1, 3))
    def add(self, data, num_requests):
        for _ in range(num_requests):
            prefix = []
            if self.all and data.draw(st.booleans(), label="share a prefix"):
                base = data.draw(st.sampled_from(self.all)).token_ids
                prefix = [t for t in base[: data.draw(st.integers(0, len(base)))] if t >= 0]
            tokens = (prefix + data.draw(st.lists(TOKENS, max_size=24)))[:MAX_MODEL_LEN]
            params = SamplingParams(max_tokens=data.draw(st.integers(1, 10)), ignore_eos=data.draw(st.booleans()))
            most = max(len(tokens), min(len(tokens) + params.max_tokens, MAX_MODEL_LEN) - 1)
            if not tokens or not self.kv.could_ever_fit(most):
                continue  # the engine rejects it before it reaches the scheduler
            request = Request(
                next(self.ids),
                tokens,
                params,
                arrival_time=self.now,
                priority=data.draw(st.integers(-2, 2), label="priority"),
                metadata=request_metadata(self.rng, self.now),
                eos_token_id=EOS,
                max_model_len=MAX_MODEL_LEN,
            )
            self.core.add(request)
            self.live.append(request)
            self.all.append(request)

    @rule(data=st.data(), overlap=st.booleans())
    def step(self, data, overlap):
        self._step(
            lambda: data.draw(TOKENS, label="sampled"),
            overlap=overlap,
            interrupted=data.draw(st.integers(0, 9), label="interrupted") == 0,
        )

    def _step(self, sample, overlap=False, interrupted=False) -> bool:
        """One engine step (schedule, compute, resolve the previous step under overlap, advance);
        False when there was nothing to do."""
        self.now += 0.25
        scheduler = self.core
        preemptions = scheduler.num_preemptions
        batch = scheduler.schedule()
        self.seen["preemption"] += scheduler.num_preemptions > preemptions
        if not batch.requests and self.pending is None:
            assert not scheduler.has_unfinished(), "requests are pending but the scheduler scheduled nothing"
            return False
        assert len(batch.requests) == len(set(map(id, batch.requests))) <= self.config.max_num_seqs
        if not self.budgeted:
            assert batch.total_tokens <= self.config.max_num_batched_tokens
        for request, num_tokens, table in zip(batch.requests, batch.num_scheduled_tokens, batch.block_tables):
            assert request.status is RequestStatus.RUNNING and request in self.live
            assert 1 <= num_tokens <= request.num_tokens - request.num_computed_tokens
            assert len(table) * self.bs >= request.num_computed_tokens + num_tokens
        if interrupted:  # the forward pass raised: nothing computed, nothing advanced
            self.seen["interrupted"] += 1
            return True
        # The runner reads the batch as scheduled, before the previous step's tokens resolve: a
        # request that a stop token ends then still writes this step's K/V into its own blocks.
        writes = [
            (request, request.num_computed_tokens, request.num_computed_tokens + n, list(table))
            for request, n, table in zip(batch.requests, batch.num_scheduled_tokens, batch.block_tables)
        ]
        sampled = [sample() if end == request.num_tokens else None for request, _, end, _ in writes]
        if self.pending is not None:  # the previous step's tokens become known while this one runs
            self._report(scheduler.resolve(*self.pending))
            self.pending = None
        for request, start, end, table in writes:
            for i in range(start // self.bs, ceil_div(end, self.bs)):  # the runner writes K/V
                self.content[table[i]] = tuple(request.token_ids[: min((i + 1) * self.bs, end)])
        if overlap:
            placeholders = [None if t is None else -(k + 1) for k, t in enumerate(sampled)]
            self.pending = (scheduler.advance(batch, placeholders), sampled)
            self.seen["overlap"] += 1
        else:
            self._report(scheduler.resolve(scheduler.advance(batch, sampled), sampled))
        return True

    def _report(self, finished: list[Request]) -> None:
        for request in finished:
            assert request.is_finished and request.finish_reason in ("stop", "length")
            assert not self.kv.block_table(request) and request.finish_time is not None
            assert all(t >= 0 for t in request.token_ids), "a finished request kept a placeholder"
            self.live.remove(request)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        request = data.draw(st.sampled_from(self.live))
        if request.is_finished:
            return  # finished by length, reported when its token resolves
        assert self.core.abort(request) and not self.core.abort(request)
        assert request.finish_reason == "abort" and not self.kv.block_table(request)
        self.live.remove(request)

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def queues_hold_the_live_requests(self):
        if not hasattr(self, "core"):
            return
        unfinished = [r for r in self.live if not r.is_finished]
        assert self.core.has_unfinished() == bool(unfinished)
        assert sum(r.status is RequestStatus.RUNNING for r in unfinished) <= self.config.max_num_seqs
        for request in unfinished:
            if request.status is RequestStatus.WAITING:  # recompute preemption: it holds nothing
                assert not self.kv.block_table(request) and request.num_computed_tokens == 0
        assert self.core.num_preemptions == sum(r.num_preemptions for r in self.all)

    @invariant()
    def no_block_lost(self):
        if hasattr(self, "core"):
            assert_blocks_accounted(self.kv, self.live, self.bs)

    @invariant()
    def requests_read_their_own_prefix(self):
        if hasattr(self, "core"):
            assert_own_prefixes(self.kv, self.live, self.bs, self.content)

    def teardown(self):
        """Every request finishes. With recompute preemption a policy could in principle thrash;
        the bound allows each request to be recomputed many times over."""
        if not hasattr(self, "core"):
            return
        bound = 8 * sum(r.num_prompt_tokens + r.params.max_tokens for r in self.live) + 20
        tokens = iter(range(1, 10**9))
        for _ in range(bound):
            if not self._step(lambda: 1 + next(tokens) % 3):  # never EOS: run to max_tokens or max_model_len
                break
            self.queues_hold_the_live_requests()
            self.no_block_lost()
            self.requests_read_their_own_prefix()
        assert not self.live, f"{len(self.live)} requests still pending after {bound} steps"
        assert self.kv.num_free_blocks == self.kv.num_blocks
        for request in self.all:
            assert request.is_finished and not self.kv.block_table(request)
            if request.finish_reason == "length":
                assert request.num_output_tokens == request.params.max_tokens or request.num_tokens >= MAX_MODEL_LEN


class SchedulerPolicySuite:
    """Subclass with `scheduler` (a registered name) and optionally `scheduler_options`; pytest
    collects the subclass's tests."""

    scheduler: str = "fcfs"
    scheduler_options: dict = {}
    machine: type = SchedulerMachine
    hypothesis_settings = settings(max_examples=150, stateful_step_count=50, deadline=None, derandomize=True)

    def test_state_machine(self):
        seen = run_machine(
            self.machine, self.hypothesis_settings, scheduler=self.scheduler, scheduler_options=self.scheduler_options
        )
        assert seen["preemption"] > 0 and seen["interrupted"] > 0 and seen["overlap"] > 0

    def test_admission_order_keeps_its_declarations(self):
        """A PureAdmissionOrder policy gives the same order when asked again with the same
        arguments (a simulated run skips calls on that promise), and a FixedAdmissionOrder one the
        same order whatever the state (a run asks it once): checked on random waiting queues."""
        registry = get_registry()
        policy = registry.create("scheduler", self.scheduler, options=self.scheduler_options)
        config = EngineConfig(kvcache_block_size=16, max_model_len=MAX_MODEL_LEN)
        kv = registry.create("kv_cache", "paged", config, 64)
        pure = isinstance(policy, PureAdmissionOrder) and policy.admission_order_is_pure
        fixed = pure and isinstance(policy, FixedAdmissionOrder) and policy.admission_order_is_fixed
        if not pure:
            import pytest

            pytest.skip(f"scheduler {self.scheduler!r} does not declare PureAdmissionOrder")
        rng = random.Random(3)
        for trial in range(50):
            waiting = []
            for i in range(rng.randrange(1, 12)):
                params = SamplingParams(max_tokens=rng.randrange(1, 8), ignore_eos=True)
                request = Request(i, [rng.randrange(1, 4) for _ in range(rng.randrange(1, 40))], params)
                request.arrival_time = rng.uniform(0.0, 5.0)
                request.priority = rng.randrange(-2, 3)
                request.metadata = request_metadata(rng, request.arrival_time)
                waiting.append(request)
            views = tuple(RequestView(request, kv) for request in waiting)
            states = [SchedulerState(6.0, trial, (), len(views), 32, 64, 16, 8, 256)] * 2
            if fixed:
                states.append(
                    SchedulerState(rng.uniform(6, 60), trial + 7, (), len(views), rng.randrange(64), 64, 16, 8, 256)
                )
            first, *others = ([view.request_id for view in policy.admission_order(views, st)] for st in states)
            assert others[0] == first, "admission_order is declared pure but changed its answer"
            assert others[1:] in ([], [first]), "admission_order is declared fixed but its order followed the state"

    def test_serves_an_engine(self):
        """The policy in an engine on the embedded model, with a KV cache small enough to preempt:
        every request gets exactly its max_tokens, with the tokens a lone greedy run gives."""
        from inferlab import LLM

        rng = random.Random(1)
        prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(10, 48))] for _ in range(12)]
        params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 12), ignore_eos=True) for _ in prompts]
        metadata = [request_metadata(rng, 0.0) for _ in prompts]
        settings_ = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=5, max_num_seqs=4)
        with LLM(
            scheduler=self.scheduler, scheduler_options=self.scheduler_options, max_num_batched_tokens=32, **settings_
        ) as llm:
            outputs = llm.generate(
                prompts, params, use_tqdm=False, priority=[rng.randrange(-2, 3) for _ in prompts], metadata=metadata
            )
            assert llm.is_finished() and llm.kv_manager.num_free_blocks == llm.kv_manager.num_blocks
            assert llm.stats.num_preemptions > 0, "the cache was meant to be small enough to preempt"
        with LLM(**settings_) as alone:
            for prompt, p, out in zip(prompts, params, outputs):
                assert out["finish_reason"] == "length" and len(out["token_ids"]) == p.max_tokens
                assert out["token_ids"] == alone.generate([prompt], p, use_tqdm=False)[0]["token_ids"]
