"""The shared-GPU calibration (inferlab.experiment.timeslice): its estimator recovers the switch
cost and the timeslice from kernel end times of two time-sliced contexts, and finds none where
the two ran at once; its measurement runs on CPU actors through Ray."""

import pytest

from inferlab.experiment.timeslice import estimate


def time_sliced(kernel_s: float, timeslice_s: float, switch_s: float, total_s: float) -> list[list[float]]:
    """When each kernel of two contexts ends on a GPU that gives each timeslice_s in turn (a kernel
    cut at the boundary goes on when its context gets the GPU back), switch_s a switch."""
    ends, left, t, holder = [[], []], [kernel_s, kernel_s], 0.0, 0
    while t < total_s:
        until = t + timeslice_s
        while t + left[holder] <= until:
            t += left[holder]
            ends[holder].append(t)
            left[holder] = kernel_s
        left[holder] -= until - t
        t = until + switch_s
        holder = 1 - holder
    return ends


@pytest.mark.parametrize("kernel_s", [0.0002, 0.001, 0.005])
def test_the_estimator_recovers_the_switch_cost_and_the_timeslice(kernel_s):
    solo = [kernel_s * (i + 1) for i in range(1000)]
    both = time_sliced(kernel_s, timeslice_s=0.002, switch_s=0.0001, total_s=2.0)
    found = estimate(solo, both)
    assert found["kernel_s"] == pytest.approx(kernel_s)
    if kernel_s < 0.002:  # a kernel longer than the timeslice is cut more than once an interval
        assert found["context_switch_s"] == pytest.approx(0.0001, rel=0.1)
        assert found["timeslice_s"] == pytest.approx(0.002, rel=0.05)
    assert found["busy_fraction"] == pytest.approx(0.002 / 0.0021, rel=0.02)


def test_two_processes_that_ran_at_once_show_no_switch():
    solo = [0.001 * (i + 1) for i in range(500)]
    both = [[0.0003 + 0.001 * (i + 1) for i in range(500)], [0.0007 + 0.001 * (i + 1) for i in range(500)]]
    both[0][250:] = [t + 0.0005 for t in both[0][250:]]  # the OS held one back once
    found = estimate(solo, both)
    assert (
        found["busy_fraction"] > 1.9
        and found["gaps"] == 0
        and found["context_switch_s"] == 0.0
        and found["timeslice_s"] is None
    )
    assert found["slowdown_p50"] == pytest.approx(1.0)


@pytest.mark.slow
def test_the_measurement_runs_on_cpu_actors():
    ray = pytest.importorskip("ray")
    from inferlab.experiment.timeslice import Spinner, measure

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actors = [ray.remote(num_gpus=0, num_cpus=0)(Spinner).remote() for _ in range(2)]
        assert ray.get(actors[0].where.remote())["cuda"] is False
        found = measure(actors, durations_s=(0.002,), seconds=0.2)
    finally:
        ray.shutdown()
    (run,) = found["runs"]
    assert run["kernel_s"] == pytest.approx(0.002, rel=0.5) and run["kernels"] > 50
    assert found["context_switch_s"] >= 0.0
