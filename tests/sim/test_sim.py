"""The simulated executor: cost models fitted and evaluated as specified, the engine run on a
virtual clock with the real policy and KV manager, and the profiling job's measurements."""

import json
import re
from time import perf_counter

import numpy as np
import pytest
import torch

from inferlab import LLM, SamplingParams
from inferlab.core.cuda_graphs import prefill_graph_capacity
from inferlab.core.model_cost import DeviceRates, ModelCost
from inferlab.core.plugins import PluginError
from inferlab.sim.cost_model import (
    HostLaunchModel,
    MeasuredCostModel,
    RooflineCostModel,
    StepShape,
    nonnegative_least_squares,
)
from inferlab.sim.profile import Profile, load_profile, model_fields, shipped_profiles


def linear_truth(shape: StepShape) -> float:
    """A device whose steps cost 2 ms + 10 us a decode request + 1 ns a context token, and for
    prefill 3 ms + 20 ns a token + 0.5 ps a pair on top."""
    seconds = 0.0
    if shape.decode_requests:
        seconds += 2e-3 + 1e-5 * shape.decode_requests + 1e-9 * shape.decode_context
    if shape.prefill_tokens:
        seconds += 3e-3 + 2e-8 * shape.prefill_tokens + 5e-13 * shape.prefill_pairs
    return seconds


def measured(shapes) -> list[dict]:
    return [{**s.as_dict(), "seconds": linear_truth(s)} for s in shapes]


GRID = [StepShape(decode_requests=b, decode_context=b * c, graph=True) for b in (1, 4, 16, 64) for c in (128, 1024)]
GRID += [StepShape(decode_requests=b, decode_context=b * 512, graph=False) for b in (1, 64)]
GRID += [
    StepShape(prefill_tokens=n, prefill_pairs=n * c + n * (n + 1) // 2, prefill_requests=1)
    for n in (16, 256, 4096)
    for c in (0, 2048)
]
GRID += [
    StepShape(
        prefill_tokens=256,
        prefill_pairs=256 * 257 // 2,
        prefill_requests=1,
        decode_requests=16,
        decode_context=16 * 1024,
    )
]


def test_the_measured_model_recovers_a_linear_device():
    model = MeasuredCostModel(measured(GRID))
    unseen = [
        StepShape(decode_requests=32, decode_context=32 * 700, graph=True),
        StepShape(prefill_tokens=1000, prefill_pairs=1000 * 500 + 500_500, prefill_requests=1),
    ]
    for shape in GRID + unseen:
        assert model(shape) == pytest.approx(linear_truth(shape), rel=1e-6)
    described = model.describe()
    assert described["with_prefill"]["per_prefill_token_s"] == pytest.approx(2e-8, rel=1e-6)
    assert described["decode"]["graph"]["batch_sizes"] == [1, 4, 16, 64]


def test_small_prefill_steps_cost_the_host_floor():
    """A host that needs 20 ms to launch any eager step: the fit finds that floor and the device's
    linear cost above it, which a single line through every step could not."""

    def truth(shape: StepShape) -> float:
        if not shape.prefill_tokens:
            return linear_truth(shape)
        return max(0.02, 3e-3 + 1e-6 * shape.prefill_tokens + 2e-11 * shape.prefill_pairs)

    grid = [s for s in GRID if not s.prefill_tokens] + [
        StepShape(prefill_tokens=n, prefill_pairs=n * c + n * (n + 1) // 2, prefill_requests=1)
        for n in (16, 256, 4096, 16384, 32768)
        for c in (0, 16384, 65536)
    ]
    model = MeasuredCostModel([{**s.as_dict(), "seconds": truth(s)} for s in grid])
    assert model.describe()["with_prefill"]["host_floor_s"] == pytest.approx(0.02)
    for shape in grid:
        assert model(shape) == pytest.approx(truth(shape), rel=1e-6)


def test_graphed_prefill_steps_have_their_own_costs_and_no_host_floor():
    """Steps with prefill replayed from CUDA graphs: fitted apart from the eager ones (no floor,
    their own fixed part); with too few of them measured, the eager fit's device part serves."""

    def truth(shape: StepShape) -> float:
        if not shape.prefill_tokens:
            return linear_truth(shape)
        if shape.graph:  # the graph's padded size sets the per-token work
            return 5e-4 + 2e-7 * shape.graph_tokens + 1e-6 * shape.decode_requests
        return max(0.02, 3e-3 + 1e-6 * shape.prefill_tokens + 2e-11 * shape.prefill_pairs)

    eager = [
        StepShape(prefill_tokens=n, prefill_pairs=n * c + n * (n + 1) // 2, prefill_requests=1)
        for n in (16, 256, 4096, 16384, 32768)
        for c in (0, 16384, 65536)
    ]
    graphed = [
        StepShape(
            prefill_tokens=n,
            prefill_pairs=n * (n + 1) // 2,
            prefill_requests=1,
            decode_requests=d,
            graph=True,
            graph_tokens=prefill_graph_capacity(n + d, 8192),
        )
        for n in (16, 64, 256, 1024, 2100, 5000)
        for d in (0, 8)
    ]
    assert {s.graph_tokens for s in graphed if s.prefill_tokens == 2100} == {2304}
    grid = [s for s in GRID if not s.prefill_tokens] + eager + graphed
    model = MeasuredCostModel([{**s.as_dict(), "seconds": truth(s)} for s in grid])
    described = model.describe()
    assert described["with_prefill"]["host_floor_s"] == pytest.approx(0.02)
    assert described["with_prefill_graph"]["base_s"] == pytest.approx(5e-4)
    for shape in grid:
        assert model(shape) == pytest.approx(truth(shape), rel=1e-6)
    few = MeasuredCostModel(
        [{**s.as_dict(), "seconds": truth(s)} for s in grid if not s.graph or s.prefill_tokens < 64]
    )
    small = StepShape(prefill_tokens=16, prefill_pairs=136, prefill_requests=1, graph=True)
    assert few(small) == pytest.approx(3e-3 + 1e-6 * 16 + 2e-11 * 136, rel=1e-6)  # below the floor of eager steps
    # a profile older than graph_tokens: its graphed steps pay for their own tokens
    old = StepShape.from_measurement({k: v for k, v in small.as_dict().items() if k != "graph_tokens"})
    assert old == small and few(old) == few(small)


def test_the_host_launch_model_recovers_linear_launch_times(tmp_path):
    """host_seconds of graphed steps (0.7 ms, 0.5 ms more with prefill, 2 us a request, 0.5 us a
    prefill token, 0.1 ns a context token) and of eager ones (20 ms, 1 us a prefill token) are
    fitted apart; a profile without host_seconds launches in no time."""

    def truth(shape: StepShape) -> float:
        if not shape.graph:
            return 0.02 + 1e-6 * shape.prefill_tokens
        requests = shape.prefill_requests + shape.decode_requests
        return (
            7e-4
            + 5e-4 * bool(shape.prefill_tokens)
            + 2e-6 * requests
            + 5e-7 * shape.prefill_tokens
            + 1e-10 * shape.decode_context
        )

    graphed = [
        StepShape(prefill_tokens=n, prefill_requests=1, decode_requests=d, graph=True)
        for n in (16, 1024)
        for d in (0, 8)
    ]
    grid = GRID + graphed
    model = HostLaunchModel([{**s.as_dict(), "seconds": 1.0, "host_seconds": truth(s)} for s in grid])
    unseen = [
        StepShape(decode_requests=32, decode_context=32 * 700, graph=True),
        StepShape(prefill_tokens=300, prefill_requests=2, decode_requests=3, graph=True),
        StepShape(prefill_tokens=5000, prefill_requests=1),
    ]
    for shape in grid + unseen:
        assert model(shape) == pytest.approx(truth(shape), rel=1e-6)
    assert model.describe()["graph"]["with_prefill_s"] == pytest.approx(5e-4, rel=1e-6)
    with pytest.raises(ValueError, match="host_seconds"):
        HostLaunchModel(measured(GRID))
    assert load_profile(hand_profile(tmp_path)).host_launch_model() is None
    assert load_profile("h200-qwen3-0.6b-triton").host_launch_model() is not None


@pytest.mark.parametrize(
    "graph,launch_ms,token_ms",
    [
        # each step 2 ms on the device. A graph launched onto the idle device starts when its 1 ms
        # launch ends; then each next launch hides behind the step before it
        (True, 1.0, [3, 5, 7]),
        # launches of 5 ms bound the steps; a step's tokens are read after the next launch
        (True, 5.0, [10, 15, 17]),
        # an eager step's kernels start as they are launched, and it ends no earlier than its launch
        (False, 1.0, [2, 4, 6]),
        (False, 5.0, [10, 15, 15]),
    ],
)
def test_launching_a_step_takes_the_host_its_launch_time(graph, launch_ms, token_ms):
    """One request of three tokens under overlap scheduling (prefill, then two decodes)."""
    from inferlab.core.cuda_graphs import GraphLimits
    from inferlab.experiment.driver import run_workload
    from inferlab.experiment.workload import WorkloadRequest

    sim = LLM(executor="simulated", executor_options={"profile": "roofline"}, num_kvcache_blocks=64)
    sim.runner.cost_model = lambda shape: 0.002
    sim.runner.host_launch_model = lambda shape: launch_ms / 1e3
    sim.runner.graph_limits = GraphLimits(decode_batch=8, prefill_tokens=64) if graph else GraphLimits()
    sim.runner.profile.admission_s_per_request = sim.runner.profile.admission_s_per_token = 0.0
    run = run_workload(
        sim, [WorkloadRequest(0, 0.0, list(range(10, 18)), 3)], [SamplingParams(max_tokens=3, ignore_eos=True)]
    )
    assert run.requests[0].token_times_s == pytest.approx([t / 1e3 for t in token_ms])


def test_which_steps_replay_graphs():
    """StepShape.of marks as graphed the decode-only steps up to the decode batch limit and the
    steps with prefill up to the token limit (decodes included) whose decodes are shorter than
    the decode limit."""
    from inferlab.core.batch import ScheduledBatch
    from inferlab.core.cuda_graphs import GraphLimits
    from inferlab.core.request import Request

    def request(context, total):
        r = Request(0, list(range(total)), SamplingParams())
        r.num_computed_tokens = context
        return r

    def batch(*parts):  # (context, new tokens, total tokens)
        return ScheduledBatch([request(c, t) for c, _, t in parts], [n for _, n, _ in parts], [[] for _ in parts])

    limits = GraphLimits(decode_batch=2, prefill_tokens=64, decode_context=1000)
    assert StepShape.of(batch((10, 1, 11), (20, 1, 21)), limits).graph
    assert not StepShape.of(batch((10, 1, 11), (20, 1, 21), (5, 1, 6)), limits).graph  # three decodes
    assert StepShape.of(batch((0, 60, 100), (20, 1, 21)), limits).graph  # 61 tokens
    assert not StepShape.of(batch((0, 64, 100), (20, 1, 21)), limits).graph  # 65 tokens
    assert not StepShape.of(batch((0, 30, 100), (999, 1, 1000)), limits).graph  # a decode of 1,000 tokens
    assert StepShape.of(batch((0, 30, 100), (998, 1, 999)), limits).graph
    assert not StepShape.of(batch((0, 30, 100))).graph  # no limits: eager
    assert StepShape.of(batch((0, 30, 100)), GraphLimits(prefill_tokens=64)).graph  # decode_context 0: any decodes
    # the graph that replays a step with prefill computes its whole size: 61 tokens pad to 64, 2,100 to 2,304
    assert StepShape.of(batch((0, 60, 100), (20, 1, 21)), limits).graph_tokens == 64
    assert StepShape.of(batch((0, 2100, 3000)), GraphLimits(prefill_tokens=8192)).graph_tokens == 2304
    assert StepShape.of(batch((0, 64, 100), (20, 1, 21)), limits).graph_tokens == 0  # eager
    # the rows that sample: decodes, and the chunks that reach the end of what their request holds
    mixed = batch((10, 1, 11), (0, 30, 100), (70, 30, 100), (999, 1, 1000), (0, 1, 2))
    shape, sample_rows = StepShape.sampling(mixed, limits)
    assert shape == StepShape.of(mixed, limits)
    assert (shape.decode_requests, shape.prefill_requests, sample_rows) == (2, 3, [0, 2, 3])


def test_nonnegative_least_squares_drops_negative_costs():
    rows = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    assert nonnegative_least_squares(rows, np.array([3.0, 2.0, 1.0])) == pytest.approx([2.0, 0.0])


def test_roofline_is_the_larger_of_bytes_and_flops():
    cost = ModelCost(
        weight_bytes=1000,
        kv_bytes_per_token=10,
        flops_per_token=100.0,
        head_flops_per_token=20.0,
        attention_flops_per_pair=1.0,
    )
    model = RooflineCostModel(cost, DeviceRates("test", bandwidth=1000.0, matmul_rate=1e5), step_overhead_s=0.5)
    decode = StepShape(decode_requests=2, decode_context=30)
    # bytes: 1000 + 10 * 30 = 1300 -> 1.3 s; flops: 2 * 80 + 2 * 20 + 30 = 230 -> 0.0023 s
    assert model(decode) == pytest.approx(0.5 + 1.3)
    prefill = StepShape(prefill_tokens=1000, prefill_pairs=500_500, prefill_requests=1)
    flops = 1000 * 80 + 20 + 500_500  # layers for every token, the head once, attention pairs
    assert model(prefill) == pytest.approx(0.5 + max((1000 + 10 * 1000) / 1000, flops / 1e5))


def hand_profile(tmp_path, **extra) -> str:
    """A measured profile of the embedded model's shape whose steps cost linear_truth, measured with
    the torch backend in float32 (extra: fields over these)."""
    llm = LLM(device="cpu", num_kvcache_blocks=8)
    fields = dict(
        kind="measured",
        device="hand-written",
        model=model_fields(llm.hf_config),
        dtype="float32",
        kv_cache_dtype="float32",
        attention="torch",
        tensor_parallel_size=1,
        kv_cache_bytes=10**9,
        graph_batch_limit=512,
        measurements=measured(GRID),
    )
    profile = Profile(**{**fields, **extra})
    path = tmp_path / "hand.json"
    profile.save(str(path))
    return str(path)


def test_a_simulated_run_equals_the_hand_computation(tmp_path):
    """Two requests arriving together: one prefill step for both (a 10- and a 6-token prompt),
    which samples their first tokens, then two decode steps of both and two of the longer one. The clock ends at the sum of the steps' costs."""
    profile = hand_profile(tmp_path)
    llm = LLM(executor="simulated", executor_options={"profile": profile}, kvcache_block_size=16)
    params = [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)]
    outputs = llm.generate([list(range(1, 11)), list(range(1, 7))], params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == [3, 5]
    prefill = 3e-3 + 2e-8 * 16 + 5e-13 * (10 * 11 // 2 + 6 * 7 // 2)
    # decode steps: both requests at contexts (11, 7) and (12, 8), then the second alone at 9 and 10
    decode_two = [2e-3 + 2e-5 + 1e-9 * (11 + 7), 2e-3 + 2e-5 + 1e-9 * (12 + 8)]
    decode_one = [2e-3 + 1e-5 + 1e-9 * c for c in (9, 10)]
    assert llm.clock() == pytest.approx(prefill + sum(decode_two) + sum(decode_one), rel=1e-9)
    assert llm.runner.num_steps == 5


def test_admitting_requests_takes_the_profiles_host_time(tmp_path):
    """Each added request moves the virtual clock by the profile's admission cost (per request and
    per prompt token) before the step that serves it: the hand computation above, plus both
    requests' admissions; and in a driven burst every request's first token waits for all of them."""
    from inferlab.experiment.driver import run_workload
    from inferlab.experiment.records import simulation
    from inferlab.experiment.workload import WorkloadRequest

    profile = hand_profile(tmp_path, admission_s_per_request=1e-3, admission_s_per_token=1e-5)
    llm = LLM(executor="simulated", executor_options={"profile": profile}, kvcache_block_size=16)
    params = [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)]
    llm.generate([list(range(1, 11)), list(range(1, 7))], params, use_tqdm=False)
    admissions = 2e-3 + 1e-5 * (10 + 6)
    prefill = 3e-3 + 2e-8 * 16 + 5e-13 * (10 * 11 // 2 + 6 * 7 // 2)
    decodes = [2e-3 + 2e-5 + 1e-9 * (11 + 7), 2e-3 + 2e-5 + 1e-9 * (12 + 8)] + [2e-3 + 1e-5 + 1e-9 * c for c in (9, 10)]
    assert llm.clock() == pytest.approx(admissions + prefill + sum(decodes), rel=1e-9)

    llm = LLM(executor="simulated", executor_options={"profile": profile}, kvcache_block_size=16)
    burst = [WorkloadRequest(i, 0.0, list(range(1, 11)), 2) for i in range(3)]
    records = run_workload(llm, burst, [SamplingParams(max_tokens=2, ignore_eos=True)] * 3).requests
    assert records[0].first_token_s == pytest.approx(3 * (1e-3 + 1e-5 * 10) + 3e-3 + 2e-8 * 30 + 5e-13 * 3 * 55)
    assert simulation(llm)["simulated"]["admission_s"] == {"per_request": 1e-3, "per_prompt_token": 1e-5}


def test_a_real_time_simulation_takes_the_hand_computations_time_on_this_hosts_clock(tmp_path):
    """executor.real_time: the hand computation's run (admissions, a prefill, four decodes) takes
    at least its simulated time in wall time, the engine's clock reads perf_counter, and the
    tokens and steps are those of the virtual run; waiting for the device sleeps (little CPU,
    the GIL free for a server's event loop) while the host's work is a busy loop (all CPU)."""
    import time

    from inferlab.experiment.records import simulation
    from inferlab.plugins.executors.simulated import RealTimeClock

    profile = hand_profile(tmp_path, admission_s_per_request=1e-3, admission_s_per_token=1e-5)
    options = {"profile": profile, "real_time": True}
    llm = LLM(executor="simulated", executor_options=options, kvcache_block_size=16)
    params = [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)]
    start = perf_counter()
    outputs = llm.generate([list(range(1, 11)), list(range(1, 7))], params, use_tqdm=False)
    wall = perf_counter() - start
    admissions = 2e-3 + 1e-5 * (10 + 6)
    prefill = 3e-3 + 2e-8 * 16 + 5e-13 * (10 * 11 // 2 + 6 * 7 // 2)
    decodes = [2e-3 + 2e-5 + 1e-9 * (11 + 7), 2e-3 + 2e-5 + 1e-9 * (12 + 8)] + [2e-3 + 1e-5 + 1e-9 * c for c in (9, 10)]
    assert admissions + prefill + sum(decodes) <= wall < admissions + prefill + sum(decodes) + 2.0
    assert [len(o["token_ids"]) for o in outputs] == [3, 5] and llm.runner.num_steps == 5
    assert abs(llm.clock() - perf_counter()) < 0.1
    assert simulation(llm)["simulated"]["real_time"] is True

    clock = RealTimeClock()
    for busy in (False, True):
        cpu, begin = time.thread_time(), perf_counter()
        if busy:
            clock.spend(0.05)
        else:
            clock.advance_to(begin + 0.05)
        cpu, elapsed = time.thread_time() - cpu, perf_counter() - begin
        assert elapsed >= 0.05
        # the sleep takes next to no CPU; the busy loop all it is given, a share of a loaded machine's cores
        assert (cpu > 0.005) if busy else (cpu < 0.002), (busy, cpu)


def test_capacity_comes_from_the_profile_or_the_setting(tmp_path):
    profile = hand_profile(tmp_path)
    llm = LLM(executor="simulated", executor_options={"profile": profile}, kvcache_block_size=16)
    model = llm.runner.profile.model
    block_bytes = 2 * model["num_hidden_layers"] * model["num_key_value_heads"] * model["head_dim"] * 16 * 4
    assert llm.kv_manager.num_blocks == 10**9 // block_bytes
    small = LLM(
        executor="simulated", executor_options={"profile": profile}, kvcache_block_size=16, num_kvcache_blocks=3
    )
    assert small.kv_manager.num_blocks == 3
    outputs = small.generate([list(range(1, 30))] * 3, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert small.stats.num_preemptions > 0 and all(len(o["token_ids"]) == 8 for o in outputs)


def test_a_measured_profile_refuses_another_model(tmp_path, checkpoint):
    profile = hand_profile(tmp_path)
    with pytest.raises(ValueError, match="measured on another model shape"):
        LLM(checkpoint("gqa4-untied"), executor="simulated", executor_options={"profile": profile})


def test_a_measured_profile_refuses_another_head_dim(tmp_path, checkpoint):
    """The embedded model's shape with heads of 32 dimensions instead of 16: attention's cost per
    token differs, so the profile refuses it as it does another layer count."""
    profile = hand_profile(tmp_path)
    LLM(checkpoint({}), executor="simulated", executor_options={"profile": profile})  # the same shape runs
    with pytest.raises(ValueError, match="measured on another model shape .*head_dim: 16 != 32"):
        LLM(checkpoint({}, head_dim=32), executor="simulated", executor_options={"profile": profile})


@pytest.mark.parametrize(
    "setting,value,measured_with",
    [
        ("dtype", "bfloat16", "dtype=float32"),
        ("attention", "triton", "attention=torch"),
        ("kv_cache_dtype", "fp8", "kv_cache_dtype=float32"),
    ],
)
def test_a_measured_profile_refuses_settings_it_was_not_measured_with(tmp_path, setting, value, measured_with):
    """The hand profile was measured with the torch backend, float32 and a float32 KV cache: another
    backend, dtype or KV cache dtype would not change its step times, so it is refused, naming the
    setting, the profile and what the profile was measured with."""
    profile = hand_profile(tmp_path)
    with pytest.raises(ValueError) as refused:
        LLM(executor="simulated", executor_options={"profile": profile}, **{setting: value})
    message = str(refused.value)
    assert f"{setting}={value}" in message and profile in message and measured_with in message, message


def test_a_measured_profile_runs_its_own_settings_given_or_auto(tmp_path):
    """The profile's own settings, given or as 'auto', run, and results name them; a profile measured
    with an fp8 KV cache takes kv_cache_dtype=fp8 (its blocks a byte an element) and refuses 'auto',
    which is the model's dtype."""
    from inferlab.experiment.records import resolved_plugins

    profile = hand_profile(tmp_path)
    for settings in ({}, {"dtype": "float32", "attention": "torch", "kv_cache_dtype": "auto"}):
        llm = LLM(executor="simulated", executor_options={"profile": profile}, kvcache_block_size=16, **settings)
        assert resolved_plugins(llm)["attention"] == "torch"
        assert (llm.runner.dtype, llm.runner.kv_cache_dtype) == (torch.float32, torch.float32)
    fp8 = hand_profile(tmp_path, kv_cache_dtype="float8_e4m3fn")
    llm = LLM(executor="simulated", executor_options={"profile": fp8}, kvcache_block_size=16, kv_cache_dtype="fp8")
    model = llm.runner.profile.model
    assert llm.kv_manager.num_blocks == 10**9 // (
        2 * model["num_hidden_layers"] * model["num_key_value_heads"] * model["head_dim"] * 16
    )
    with pytest.raises(ValueError, match=r"kv_cache_dtype=auto \(float32\).*kv_cache_dtype=float8_e4m3fn"):
        LLM(executor="simulated", executor_options={"profile": fp8})


def test_a_shipped_profile_refuses_an_fp8_kv_cache():
    """The reproduction from the command line: the 0.6B profile, measured with a bfloat16 cache, no
    longer sizes and times an fp8 one as if it were bfloat16."""
    with pytest.raises(ValueError, match=r"kv_cache_dtype=fp8 .*h200-qwen3-0.6b-triton.*kv_cache_dtype=bfloat16"):
        LLM(executor="simulated", executor_options={"profile": "h200-qwen3-0.6b-triton"}, kv_cache_dtype="fp8")


def test_the_roofline_estimate_models_dtypes_and_no_attention_backend():
    """The roofline estimate counts the dtype's and the KV cache dtype's bytes (an fp8 cache holds
    twice the blocks and reads half the bytes), and models no attention backend, which results
    record as 'any' whatever attention says."""
    from inferlab.experiment.records import resolved_plugins

    # A thousandth of an H200's memory: the tiny model's blocks would otherwise number tens of millions.
    small = dict(kvcache_block_size=16, gpu_memory_utilization=0.001)
    bf16 = LLM(executor="simulated", **small)
    fp8 = LLM(executor="simulated", **small, kv_cache_dtype="fp8", attention="torch")
    assert (bf16.runner.dtype, bf16.runner.kv_cache_dtype) == (torch.bfloat16, torch.bfloat16)
    assert fp8.runner.kv_cache_dtype == torch.float8_e4m3fn
    assert fp8.runner.cost_model.cost.kv_bytes_per_token * 2 == bf16.runner.cost_model.cost.kv_bytes_per_token
    assert fp8.kv_manager.num_blocks == pytest.approx(2 * bf16.kv_manager.num_blocks, abs=1)
    assert resolved_plugins(fp8)["attention"] == "any"
    f32 = LLM(executor="simulated", **small, dtype="float32")
    assert f32.runner.cost_model.cost.weight_bytes == 2 * bf16.runner.cost_model.cost.weight_bytes


@pytest.fixture(scope="module")
def hand_profile_data(tmp_path_factory) -> dict:
    return json.loads(open(hand_profile(tmp_path_factory.mktemp("hand"))).read())


def _set(path: str, value):
    """An edit of a profile's data: `value` at `path` (keys and list indices, dot-separated)."""

    def edit(data):
        *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
        node = data
        for key in parents:
            node = node[key]
        node[last] = value
        return data

    return edit


def _drop_decodes(data):
    data["measurements"] = [m for m in data["measurements"] if m["prefill_tokens"]]
    return data


@pytest.mark.parametrize(
    "text,expected",
    [
        ("", "not JSON"),
        ("[1, 2]", "JSON object"),
        (_set("kind", "bogus"), "kind must be one of ['measured', 'roofline'], got 'bogus'"),
        (_set("measurements.0.seconds", float("nan")), "measurements[0].seconds must be a finite number > 0, got nan"),
        (_set("measurements.3.seconds", -0.001), "measurements[3].seconds must be a finite number > 0, got -0.001"),
        (_set("measurements.2.host_seconds", float("inf")), "measurements[2].host_seconds must be a finite number > 0"),
        (_set("measurements.1.decode_requests", -4), "measurements[1].decode_requests must be a whole number >= 0"),
        (_set("measurements.1.graph", "yes"), "measurements[1].graph must be true or false"),
        (_set("measurements", []), "a measured profile needs measurements"),
        (_drop_decodes, "no decode-only measurements"),
        (_set("kv_cache_bytes", 0), "kv_cache_bytes must be a whole number > 0, got 0"),
        (_set("kv_cache_bytes", -5), "kv_cache_bytes must be a whole number > 0, got -5"),
        (_set("kv_cache_bytes", 1.5e9), "kv_cache_bytes must be a whole number > 0, got 1500000000.0"),
        (_set("tensor_parallel_size", 0), "tensor_parallel_size must be a whole number > 0"),
        (_set("dtype", "float64"), "dtype must be one of ['bfloat16', 'float16', 'float32'], got 'float64'"),
        (_set("kv_cache_dtype", "int8"), "kv_cache_dtype must be one of"),
        (_set("model.head_dim", 0), "model.head_dim must be a whole number > 0, got 0"),
        (_set("admission_s_per_request", float("nan")), "admission_s_per_request must be a finite number >= 0"),
        (_set("graph_batch_limit", -1), "graph_batch_limit must be a whole number >= 0"),
        (
            lambda d: {**d, "kind": "roofline", "rates": {"bandwidth": 0.0, "matmul_rate": 1e12}},
            "rates.bandwidth must be a finite number > 0, got 0.0",
        ),
        (lambda d: {**d, "kind": "roofline", "rates": {}}, "rates must hold bandwidth and matmul_rate"),
    ],
)
def test_a_malformed_profile_file_is_refused_naming_the_file_and_the_field(tmp_path, hand_profile_data, text, expected):
    path = tmp_path / "bad.json"
    if callable(text):
        text = json.dumps(text(json.loads(json.dumps(hand_profile_data))))
    path.write_text(text)
    with pytest.raises(ValueError) as refused:
        load_profile(str(path))
    message = str(refused.value)
    assert str(path) in message and expected in message, message


@pytest.mark.parametrize(
    "option,value,expected",
    [
        ("roofline_step_overhead_s", float("nan"), "finite number of seconds >= 0, got nan"),
        ("roofline_step_overhead_s", float("inf"), "finite number of seconds >= 0, got inf"),
        ("roofline_step_overhead_s", -0.001, "finite number of seconds >= 0, got -0.001"),
        ("roofline_step_overhead_s", "0.1", "finite number of seconds >= 0, got '0.1'"),
        ("real_time", "false", "True or False, got 'false'"),
        ("roofline_device", "a100", "one of ['h200'], got 'a100'"),
        ("profile", 3, "got 3"),
    ],
)
def test_bad_executor_options_are_refused_before_the_run(option, value, expected):
    from inferlab.plugins.executors.simulated import SimulatedOptions

    with pytest.raises(ValueError, match=f"executor.{option} .*" + re.escape(expected)):
        SimulatedOptions(**{option: value})
    if (option, value) in (("roofline_step_overhead_s", "0.1"), ("real_time", "false"), ("profile", 3)):
        return  # LLM's options are typed as the command line types them: "0.1" is 0.1 there, 3 the profile "3"
    with pytest.raises(PluginError, match=f"executor.{option} "):  # as every plugin's bad options
        LLM(executor="simulated", executor_options={"profile": "h200-qwen3-0.6b-triton", option: value})


def test_a_nan_step_overhead_from_the_command_line_is_refused_when_the_engine_is_built():
    from inferlab.conf import compose, engine_arguments

    cfg = compose(["job=bench", "executor=simulated", "executor.roofline_step_overhead_s=nan"])
    model_path, settings = engine_arguments(cfg)
    with pytest.raises(PluginError, match="executor.roofline_step_overhead_s must be a finite number"):
        LLM(model_path, **settings)


def test_bad_executor_settings_are_errors(tmp_path):
    with pytest.raises(PluginError, match=r"unknown executor 'fast'; available: \[.*'real', 'simulated'"):
        LLM(executor="fast")
    with pytest.raises(PluginError, match=r"bad options for executor 'simulated': .*speed"):
        LLM(executor="simulated", executor_options={"speed": 2})
    with pytest.raises(FileNotFoundError, match="no step-time profile 'nope'"):
        load_profile("nope")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="not a step-time profile"):
        load_profile(str(bad))


def test_the_roofline_profile_serves_any_shape(checkpoint):
    llm = LLM(checkpoint("gqa4-untied"), executor="simulated", kvcache_block_size=16, num_kvcache_blocks=64)
    assert "roofline estimate" in llm.runner.profile.label()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert llm.clock() > 0


def test_a_slow_host_in_one_graphed_decode_measurement_leaves_the_device_model_alone():
    """Decode steps replayed from graphs are fitted to the device's own time where the profile
    recorded it: a host slow throughout one composition's measurement (its interval three times
    its device time, as in the H100 profile's batch 8) must not raise the neighbouring batch sizes'
    predictions; without device times the interval is all there is."""
    points = measured(GRID)
    for m in points:
        if m["graph"] and not m["prefill_tokens"]:
            m["device_seconds"] = m["seconds"]
    paused = next(m for m in points if m["graph"] and m["decode_requests"] == 4 and not m["prefill_tokens"])
    paused["seconds"] *= 3
    model = MeasuredCostModel(points)
    for batch in (2, 4, 8):
        shape = StepShape(decode_requests=batch, decode_context=batch * 700, graph=True)
        assert model(shape) == pytest.approx(linear_truth(shape), rel=1e-6)
    for m in points:
        m.pop("device_seconds", None)
    shape = StepShape(decode_requests=4, decode_context=4 * 700, graph=True)
    assert MeasuredCostModel(points)(shape) > 1.5 * linear_truth(shape)


def test_the_shipped_h100_profile_predicts_decode_steps_rising_with_the_batch():
    """The H100 profile's measurement of batch 8 at 129 tokens of context ran on a slow host
    (interval 3.7 ms, launches 2.6 ms, device 1.2 ms): batches between 4 and 16 must still cost
    between them."""
    model = load_profile("h100-qwen3-0.6b-triton").cost_model()
    times = [model(StepShape(decode_requests=b, decode_context=b * 700, graph=True)) for b in (4, 6, 8, 12, 16)]
    assert times == sorted(times)


@pytest.mark.parametrize("name", shipped_profiles())
def test_shipped_profiles_load_and_fit(name):
    profile = load_profile(name)
    assert profile.kind == "measured" and profile.measurements
    model = profile.cost_model()
    errors = [abs(model(StepShape.from_measurement(m)) / m["seconds"] - 1) for m in profile.measurements]
    assert np.median(errors) < 0.05, f"the fit misses its own measurements by {np.median(errors):.1%} (median)"


def test_the_host_and_device_lines_list_decode_steps_alone():
    from inferlab.experiment.profile_job import host_and_device_lines

    shape = {"prefill_tokens": 0, "decode_requests": 4, "decode_context": 4 * 513, "graph": True}
    measurements = [
        {**shape, "seconds": 0.002, "device_seconds": 0.001},
        # a step with prefill replaying a graph, no decodes: its zero decode context must not pass for one
        {
            **shape,
            "prefill_tokens": 16,
            "decode_requests": 0,
            "decode_context": 0,
            "seconds": 0.03,
            "device_seconds": 0.03,
        },
        {**shape, "graph": False, "seconds": 0.004},  # eager: no device time taken apart
    ]
    assert host_and_device_lines(measurements) == [
        "decode batch   4 at 512 tokens of context: step 2.000 ms, device 1.000 ms (2.00x)"
    ]


def test_profiling_measures_the_real_engine_and_the_fit_reads_it(tmp_path):
    """job=profile's measurement on the CPU engine (on a GPU it is the same code): every
    composition of the grid that fits becomes a measurement, and the profile loads and fits."""
    from inferlab.conf import ProfileConfig
    from inferlab.experiment.profile_job import measure, run_profile

    settings = ProfileConfig(repeats=2, decode_batches=[1, 4], decode_contexts=[16, 64], prefill_tokens=[16, 64])
    with LLM(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256) as llm:
        measurements = measure(llm, settings)
        shapes = {(m["decode_requests"], m["decode_context"], m["prefill_tokens"]) for m in measurements}
        # decode batches of 1 and 4 at contexts 16 and 64, prefills of 16 and 64 tokens; the mixed
        # steps' decodes (at context 1024) exceed max_model_len and are left out
        assert shapes == {(1, 17, 0), (1, 65, 0), (4, 68, 0), (4, 260, 0), (0, 0, 16), (0, 0, 64)}
        assert all(m["seconds"] > 0 for m in measurements)
        assert all(0 < m["host_seconds"] <= 2 * m["seconds"] for m in measurements)  # launch() alone
        assert llm.kv_manager.num_free_blocks == llm.kv_manager.num_blocks  # every measured step's blocks freed
        profile = run_profile(llm, settings, "test")
        assert profile.admission_s_per_request > 0 and profile.admission_s_per_token >= 0
        assert llm.is_finished()  # the admission measurement's requests were all aborted
    path = tmp_path / "cpu.json"
    profile.save(str(path))
    loaded = load_profile(str(path))
    assert loaded.kind == "measured" and loaded.source["command"] == "test"
    sim = LLM(executor="simulated", executor_options={"profile": str(path)}, kvcache_block_size=16)
    sim.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert sim.clock() > 0


@pytest.mark.parametrize("host,device", [(0.002, 0.005), (0.005, 0.002)])
def test_a_profiled_step_takes_its_device_time_or_its_launch_whichever_is_longer(monkeypatch, host, device):
    """A runner whose launch takes the host `host` seconds and whose step then takes the device
    `device` seconds, on a virtual clock: the profiled step time is the steady interval between
    reads, max(host, device), without the first launch onto the idle device."""
    from inferlab.conf import ProfileConfig
    from inferlab.experiment import profile_job as profiling
    from inferlab.plugins.executors.simulated import VirtualClock

    class Step:
        def __init__(self, ends_at):
            self.ends_at = ends_at

        def tokens(self):
            clock.advance_to(self.ends_at)
            return []

    clock, device_free_at = VirtualClock(), [0.0]

    def launch(batch):
        clock.now += host
        device_free_at[0] = max(device_free_at[0], clock.now) + device
        return Step(device_free_at[0])

    with LLM(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256) as llm:
        monkeypatch.setattr(llm.runner, "launch", launch)
        monkeypatch.setattr(profiling.time, "perf_counter", clock)
        measurement = profiling.StepTimer(llm, repeats=5).time([(16, 1)])
        monkeypatch.undo()
    assert measurement["seconds"] == pytest.approx(max(host, device))
    assert measurement["host_seconds"] == pytest.approx(host)
    with pytest.raises(ValueError, match="repeats"):
        ProfileConfig(repeats=1)


def test_a_step_with_a_prompt_is_timed_on_fresh_requests_each_launch():
    """Relaunching one batch meets the same rows again; a run's prompt steps meet new ones, so
    prompt-bearing compositions alternate two sets of requests, decode-only ones keep one."""
    from inferlab.experiment import profile_job as profiling

    with LLM(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256) as llm:
        launch, launched = llm.runner.launch, []

        def recording(batch, *args, **kwargs):
            launched.append(tuple(r.request_id for r in batch.requests))
            return launch(batch, *args, **kwargs)

        llm.runner.launch = recording
        timer = profiling.StepTimer(llm, repeats=3)
        for parts, fresh, sets in (
            ([(0, 24), (16, 1)], True, 2),
            ([(16, 1)] * 2, True, 1),
            ([(0, 24), (16, 1)], False, 1),
            ([(0, 250)] * 3, True, 1),  # two sets would not fit the cache: one, relaunched
        ):
            launched.clear()
            timer.fresh_prompts = fresh
            assert timer.time(parts) is not None
            assert len(set(launched)) == sets
            assert all(a != b for a, b in zip(launched, launched[1:])) == (sets == 2)
        assert llm.kv_manager.num_free_blocks == 64  # every set's blocks went back
        del llm.runner.launch


class ReplayCost:
    """A cost model that returns measured step times, in order."""

    def __init__(self, seconds: list[float]):
        self.seconds = iter(seconds)

    def __call__(self, shape: StepShape) -> float:
        return next(self.seconds)


def recorded_launches(llm, clock=None) -> tuple[list, list]:
    """Wraps llm's runner so that every launched batch's (request id, tokens) is recorded; with a
    clock, also each launch's real duration (the forward pass and sampling, read back), by which
    the clock moves."""
    batches, durations, launch = [], [], llm.runner.launch

    def recording(batch):
        batches.append([(r.request_id, n) for r, n in zip(batch.requests, batch.num_scheduled_tokens)])
        start = perf_counter()
        handle = launch(batch)
        if clock is not None:
            handle.tokens()
            durations.append(perf_counter() - start)
            clock.now += durations[-1]
        return handle

    llm.runner.launch = recording
    return batches, durations


def test_the_same_policy_code_schedules_real_and_simulated_runs_alike(tmp_path):
    """A Poisson workload on the embedded model, under preemption: the real engine, whose clock
    moves by each real step's measured duration (and jumps over idle time, as a simulation's
    does), then a simulated engine whose cost model replays those durations. The policy and the
    KV manager are the same code in both: every step's batch is the same, and so is every
    request's record."""
    from inferlab.conf import compose
    from inferlab.experiment.driver import run_workload
    from inferlab.experiment.workload import build_workload
    from inferlab.plugins.executors.simulated import VirtualClock

    cfg = compose(
        [
            "job=bench",
            "bench.arrival=poisson",
            "bench.request_rate=40",
            "bench.num_seqs=24",
            "bench.min_len=8",
            "bench.max_len=60",
            "bench.max_output_len=12",
            "bench.min_output_len=2",
        ]
    )
    settings = dict(
        scheduler="lpm",
        kvcache_block_size=16,
        num_kvcache_blocks=10,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        overlap_scheduling=False,  # the real steps here are timed one at a time
    )
    real = LLM(device="cpu", **settings)
    workload = build_workload(cfg.bench, real.hf_config.vocab_size, real.config.max_model_len)
    params = workload.sampling_params(cfg.bench)
    clock = VirtualClock()
    real.clock, real.wait_until = clock, clock.advance_to
    real_batches, measured = recorded_launches(real, clock)
    real_run = run_workload(real, workload.requests, params)
    assert real.stats.num_preemptions > 0, "the cache was meant to be small enough to preempt"

    sim = LLM(executor="simulated", executor_options={"profile": "roofline"}, **settings)
    sim.runner.cost_model = ReplayCost(measured)
    sim_batches, _ = recorded_launches(sim)
    sim_run = run_workload(sim, workload.requests, params)
    assert sim_batches == real_batches
    # pytest.approx compares flat sequences of numbers, not nested tuples: ids and counts exactly, times approximately.
    assert [(r.request_id, r.num_preemptions) for r in sim_run.requests] == [
        (r.request_id, r.num_preemptions) for r in real_run.requests
    ]
    times = [(r.first_scheduled_s, r.first_token_s, r.finish_s) for r in sim_run.requests]
    real_times = [(r.first_scheduled_s, r.first_token_s, r.finish_s) for r in real_run.requests]
    assert [t for row in times for t in row] == pytest.approx([t for row in real_times for t in row])


@pytest.mark.parametrize("overlap", [True, False])
def test_a_simulated_request_arriving_mid_step_waits_as_on_the_device(overlap):
    """Steps of 10 ms on the virtual device. Under overlap scheduling (a simulation's default, as
    a GPU engine's) the step after the running one is launched before a new arrival is seen, so the
    arrival's prefill runs one step later than without overlap; its tokens are read when each step
    ends."""
    from inferlab.experiment.driver import run_workload
    from inferlab.experiment.workload import WorkloadRequest

    options = {} if overlap else {"overlap_scheduling": False}
    sim = LLM(executor="simulated", executor_options={"profile": "roofline"}, num_kvcache_blocks=64, **options)
    assert sim.overlap is overlap
    sim.runner.cost_model = lambda shape: 0.01
    sim.runner.profile.admission_s_per_request = sim.runner.profile.admission_s_per_token = 0.0
    requests = [WorkloadRequest(0, 0.0, list(range(10, 18)), 20), WorkloadRequest(1, 0.025, list(range(20, 28)), 3)]
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in requests]
    run = run_workload(sim, requests, params)
    first, second = run.requests
    # the first request's tokens come at the end of each step: 10 ms, 20 ms, ...
    assert first.token_times_s == pytest.approx([0.01 * (k + 1) for k in range(20)])
    # seen at 30 ms (the end of the step it arrived in); under overlap the step launched at 20 ms
    # still runs until 40 ms, so its prefill ends at 50 ms, else at 40 ms
    assert second.first_token_s == pytest.approx(0.05 if overlap else 0.04)
    assert second.token_times_s == pytest.approx([second.first_token_s + 0.01 * k for k in range(3)])


def test_a_profiles_fits_are_made_once_for_equal_measurements():
    """A fleet's replicas each load the profile: the fitted models are shared, never fitted again,
    and measurements that changed are fitted anew."""
    first, second = load_profile("h200-qwen3-8b-triton"), load_profile("h200-qwen3-8b-triton")
    assert first is not second
    assert first.cost_model() is second.cost_model()
    assert first.host_launch_model() is second.host_launch_model()
    changed = load_profile("h200-qwen3-8b-triton")
    changed.measurements = [dict(m, seconds=m["seconds"] * 2) for m in changed.measurements]
    assert changed.cost_model() is not first.cost_model()
    shape = StepShape(prefill_tokens=512, prefill_pairs=512 * 513 // 2, prefill_requests=1)
    assert changed.cost_model()(shape) > first.cost_model()(shape)
