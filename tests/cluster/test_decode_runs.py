"""A simulated fleet's runs of decode steps at once (LLMEngine.run_decodes), a replica's steps up to
the next arrival taken in one go (LocalFleet.step), commits asked only
of requests that filled a block and allocations only of those going past their last computed
token's block (Scheduler.commit_stride), and runs that read and report the
requests the step before them finished at their length, give exactly what stepping one at a
time, allocating and committing every request every step gives: every request's token ids, token times, TTFT, TPOT, preemptions
and cache hits, the replicas' counters and KV books, and the step records."""

import dataclasses
import math
import random
from collections import Counter

import pytest

from inferlab import Cluster
from inferlab.conf import compose
from inferlab.core.engine import steps_in_free_blocks
from inferlab.core.plugins import PluginRegistry
from inferlab.experiment.driver import run_workload
from inferlab.experiment.latency import latency_figures
from inferlab.experiment.workload import build_workload
from inferlab.sim.profile import load_profile


@pytest.fixture(scope="module")
def noisy_profile(tmp_path_factory) -> str:
    """The shipped small-model profile with a measured spread, so that step times are draws."""
    profile = load_profile("h200-qwen3-0.6b-triton")
    for m in profile.measurements:
        m["seconds_std"] = 0.05 * m["seconds"]
    path = tmp_path_factory.mktemp("profile") / "noisy.json"
    profile.save(str(path))
    return str(path)


def replay(
    profile: str,
    decode_runs: bool,
    router: str,
    num_blocks: int,
    rate: float,
    noise: float,
    split=False,
    waits: Counter | None = None,
    unheld: bool = True,
    **engine,
):
    """60 requests of up to 400 prompt and output tokens, arriving at `rate` a second, each behind
    one of 3 shared prefixes, on 3 replicas with small caches of 16-token blocks (split: one
    prefill and two decode replicas, their K/V moving through kv_transfer=simulated). waits counts
    the decode steps taken while requests waited: "one at a time", "in runs", and "admitting after
    a run" (steps right after such a run that admitted one); unheld=False: runs that do not count
    a waiting request's cached blocks that nobody holds; engine: more engine settings."""
    bench = compose(
        [
            "bench.arrival=poisson",
            f"bench.request_rate={rate}",
            "bench.num_seqs=60",
            "bench.max_len=400",
            "bench.shared_prefix_len=64",
            "bench.num_prefixes=3",
        ]
    ).bench
    settings = dict(
        executor="simulated",
        executor_options={"profile": profile, "noise": noise},
        kvcache_block_size=16,
        num_kvcache_blocks=num_blocks,
        max_model_len=2048,
        **engine,
    )
    replicas = dict(prefill_replicas=1, decode_replicas=2) if split else dict(replicas=3)
    with Cluster(router=router, **replicas, **settings) as cluster:
        workload = build_workload(bench, cluster.hf_config.vocab_size, cluster.config.max_model_len)
        cluster.fleet.decode_runs = decode_runs
        if not decode_runs:  # the slow path throughout: every step's allocate and commit asked of every request too
            for engine in cluster.fleet.engines:
                engine.scheduler.commit_stride = 0
        calls, reported = [], []  # each run's steps; the requests a run's first step reported
        for engine in cluster.fleet.engines:
            if not unheld:  # as without the KV manager's UnheldPrefixBlocks
                engine.unheld_prefix_blocks = None
            run_decodes, take_finished = engine.run_decodes, engine.take_finished
            engine.run_decodes = lambda until, f=run_decodes: calls.append(f(until)) or calls[-1]
            engine.take_finished = lambda f=take_finished: counted(f(), reported)
            if waits is not None:
                count_waiting_steps(engine, waits)
        run = run_workload(cluster, workload.requests, workload.sampling_params(bench))
        kv = [
            (dict(e.kv_manager.cached), list(e.kv_manager.free_queue), e.kv_manager.prefix_cache_stats())
            for e in cluster.fleet.engines
        ]
        stats = [dataclasses.replace(s, wait_seconds=0.0) for s in cluster.fleet.replica_stats()]
        runners = [(e.runner.num_steps, e.runner.simulated_seconds) for e in cluster.fleet.engines]
        fast_steps = sum(len(spans) for spans in calls)
    if decode_runs and not split:  # requests a step finished at their length: the run after it reported them
        assert reported
    return run, kv, stats, runners, fast_steps


def counted(finished: list, reported: list) -> list:
    reported += finished
    return finished


def count_waiting_steps(engine, waits: Counter) -> None:
    after_run = []  # whether the engine's last call was a run of decode steps while requests waited
    run_decodes, step = engine.run_decodes, engine.step

    def counting_run_decodes(until):
        waiting = bool(engine.scheduler.waiting)
        spans = run_decodes(until)
        if spans:  # else step() runs the next step
            waits["in runs"] += len(spans) if waiting else 0
            after_run[:] = [waiting]
        return spans

    def counting_step():
        waiting = bool(engine.scheduler.waiting)
        output = step()
        if waiting and output.num_decode_tokens and not output.num_prefill_tokens:
            waits["one at a time"] += 1
        if after_run and after_run[0] and output.num_prefill_tokens:  # no prefill runs during such a run
            waits["admitting after a run"] += 1
        after_run.clear()
        return output

    engine.run_decodes, engine.step = counting_run_decodes, counting_step


@pytest.mark.parametrize(
    "router, num_blocks, rate, noise",
    [("prefix_aware", 400, 20.0, 1.0), ("kv_aware", 100, 50.0, 0.0), ("least_load", 100, 50.0, 1.0)],
)
def test_runs_of_decode_steps_give_exactly_the_records_of_one_step_at_a_time(
    noisy_profile, router, num_blocks, rate, noise
):
    """With noise, each step's time is drawn as one at a time draws it; without, a run's times
    come from the profile's lines without a call a step."""
    one, kv_one, stats_one, runners_one, none = replay(noisy_profile, False, router, num_blocks, rate, noise)
    fast, kv_fast, stats_fast, runners_fast, fast_steps = replay(noisy_profile, True, router, num_blocks, rate, noise)
    assert none == 0 and fast_steps > sum(s.num_steps for s in stats_fast) / 3  # many steps ran in runs
    assert fast.requests == one.requests  # token times, TTFT, preemptions, cache hits, replicas: every field
    assert sorted(map(dataclasses.astuple, fast.steps)) == sorted(map(dataclasses.astuple, one.steps))
    assert fast.wall_time_s == one.wall_time_s
    assert stats_fast == stats_one and kv_fast == kv_one and runners_fast == runners_one
    figures = latency_figures(fast.requests, fast.wall_time_s)
    assert figures == latency_figures(one.requests, one.wall_time_s)
    assert sum(r.num_output_tokens for r in fast.requests) > 10_000
    if num_blocks == 100:  # the small cache preempts and evicts: runs stop short of what they cannot allocate
        assert sum(r.num_preemptions for r in fast.requests) > 0
    assert sum(r.num_cached_tokens for r in fast.requests) > 0
    assert not any(math.isnan(t) for r in fast.requests for t in r.token_times_s)


def test_a_disaggregated_fleets_decode_runs_end_before_any_handoff_could_reach_them(noisy_profile):
    """A decode replica runs decode steps at once only up to the earliest time a prefill replica
    could hand it a request, and not while K/V moves to it: the records equal one step at a time."""
    one, kv_one, stats_one, runners_one, none = replay(noisy_profile, False, "least_load", 100, 50.0, 1.0, split=True)
    fast, kv_fast, stats_fast, runners_fast, fast_steps = replay(
        noisy_profile, True, "least_load", 100, 50.0, 1.0, split=True
    )
    assert none == 0 and fast_steps > 0
    assert fast.requests == one.requests
    assert sorted(map(dataclasses.astuple, fast.steps)) == sorted(map(dataclasses.astuple, one.steps))
    assert fast.wall_time_s == one.wall_time_s
    assert stats_fast == stats_one and kv_fast == kv_one and runners_fast == runners_one


@pytest.mark.parametrize("scheduler", ["fcfs", "lpm"])
def test_decode_steps_run_at_once_while_requests_wait_that_no_step_could_admit(noisy_profile, scheduler):
    """Requests waiting behind a full KV cache that no step of a run could admit, in whatever order
    the policy (a PureAdmissionOrder) would give them, do not keep the run from going: the records
    equal one step at a time, requests admitted right after such a run (its last step freed
    blocks) included, and every decode step taken while requests waited is taken either way."""
    one_waits, fast_waits = Counter(), Counter()
    one, kv_one, stats_one, runners_one, _ = replay(
        noisy_profile, False, "kv_aware", 100, 50.0, 0.0, waits=one_waits, scheduler=scheduler
    )
    fast, kv_fast, stats_fast, runners_fast, _ = replay(
        noisy_profile, True, "kv_aware", 100, 50.0, 0.0, waits=fast_waits, scheduler=scheduler
    )
    assert fast.requests == one.requests
    assert sorted(map(dataclasses.astuple, fast.steps)) == sorted(map(dataclasses.astuple, one.steps))
    assert stats_fast == stats_one and kv_fast == kv_one and runners_fast == runners_one
    assert one_waits["in runs"] == 0 and fast_waits["in runs"] > 100
    assert fast_waits["in runs"] + fast_waits["one at a time"] == one_waits["one at a time"]
    assert fast_waits["admitting after a run"] > 0


def test_cached_blocks_nobody_holds_count_against_a_waiting_request(noisy_profile):
    """A waiting request that would fit only if the cached blocks of its prefix that nobody holds
    were not taken from the free ones when it is admitted (UnheldPrefixBlocks) keeps no run from
    going: fewer decode steps run one at a time while requests wait than where they are not
    counted, and the records equal one step at a time either way."""
    one_waits, blind_waits, fast_waits = Counter(), Counter(), Counter()
    one, kv_one, stats_one, runners_one, _ = replay(noisy_profile, False, "kv_aware", 100, 50.0, 0.0, waits=one_waits)
    blind, kv_blind, stats_blind, runners_blind, _ = replay(
        noisy_profile, True, "kv_aware", 100, 50.0, 0.0, waits=blind_waits, unheld=False
    )
    fast, kv_fast, stats_fast, runners_fast, _ = replay(
        noisy_profile, True, "kv_aware", 100, 50.0, 0.0, waits=fast_waits
    )
    for run, kv, stats, runners in (
        (blind, kv_blind, stats_blind, runners_blind),
        (fast, kv_fast, stats_fast, runners_fast),
    ):
        assert run.requests == one.requests
        assert sorted(map(dataclasses.astuple, run.steps)) == sorted(map(dataclasses.astuple, one.steps))
        assert stats == stats_one and kv == kv_one and runners == runners_one
    assert fast_waits["one at a time"] < blind_waits["one at a time"]
    assert fast_waits["in runs"] + fast_waits["one at a time"] == one_waits["one at a time"]


class CountingFCFS:
    """FCFS that notes each time it is asked to order the waiting requests: a side effect, so it is
    no PureAdmissionOrder."""

    def __init__(self):
        self.asked = []

    def admission_order(self, waiting, state):
        self.asked.append((state.step, state.now, len(waiting)))
        return waiting

    def preemption_victim(self, running, state):
        return running[-1]


def replay_counting_fcfs(profile: str, decode_runs: bool, plugin_module):
    """replay() of 100-block replicas taking 4 requests each, under CountingFCFS: what each
    replica's policy was asked, replay()'s results, and the decode steps taken while requests
    waited."""
    policies = []

    def counting_fcfs():
        policies.append(CountingFCFS())
        return policies[-1]

    registry = PluginRegistry()
    registry.register(
        plugin_module("counting", register_schedulers=lambda register: register("counting_fcfs", counting_fcfs))
    )
    waits = Counter()
    run = replay(
        profile,
        decode_runs,
        "least_load",
        100,
        50.0,
        0.0,
        waits=waits,
        scheduler="counting_fcfs",
        registry=registry,
        max_num_seqs=4,
    )
    return [policy.asked for policy in policies], run, waits


def test_a_policy_without_pure_admission_order_is_asked_in_every_step_it_was_asked_in(noisy_profile, plugin_module):
    """A policy that is no PureAdmissionOrder is asked in every step that one at a time asks it in,
    though the requests waiting fit nowhere (fcfs, the same policy declared pure, runs more of
    those steps at once); decode steps still run at once while requests wait where the scheduler
    asks no policy: every sequence slot is taken (max_num_seqs)."""
    asked_one, one, one_waits = replay_counting_fcfs(noisy_profile, False, plugin_module)
    asked_fast, fast, fast_waits = replay_counting_fcfs(noisy_profile, True, plugin_module)
    assert asked_fast == asked_one and sum(map(len, asked_one)) > 1000
    assert fast[0].requests == one[0].requests
    assert fast[1:4] == one[1:4]  # the KV books, the replicas' counters, the runners
    assert one_waits["in runs"] == 0 and fast_waits["in runs"] > 100
    assert fast_waits["in runs"] + fast_waits["one at a time"] == one_waits["one at a time"]
    fcfs_waits = Counter()
    replay(noisy_profile, True, "least_load", 100, 50.0, 0.0, waits=fcfs_waits, scheduler="fcfs", max_num_seqs=4)
    assert fcfs_waits["in runs"] > fast_waits["in runs"] + 500


class PureFCFS:
    """FCFS declared a PureAdmissionOrder but not a FixedAdmissionOrder."""

    admission_order_is_pure = True

    def admission_order(self, waiting, state):
        return waiting

    def preemption_victim(self, running, state):
        return running[-1]


def test_a_fixed_admission_order_lets_runs_go_on_while_its_first_request_does_not_fit(noisy_profile, plugin_module):
    """fcfs (a FixedAdmissionOrder) runs decode steps at once while the request first in its queue
    does not fit, though others would; the same policy declared only pure runs them only while no
    waiting request fits. Both give the records of one step at a time."""
    registry = PluginRegistry()
    registry.register(plugin_module("pure_fcfs", register_schedulers=lambda register: register("pure_fcfs", PureFCFS)))
    one = replay(noisy_profile, False, "least_load", 60, 50.0, 0.0, scheduler="fcfs")
    waits = {}
    for scheduler in ("fcfs", "pure_fcfs"):
        waits[scheduler] = Counter()
        fast = replay(
            noisy_profile,
            True,
            "least_load",
            60,
            50.0,
            0.0,
            waits=waits[scheduler],
            scheduler=scheduler,
            registry=registry,
        )
        assert fast[0].requests == one[0].requests
        assert fast[1:4] == one[1:4]  # the KV books, the replicas' counters, the runners
    assert waits["fcfs"]["in runs"] > waits["pure_fcfs"]["in runs"] + 500 > 1000


def blocks_needed(books: list[tuple[int, int]], bs: int, n: int) -> int:
    return sum(max(0, -(-(c + n) // bs) - held) for c, held in books)


def test_a_runs_length_in_free_blocks_is_the_longest_a_search_over_lengths_finds():
    """steps_in_free_blocks against the search it replaced: the longest n <= steps whose blocks
    (each request holding `held` blocks with c tokens computed takes ceil((c + n) / bs) - held by
    step n) fit in the free ones."""
    rng = random.Random(3)
    cut = 0
    for _ in range(3000):
        bs = rng.choice([1, 4, 16, 256])
        books = []
        for _ in range(rng.randrange(1, 12)):
            c = rng.randrange(1, 3000)
            books.append((c, -(-c // bs) + rng.choice([0, 0, 1])))  # its blocks hold c tokens, maybe one more
        steps, free = rng.randrange(1, 600), rng.randrange(0, 40)

        longest = max(n for n in range(steps + 1) if blocks_needed(books, bs, n) <= free)
        firsts = [held * bs - c + 1 for c, held in books]
        assert steps_in_free_blocks(firsts, steps, bs, free) == longest
        cut += longest < steps
    assert cut > 500  # the free blocks cut many runs short
