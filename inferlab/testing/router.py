"""Conformance tests for a router plugin, through public interfaces only.

    from inferlab.testing import RouterSuite

    class TestMyRouter(RouterSuite):
        router = "my_router"        # the name it is registered under
        router_options = {}          # its options, if any

A hypothesis state machine routes requests (sharing prefixes now and then) over a few replicas
whose views change under it: queues grow and drain, KV blocks fill, prefixes get cached, time
passes, replicas die (and are no longer offered). Every answer must be one of the views offered;
an ObservingRouter sees each request end; a PairRouter's route_pair answers one offered prefill
view and one offered decode view. Then the router runs in a cluster of engines on the embedded model,
colocated and disaggregated: every request completes with the tokens a lone engine gives.
"""

import random
from collections import Counter
from itertools import count

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from inferlab.core.blocks import block_hashes
from inferlab.core.plugins import get_registry
from inferlab.core.protocols import ClusterState, ObservingRouter, PairRouter
from inferlab.core.request import Request, RequestStatus
from inferlab.core.routing import ReplicaView, RoutedRequest, cached_prefix_from_names
from inferlab.core.sampling_params import SamplingParams
from inferlab.testing.common import run_machine

TOKENS = st.integers(0, 3)  # a tiny alphabet: prompts share blocks often
TENANTS = ("a", "b", "c")


class FakeReplica:
    """A replica's record (inferlab.core.routing.ReplicaState) that the machine changes by hand."""

    def __init__(self, replica_id: int, block_size: int, num_blocks: int):
        self.replica_id = replica_id
        self.role = None  # the machine's pairs give its replicas roles for one routing
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_free_blocks = num_blocks
        self.num_waiting = 0
        self.num_running = 0
        self.num_queued_prompt_tokens = 0
        self.num_outstanding_tokens = 0
        self.cached: set[int] = set()

    def cached_prefix_tokens(self, request: RoutedRequest) -> int:
        return cached_prefix_from_names(request, self.block_size, self.cached)


class RouterMachine(RuleBasedStateMachine):
    """The state machine; RouterSuite runs it against a registered router."""

    router = "round_robin"
    router_options: dict = {}
    seen = Counter()

    def __init__(self):
        super().__init__()
        self.ids = count()
        self.now = 0.0
        self.rng = random.Random(0)
        self.routed: list[tuple[RoutedRequest, FakeReplica]] = []  # in flight
        self.prompts: list[list[int]] = []

    @initialize(num_replicas=st.integers(1, 6), block_size=st.sampled_from([2, 4]), num_blocks=st.integers(4, 64))
    def make_router(self, num_replicas, block_size, num_blocks):
        self.instance = get_registry().create("router", self.router, options=self.router_options)
        self.observing = isinstance(self.instance, ObservingRouter)
        self.replicas = [FakeReplica(i, block_size, num_blocks) for i in range(num_replicas)]
        self.views = [ReplicaView(r) for r in self.replicas]
        self.alive = [True] * num_replicas

    def state(self) -> ClusterState:
        return ClusterState(now=self.now, num_routed=next(self.ids), num_replicas=len(self.replicas))

    @rule(data=st.data())
    def route(self, data):
        prefix = []
        if self.prompts and data.draw(st.booleans(), label="share a prefix"):
            base = data.draw(st.sampled_from(self.prompts))
            prefix = base[: data.draw(st.integers(0, len(base)))]
        tokens = prefix + data.draw(st.lists(TOKENS, min_size=0 if prefix else 1, max_size=20))
        self.prompts.append(tokens)
        params = SamplingParams(max_tokens=data.draw(st.integers(1, 16)))
        request = Request(
            len(self.prompts),
            tokens,
            params,
            arrival_time=self.now,
            priority=data.draw(st.integers(-2, 2), label="priority"),
            metadata={"tenant": self.rng.choice(TENANTS)},
        )
        offered = tuple(v for v, alive in zip(self.views, self.alive) if alive)
        routed = RoutedRequest(request)
        choice = self.instance.route(routed, offered, self.state())
        assert any(choice is view for view in offered), (
            f"router {self.router!r} returned {choice!r}, which is not one of the replicas offered {offered}"
        )
        replica = choice._replica
        replica.num_waiting += 1
        replica.num_queued_prompt_tokens += len(tokens)
        replica.num_outstanding_tokens += len(tokens) + params.max_tokens
        self.routed.append((routed, replica))
        self.seen["routed"] += 1
        if len(offered) < len(self.views):
            self.seen["a replica not offered"] += 1

    @rule(data=st.data())
    def route_pair(self, data):
        """A disaggregated cluster's question, over the offered replicas split into roles."""
        offered = tuple(v for v, alive in zip(self.views, self.alive) if alive)
        if not isinstance(self.instance, PairRouter) or len(offered) < 2:
            return
        split = data.draw(st.integers(1, len(offered) - 1), label="prefill replicas")
        prefill, decode = offered[:split], offered[split:]
        for view in offered:
            view._replica.role = "prefill" if view in prefill else "decode"
        tokens = data.draw(st.lists(TOKENS, min_size=1, max_size=20))
        request = Request(10_000 + len(self.prompts), tokens, SamplingParams(max_tokens=4), arrival_time=self.now)
        answer = self.instance.route_pair(RoutedRequest(request), prefill, decode, self.state())
        for view in offered:
            view._replica.role = None
        assert isinstance(answer, tuple) and len(answer) == 2, f"route_pair returned {answer!r}, not a pair"
        assert any(answer[0] is v for v in prefill) and any(answer[1] is v for v in decode), (
            f"router {self.router!r}: route_pair returned {answer!r}, not (one of {prefill}, one of {decode})"
        )
        self.seen["pair"] += 1

    @precondition(lambda self: self.routed)
    @rule(data=st.data())
    def run(self, data):
        """A routed request is admitted: its prompt is computed and cached, its blocks held."""
        routed, replica = data.draw(st.sampled_from(self.routed))
        request = routed._request
        if request.status is not RequestStatus.WAITING:
            return
        request.status = RequestStatus.RUNNING
        replica.num_waiting -= 1
        replica.num_running += 1
        replica.num_queued_prompt_tokens -= request.num_prompt_tokens
        replica.num_outstanding_tokens -= request.num_prompt_tokens
        needed = -(-request.num_prompt_tokens // replica.block_size)
        replica.num_free_blocks = max(0, replica.num_free_blocks - needed)
        replica.cached.update(
            block_hashes(request.token_ids, replica.block_size, request.num_prompt_tokens // replica.block_size)
        )

    @precondition(lambda self: self.routed)
    @rule(data=st.data(), reason=st.sampled_from(["stop", "length", "abort", "error"]))
    def finish(self, data, reason):
        index = data.draw(st.integers(0, len(self.routed) - 1))
        routed, replica = self.routed.pop(index)
        request = routed._request
        if request.status is RequestStatus.WAITING:
            replica.num_waiting -= 1
            replica.num_queued_prompt_tokens -= request.num_prompt_tokens
            replica.num_outstanding_tokens -= request.num_prompt_tokens
        else:
            replica.num_running -= 1
            replica.num_free_blocks = min(replica.num_blocks, replica.num_free_blocks + 1)
        replica.num_outstanding_tokens -= request.params.max_tokens
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if self.observing:
            self.instance.observe(routed, self.views[replica.replica_id], self.state())
            self.seen["observed"] += 1

    @rule(seconds=st.floats(0, 300))
    def wait(self, seconds):
        self.now += seconds

    @precondition(lambda self: sum(self.alive) > 1)
    @rule(data=st.data())
    def kill(self, data):
        """A replica dies: it is offered no more, and its requests end with an error."""
        victim = data.draw(st.sampled_from([i for i, alive in enumerate(self.alive) if alive]))
        self.alive[victim] = False
        for routed, replica in [item for item in self.routed if item[1].replica_id == victim]:
            self.routed.remove((routed, replica))
            routed._request.status = RequestStatus.FINISHED
            routed._request.finish_reason = "error"
            if self.observing:
                self.instance.observe(routed, self.views[victim], self.state())


class RouterSuite:
    """Subclass with `router` (a registered name) and optionally `router_options`; pytest collects
    the subclass's tests."""

    router: str = "round_robin"
    router_options: dict = {}
    machine: type = RouterMachine
    hypothesis_settings = settings(max_examples=100, stateful_step_count=40, deadline=None, derandomize=True)

    def test_state_machine(self):
        seen = run_machine(
            self.machine, self.hypothesis_settings, router=self.router, router_options=self.router_options
        )
        assert seen["routed"] > 0 and seen["a replica not offered"] > 0
        if isinstance(get_registry().create("router", self.router, options=self.router_options), PairRouter):
            assert seen["pair"] > 0

    def test_serves_a_cluster(self):
        """The router in front of three engines on the embedded model, prompts sharing prefixes:
        every request gets exactly its max_tokens, with the tokens a lone greedy run gives."""
        from inferlab import LLM, Cluster

        rng = random.Random(2)
        stems = [[rng.randrange(3, 300) for _ in range(40)] for _ in range(3)]
        prompts = [
            rng.choice(stems)[: rng.randrange(8, 40)] + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 9))]
            for _ in range(8)
        ]
        params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 6), ignore_eos=True) for _ in prompts]
        settings_ = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=12, max_num_seqs=4)
        with Cluster(replicas=3, router=self.router, router_options=self.router_options, **settings_) as cluster:
            outputs = cluster.generate(prompts, params, use_tqdm=False)
            assert cluster.is_finished()
            served = Counter(cluster.replica_of(i) for i in range(len(prompts)))
        assert sum(served.values()) == len(prompts)
        with Cluster(
            prefill_replicas=1, decode_replicas=2, router=self.router, router_options=self.router_options, **settings_
        ) as cluster:
            split = cluster.generate(prompts, params, use_tqdm=False)
        with LLM(**settings_) as alone:
            for prompt, p, out, out_split in zip(prompts, params, outputs, split):
                assert out["finish_reason"] == "length" and len(out["token_ids"]) == p.max_tokens
                assert out["token_ids"] == alone.generate([prompt], p, use_tqdm=False)[0]["token_ids"]
                assert out_split["token_ids"] == out["token_ids"], "prefill on one replica, decode on another"
