"""Replicas sharing one virtual GPU (cluster.gpus_per_replica < 1, inferlab.sim.shared_gpu): steps
of different replicas never overlap, a switch of context costs its time, a step longer than a
timeslice is cut for another replica's ready step, and gpus_per_replica=1 times every step as a
GPU of one's own did."""

import math

import pytest

from inferlab import Cluster
from inferlab.conf.cluster import ClusterConfig, ClusterConfigError, validate_cluster
from inferlab.core.plugins import PluginError
from inferlab.sim.shared_gpu import SharedGPU

PROFILE = {"profile": "h100-qwen3-0.6b-triton", "noise": 0.0}


def test_steps_of_two_contexts_queue_and_pay_a_switch():
    gpu = SharedGPU(timeslice_s=None, context_switch_s=0.1)
    assert gpu.place(0, ready=0.0, seconds=1.0, not_before=0.0) == 1.0
    assert gpu.place(1, ready=0.5, seconds=1.0, not_before=0.5) == 2.1  # after 0's step and a switch
    assert gpu.place(1, ready=1.0, seconds=1.0, not_before=1.0) == 3.1  # same context: no switch
    assert gpu.place(0, ready=5.0, seconds=1.0, not_before=5.0) == 6.1  # idle, yet another context
    assert gpu.num_switches == 2 and gpu.num_preemptions == 0


def test_a_step_longer_than_a_timeslice_is_cut_for_a_ready_one():
    gpu = SharedGPU(timeslice_s=2.0, context_switch_s=0.1)
    assert gpu.place(0, ready=0.0, seconds=10.0, not_before=0.0) == 10.0
    # ready at 0.5: runs at the boundary 2.0 after a switch; context 0 resumes after another
    assert gpu.place(1, ready=0.5, seconds=1.0, not_before=0.5) == pytest.approx(3.1)
    assert gpu.free_at == pytest.approx(10.0 + 1.0 + 0.2)
    # the next step of 1 waits for 0's next timeslice, which began when it resumed (3.2)
    assert gpu.place(1, ready=3.2, seconds=1.0, not_before=3.2) == pytest.approx(5.2 + 0.1 + 1.0)
    assert gpu.num_preemptions == 2 and gpu.num_switches == 4
    # work the holder finishes before the boundary is not cut
    short = SharedGPU(timeslice_s=2.0, context_switch_s=0.0)
    short.place(0, 0.0, 1.5, 0.0)
    assert short.place(1, 0.5, 1.0, 0.5) == 2.5 and short.num_preemptions == 0


def test_eager_steps_end_no_earlier_than_their_launch():
    gpu = SharedGPU(timeslice_s=None, context_switch_s=0.0)
    assert gpu.place(0, ready=0.0, seconds=1.0, not_before=3.0) == 3.0


def replay(gpus_per_replica: float, **options) -> tuple[list, Cluster]:
    """16 prompts on two simulated replicas: each step's (replica, start, end)."""
    cluster = Cluster(
        replicas=2,
        executor="simulated",
        executor_options={**PROFILE, **options},
        gpus_per_replica=gpus_per_replica,
        num_kvcache_blocks=200,
    )
    steps = []
    with cluster:
        for i in range(16):
            cluster.add_request([1 + i] * (40 + 8 * i))
        while not cluster.is_finished():
            steps += cluster.step().replica_steps
    return steps, cluster


def test_two_replicas_on_one_gpu_take_turns_and_the_switches_cost():
    alone, _ = replay(1.0)
    shared, cluster = replay(0.5, context_switch_s=0.001)
    runners = [e.runner for e in cluster.fleet.engines]
    assert runners[0].shared is runners[1].shared and not cluster.fleet.decode_runs
    described = runners[0].describe()["shared_gpu"]
    assert described["replicas"] == 2 and described["num_switches"] > 0
    # the same work, but on one timeline that switches: the fleet ends later than with a GPU each
    assert (
        max(end for _, _, end, _ in shared) > max(end for _, _, end, _ in alone) + 0.001 * described["num_switches"] / 2
    )
    # one timeline: it holds both replicas' device time and every switch, none of it overlapping
    busy = sum(r.simulated_seconds for r in runners) + 0.001 * described["num_switches"]
    assert runners[0].shared.free_at >= busy


def test_one_gpu_each_times_steps_as_before_to_the_bit():
    """gpus_per_replica=1 leaves each runner its own device; a GPU shared by one runner alone does
    the same arithmetic, so that both give the very same step times."""
    alone, cluster = replay(1.0)
    assert all(e.runner.shared is None for e in cluster.fleet.engines) and cluster.fleet.decode_runs
    original = Cluster.__init__

    def one_context_each(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for engine in self.fleet.engines:
            engine.runner.share_device([engine.runner])

    Cluster.__init__ = one_context_each
    try:
        single, _ = replay(1.0)
    finally:
        Cluster.__init__ = original
    assert [(r, s, e) for r, s, e, _ in single] == [(r, s, e) for r, s, e, _ in alone]


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf])
def test_bad_gpus_per_replica_is_refused_naming_it(value):
    with pytest.raises(ClusterConfigError, match="cluster.gpus_per_replica must be a finite number >= 0"):
        validate_cluster(ClusterConfig(replicas=2, gpus_per_replica=value))


@pytest.mark.parametrize(
    "options, name",
    [
        ({"timeslice_s": -0.001}, "executor.timeslice_s"),
        ({"timeslice_s": 0.0}, "executor.timeslice_s"),
        ({"timeslice_s": math.nan}, "executor.timeslice_s"),
        ({"context_switch_s": -1e-6}, "executor.context_switch_s"),
        ({"context_switch_s": math.nan}, "executor.context_switch_s"),
    ],
)
def test_bad_sharing_options_are_refused_naming_them(options, name):
    with pytest.raises(PluginError, match=name):
        Cluster(replicas=2, executor="simulated", executor_options={**PROFILE, **options}, gpus_per_replica=0.5)
