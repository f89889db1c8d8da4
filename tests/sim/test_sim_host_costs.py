"""The simulator's host costs beyond launching a step (the engine's own work on a step, rebuilding
sampling settings for new rows, waking up after idling), its measured step-time noise, and the
profile job's measurements of them."""

import ctypes
import json
import os
import re
import sys
import threading
from time import perf_counter

import numpy as np
import pytest
from test_sim import GRID, hand_profile, measured

from inferlab import LLM, SamplingParams
from inferlab.experiment.driver import run_workload
from inferlab.experiment.workload import WorkloadRequest
from inferlab.sim.cost_model import StepNoise, StepShape
from inferlab.sim.profile import PROFILE_DIR, load_profile, shipped_profiles

PARAMS = [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)]
PROMPTS = [list(range(1, 11)), list(range(1, 7))]
# the hand computation of test_sim: one prefill step of both prompts, two decode steps of both,
# two of the longer one
PREFILL = 3e-3 + 2e-8 * 16 + 5e-13 * (10 * 11 // 2 + 6 * 7 // 2)
DECODES = [2e-3 + 2e-5 + 1e-9 * (11 + 7), 2e-3 + 2e-5 + 1e-9 * (12 + 8)] + [2e-3 + 1e-5 + 1e-9 * c for c in (9, 10)]


def simulated(profile: str, **settings) -> LLM:
    return LLM(executor="simulated", executor_options={"profile": profile, **settings.pop("options", {})}, **settings)


def test_each_step_pays_the_engines_own_host_work(tmp_path):
    """Without overlap every step's host work adds to the clock: per step, per request in the
    batch and per prefill token, on top of the hand computation's device times."""
    profile = hand_profile(
        tmp_path, step_host_s_per_step=1e-3, step_host_s_per_request=1e-4, step_host_s_per_prefill_token=1e-6
    )
    llm = simulated(profile, kvcache_block_size=16, overlap_scheduling=False)
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    host = 5 * 1e-3 + 1e-4 * (2 + 2 + 2 + 1 + 1) + 1e-6 * 16
    assert llm.clock() == pytest.approx(PREFILL + sum(DECODES) + host, rel=1e-9)
    described = llm.runner.describe()["step_host_s"]
    assert described == {"per_step": 1e-3, "per_request": 1e-4, "per_prefill_token": 1e-6}


def test_under_overlap_the_engines_host_work_hides_behind_a_longer_device_step(tmp_path):
    """The first step's host work delays it; the later ones (0.2 ms each) run while the device
    computes the step before (2 ms and more), so the run ends that first cost later, no more."""
    profile = hand_profile(tmp_path, step_host_s_per_step=2e-4)
    llm = simulated(profile, kvcache_block_size=16)
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert llm.clock() == pytest.approx(2e-4 + PREFILL + sum(DECODES), rel=1e-9)


def recorded_setups(llm, real: bool) -> list[bool]:
    """For each launch of llm's runner that samples: whether it (re)built its sampling settings."""
    runner, setups = llm.runner, []
    launch = runner.launch
    if real:
        build = runner.sampling_tensors

        def sampling_tensors(rows, steps):
            cached = runner._sampling_cache
            tensors = build(rows, steps)
            setups.append(runner._sampling_cache is not cached)
            return tensors

        runner.sampling_tensors = sampling_tensors
        return setups

    def recording(batch):
        before = runner.sampling_rows
        handle = launch(batch)
        if handle.sample_rows:
            setups.append(runner.sampling_rows is not before)
        return handle

    runner.launch = recording
    return setups


def test_a_launch_pays_the_sampling_setup_exactly_when_the_real_runner_rebuilds_it(tmp_path):
    """A burst of requests with different lengths through at most three at a time, so that rows
    join and leave: the simulated runner charges the rebuild of sampling settings at exactly the
    launches where the real runner (under overlap, as on a GPU) rebuilds them, each costing the
    profile's time for its rows."""
    settings = dict(kvcache_block_size=16, max_num_seqs=3, max_num_batched_tokens=32, overlap_scheduling=True)
    prompts = [list(range(1 + i, 9 + 3 * i)) for i in range(6)]
    params = [SamplingParams(max_tokens=2 + (5 * i) % 7, ignore_eos=True) for i in range(6)]
    real = LLM(device="cpu", num_kvcache_blocks=32, **settings)
    real_setups = recorded_setups(real, real=True)
    real.generate(prompts, params, use_tqdm=False)
    profile = hand_profile(tmp_path, sampling_setup_s_per_step=1e-3, sampling_setup_s_per_row=1e-4)
    sim = simulated(profile, num_kvcache_blocks=32, **settings)
    sim_setups = recorded_setups(sim, real=False)
    sim.generate(prompts, params, use_tqdm=False)
    assert sim_setups == real_setups
    assert any(real_setups) and not all(real_setups)


def test_the_sampling_setup_costs_its_rows(tmp_path):
    """A launch of two sampling rows after one of other rows pays 1 ms + 2 x 0.1 ms more than the
    same launch repeated."""
    from inferlab.core.batch import ScheduledBatch
    from inferlab.core.request import Request

    profile = hand_profile(tmp_path, sampling_setup_s_per_step=1e-3, sampling_setup_s_per_row=1e-4)
    llm = simulated(profile, kvcache_block_size=16, overlap_scheduling=False)
    runner = llm.runner
    runner.host_launch_model = None
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    requests = [Request(i, [1, 2, 3], params) for i in range(2)]
    for request in requests:
        request.num_computed_tokens = 2
    batch = ScheduledBatch(requests, [1, 1], [[0], [1]])
    costs = []
    for _ in range(2):
        before = runner.clock()
        runner.launch(batch)
        costs.append(runner.clock() - before)
    assert costs == pytest.approx([1e-3 + 2e-4, 0.0])


def test_launching_in_a_run_costs_the_profiles_factor_over_relaunching(tmp_path):
    """A profile whose host launches take 1 ms, measured to take 1.5 times that in a run: each
    launch of the sim moves the clock by 1.5 ms, the sampling setup included in what it scales."""
    from inferlab.core.batch import ScheduledBatch
    from inferlab.core.request import Request

    profile = hand_profile(tmp_path, launch_in_run_factor=1.5, sampling_setup_s_per_step=1e-3)
    llm = simulated(profile, kvcache_block_size=16, overlap_scheduling=False)
    runner = llm.runner
    runner.host_launch_model = lambda shape: 1e-3
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    request = Request(0, [1, 2, 3], params)
    request.num_computed_tokens = 2
    batch = ScheduledBatch([request], [1], [[0]])
    costs = []
    for _ in range(2):
        before = runner.clock()
        runner.launch(batch)
        costs.append(runner.clock() - before)
    assert costs == pytest.approx([1.5 * 2e-3, 1.5e-3])
    assert load_profile(profile).launch_in_run_factor == 1.5


def test_a_launch_onto_an_idle_engine_pays_its_wake_up(tmp_path):
    """The profile's wake-up costs, linear between its idle times: a request arriving 55 ms after
    the device finished the last step gets its first token 1 + (4 - 1) x 45 / 90 ms later than on
    a profile without them; the first, arriving at the run's start, pays nothing."""
    params = [SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=2, ignore_eos=True)]
    idle_wake = [[0.01, 0.001], [0.1, 0.004]]

    def run(wake, arrival):
        llm = simulated(hand_profile(tmp_path, idle_wake=wake), kvcache_block_size=16)
        requests = [
            WorkloadRequest(0, 0.0, list(range(10, 18)), 1),
            WorkloadRequest(1, arrival, list(range(20, 28)), 2),
        ]
        return run_workload(llm, requests, params).requests

    first_done = run([], 1.0)[0].finish_s  # the device's last step before the idle time ends here
    plain, woken = run([], first_done + 0.055), run(idle_wake, first_done + 0.055)
    assert woken[0].ttft_s == pytest.approx(plain[0].ttft_s)
    assert woken[1].ttft_s - plain[1].ttft_s == pytest.approx(0.001 + 0.003 * 45 / 90)
    profile = load_profile(hand_profile(tmp_path, idle_wake=idle_wake))
    assert [profile.idle_wake_seconds(t) for t in (0, 0.005, 0.01, 1.0)] == pytest.approx([0, 0.0005, 0.001, 0.004])


def spread(shapes, cv: float) -> list[dict]:
    return [{**m, "seconds_std": cv * m["seconds"]} for m in measured(shapes)]


def test_step_noise_draws_around_the_prediction_with_the_measured_spread():
    """Each kind of step takes the spread of its nearest measured composition; the draws have mean
    1 and that coefficient of variation; a seed gives the same draws again; scale 0, or
    measurements without a spread, give none."""
    decodes = [s for s in GRID if not s.prefill_tokens]
    prefills = [s for s in GRID if s.prefill_tokens]
    noise = StepNoise(spread(decodes, 0.02) + spread(prefills, 0.1), scale=1.0, seed=7)
    decode = StepShape(decode_requests=16, decode_context=16 * 300, graph=True)
    prefill = StepShape(prefill_tokens=300, prefill_pairs=300 * 301 // 2, prefill_requests=1)
    assert noise.cv(decode) == pytest.approx(0.02) and noise.cv(prefill) == pytest.approx(0.1)
    draws = np.array([noise(prefill, 1.0) for _ in range(20000)])
    assert draws.mean() == pytest.approx(1.0, abs=0.005)
    assert draws.std() == pytest.approx(0.1, rel=0.05)
    assert (draws > 0).all()
    noise.reseed(7)
    again = [noise(prefill, 1.0) for _ in range(5)]
    assert again == draws[:5].tolist()
    assert StepNoise(spread(GRID, 0.1), scale=0.0).active is False
    assert StepNoise(measured(GRID), scale=1.0).active is False  # a profile measured before seconds_std


def test_a_simulated_run_with_noise_varies_by_seed_and_is_reproducible(tmp_path):
    """With the measured spread each step's time is a draw: the same engine seed gives the same
    run, another seed (or reseed) another, and executor.noise=0 the hand computation exactly."""
    profile = hand_profile(tmp_path, measurements=spread(GRID, 0.05))
    clocks = []
    for seed, noise in ((0, 1.0), (0, 1.0), (1, 1.0), (0, 0.0)):
        llm = simulated(profile, kvcache_block_size=16, seed=seed, options={"noise": noise})
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        clocks.append(llm.clock())
    assert clocks[0] == clocks[1] != clocks[2]
    assert clocks[3] == pytest.approx(PREFILL + sum(DECODES), rel=1e-9)
    assert clocks[0] == pytest.approx(clocks[3], rel=0.2)
    llm = simulated(profile, kvcache_block_size=16, seed=5)
    llm.runner.reseed(0)  # as a bench's repeat does: the draws restart from the given seed
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert llm.clock() == clocks[0]
    assert llm.runner.describe()["noise"]["scale"] == 1.0


@pytest.mark.parametrize("name", shipped_profiles())
def test_profiles_measured_before_the_host_costs_load_without_them(name):
    """A shipped profile measured before these fields holds none: it loads, with no noise and no
    host costs beyond admission and launch, as it ran before."""
    profile = load_profile(name)
    with open(os.path.join(PROFILE_DIR, f"{name}.json")) as f:
        data = json.load(f)
    for key in ("step_host_s_per_step", "sampling_setup_s_per_step", "idle_wake"):
        if key not in data:
            assert not getattr(profile, key)
    if not any("seconds_std" in m for m in data["measurements"]):
        assert not StepNoise(profile.measurements, 1.0).active


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("step_host_s_per_request", -1e-6, "step_host_s_per_request must be a finite number >= 0"),
        ("sampling_setup_s_per_row", float("nan"), "sampling_setup_s_per_row must be a finite number >= 0"),
        ("idle_wake", [[0.1, 0.001], [0.01, 0.002]], "idle_wake must be a list of [idle seconds, extra seconds]"),
        ("idle_wake", [[0.1]], "idle_wake must be a list"),
        ("launch_in_run_factor", 0, "launch_in_run_factor must be a finite number > 0"),
    ],
)
def test_bad_host_costs_are_refused_naming_the_field(tmp_path, field, value, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        hand_profile(tmp_path, **{field: value})


def test_a_bad_noise_setting_is_refused():
    with pytest.raises(Exception, match="executor.noise must be a finite number >= 0"):
        LLM(executor="simulated", executor_options={"profile": "roofline", "noise": -1})


def test_profiling_measures_the_host_costs_and_the_spread(tmp_path):
    """job=profile's new measurements on the CPU engine: each composition's spread, the engine's
    own step work, the sampling setup and the idle wake-up, all finite and >= 0; the engine is left
    as it was (no requests, every block free, its counters untouched)."""
    from inferlab.conf import ProfileConfig
    from inferlab.experiment.profile_job import host_cost_lines, run_profile

    settings = ProfileConfig(repeats=3, decode_batches=[1, 4], decode_contexts=[16], prefill_tokens=[16, 64])
    with LLM(device="cpu", kvcache_block_size=16, num_kvcache_blocks=300, max_model_len=256) as llm:
        profile = run_profile(llm, settings, "test")
        assert llm.is_finished() and llm.kv_manager.num_free_blocks == llm.kv_manager.num_blocks
        assert llm.stats.num_steps == 0
    assert all(m["seconds_std"] >= 0 for m in profile.measurements)
    assert profile.step_host_s_per_step + profile.step_host_s_per_request > 0
    assert profile.sampling_setup_s_per_step + profile.sampling_setup_s_per_row > 0
    assert [gap for gap, _ in profile.idle_wake] == [0.002, 0.02, 0.2]
    assert all(extra >= 0 for _, extra in profile.idle_wake)
    assert 0 < profile.launch_in_run_factor < 100
    path = tmp_path / "cpu.json"
    profile.save(str(path))
    assert load_profile(str(path)).step_host_s_per_step == profile.step_host_s_per_step
    lines = host_cost_lines(profile)
    assert any("engine's own work on a step" in line for line in lines)


@pytest.mark.skipif(sys.platform != "linux", reason="timer slack is Linux's")
def test_the_real_runners_sleeps_end_on_time():
    """sleep_until (how a driver waits for an arrival) sets its thread's timer slack to 1 us, so
    that a sleep ends within microseconds of its time rather than Linux's default 50 us."""
    from inferlab.core.model_runner import sleep_until

    slack = {}

    def sleeper():
        prctl = ctypes.CDLL(None).prctl
        prctl(29, 50_000, 0, 0, 0)  # PR_SET_TIMERSLACK to Linux's default (a thread inherits its creator's)
        slack["before"] = prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK
        sleep_until(perf_counter() + 0.001)
        slack["after"] = prctl(30, 0, 0, 0, 0)

    for _ in range(2):  # the second thread may get the first's id: it still sets its own slack
        thread = threading.Thread(target=sleeper)
        thread.start()
        thread.join()
        assert slack == {"before": 50_000, "after": 1000}


def test_a_profile_dropped_into_the_profile_directory_ships_by_its_name(tmp_path, monkeypatch):
    """The device's profiles ship as <card>-<model>-<backend>.json beside the H200 ones: the list
    of shipped profiles names them and an engine takes them by name."""
    import shutil

    from inferlab.sim import profile as profiles

    for name in shipped_profiles():
        shutil.copy(os.path.join(PROFILE_DIR, f"{name}.json"), tmp_path)
    shutil.copy(os.path.join(PROFILE_DIR, "h200-qwen3-0.6b-triton.json"), tmp_path / "h100-qwen3-0.6b-triton.json")
    monkeypatch.setattr(profiles, "PROFILE_DIR", str(tmp_path))
    assert "h100-qwen3-0.6b-triton" in profiles.shipped_profiles()
    llm = LLM(executor="simulated", executor_options={"profile": "h100-qwen3-0.6b-triton"})
    assert llm.runner.profile.kind == "measured"
