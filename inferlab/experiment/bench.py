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
from inferlab.cluster import Cluster
from inferlab.conf import PLUGIN_FIELDS, cluster_arguments, engine_arguments, flat_choices, validate_bench
from inferlab.core.engine import EngineStats
from inferlab.core.model_cost import model_cost
from inferlab.core.protocols import OnDevice, PrefixCacheStats, SimulatedDevice
from inferlab.core.sampling_params import SamplingParams
from inferlab.experiment.driver import run_workload
from inferlab.experiment.floor import device_rates, workload_floor
from inferlab.experiment.http_client import run_http_bench
from inferlab.experiment.latency import RunRecords, aggregate_repeats, distribution, latency_figures
from inferlab.experiment.records import (
    environment,
    num_kvcache_blocks,
    record_result,
    resolved_plugins,
    start_run_record,
    write_run_records,
)
from inferlab.experiment.workload import WorkloadRequest, build_workload


def warm_up(llm) -> None:
    """bench.py's warm-up: one short generate before anything is timed (on every replica of a
    cluster)."""
    if isinstance(llm, Cluster):
        llm.warm_up("Benchmark: ", SamplingParams())
    else:
        llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)


def prefix_cache_hits(llm) -> int | None:
    """Prompt tokens the prefix cache (every replica's, for a cluster) served so far, where the KV
    manager counts them."""
    if isinstance(llm, Cluster):
        counts = llm.prefix_cache_stats()
        return None if counts is None else counts[0]
    return llm.kv_manager.prefix_cache_stats()[0] if isinstance(llm.kv_manager, PrefixCacheStats) else None


def replica_figures(cluster: Cluster, run: RunRecords) -> dict:
    """A cluster's figures per replica (requests served, TTFT, TPOT, prefix-cache hit rate, the
    share of the run it spent stepping) and load_imbalance: the busiest replica's stepping time over
    the mean (1 when every replica worked as long)."""
    by_replica: dict[int, list] = {}
    for record in run.requests:
        if record.replica_id is not None:
            by_replica.setdefault(record.replica_id, []).append(record)
    busy = [stats.prefill_seconds + stats.decode_seconds for stats in cluster.fleet.replica_stats()]
    replicas = []
    for replica_id, busy_seconds in enumerate(busy):
        records = by_replica.get(replica_id, [])
        prompt_tokens = sum(r.num_prompt_tokens for r in records)
        replicas.append(
            {
                "replica_id": replica_id,
                "num_requests": len(records),
                "ttft_s": distribution(r.ttft_s for r in records if r.ttft_s is not None),
                "tpot_s": distribution(r.tpot_s for r in records if r.tpot_s is not None),
                "prefix_cache_hit_rate": sum(r.num_cached_tokens for r in records) / prompt_tokens
                if prompt_tokens
                else None,
                "busy_fraction": busy_seconds / run.wall_time_s,
            }
        )
    mean_busy = sum(busy) / len(busy)
    figures = {"replicas": replicas, "load_imbalance": max(busy) / mean_busy if mean_busy else None}
    if cluster.roles is not None:
        figures["disaggregation"] = role_figures(cluster, [r["busy_fraction"] for r in replicas])
    return figures


def role_figures(cluster: Cluster, busy_fractions: list[float]) -> dict:
    """A disaggregated cluster's roles: how many replicas each, the mean share of the run they spent
    stepping, and the KV bytes moved from prefill to decode replicas."""
    figures = {}
    for role in ("prefill", "decode"):
        shares = [share for share, r in zip(busy_fractions, cluster.roles) if r == role]
        figures[f"{role}_replicas"] = len(shares)
        figures[f"{role}_busy_fraction"] = sum(shares) / len(shares)
    figures["kv_bytes_moved"] = sum(stats.kv_bytes_received for stats in cluster.fleet.replica_stats())
    figures["kv_transfer"] = cluster.kv_transfer_name
    return figures


def measure(
    llm,
    requests: Sequence[WorkloadRequest],
    params: Sequence,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
    wait_until: Callable[[float], None] | None = None,
    record_steps: bool = True,
    record_token_times: bool = True,
) -> tuple[dict, RunRecords]:
    """Runs the workload once through the driver (inferlab.experiment.driver.run_workload) on an
    engine or a Cluster, and returns its figures with the run's records. The figures are the latency
    figures of its records (inferlab.experiment.latency.latency_figures, with the SLOs given) and the
    engine's: prefill and decode tokens/s, computed tokens, steps, the time blocked on the device,
    and prefix_cache_hit_rate as the KV manager counts hits (readmissions after preemption
    included); for a burst (every request at t=0) on one engine also the workload's floor on this
    device; for a cluster, its replicas' figures and load_imbalance (replica_figures) and the host's
    time in the router's route() per request (router_us_per_request). A simulated
    run adds what it cost this host, simulated_requests_per_host_s among them."""
    llm.stats = EngineStats()
    hits_before = prefix_cache_hits(llm)
    routing_before = (llm.route_seconds, llm.num_routed) if isinstance(llm, Cluster) else None
    started = time.perf_counter()
    run = run_workload(llm, requests, params, wait_until, record_steps, record_token_times)
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
    cluster = isinstance(llm, Cluster)
    if llm.simulated if cluster else isinstance(llm.runner, SimulatedDevice):  # what the simulation cost this host
        figures["simulator_seconds"] = host_seconds
        figures["simulator_us_per_step"] = 1e6 * host_seconds / max(stats.num_steps, 1)
        figures["simulated_requests_per_host_s"] = len(requests) / host_seconds
    if hits_before is not None and latency["num_prompt_tokens"]:
        hits = prefix_cache_hits(llm) - hits_before
        figures["prefix_cache_hit_rate"] = hits / latency["num_prompt_tokens"]
    if cluster:
        figures.update(replica_figures(llm, run))
        seconds, routed = llm.route_seconds - routing_before[0], llm.num_routed - routing_before[1]
        figures["router_us_per_request"] = 1e6 * seconds / routed if routed else None
    # the floor of a burst on the device that ran it (a simulation has its profile, not a device)
    elif all(r.arrival_s == 0 for r in requests) and isinstance(llm.runner, OnDevice):
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
    if "replicas" in result:
        cluster = result["cluster"]
        served = [replica["num_requests"] for replica in result["replicas"]]
        lines.append(
            f"{cluster['replicas']} replicas ({cluster['backend']}), router {result['plugins']['router']}: "
            f"load imbalance {result['load_imbalance']:.3g} (busiest replica's stepping time over the mean), "
            f"{min(served)}-{max(served)} requests a replica, {result['router_us_per_request']:.0f} µs routing each"
        )
    if "disaggregation" in result:
        split = result["disaggregation"]
        moves = result.get("kv_transfer_s")
        lines.append(
            f"prefill/decode: {split['prefill_replicas']} + {split['decode_replicas']} replicas, busy "
            f"{split['prefill_busy_fraction']:.2f} / {split['decode_busy_fraction']:.2f} of the run; "
            f"{split['kv_bytes_moved'] / 2**30:.3g} GiB of K/V moved ({split['kv_transfer']})"
            + (f", a move p50 {moves['p50'] * 1e3:.3g} ms, p99 {moves['p99'] * 1e3:.3g} ms" if moves else "")
        )
    if "simulated" in result:
        lines.append(
            f"simulated on {result['simulated']['profile']}: {result['num_steps']} steps in "
            f"{result['simulator_seconds']:.1f} s on this host ({result['simulator_us_per_step']:.0f} µs a step, "
            f"{result['simulated_requests_per_host_s']:.0f} simulated requests a second of host time)"
        )
    return "\n".join(lines)


def cluster_summary(cluster: dict, llm: Cluster) -> dict:
    """result.json's `cluster`: its settings, with roles when prefill is split from decode."""
    summary = {k: cluster[k] for k in ("replicas", "backend", "gpus_per_replica")}
    summary["replicas"] = len(llm.fleet.replicas)
    if llm.roles is not None:
        summary.update(prefill_replicas=cluster["prefill_replicas"], decode_replicas=cluster["decode_replicas"])
    return summary


def _bench_figures(cfg: DictConfig, output_dir: str) -> dict:
    """Builds the engine, warms it up, runs the workload bench.repeats times (each drawn from
    bench.seed + its index, on a fresh prefix cache, a simulation's noise reseeded likewise),
    writes the records beside result.json and returns the figures with what ran and where."""
    bench = cfg.bench
    model_path, settings = engine_arguments(cfg)
    cluster = cluster_arguments(cfg)
    # inferlab.LLM and inferlab.Cluster are read at call time, so that a test can stand in for them
    llm = inferlab.Cluster(model_path, **cluster, **settings) if cluster else inferlab.LLM(model_path, **settings)
    with llm:
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
            if cluster:
                llm.reseed(workload.seed)
            elif isinstance(llm.runner, SimulatedDevice):
                llm.runner.reseed(workload.seed)
            repeat_figures, run = measure(
                llm,
                workload.requests,
                workload.sampling_params(bench),
                bench.slo_ttft_s,
                bench.slo_tpot_s,
                record_steps=bench.timeline,
                record_token_times=bench.record_token_times,
            )
            figures.append(repeat_figures)
            runs.append(run)
            del workload  # a long trace's prompts: one repeat's at a time
        timeline_files = write_run_records(output_dir, runs, bench.timeline)
        plugin_options = {
            kind: settings[f"{kind}_options"] for kind in ("model", "scheduler", "kv_cache", "attention", "sampler")
        }
        return {
            **aggregate_repeats(figures),
            "requests_file": "requests.jsonl",
            **({"timeline_files": timeline_files} if timeline_files else {}),
            "workload": first.summary(),
            "plugins": resolved_plugins(llm),
            "plugin_options": {
                **plugin_options,
                **({"router": cluster["router_options"]} if cluster else {}),
                **({"kv_transfer": llm.kv_transfer_options} if cluster and llm.roles is not None else {}),
            },
            "engine": {k: v for k, v in asdict(llm.config).items() if k not in PLUGIN_FIELDS},
            **({"cluster": cluster_summary(cluster, llm)} if cluster else {}),
            "num_kvcache_blocks": num_kvcache_blocks(llm),
            "model_path": llm.model_path,
            **environment(llm),
        }
