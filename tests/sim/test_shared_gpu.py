"""Replicas sharing one virtual GPU (cluster.gpus_per_replica < 1, inferlab.sim.shared_gpu): steps
of different replicas never overlap, a switch of context costs its time, a context holds the device
for up to a timeslice while it has work and yields at once when it has none, any step is cut at a
timeslice boundary for another context's work and resumes in its next timeslice, the ends replicas
read take every launch into account, and gpus_per_replica=1 times every step as a GPU of one's own
did."""

import math

import pytest

from inferlab import Cluster
from inferlab.conf.cluster import ClusterConfig, ClusterConfigError, validate_cluster
from inferlab.core.plugins import PluginError
from inferlab.sim.shared_gpu import FORGET_AFTER, SharedGPU

PROFILE = {"profile": "h100-qwen3-0.6b-triton", "noise": 0.0}


def ends(gpu: SharedGPU, steps) -> list[float]:
    return [gpu.end(step) for step in steps]


def test_steps_of_two_contexts_queue_and_pay_a_switch():
    gpu = SharedGPU(timeslice_s=None, context_switch_s=0.1)
    a = gpu.place(0, ready=0.0, seconds=1.0, not_before=0.0)
    b = gpu.place(1, ready=0.5, seconds=1.0, not_before=0.5)
    c = gpu.place(1, ready=1.0, seconds=1.0, not_before=1.0)
    d = gpu.place(0, ready=5.0, seconds=1.0, not_before=5.0)
    # b after a and a switch; c right after b (same context); d on an idle device, yet another context
    assert ends(gpu, [a, b, c, d]) == [1.0, 2.1, 3.1, 6.1]
    assert gpu.drained().num_switches == 2 and gpu.drained().num_preemptions == 0


def test_a_step_is_cut_at_a_timeslice_boundary_and_resumes_in_its_next_timeslice():
    gpu = SharedGPU(timeslice_s=2.0, context_switch_s=0.1)
    a = gpu.place(0, ready=0.0, seconds=10.0, not_before=0.0)
    b = gpu.place(1, ready=0.5, seconds=1.0, not_before=0.5)
    # a is cut at 2.0; b runs from 2.1 to 3.1 and yields; a's 8.0 left runs from 3.2, nobody waiting
    assert gpu.pending_end(a) == pytest.approx(11.2)
    # b's context launches again at 3.2, before a ends: a is cut again at the end of the timeslice
    # it began at 3.2 (5.2), c runs 5.3-6.3, and a's 6.0 left runs from 6.4
    c = gpu.place(1, ready=3.2, seconds=1.0, not_before=3.2)
    assert ends(gpu, [b, c, a]) == pytest.approx([3.1, 6.3, 12.4])
    timeline = gpu.drained()
    assert timeline.num_preemptions == 2 and timeline.num_switches == 4


def test_a_prompt_step_shared_with_decodes_is_cut_each_timeslice():
    """A long step (a prompt) against a context that keeps launching short ones: each of its
    timeslices ends in a cut while the other has work, and the short ones run between."""
    gpu = SharedGPU(timeslice_s=1.0, context_switch_s=0.0)
    prompt = gpu.place(0, ready=0.0, seconds=2.5, not_before=0.0)
    decodes = [gpu.place(1, ready=0.0, seconds=0.25, not_before=0.0) for _ in range(3)]
    # the prompt runs 0-1 and is cut; the decodes 1-1.75, then their context yields; the prompt's
    # 1.5 left runs 1.75-3.25, nobody waiting
    assert ends(gpu, decodes) == [1.25, 1.5, 1.75]
    assert gpu.end(prompt) == 3.25
    assert gpu.drained().num_preemptions == 1


def test_work_a_context_queues_during_its_timeslice_keeps_it_there():
    """Overlap scheduling: a context that launches its next step before the one running ends
    keeps the device for the whole timeslice; the other's step runs at its end."""
    gpu = SharedGPU(timeslice_s=2.0, context_switch_s=0.0)
    a1 = gpu.place(0, ready=0.0, seconds=0.75, not_before=0.0)
    b1 = gpu.place(1, ready=0.1, seconds=0.75, not_before=0.1)
    a2 = gpu.place(0, ready=0.5, seconds=0.75, not_before=0.5)
    a3 = gpu.place(0, ready=1.0, seconds=0.75, not_before=1.0)
    # a1 0-0.75, a2 0.75-1.5, a3 from 1.5 cut at 2.0 (0.25 left), b1 2.0-2.75, a3 2.75-3.0
    assert ends(gpu, [a1, a2, b1, a3]) == [0.75, 1.5, 2.75, 3.0]


def test_a_context_that_runs_out_of_work_yields_at_once():
    gpu = SharedGPU(timeslice_s=2.0, context_switch_s=0.1)
    a1 = gpu.place(0, ready=0.0, seconds=0.5, not_before=0.0)
    b1 = gpu.place(1, ready=0.1, seconds=1.0, not_before=0.1)
    a2 = gpu.place(0, ready=1.0, seconds=0.5, not_before=1.0)  # launched after a1 ended: a's queue ran dry
    # a yields at 0.5, well inside its timeslice; b runs 0.6-1.6 and yields; a2 runs 1.7-2.2
    assert ends(gpu, [a1, b1, a2]) == pytest.approx([0.5, 1.6, 2.2])
    assert gpu.drained().num_switches == 2 and gpu.drained().num_preemptions == 0


def test_an_eager_step_ends_no_earlier_than_its_launch_and_leaves_the_device_meanwhile():
    gpu = SharedGPU(timeslice_s=None, context_switch_s=0.0)
    a = gpu.place(0, ready=0.0, seconds=1.0, not_before=3.0)
    b = gpu.place(1, ready=0.5, seconds=1.0, not_before=0.5)
    # a's work is done at 1.0, its kernels' launches go on to 3.0: b runs in between
    assert ends(gpu, [a, b]) == [3.0, 2.0]


def test_an_end_once_read_stays():
    """A step's end is read once the launches that could delay it have been placed: it is
    committed, and a launch placed later that could start only after it changes nothing of it."""
    gpu = SharedGPU(timeslice_s=1.0, context_switch_s=0.0)
    a = gpu.place(0, ready=0.0, seconds=3.0, not_before=0.0)
    assert gpu.end(a) == 3.0
    b = gpu.place(1, ready=3.0, seconds=1.0, not_before=3.0)
    assert gpu.end(a) == 3.0 and gpu.end(b) == 4.0


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
    assert runners[0].shared.drained().now >= busy


def test_the_ends_replicas_read_are_those_of_every_launch_they_made(monkeypatch):
    """The fleet steps a replica on a shared GPU at the end of the step it reads next, so that by
    then the other replica has launched every step that could delay it: each end a replica read is
    the one the timeline of all the launches gives (a replica stepped at its clock instead would
    read ends that the other's later launches move)."""
    placed, place = [], SharedGPU.place

    def recording(gpu, *args):
        placed.append(place(gpu, *args))
        return placed[-1]

    monkeypatch.setattr(SharedGPU, "place", recording)
    _, cluster = replay(0.5, timeslice_s=0.002, context_switch_s=0.0001)
    monkeypatch.undo()
    again = SharedGPU(0.002, 0.0001, len(cluster.fleet.engines))
    steps = {
        (step.context, step.index): again.place(step.context, step.ready, step.seconds, step.not_before)
        for step in placed
    }
    read = [(step.context, step.index, step.end) for step in placed if step.end is not None]
    assert len(read) > 50 and again.drained().num_preemptions > 0
    assert read == [(c, i, again.end(steps[c, i])) for c, i, _ in read]


def test_steps_that_ran_leave_the_queues():
    """A long run's queues hold the steps not yet run and fewer than FORGET_AFTER run ones, each
    step's end staying what it read."""
    gpu = SharedGPU(timeslice_s=1.0, context_switch_s=0.01)
    ends_read = []
    for i in range(5 * FORGET_AFTER):
        a = gpu.place(0, ready=i * 0.5, seconds=0.3, not_before=i * 0.5)
        b = gpu.place(1, ready=i * 0.5, seconds=0.1, not_before=i * 0.5)
        ends_read += [gpu.end(a), gpu.end(b)]
        assert all(len(queue) <= FORGET_AFTER for queue in gpu.queues)
    assert a.index == b.index == 5 * FORGET_AFTER - 1 and gpu.drained().now == max(ends_read[-2:])
    # the same launches on a GPU that forgets nothing give the same ends
    again = SharedGPU(timeslice_s=1.0, context_switch_s=0.01)
    again._forget = lambda: None
    steps = []
    for i in range(5 * FORGET_AFTER):
        steps += [again.place(0, i * 0.5, 0.3, i * 0.5), again.place(1, i * 0.5, 0.1, i * 0.5)]
    assert [again.end(step) for step in steps] == ends_read


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


def test_a_request_that_arrives_during_a_step_on_a_shared_gpu_waits_for_it():
    """A replica on a shared GPU steps at the end of the step it reads, its step having begun at
    its clock: a request that reaches it in between is taken once that step returns, as an engine
    takes what arrives mid-step, not by a step that had begun before it arrived."""
    cluster = Cluster(
        replicas=2,
        executor="simulated",
        executor_options={**PROFILE, "timeslice_s": 0.002, "context_switch_s": 0.0001},
        gpus_per_replica=0.5,
        num_kvcache_blocks=200,
        router="round_robin",
    )
    steps = []
    with cluster:
        for i in range(2):  # one long prompt on each replica
            cluster.add_request([1 + i] * 3000, arrival_time=0.0)
        late = cluster.add_request([7] * 40, arrival_time=0.01)  # to replica 0, while its step reads the prompt
        request = cluster.requests[late]
        while not cluster.is_finished():
            steps += cluster.step().replica_steps
    spanning = [(start, end) for replica, start, end, _ in steps if replica == 0 and start < 0.01 < end]
    assert spanning, "the late request arrived between two steps of replica 0; the test needs one during a step"
    assert request.first_scheduled_time >= spanning[0][1]
