"""`inferlab job=bench`: a workload on the configured engine (nano-vllm's bench.py by default),
driven through the engine's step loop with its arrivals, with the figures (throughput, latency,
what ran, where) written to result.json in the run's output directory, every request's record to
requests.jsonl beside it and, with bench.timeline, the run's Perfetto trace.

bench.py: random.seed(0); 256 prompts of randint(100, 1024) token ids randint(0, 10000); then for
each a max_tokens of randint(100, 1024); temperature 0.6, ignore_eos; one warm-up generate; then
output tokens / wall time of one run over all of them, every request arriving at t=0 (the burst).
bench.shared_prefix_len and bench.num_prefixes put one of a few shared prefixes before each
prompt, for prefix-cache ablations.

The workload itself (arrival processes, traces, fitting, validation) is inferlab.experiment.workload; the
loop that adds requests as they arrive and records them, inferlab.experiment.driver; the latency figures of
its records, inferlab.experiment.latency; a run's Perfetto trace, inferlab.experiment.timeline.
"""

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict

from omegaconf import DictConfig

import inferlab
from inferlab.conf import PLUGIN_FIELDS, engine_arguments, flat_choices, validate_bench
from inferlab.core.engine import EngineStats
from inferlab.core.model_cost import model_cost
from inferlab.core.protocols import OnDevice, PrefixCacheStats, SimulatedDevice
from inferlab.core.sampling_params import SamplingParams
from inferlab.experiment.driver import run_workload
from inferlab.experiment.floor import device_rates, workload_floor
from inferlab.experiment.http_client import run_http_bench
from inferlab.experiment.latency import RunRecords, aggregate_repeats, latency_figures
from inferlab.experiment.records import (
    environment,
    record_result,
    resolved_plugins,
    start_run_record,
    write_run_records,
)
from inferlab.experiment.workload import WorkloadRequest, build_workload


def warm_up(llm) -> None:
    """bench.py's warm-up: one short generate before anything is timed."""
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)


def measure(
    llm,
    requests: Sequence[WorkloadRequest],
    params: Sequence,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
    wait_until: Callable[[float], None] | None = None,
) -> tuple[dict, RunRecords]:
    """Runs the workload once through the driver (inferlab.experiment.driver.run_workload) and returns its
    figures with the run's records. The figures are the latency figures of its records
    (inferlab.experiment.latency.latency_figures, with the SLOs given) and the engine's: prefill and decode
    tokens/s, computed tokens, steps, the time blocked on the device, and prefix_cache_hit_rate as
    the KV manager counts hits (readmissions after preemption included); for a burst (every
    request at t=0) also the workload's floor on this device."""
    llm.stats = EngineStats()
    counts_hits = isinstance(llm.kv_manager, PrefixCacheStats)
    hits_before = llm.kv_manager.prefix_cache_stats()[0] if counts_hits else 0
    started = time.perf_counter()
    run = run_workload(llm, requests, params, wait_until)
    host_seconds = time.perf_counter() - started
    stats = llm.stats
    latency = latency_figures(run.requests, run.wall_time_s, slo_ttft_s, slo_tpot_s)
    figures = {
        "output_tokens_per_s": latency["output_tokens_per_s"],
        "prefill_tokens_per_s": stats.num_prefill_tokens / stats.prefill_seconds if stats.prefill_seconds else None,
        "decode_tokens_per_s": stats.num_decode_tokens / stats.decode_seconds if stats.decode_seconds else None,
        "wall_time_s": run.wall_time_s,
        **latency,
        "num_prefill_tokens": stats.num_prefill_tokens,  # computed, so prefix-cache hits are not in it
        "num_decode_tokens": stats.num_decode_tokens,
        "num_steps": stats.num_steps,
        "wait_seconds": stats.wait_seconds,  # blocked on the device; the rest of the wall time is CPU work
    }
    if isinstance(llm.runner, SimulatedDevice):  # what the simulation itself cost, on this host's clock
        figures["simulator_seconds"] = host_seconds
        figures["simulator_us_per_step"] = 1e6 * host_seconds / max(stats.num_steps, 1)
    if counts_hits and latency["num_prompt_tokens"]:
        hits = llm.kv_manager.prefix_cache_stats()[0] - hits_before
        figures["prefix_cache_hit_rate"] = hits / latency["num_prompt_tokens"]
    # the floor of a burst on the device that ran it (a simulation has its profile, not a device)
    if all(r.arrival_s == 0 for r in requests) and isinstance(llm.runner, OnDevice):
        figures.update(
            floor_figures(
                llm, [r.num_prompt_tokens for r in run.requests], [r.num_output_tokens for r in run.requests], run
            )
        )
    return figures, run


def floor_figures(llm, prompt_lengths: list[int], output_lengths: list[int], run: RunRecords) -> dict:
    """The workload's hardware floor on this device (inferlab.experiment.floor) and how close the run came."""
    floor = workload_floor(
        prompt_lengths,
        output_lengths,
        model_cost(llm.hf_config, llm.runner.dtype, llm.runner.kv_cache_dtype, llm.config.tensor_parallel_size),
        device_rates(llm.runner.device, llm.runner.dtype),
    )
    return {
        **floor,
        "percent_of_floor": 100 * floor["floor_seconds"] / run.wall_time_s,
        "percent_of_strict_floor": 100 * floor["strict_floor_seconds"] / run.wall_time_s,
    }


def run_bench(cfg: DictConfig, output_dir: str | None = None) -> dict:
    """Runs the benchmark cfg describes and writes result.json, requests.jsonl and (with
    bench.timeline) the timeline into output_dir (default: the Hydra run's output directory). The
    bench settings are checked first (BenchConfigError), before anything is built. A run that fails
    writes result.json with its error and settings (so that a sweep's report lists it), then raises.
    With bench.url, the workload goes to that server over HTTP instead (inferlab.experiment.http_client)."""
    if cfg.bench.url:
        return run_http_bench(cfg, output_dir)
    path, context = start_run_record(cfg, output_dir, flat_choices(cfg))
    output_dir = os.path.dirname(path)

    def figures() -> dict:
        validate_bench(cfg.bench)
        return _bench_figures(cfg, output_dir)

    result = record_result(path, context, figures)
    print(summary_lines(result, path))
    return result


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.3g} ms" if value < 1 else f"{value:.3g} s"


def summary_lines(result: dict, path: str) -> str:
    """The lines run_bench prints: throughput, latency percentiles, SLOs, requests not served, and
    the floor where it applies (a burst)."""
    rate = lambda value: f"{value:.0f}" if value is not None else "-"  # noqa: E731
    repeats = f" (mean of {result['num_repeats']} repeats)" if "num_repeats" in result else ""
    workload = result["workload"]
    lines = [
        f"{result['num_requests']:g} requests ({workload['arrival']}), {result['num_output_tokens']:.0f} output tokens in "
        f"{result['wall_time_s']:.2f} s{repeats}: {result['output_tokens_per_s']:.0f} tok/s, "
        f"{result['request_throughput']:.3g} req/s (prefill {rate(result['prefill_tokens_per_s'])} tok/s, "
        f"decode {rate(result['decode_tokens_per_s'])} tok/s, {result['num_preemptions']} preemptions) -> {path}",
        f"TTFT p50 {_seconds(result['ttft_s']['p50'])}, p99 {_seconds(result['ttft_s']['p99'])}; "
        f"TPOT p50 {_seconds(result['tpot_s']['p50'])}, p99 {_seconds(result['tpot_s']['p99'])}; "
        f"queue p50 {_seconds(result['queue_s']['p50'])}, p99 {_seconds(result['queue_s']['p99'])}",
    ]
    if "slo_attainment" in result:
        bounds = [
            f"{name} <= {_seconds(result['bench'][key])}"
            for name, key in (("TTFT", "slo_ttft_s"), ("TPOT", "slo_tpot_s"))
            if result["bench"].get(key) is not None
        ]
        if result["bench"].get("classes"):
            bounds.append("each class's own")
        lines.append(
            f"SLOs ({', '.join(bounds)}): {100 * result['slo_attainment']:.1f}% of requests attained them, "
            f"goodput {result['goodput']:.3g} req/s"
        )
    for name, figures in (result.get("classes") or {}).items():
        if figures is None:
            continue
        attained = figures.get("slo_attainment")
        lines.append(
            f"class {name}: {figures['num_requests']:g} requests, TTFT p50 {_seconds(figures['ttft_s']['p50'])}, "
            f"p99 {_seconds(figures['ttft_s']['p99'])}"
            + (
                f"; {100 * attained:.1f}% attained its SLOs, goodput {figures['goodput']:.3g} req/s"
                if attained is not None
                else ""
            )
        )
    if result.get("tenant_fairness") is not None:
        lines.append(f"Jain's fairness over the tenants' service rates: {result['tenant_fairness']:.3f}")
    if result["num_failed_requests"] or result["num_aborted_requests"]:
        lines.append(
            f"not served: {result['num_failed_requests']} refused with an error, {result['num_aborted_requests']} "
            "aborted (requests.jsonl says which and why)"
        )
    if "floor_seconds" in result:
        lines.append(
            f"floor on this device: {result['floor_seconds']:.3f} s ({result['floor_output_tokens_per_s']:.0f} tok/s, "
            f"{result['bandwidth_GBps']:.0f} GB/s and {result['matmul_TFLOPs']:.3g} TFLOP/s measured; each decode "
            f"step's reads plus prefill's FLOPs): this run reached {result['percent_of_floor']:.1f}% of it; "
            f"strict floor (all bytes or all FLOPs, whichever is longer) {result['strict_floor_seconds']:.3f} s: "
            f"{result['percent_of_strict_floor']:.1f}% of it"
        )
    if "simulated" in result:
        lines.append(
            f"simulated on {result['simulated']['profile']}: {result['simulated']['num_steps']} steps in "
            f"{result['simulator_seconds']:.1f} s on this host ({result['simulator_us_per_step']:.0f} µs a step)"
        )
    return "\n".join(lines)


def _bench_figures(cfg: DictConfig, output_dir: str) -> dict:
    """Builds the engine, warms it up, runs the workload bench.repeats times (each drawn from
    bench.seed + its index, on a fresh prefix cache, a simulation's noise reseeded likewise),
    writes the records beside result.json and returns the figures with what ran and where."""
    bench = cfg.bench
    model_path, settings = engine_arguments(cfg)
    with inferlab.LLM(model_path, **settings) as llm:  # read at call time, so that a test can stand in for it
        first = build_workload(bench, llm.hf_config.vocab_size, llm.config.max_model_len)
        if bench.warmup:
            warm_up(llm)
        figures, runs = [], []
        for repeat in range(bench.repeats):
            workload = (
                first
                if repeat == 0
                else build_workload(bench, llm.hf_config.vocab_size, llm.config.max_model_len, repeat)
            )
            llm.reset_prefix_cache()
            if isinstance(llm.runner, SimulatedDevice):
                llm.runner.reseed(workload.seed)
            repeat_figures, run = measure(
                llm, workload.requests, workload.sampling_params(bench), bench.slo_ttft_s, bench.slo_tpot_s
            )
            figures.append(repeat_figures)
            runs.append(run)
            del workload  # a long trace's prompts: one repeat's at a time
        timeline_files = write_run_records(output_dir, runs, bench.timeline)
        return {
            **aggregate_repeats(figures),
            "requests_file": "requests.jsonl",
            **({"timeline_files": timeline_files} if timeline_files else {}),
            "workload": first.summary(),
            "plugins": resolved_plugins(llm),
            "plugin_options": {
                kind: settings[f"{kind}_options"] for kind in ("model", "scheduler", "kv_cache", "attention", "sampler")
            },
            "engine": {k: v for k, v in asdict(llm.config).items() if k not in PLUGIN_FIELDS},
            "num_kvcache_blocks": llm.kv_manager.num_blocks,
            "model_path": llm.model_path,
            **environment(llm),
        }
