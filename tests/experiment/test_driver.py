"""The latency driver: requests join the engine's step loop only once they have arrived on the
engine's clock, none is dropped under overload, refused requests are recorded, repeats start from
a fresh prefix cache, shortest-job-first beats FCFS on mean TTFT under overload, and `job=bench`
writes result.json, requests.jsonl and the timeline for Poisson arrivals and a Mooncake trace."""

import json
import os
import subprocess
import sys

import pytest

from inferlab import LLM, SamplingParams
from inferlab.conf import BenchConfig, compose
from inferlab.core.plugins import PluginRegistry
from inferlab.experiment.bench import measure, run_bench
from inferlab.experiment.driver import request_record, run_workload
from inferlab.experiment.latency import latency_figures
from inferlab.experiment.traces import MOONCAKE_BLOCK_SIZE
from inferlab.experiment.workload import WorkloadRequest, build_workload

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
MOONCAKE = os.path.join(DATA, "mooncake_conversation_200.jsonl")
ENGINE = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=256)
DISTRIBUTIONS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")


class VirtualClock:
    """A clock that moves only when read (tick seconds a reading) or told to wait: steps then take
    time in proportion to the clock readings they make, the same on every machine."""

    def __init__(self, tick: float = 0.001):
        self.now = 0.0
        self.tick = tick
        self.waits: list[float] = []

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def wait_until(self, t: float) -> None:
        self.waits.append(t)
        self.now = max(self.now, t)


def workload_of(bench: BenchConfig, llm):
    workload = build_workload(bench, llm.hf_config.vocab_size, llm.config.max_model_len)
    return workload, workload.sampling_params(bench)


def test_requests_are_added_only_once_they_have_arrived(one_torch_thread):
    """On a virtual clock: every request is first scheduled no earlier than its arrival, idle gaps
    are waited through wait_until (never a sleep), and every request runs to its length."""
    bench = BenchConfig(
        arrival="poisson", request_rate=2.0, num_seqs=12, min_len=4, max_len=20, min_output_len=1, max_output_len=6
    )
    with LLM(**ENGINE, max_num_seqs=2) as llm:
        clock = llm.clock = VirtualClock()
        workload, params = workload_of(bench, llm)
        start = clock.now + clock.tick  # the run's t=0: the clock's next reading
        run = run_workload(llm, workload.requests, params, wait_until=clock.wait_until)
    assert [r.request_id for r in run.requests] == list(range(12))
    for record, request in zip(run.requests, workload.requests):
        assert record.arrival_s == pytest.approx(request.arrival_s)
        assert record.first_scheduled_s >= record.arrival_s
        assert (record.finish_reason, record.num_output_tokens) == ("length", request.output_len)
    # at 2 requests/s and a millisecond a clock reading the engine idles between arrivals
    arrivals = [start + request.arrival_s for request in workload.requests]
    assert clock.waits and all(min(abs(t - a) for a in arrivals) < 1e-9 for t in clock.waits)
    assert run.wall_time_s >= run.requests[-1].finish_s and len(run.steps) >= 1
    assert all(step.end_s >= step.start_s for step in run.steps)


@pytest.mark.parametrize("arrivals", [[0.0, float("nan")], [float("nan")], [0.0, float("inf")], [1.0, 0.5], [-1.0]])
def test_arrivals_that_are_not_finite_and_in_order_are_refused_before_anything_runs(arrivals, one_torch_thread):
    # a NaN arrival passed the old check (every comparison with NaN is false) and was never due: the run hung
    requests = [WorkloadRequest(i, t, [1, 2, 3], 2) for i, t in enumerate(arrivals)]
    with LLM(**ENGINE) as llm:
        with pytest.raises(ValueError, match="in arrival order, with finite arrival_s >= 0"):
            run_workload(llm, requests, [SamplingParams(max_tokens=2)] * len(requests))
        assert llm.is_finished()


def test_nothing_is_dropped_under_overload(one_torch_thread):
    """A burst of 40 requests on a cache of six 16-token blocks: every request queues in the engine,
    some are preempted, and all finish with their full length."""
    bench = BenchConfig(num_seqs=40, min_len=8, max_len=40, min_output_len=4, max_output_len=24, seed=1)
    with LLM(**{**ENGINE, "num_kvcache_blocks": 6}, max_num_seqs=4) as llm:
        workload, params = workload_of(bench, llm)
        figures, run = measure(llm, workload.requests, params)
    assert figures["num_requests"] == 40 and figures["num_failed_requests"] == figures["num_aborted_requests"] == 0
    assert [r.num_output_tokens for r in run.requests] == [r.output_len for r in workload.requests]
    assert figures["num_preemptions"] > 0 and figures["num_preemptions"] == sum(r.num_preemptions for r in run.requests)
    assert max(step.num_seqs for step in run.steps) > 1
    assert figures["queue_s"]["p99"] > figures["queue_s"]["p50"] >= 0


def test_a_request_too_large_for_the_cache_is_recorded_as_refused(one_torch_thread):
    requests = [
        WorkloadRequest(0, 0.0, list(range(1, 9)), 4),
        WorkloadRequest(1, 0.0, list(range(1, 200)), 4),  # 203 tokens: more than 8 blocks of 16
        WorkloadRequest(2, 0.01, list(range(1, 9)), 4),
    ]
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in requests]
    with LLM(**{**ENGINE, "num_kvcache_blocks": 8}) as llm:
        figures, run = measure(llm, requests, params)
    refused = run.requests[1]
    assert refused.finish_reason == "error" and "KV blocks" in refused.error and refused.num_output_tokens == 0
    assert [r.finish_reason for r in run.requests] == ["length", "error", "length"]
    assert figures["num_failed_requests"] == 1 and figures["num_requests"] == 3
    assert figures["request_throughput"] == pytest.approx(2 / figures["wall_time_s"])


class ShortestJobFirst:
    """The examples' sjf policy (examples/sjf_scheduler), registered here by hand."""

    def admission_order(self, waiting, state):
        return sorted(waiting, key=lambda view: view.max_tokens - view.num_output_tokens)

    def preemption_victim(self, running, state):
        return max(running, key=lambda view: view.max_tokens - view.num_output_tokens)


def test_shortest_job_first_has_a_lower_mean_ttft_than_fcfs_under_overload(plugin_module, one_torch_thread):
    """Poisson arrivals far faster than a batch of one can serve: the queue holds most of the
    workload, and serving short jobs first cuts the mean wait (queueing theory: SJF minimizes
    it). The outputs vary 1..60 tokens, so the order matters. On the virtual clock a step takes as
    long as its clock readings, so the comparison does not depend on the machine's load."""
    registry = PluginRegistry()
    # a name of its own, so that the installed example (if any) does not clash with it
    register_schedulers = lambda register: register("shortest_first", ShortestJobFirst)  # noqa: E731
    registry.register(plugin_module("shortest_first", register_schedulers=register_schedulers))
    bench = BenchConfig(
        arrival="poisson",
        request_rate=500.0,
        num_seqs=24,
        min_len=8,
        max_len=16,
        min_output_len=1,
        max_output_len=60,
        seed=0,
    )
    mean_ttft = {}
    for scheduler in ("fcfs", "shortest_first"):
        with LLM(**ENGINE, scheduler=scheduler, registry=registry, max_num_seqs=1) as llm:
            clock = llm.clock = VirtualClock()
            workload, params = workload_of(bench, llm)
            figures, run = measure(llm, workload.requests, params, wait_until=clock.wait_until)
        assert figures["num_requests"] == 24 and figures["num_output_tokens"] == sum(p.max_tokens for p in params)
        mean_ttft[scheduler] = figures["ttft_s"]["mean"]
    assert mean_ttft["shortest_first"] < 0.8 * mean_ttft["fcfs"], mean_ttft


def test_repeats_start_from_a_fresh_prefix_cache(tmp_path, one_torch_thread):
    """Three requests far apart in time, the second sharing the first's first hash block: each
    repeat hits exactly that block, where a cache kept from the repeat before would hit everything."""
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [0, 1]},
        {"timestamp": 300, "input_length": 700, "output_length": 2, "hash_ids": [0, 2]},
        {"timestamp": 600, "input_length": 300, "output_length": 2, "hash_ids": [3]},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    overrides = [
        "job=bench",
        "engine.device=cpu",
        "engine.kvcache_block_size=16",
        "engine.num_kvcache_blocks=256",
        "engine.max_model_len=1024",
        "bench.arrival=trace",
        f"bench.trace={trace}",
        "bench.repeats=2",
        "bench.warmup=false",
    ]
    result = run_bench(compose(overrides), output_dir=str(tmp_path / "run"))
    expected = MOONCAKE_BLOCK_SIZE / 1600
    assert [r["prefix_cache_hit_rate"] for r in result["repeats"]] == pytest.approx([expected, expected])
    assert [r["num_cached_tokens"] for r in result["repeats"]] == [MOONCAKE_BLOCK_SIZE] * 2
    lines = [json.loads(line) for line in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert [(line["repeat"], line["request_id"], line["num_cached_tokens"]) for line in lines] == [
        (0, 0, 0),
        (0, 1, MOONCAKE_BLOCK_SIZE),
        (0, 2, 0),
        (1, 0, 0),
        (1, 1, MOONCAKE_BLOCK_SIZE),
        (1, 2, 0),
    ]


def check_latency_result(result: dict, run_dir, num_requests: int) -> None:
    """result.json holds every latency figure, today's keys, and requests.jsonl a line per request."""
    for key in DISTRIBUTIONS:
        assert set(result[key]) == {"mean", "std", "p50", "p90", "p99"} and result[key]["p50"] is not None, key
    assert result["ttft_s"]["p99"] >= result["ttft_s"]["p50"] > 0
    assert result["request_throughput"] > 0 and result["output_tokens_per_s"] > 0
    assert result["num_requests"] == num_requests and result["num_failed_requests"] == 0
    for key in ("plugins", "plugin_options", "engine", "plugin_packages", "triton_interpret", "torch_version"):
        assert key in result, key
    assert result["workload"]["num_requests"] == num_requests
    lines = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert [line["request_id"] for line in lines] == list(range(num_requests))
    assert sum(line["num_output_tokens"] for line in lines) == result["num_output_tokens"]
    assert [line["ttft_s"] for line in lines] == pytest.approx(
        [line["first_token_s"] - line["arrival_s"] for line in lines]
    )
    timeline = json.loads((run_dir / "timeline.json").read_text())
    steps = [e for e in timeline["traceEvents"] if e["ph"] == "X" and e["cat"] == "step"]
    spans = [e for e in timeline["traceEvents"] if e["ph"] == "X" and e["name"].startswith("request ")]
    assert len(steps) == result["num_steps"] and len(spans) == num_requests


@pytest.mark.slow
def test_poisson_run_through_the_command(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "inferlab",
            "job=bench",
            "engine.device=cpu",
            "engine.kvcache_block_size=16",
            "engine.num_kvcache_blocks=128",
            "engine.max_model_len=128",
            "engine.max_num_seqs=4",
            "bench.arrival=poisson",
            "bench.request_rate=40",
            "bench.num_seqs=16",
            "bench.min_len=8",
            "bench.max_len=48",
            "bench.min_output_len=2",
            "bench.max_output_len=12",
            "bench.slo_ttft_s=0.5",
            "bench.slo_tpot_s=0.5",
            "bench.timeline=true",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    check_latency_result(result, tmp_path / "run", 16)
    assert 0 <= result["slo_attainment"] <= 1
    assert result["goodput"] == pytest.approx(result["slo_attainment"] * 16 / result["wall_time_s"])
    assert result["workload"]["arrival"] == "poisson" and result["workload"]["offered_request_rate"] > 0
    assert result["timeline_files"] == ["timeline.json"] and "floor_seconds" not in result
    assert (
        "16 requests (poisson)" in proc.stdout and "TTFT p50 " in proc.stdout and "SLOs (TTFT <= 500 ms" in proc.stdout
    )


@pytest.mark.slow
def test_mooncake_trace_run(tmp_path, one_torch_thread):
    """The excerpt's first 16 requests, ten times faster, lengths scaled to a 4096-token model
    (by 4096 / 87571, its longest request): the trace's shared system-prompt block gives prefix-cache hits."""
    overrides = [
        "job=bench",
        "engine.device=cpu",
        "engine.kvcache_block_size=16",
        "engine.num_kvcache_blocks=1024",
        "engine.max_model_len=4096",
        "engine.max_num_seqs=8",
        "bench.arrival=trace",
        f"bench.trace={MOONCAKE}",
        "bench.max_requests=16",
        "bench.time_scale=0.1",
        "bench.fit=scale",
        "bench.timeline=true",
        "bench.slo_ttft_s=1",
    ]
    result = run_bench(compose(overrides), output_dir=str(tmp_path))
    check_latency_result(result, tmp_path, 16)
    workload = result["workload"]
    assert workload["trace_format"] == "mooncake" and workload["num_fitted"] == 16 and workload["length_scale"] < 1
    assert workload["arrival_span_s"] == pytest.approx(0.3)  # the 16th request arrives at 3 s, ten times faster
    assert result["prefix_cache_hit_rate"] > 0 and result["num_cached_tokens"] > 0
    assert "slo_attainment" in result and "goodput" in result


def test_a_burst_keeps_its_throughput_figures_and_gains_latency(tmp_path, one_torch_thread):
    overrides = [
        "job=bench",
        "engine.device=cpu",
        "engine.kvcache_block_size=16",
        "engine.num_kvcache_blocks=128",
        "engine.max_model_len=128",
        "bench.num_seqs=6",
        "bench.min_len=8",
        "bench.max_len=40",
        "bench.min_output_len=2",
        "bench.max_output_len=6",
        "bench.timeline=true",
    ]
    result = run_bench(compose(overrides), output_dir=str(tmp_path))
    check_latency_result(result, tmp_path, 6)
    assert result["output_tokens_per_s"] == pytest.approx(result["num_output_tokens"] / result["wall_time_s"])
    assert result["num_output_tokens"] == result["num_decode_tokens"] + 6  # the first token comes with the prefill
    assert 0 < result["floor_seconds"] < result["wall_time_s"]
    assert result["percent_of_floor"] == pytest.approx(100 * result["floor_seconds"] / result["wall_time_s"])
    assert all(line["arrival_s"] == 0 for line in map(json.loads, (tmp_path / "requests.jsonl").open()))


def test_request_record_of_an_engine_request(one_torch_thread):
    """Times relative to the run's start; the finish is never before the last token's time."""
    with LLM(**ENGINE) as llm:
        start = llm.clock()
        request_id = llm.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), priority=2)
        request = llm.requests[request_id]
        with pytest.raises(ValueError, match="has not finished"):
            request_record(request, start)
        while not llm.is_finished():
            llm.step()
    record = request_record(request, start, request_id="a")
    assert record.request_id == "a" and record.priority == 2 and record.num_output_tokens == 3
    assert record.token_times_s == pytest.approx([t - start for t in request.token_times])
    assert record.finish_s == max(request.finish_time - start, record.token_times_s[-1])
    assert latency_figures([record], record.finish_s)["ttft_s"]["mean"] == record.ttft_s
