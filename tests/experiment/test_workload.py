"""Bench workloads: arrival processes with the asked rate and burstiness, generated workloads that
differ only in their arrivals, fitting to max_model_len, and settings that cannot run failing at
compose time (the compose API and the `inferlab` command)."""

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest

from inferlab.conf import BenchConfig, compose
from inferlab.conf.bench import BenchConfigError, validate_bench
from inferlab.experiment.workload import arrival_times, build_workload, fit_lengths

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
MOONCAKE = os.path.join(DATA, "mooncake_conversation_200.jsonl")


def gaps(arrivals: np.ndarray) -> np.ndarray:
    return np.diff(arrivals)


def test_poisson_arrivals_have_the_asked_rate_and_exponential_gaps():
    arrivals = arrival_times(20_000, "poisson", request_rate=4.0, seed=1)
    assert arrivals[0] == 0 and np.all(np.diff(arrivals) >= 0)
    inter = gaps(arrivals)
    assert inter.mean() == pytest.approx(1 / 4.0, rel=0.02)
    assert inter.std() / inter.mean() == pytest.approx(1.0, rel=0.03)  # exponential: CV 1
    # memorylessness: the fraction of gaps above the mean is e^-1
    assert np.mean(inter > 0.25) == pytest.approx(np.exp(-1), abs=0.01)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_keep_the_rate_and_have_cv_one_over_sqrt_burstiness(burstiness):
    inter = gaps(arrival_times(40_000, "gamma", request_rate=2.0, burstiness=burstiness, seed=7))
    assert inter.mean() == pytest.approx(0.5, rel=0.03)
    assert inter.std() / inter.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)


def test_arrivals_are_seeded():
    a = arrival_times(100, "gamma", request_rate=3.0, burstiness=0.5, seed=3)
    assert np.array_equal(a, arrival_times(100, "gamma", request_rate=3.0, burstiness=0.5, seed=3))
    assert not np.array_equal(a, arrival_times(100, "gamma", request_rate=3.0, burstiness=0.5, seed=4))
    assert np.array_equal(arrival_times(5, "burst"), np.zeros(5))


def test_generated_workloads_differ_only_in_arrivals():
    burst = BenchConfig(num_seqs=50, min_len=5, max_len=40, min_output_len=2, max_output_len=9, seed=5)
    poisson = replace(burst, arrival="poisson", request_rate=10.0)
    gamma = replace(burst, arrival="gamma", request_rate=10.0, burstiness=0.5)
    workloads = [build_workload(b, vocab_size=384, max_model_len=4096) for b in (burst, poisson, gamma)]
    prompts = [[r.prompt_token_ids for r in w.requests] for w in workloads]
    lengths = [[r.output_len for r in w.requests] for w in workloads]
    assert prompts[0] == prompts[1] == prompts[2] and lengths[0] == lengths[1] == lengths[2]
    assert [r.arrival_s for r in workloads[0].requests] == [0.0] * 50
    assert workloads[1].requests[-1].arrival_s > 0
    assert [r.arrival_s for r in workloads[1].requests] != [r.arrival_s for r in workloads[2].requests]
    params = workloads[1].sampling_params(poisson)
    assert [p.max_tokens for p in params] == lengths[1] and all(p.ignore_eos for p in params)
    summary = workloads[1].summary()
    assert summary["num_requests"] == 50 and summary["num_fitted"] == 0
    span = workloads[1].requests[-1].arrival_s
    assert summary["arrival_span_s"] == span and summary["offered_request_rate"] == pytest.approx(49 / span)
    assert workloads[0].summary()["offered_request_rate"] is None


def test_priorities_are_drawn_apart_from_everything_else():
    plain = BenchConfig(num_seqs=400, min_len=5, max_len=40, seed=2, arrival="poisson", request_rate=5.0)
    ranked = replace(plain, num_priorities=3)
    plain_workload, workload = (build_workload(b, vocab_size=384, max_model_len=4096) for b in (plain, ranked))
    assert {r.priority for r in plain_workload.requests} == {0}
    priorities = [r.priority for r in workload.requests]
    assert set(priorities) == {0, 1, 2} and all(abs(priorities.count(p) / 400 - 1 / 3) < 0.07 for p in range(3))
    assert [r.priority for r in build_workload(ranked, vocab_size=384, max_model_len=4096).requests] == priorities
    # the prompts, lengths and arrivals are those of the workload without priorities
    assert [(r.prompt_token_ids, r.output_len, r.arrival_s) for r in workload.requests] == [
        (r.prompt_token_ids, r.output_len, r.arrival_s) for r in plain_workload.requests
    ]
    trace = BenchConfig(arrival="trace", trace=MOONCAKE, num_priorities=2)
    assert {r.priority for r in build_workload(trace, vocab_size=384, max_model_len=4096).requests} == {0, 1}


def test_clip_cuts_prompts_then_outputs_and_counts_them():
    inputs, outputs, scale = fit_lengths([10, 70, 63, 0], [5, 5, 1, 0], max_model_len=64, fit="clip")
    assert (inputs, outputs, scale) == ([10, 63, 63, 1], [5, 1, 1, 1], 1.0)
    bench = BenchConfig(num_seqs=40, min_len=10, max_len=90, min_output_len=5, max_output_len=60)
    workload = build_workload(bench, vocab_size=384, max_model_len=64)
    changed = sum(
        1
        for r, (prompt_len, out_len) in zip(workload.requests, _unfitted_lengths(bench))
        if (len(r.prompt_token_ids), r.output_len) != (prompt_len, out_len)
    )
    assert workload.num_fitted == changed > 0


def _unfitted_lengths(bench):
    big = build_workload(bench, vocab_size=384, max_model_len=100_000)
    return [(len(r.prompt_token_ids), r.output_len) for r in big.requests]


def test_scale_shrinks_every_length_by_one_factor_so_the_longest_fits():
    inputs, outputs, scale = fit_lengths([100, 300, 50], [100, 100, 10], max_model_len=200, fit="scale")
    assert scale == pytest.approx(200 / 400)
    assert inputs == [50, 150, 25] and outputs == [50, 50, 5]
    assert max(i + o for i, o in zip(inputs, outputs)) <= 200
    # a prompt alone too long: the prompt bound decides
    inputs, outputs, scale = fit_lengths([1000], [1], max_model_len=100, fit="scale")
    assert scale == pytest.approx(99 / 1000) and inputs == [99] and outputs == [1]
    assert fit_lengths([10], [10], max_model_len=100, fit="scale") == ([10], [10], 1.0)


def test_trace_workload_scaled_to_a_small_model():
    bench = BenchConfig(arrival="trace", trace=MOONCAKE, fit="scale", max_requests=50)
    workload = build_workload(bench, vocab_size=384, max_model_len=256)
    assert len(workload.requests) == 50 and workload.num_fitted == 50 and workload.length_scale < 1
    assert all(len(r.prompt_token_ids) + r.output_len <= 256 for r in workload.requests)
    assert max(len(r.prompt_token_ids) + r.output_len for r in workload.requests) >= 250


BAD_SETTINGS = [
    (["bench.max_len=10", "bench.min_len=50"], "1 <= min_len <= max_len, got 50, 10"),
    (["bench.arrival=poisson"], "bench.arrival=poisson needs bench.request_rate, a finite number > 0"),
    (
        ["bench.arrival=gamma", "bench.request_rate=0"],
        "needs bench.request_rate, a finite number > 0 (requests/s, or arrival=burst for all at once), got 0",
    ),
    (
        ["bench.arrival=gamma", "bench.request_rate=1", "bench.burstiness=0"],
        "bench.burstiness must be a finite number > 0",
    ),
    (["bench.arrival=poisson", "bench.request_rate=1", "bench.burstiness=2"], "applies to arrival=gamma"),
    (["bench.arrival=trace"], "bench.arrival=trace needs bench.trace=PATH"),
    (["bench.arrival=trace", "bench.trace=/no/such/trace.jsonl"], "bench.trace: no file '/no/such/trace.jsonl'"),
    (["bench.arrival=uniform"], "bench.arrival must be one of burst, poisson, gamma, trace; got 'uniform'"),
    (
        ["bench.arrival=trace", f"bench.trace={MOONCAKE}", "bench.time_scale=0"],
        "bench.time_scale must be a finite number > 0",
    ),
    (["bench.arrival=trace", f"bench.trace={MOONCAKE}", "bench.max_requests=0"], "bench.max_requests must be >= 1"),
    (["bench.arrival=trace", f"bench.trace={MOONCAKE}", "bench.request_rate=2"], "set bench.time_scale"),
    ([f"bench.trace={MOONCAKE}"], "bench.trace is set but bench.arrival=burst"),
    (["bench.time_scale=0.5"], "bench.time_scale applies to arrival=trace, not burst"),
    (["bench.request_rate=3"], "bench.request_rate applies to arrival=poisson or gamma, not burst"),
    (["bench.burstiness=0.5"], "bench.burstiness=0.5 applies to arrival=gamma, not burst"),
    (["bench.fit=squeeze"], "bench.fit must be one of clip, scale"),
    (["bench.repeats=0"], "bench.repeats must be >= 1"),
    (["bench.num_priorities=0"], "bench.num_priorities must be >= 1"),
    (["bench.slo_ttft_s=0"], "bench.slo_ttft_s must be a positive number of seconds"),
    (["bench.slo_tpot_s=-1"], "bench.slo_tpot_s must be a positive number of seconds"),
    # infinities made arrival times NaN, which were never due: the runs hung
    (["bench.arrival=gamma", "bench.request_rate=2", "bench.burstiness=inf"], "bench.burstiness must be a finite"),
    (["bench.arrival=trace", f"bench.trace={MOONCAKE}", "bench.time_scale=inf"], "bench.time_scale must be a finite"),
    (["bench.arrival=poisson", "bench.request_rate=nan"], "needs bench.request_rate, a finite number > 0"),
    (["bench.arrival=poisson", "bench.request_rate=inf"], "needs bench.request_rate, a finite number > 0"),
    # a trace brings its own requests: these would be swept without effect
    (["bench.arrival=trace", f"bench.trace={MOONCAKE}", "bench.num_seqs=5"], "bench.num_seqs applies to generated"),
    (["bench.arrival=trace", f"bench.trace={MOONCAKE}", "bench.max_len=64"], "bench.max_len applies to generated"),
    (["bench.arrival=trace", f"bench.trace={MOONCAKE}", "bench.shared_prefix_len=8"], "shared_prefix_len applies"),
]


@pytest.mark.parametrize("overrides,message", BAD_SETTINGS)
def test_settings_that_cannot_run_fail_at_compose_time(overrides, message):
    with pytest.raises(BenchConfigError, match=re.escape(message)):
        compose(["job=bench", *overrides])


def test_a_file_in_no_trace_format_fails_at_compose_time(tmp_path):
    bad = tmp_path / "trace.csv"
    bad.write_text("time,prompt,output\n0,1,2\n")
    with pytest.raises(BenchConfigError, match=r"is in no known format: expected Mooncake JSONL .* Azure CSV"):
        compose(["job=bench", "bench.arrival=trace", f"bench.trace={bad}"])


def test_every_problem_is_named_at_once():
    bench = BenchConfig(arrival="gamma", request_rate=-1, burstiness=-2, repeats=0)
    with pytest.raises(BenchConfigError) as error:
        validate_bench(bench)
    assert str(error.value).count(";") == 2
    for message in (
        "request_rate, a finite number > 0",
        "burstiness must be a finite number > 0",
        "repeats must be >= 1",
    ):
        assert message in str(error.value)


def test_a_rate_too_small_for_floats_is_an_error_not_a_division_by_zero():
    with pytest.raises(ValueError, match="underflows to 0"):
        arrival_times(3, "gamma", request_rate=1e-200, burstiness=1e-200)
    with pytest.raises(ValueError, match="beyond float range"):
        arrival_times(3, "poisson", request_rate=1e-320)


def test_a_workload_too_large_to_draw_is_refused_at_once():
    # max_len=10**12 or num_seqs=10**11 drew every token before fitting: the run hung, then ran out of memory
    for overrides in (["bench.max_len=1000000000000"], ["bench.num_seqs=100000000000"]):
        start = time.perf_counter()
        with pytest.raises(BenchConfigError, match=r"bench draws up to [0-9,]+ prompt tokens .* more than the"):
            compose(["job=bench", *overrides])
        assert time.perf_counter() - start < 30


def test_prompts_longer_than_the_model_keep_only_what_fits_and_the_draws_stay_bench_pys():
    bench = BenchConfig(num_seqs=4, min_len=50_000, max_len=60_000, min_output_len=1, max_output_len=8)
    small = build_workload(bench, vocab_size=384, max_model_len=256)
    large = build_workload(bench, vocab_size=384, max_model_len=100_000)
    assert [r.prompt_token_ids for r in small.requests] == [r.prompt_token_ids[:255] for r in large.requests]
    assert [r.output_len for r in small.requests] == [1] * 4


def test_valid_latency_settings_compose():
    cfg = compose(["job=bench", "bench.arrival=gamma", "bench.request_rate=2.5", "bench.burstiness=0.5"])
    assert cfg.bench.arrival == "gamma" and cfg.bench.request_rate == 2.5
    cfg = compose(["job=bench", "bench.arrival=trace", f"bench.trace={MOONCAKE}", "bench.time_scale=0.1"])
    assert cfg.bench.trace == MOONCAKE
    # a generate job does not check bench settings it never uses
    assert compose(["bench.arrival=poisson"]).bench.arrival == "poisson"


def test_the_command_names_the_problem_without_a_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "inferlab", "job=bench", "bench.arrival=poisson", "bench.min_len=9", "bench.max_len=3"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("inferlab: bench.arrival=poisson needs bench.request_rate, a finite number > 0")
    assert "1 <= min_len <= max_len, got 9, 3" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    # the run's result.json records the error, so that a sweep's report lists the run as failed
    (result,) = list((tmp_path / "outputs").rglob("result.json"))
    saved = json.loads(result.read_text())
    assert saved["error"].startswith("BenchConfigError: bench.arrival=poisson needs")
    assert "bench.arrival=poisson" in saved["overrides"] and "num_output_tokens" not in saved
