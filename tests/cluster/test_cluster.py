"""A cluster of local replicas behind a router: the engine's surface (add_request, step, abort,
generate), routing failures failing one request alone, what routers see, and the simulated fleet
on virtual clocks (one replica is the single engine exactly; events in time order; deterministic)."""

import dataclasses
import types

import pytest

from inferlab import LLM, Cluster, SamplingParams
from inferlab.core import engine as engine_module
from inferlab.core.blocks import block_hashes
from inferlab.core.engine import EngineStats, RequestTooLargeError
from inferlab.core.hookspecs import hookimpl
from inferlab.core.plugins import PluginError, PluginRegistry
from inferlab.core.protocols import CachedPrefixLookup
from inferlab.core.routing import ReplicaView
from inferlab.experiment.driver import run_workload
from inferlab.experiment.workload import WorkloadRequest
from inferlab.plugins.kv_cache.paged import PagedKVCache

CPU = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=16)
SIM = dict(executor="simulated", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=1024)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def registry_with(**routers) -> PluginRegistry:
    """The installed plugins plus these routers (name -> class)."""
    registry = PluginRegistry()

    @hookimpl
    def register_routers(register):
        for name, cls in routers.items():
            register(name, cls)

    registry.register(types.SimpleNamespace(register_routers=register_routers), name="test_routers")
    return registry


class Recording:
    """Routes round robin and records what it saw and what ended."""

    seen: list = []
    ended: list = []

    def __init__(self):
        self.next = 0

    def route(self, request, replicas, state):
        Recording.seen.append(
            (
                request.request_id,
                state.now,
                [(r.replica_id, r.num_waiting, r.num_queued_prompt_tokens, r.num_outstanding_tokens) for r in replicas],
            )
        )
        choice = replicas[self.next % len(replicas)]
        self.next += 1
        return choice

    def observe(self, request, replica, state):
        Recording.ended.append((request.request_id, replica.replica_id, request.finish_reason))


class Faulty:
    """Raises for odd request ids, answers a view it was not offered for ids divisible by 4."""

    def route(self, request, replicas, state):
        if request.request_id % 2:
            raise RuntimeError("odd requests are not welcome")
        if request.request_id % 4 == 0 and request.request_id:
            return ReplicaView(replicas[0]._replica)  # a view of a replica, but not one it was offered
        return replicas[0]


def workload(num_requests: int, rate: float = 40.0, prompt_len: int = 40, shared: int = 32) -> list[WorkloadRequest]:
    import random

    rng = random.Random(5)
    stem = [rng.randrange(3, 380) for _ in range(shared)]
    t, requests = 0.0, []
    for i in range(num_requests):
        t += rng.expovariate(rate)
        prompt = stem + [rng.randrange(3, 380) for _ in range(prompt_len - shared)]
        requests.append(WorkloadRequest(i, t, prompt, rng.randrange(4, 40)))
    return requests


def run(llm, requests):
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in requests]
    return run_workload(llm, requests, params)


def test_a_router_that_raises_or_answers_wrong_fails_that_request_alone():
    with Cluster(replicas=2, router="faulty", registry=registry_with(faulty=Faulty), **CPU) as cluster:
        outputs = cluster.generate([[5, 6, 7, 8]] * 6, GREEDY, use_tqdm=False)
        assert cluster.is_finished()
    assert [o["finish_reason"] for o in outputs] == ["length", "error", "length", "error", "error", "error"]
    assert (
        "PolicyError: router 'faulty': route raised RuntimeError: odd requests are not welcome" in outputs[1]["error"]
    )
    assert "PolicyError: router 'faulty': route returned ReplicaView(0" in outputs[4]["error"]
    assert "which is not one of the replicas offered (replica_ids [0, 1])" in outputs[4]["error"]
    assert outputs[0]["token_ids"] == outputs[2]["token_ids"] and len(outputs[0]["token_ids"]) == 4


@pytest.mark.parametrize(
    ("router", "options", "message"),
    [
        ("no_such_router", {}, "unknown router 'no_such_router'"),
        ("kv_aware", {"overlap_weight": "heavy"}, "bad options for router 'kv_aware'"),
        ("prefix_aware", {"cache_threshold": 2.0}, "router.cache_threshold must be in"),
    ],
)
def test_unknown_routers_and_bad_options_fail_before_anything_loads(monkeypatch, router, options, message):
    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was built before the router was checked")

    monkeypatch.setattr(engine_module.LLMEngine, "__init__", no_engine)
    with pytest.raises(PluginError, match=message):
        Cluster(replicas=2, router=router, router_options=options, **CPU)


def test_bad_cluster_and_engine_settings_fail_before_anything_loads(monkeypatch):
    monkeypatch.setattr(engine_module.LLMEngine, "__init__", lambda *a, **k: pytest.fail("an engine was built"))
    with pytest.raises(ValueError, match="cluster.replicas must be a whole number >= 1"):
        Cluster(replicas=0, **CPU)
    with pytest.raises(TypeError, match="unknown engine setting"):
        Cluster(replicas=2, max_num_seq=4)


def test_routers_see_each_replica_as_of_its_latest_step():
    Recording.seen, Recording.ended = [], []
    with Cluster(replicas=2, router="recording", registry=registry_with(recording=Recording), **SIM) as cluster:
        a = cluster.add_request(list(range(3, 13)), SamplingParams(max_tokens=5, ignore_eos=True), arrival_time=0.0)
        b = cluster.add_request(list(range(3, 23)), SamplingParams(max_tokens=7, ignore_eos=True), arrival_time=0.0)
        assert cluster.replica_of(a) is None  # added, routed when its arrival comes
        while not cluster.is_finished():
            cluster.step()
        assert (cluster.replica_of(a), cluster.replica_of(b)) == (0, 1)
    assert Recording.seen[0] == (a, 0.0, [(0, 0, 0, 0), (1, 0, 0, 0)])
    # replica 0 holds a, waiting: its 10 prompt tokens queued, 10 + 5 outstanding
    assert Recording.seen[1] == (b, 0.0, [(0, 1, 10, 15), (1, 0, 0, 0)])
    assert sorted(Recording.ended) == [(a, 0, "length"), (b, 1, "length")]


class Checking:
    """Routes to the least loaded replica, checking at every arrival that each view's queue
    lengths (kept in the view, LocalReplicaView) are its engine's now, and that views refuse writes."""

    checked = 0

    def route(self, request, replicas, state):
        for view in replicas:
            scheduler = view._replica.engine.scheduler
            assert (view.num_waiting, view.num_running) == (len(scheduler.waiting), len(scheduler.running))
            with pytest.raises(AttributeError, match="read-only"):
                view.num_waiting = 0
        Checking.checked += 1
        return min(replicas, key=lambda r: (r.num_waiting + r.num_running, r.replica_id))


def test_in_process_views_hold_the_queues_as_of_every_arrival():
    Checking.checked = 0
    registry = registry_with(checking=Checking)
    with Cluster(replicas=3, router="checking", registry=registry, **SIM) as cluster:
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        for i in range(12):  # arrivals while others wait, run and finish
            cluster.add_request(list(range(3, 40 + i)), params, arrival_time=0.01 * (i // 3))
        while not cluster.is_finished():
            cluster.step(until=1.0)
        assert cluster.clock() < 1.0  # all idle again, before the time step(until=1.0) promised
        cluster.add_request(list(range(3, 30)), params, arrival_time=1.0)
        while not cluster.is_finished():
            cluster.step()
    assert Checking.checked == 13


def test_abort_before_and_after_routing_and_observe_sees_aborts():
    Recording.seen, Recording.ended = [], []
    with Cluster(replicas=2, router="recording", registry=registry_with(recording=Recording), **SIM) as cluster:
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        early = cluster.add_request(list(range(3, 40)), params, arrival_time=0.0)
        late = cluster.add_request(list(range(3, 40)), params, arrival_time=5.0)
        cluster.step()  # routes `early` (due), steps it once
        assert cluster.abort(late) and cluster.abort(early)
        assert not cluster.abort(early)
        ended = []
        while not cluster.is_finished():  # each aborted request is reported by a step, as LLM's are
            ended += [(r.request_id, r.finish_reason) for r in cluster.step().finished]
        assert cluster.stats.num_aborted_requests == 2
    assert sorted(ended) == [(early, "abort"), (late, "abort")]
    assert [id_ for id_, *_ in Recording.seen] == [early]  # `late` was never routed
    assert Recording.ended == [(early, 0, "abort")]


class NoLookup(PagedKVCache):
    """The paged manager without CachedPrefixLookup: routers' questions go through admission's."""

    cached_prefix_blocks = None  # a Protocol member set to None is one the object lacks


@pytest.mark.parametrize("kv_cache", ["paged", "no_lookup"])
def test_cached_prefix_tokens_asks_the_replica_and_leaves_no_trace_on_the_others(kv_cache):
    seen = {}

    class Probing:
        def route(self, request, replicas, state):
            seen[request.request_id] = [r.cached_prefix_tokens(request) for r in replicas]
            return replicas[0]

    @hookimpl
    def register_kv_caches(register):
        register("no_lookup", NoLookup)

    registry = registry_with(probing=Probing)
    registry.register(types.SimpleNamespace(register_kv_caches=register_kv_caches), name="no_lookup")
    prompt = list(range(3, 3 + 50))  # 3 full blocks of 16, then 2 tokens
    with Cluster(replicas=2, router="probing", registry=registry, kv_cache=kv_cache, **CPU) as cluster:
        assert isinstance(cluster.fleet.engines[0].kv_manager, CachedPrefixLookup) == (kv_cache == "paged")
        cluster.generate([prompt], GREEDY, use_tqdm=False)
        second = cluster.add_request(prompt[:40] + [7, 7, 7], GREEDY)
        cluster.step()
        kv0, kv1 = (replica.engine.kv_manager for replica in cluster.fleet.replicas)
        assert seen[second] == [32, 0]  # blocks 0 and 1 (32 tokens) are shared and cached on replica 0
        assert second not in kv1.hashes  # the probe's memo on the replica not chosen was dropped
        while not cluster.is_finished():
            cluster.step()
    assert kv0.prefix_cache_stats()[0] >= 32


def test_one_simulated_replica_is_the_single_engine_exactly():
    requests = workload(40)
    with LLM(**SIM) as llm:
        alone = run(llm, requests)
    with Cluster(replicas=1, **SIM) as cluster:
        fleet = run(cluster, requests)
    assert [dataclasses.replace(r, replica_id=None) for r in fleet.requests] == alone.requests
    assert [dataclasses.replace(s, replica_id=None) for s in fleet.steps] == alone.steps
    assert fleet.wall_time_s == alone.wall_time_s
    assert {r.replica_id for r in fleet.requests} == {0}


def test_a_simulated_fleet_runs_events_in_time_order_and_deterministically():
    requests = workload(80, rate=200.0)
    runs = []
    for _ in range(2):
        with Cluster(replicas=4, router="least_load", **SIM) as cluster:
            assert cluster.simulated and cluster.fleet.virtual
            runs.append(run(cluster, requests))
    first, second = runs
    assert first.requests == second.requests and first.steps == second.steps
    assert {r.replica_id for r in first.requests} == {0, 1, 2, 3}
    assert all(
        r.finish_reason == "length" and r.num_output_tokens == q.output_len for r, q in zip(first.requests, requests)
    )
    for replica_id in range(4):  # each replica's steps follow one another on its clock
        steps = [s for s in first.steps if s.replica_id == replica_id]
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(steps, steps[1:]))
    # an arrival never waits for a step that started after it: each request's first step starts
    # at or after it arrives, and every replica was idle or stepping when it came
    assert all(r.first_scheduled_s >= r.arrival_s for r in first.requests)


def test_cluster_stats_sum_the_replicas_and_reset():
    with Cluster(replicas=3, **CPU) as cluster:
        cluster.generate([[5, 6, 7]] * 5, GREEDY, use_tqdm=False)
        stats = cluster.stats
        assert stats.num_decode_tokens == sum(r.engine.stats.num_decode_tokens for r in cluster.fleet.replicas)
        assert stats.num_decode_tokens > 0 and stats.num_steps >= 3
        cluster.stats = EngineStats()
        assert cluster.stats == EngineStats()


def test_a_request_too_large_is_refused_when_added():
    with Cluster(replicas=2, **CPU) as cluster:
        with pytest.raises(RequestTooLargeError):
            cluster.add_request(list(range(3, 3 + 300)), SamplingParams(max_tokens=10))
        outputs = cluster.generate([list(range(3, 3 + 300)), [5, 6]], GREEDY, use_tqdm=False)
    assert outputs[0]["finish_reason"] == "error" and outputs[1]["finish_reason"] == "length"


def test_a_closed_cluster_refuses_calls():
    cluster = Cluster(replicas=2, **CPU)
    cluster.close()
    cluster.close()
    with pytest.raises(RuntimeError, match="closed cluster"):
        cluster.add_request([1, 2, 3])


def test_kv_events_name_blocks_as_routers_do():
    with LLM(**CPU) as llm:
        kv = llm.kv_manager
        assert kv.take_kv_events() == {}  # the first call: the whole (empty) cache; the record starts
        prompt = list(range(3, 3 + 40))
        llm.generate([prompt], GREEDY, use_tqdm=False)
        events = kv.take_kv_events()
        assert set(block_hashes(prompt, 16, 2)) <= {h for h, cached in events.items() if cached}
        assert kv.take_kv_events() == {}
        kv.reset_prefix_cache()
        assert set(kv.take_kv_events().values()) == {False}


def test_the_routers_prefix_lookup_agrees_with_admission():
    """cached_prefix_blocks (a router's question, from the prompt's names) answers what
    num_cached_prefix_tokens (admission's, confirming every block) does, as the cache fills and evicts."""
    import random

    from inferlab.core.request import Request

    rng = random.Random(3)
    stems = [[rng.randrange(3, 380) for _ in range(64)] for _ in range(4)]
    with LLM(**{**CPU, "num_kvcache_blocks": 12}) as llm:
        kv = llm.kv_manager
        for round_ in range(6):
            prompts = [rng.choice(stems)[: rng.randrange(1, 64)] + [rng.randrange(3, 380)] for _ in range(3)]
            llm.generate(prompts, GREEDY, use_tqdm=False)
            for probe in [rng.choice(stems)[: rng.randrange(1, 64)] + [7] for _ in range(8)]:
                names = block_hashes(probe, 16, (len(probe) - 1) // 16)
                expected = kv.num_cached_prefix_tokens(Request(10_000 + round_, probe, GREEDY))
                assert kv.cached_prefix_blocks(names) * 16 == expected
                kv.free(Request(10_000 + round_, probe, GREEDY))


def test_a_cluster_refuses_several_choices_a_request():
    with Cluster(replicas=2, **CPU) as cluster:
        with pytest.raises(ValueError, match="a cluster serves one choice a request"):
            cluster.add_request([5, 6, 7], SamplingParams(n=2, max_tokens=2))
