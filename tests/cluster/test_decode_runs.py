"""A simulated fleet's runs of decode steps at once (LLMEngine.run_decodes), a replica's steps up to
the next arrival taken in one go (LocalFleet.step), commits asked only
of requests that filled a block and allocations only of those going past their last computed
token's block (Scheduler.commit_stride), and runs that read and report the
requests the step before them finished at their length, give exactly what stepping one at a
time, allocating and committing every request every step gives: every request's token ids, token times, TTFT, TPOT, preemptions
and cache hits, the replicas' counters and KV books, and the step records."""

import dataclasses
import math

import pytest

from inferlab import Cluster
from inferlab.conf import compose
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


def replay(profile: str, decode_runs: bool, router: str, num_blocks: int, rate: float, noise: float, split=False):
    """60 requests of up to 400 prompt and output tokens, arriving at `rate` a second, each behind
    one of 3 shared prefixes, on 3 replicas with small caches of 16-token blocks (split: one
    prefill and two decode replicas, their K/V moving through kv_transfer=simulated)."""
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
            run_decodes, take_finished = engine.run_decodes, engine.take_finished
            engine.run_decodes = lambda until, f=run_decodes: calls.append(f(until)) or calls[-1]
            engine.take_finished = lambda f=take_finished: counted(f(), reported)
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
