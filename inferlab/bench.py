"""`inferlab job=bench`: a workload on the configured engine (nano-vllm's bench.py by default),
driven through the engine's step loop with its arrivals, with the figures (throughput, latency,
what ran, where) written to result.json in the run's output directory, every request's record to
requests.jsonl beside it and, with bench.timeline, the run's Perfetto trace.

bench.py: random.seed(0); 256 prompts of randint(100, 1024) token ids randint(0, 10000); then for
each a max_tokens of randint(100, 1024); temperature 0.6, ignore_eos; one warm-up generate; then
output tokens / wall time of one run over all of them, every request arriving at t=0 (the burst).
bench.shared_prefix_len and bench.num_prefixes put one of a few shared prefixes before each
prompt, for prefix-cache ablations.

The workload itself (arrival processes, traces, fitting, validation) is inferlab.workload; the
loop that adds requests as they arrive and records them, inferlab.driver; the latency figures of
its records, inferlab.latency; a run's Perfetto trace, inferlab.timeline.
"""

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from importlib import metadata

import torch
from omegaconf import DictConfig, OmegaConf

from inferlab.driver import run_workload
from inferlab.latency import RunRecords, aggregate_repeats, latency_figures, write_requests_jsonl
from inferlab.timeline import write_timeline
from inferlab.workload import WorkloadRequest, bench_workload, build_workload, validate_bench

__all__ = [
    "bench_workload",
    "build_workload",
    "measure",
    "run_bench",
    "validate_bench",
    "warm_up",
    "write_run_records",
]
TRUE_VALUES = ("1", "true", "yes", "on")  # how Triton reads TRITON_INTERPRET


def resolved_plugins(llm) -> dict[str, str]:
    """The plugin actually serving each kind (`auto` resolved)."""
    config = llm.config
    plugins = {kind: getattr(config, kind) for kind in ("model", "scheduler", "kv_cache", "attention", "sampler")}
    if llm.simulated:  # no backend runs: the one the profile was measured with
        plugins["attention"] = llm.runner.profile.attention
    elif plugins["attention"] == "auto":
        plugins["attention"] = type(llm.runner.backend).name
    if plugins["model"] == "auto":
        from inferlab.core.model_runner import ModelRunner

        plugins["model"] = ModelRunner._model_for(llm.registry, llm.hf_config)
    return plugins


def warm_up(llm) -> None:
    """bench.py's warm-up: one short generate before anything is timed."""
    from inferlab.core.sampling_params import SamplingParams

    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)


def measure(
    llm,
    requests: Sequence[WorkloadRequest],
    params: Sequence,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
    wait_until: Callable[[float], None] | None = None,
) -> tuple[dict, RunRecords]:
    """Runs the workload once through the driver (inferlab.driver.run_workload) and returns its
    figures with the run's records. The figures are the latency figures of its records
    (inferlab.latency.latency_figures, with the SLOs given) and the engine's: prefill and decode
    tokens/s, computed tokens, steps, the time blocked on the device, and prefix_cache_hit_rate as
    the KV manager counts hits (readmissions after preemption included); for a burst (every
    request at t=0) also the workload's floor on this device."""
    from inferlab.core.engine import EngineStats
    from inferlab.core.protocols import PrefixCacheStats

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
    if llm.simulated:  # what the simulation itself cost, on this host's clock
        figures["simulator_seconds"] = host_seconds
        figures["simulator_us_per_step"] = 1e6 * host_seconds / max(stats.num_steps, 1)
    if counts_hits and latency["num_prompt_tokens"]:
        hits = llm.kv_manager.prefix_cache_stats()[0] - hits_before
        figures["prefix_cache_hit_rate"] = hits / latency["num_prompt_tokens"]
    if all(r.arrival_s == 0 for r in requests) and not llm.simulated:  # a simulation has its profile, not a device
        figures.update(
            floor_figures(
                llm, [r.num_prompt_tokens for r in run.requests], [r.num_output_tokens for r in run.requests], run
            )
        )
    return figures, run


def floor_figures(llm, prompt_lengths: list[int], output_lengths: list[int], run: RunRecords) -> dict:
    """The workload's hardware floor on this device (inferlab.floor) and how close the run came."""
    from inferlab.floor import device_rates, model_cost, workload_floor

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


def environment(llm) -> dict:
    device = getattr(llm.runner, "device", torch.device("cpu"))
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = platform.processor() or platform.machine()
    import inferlab

    return {
        "device": str(device),
        "device_name": device_name,
        "dtype": str(getattr(llm.runner, "dtype", "")).replace("torch.", ""),
        "torch_version": torch.__version__,
        "inferlab_version": inferlab.__version__,
        "python_version": platform.python_version(),
        **git_state(),
        "plugin_packages": plugin_packages(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "").strip().lower() in TRUE_VALUES,
        "executor": llm.config.executor,
        **simulation(llm),
    }


def simulation(llm) -> dict:
    """What stood in for the device in a simulated run: the profile and the fitted cost model."""
    if not llm.simulated:
        return {}
    runner = llm.runner
    return {
        "simulated": {
            "profile": runner.profile.label(),
            "profile_kind": runner.profile.kind,
            "profile_source": runner.profile.source,
            "cost_model": runner.cost_model.describe(),
            "host_launch": runner.host_launch_model.describe() if runner.host_launch_model else None,
            "admission_s": {
                "per_request": runner.profile.admission_s_per_request,
                "per_prompt_token": runner.profile.admission_s_per_token,
            },
            "num_steps": runner.num_steps,
            "real_time": runner.real_time,  # on this host's clock (its wall time), not a virtual one
        }
    }


def plugin_packages() -> list[dict]:
    """The installed distributions that register inferlab plugins (entry points of group "inferlab"),
    with their versions and the entry points each registers."""
    packages = {}
    for entry_point in metadata.entry_points(group="inferlab"):
        dist = entry_point.dist
        name, version = (dist.metadata["Name"], dist.version) if dist is not None else (None, None)
        package = packages.setdefault(name, {"distribution": name, "version": version, "entry_points": []})
        package["entry_points"].append(entry_point.name)
    return sorted(packages.values(), key=lambda p: str(p["distribution"]))


def git_state() -> dict:
    """The commit of the inferlab checkout that ran, when it runs from one."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.exists(os.path.join(root, ".git")):
        return {"git_commit": None, "git_dirty": None}
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        status = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    if commit.returncode != 0:
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit.stdout.strip(), "git_dirty": bool(status.stdout.strip())}


def write_run_records(output_dir: str, runs: Sequence[RunRecords], timeline: bool) -> list[str]:
    """What a run writes beside result.json, one RunRecords per repeat: requests.jsonl (every
    request of every repeat) and, with timeline, timeline.json (one run) or timeline-<repeat>.json
    (several). Returns the names of the timeline files written."""
    if not runs:
        raise ValueError("no runs to write: bench.repeats is at least 1")
    os.makedirs(output_dir, exist_ok=True)
    write_requests_jsonl(os.path.join(output_dir, "requests.jsonl"), [run.requests for run in runs])
    if not timeline:
        return []
    names = ["timeline.json"] if len(runs) == 1 else [f"timeline-{i}.json" for i in range(len(runs))]
    for name, run in zip(names, runs):
        write_timeline(os.path.join(output_dir, name), run.steps, run.requests)
    return names


def start_run_record(cfg: DictConfig, output_dir: str | None, choices: dict) -> tuple[str, dict]:
    """(result.json's path, what every result records of its run: the bench settings, the
    choices, Hydra's overrides and the command) of a bench run; output_dir defaults to the Hydra
    run's output directory, and is created."""
    overrides = []
    if output_dir is None:
        from hydra.core.hydra_config import HydraConfig

        output_dir = HydraConfig.get().runtime.output_dir
        overrides = list(HydraConfig.get().overrides.task)
    os.makedirs(output_dir, exist_ok=True)
    context = {
        "bench": OmegaConf.to_container(cfg.bench, resolve=True),
        "choices": choices,
        "overrides": overrides,
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
    }
    return os.path.join(output_dir, "result.json"), context


def record_result(path: str, context: dict, figures: Callable[[], dict]) -> dict:
    """Writes figures() with the run's context and the time it finished to path and returns it;
    a run that fails writes its error with the context instead (so that a sweep's report lists
    it), then raises."""
    try:
        result = {**figures(), **context, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    except Exception as e:
        with open(path, "w") as f:
            json.dump({"error": f"{type(e).__name__}: {e}", **context}, f, indent=2)
        raise
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return result


def run_bench(cfg: DictConfig, output_dir: str | None = None) -> dict:
    """Runs the benchmark cfg describes and writes result.json, requests.jsonl and (with
    bench.timeline) the timeline into output_dir (default: the Hydra run's output directory). The
    bench settings are checked first (BenchConfigError), before anything is built. A run that fails
    writes result.json with its error and settings (so that a sweep's report lists it), then raises.
    With bench.url, the workload goes to that server over HTTP instead (inferlab.server.load)."""
    if cfg.bench.url:
        from inferlab.server.load import run_http_bench

        return run_http_bench(cfg, output_dir)
    from inferlab.conf import flat_choices

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
        f"{result['num_requests']} requests ({workload['arrival']}), {result['num_output_tokens']} output tokens in "
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
            if result["bench"][key] is not None
        ]
        lines.append(
            f"SLOs ({', '.join(bounds)}): {100 * result['slo_attainment']:.1f}% of requests attained them, "
            f"goodput {result['goodput']:.3g} req/s"
        )
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
    """Builds the engine, warms it up, runs the workload bench.repeats times (each on a fresh
    prefix cache), writes the records beside result.json and returns the figures with what ran
    and where."""
    from inferlab import LLM
    from inferlab.conf import PLUGIN_FIELDS, engine_arguments

    bench = cfg.bench
    model_path, settings = engine_arguments(cfg)
    with LLM(model_path, **settings) as llm:
        workload = build_workload(bench, llm.hf_config.vocab_size, llm.config.max_model_len)
        params = workload.sampling_params(bench)
        if bench.warmup:
            warm_up(llm)
        figures, runs = [], []
        for _ in range(bench.repeats):
            llm.reset_prefix_cache()
            repeat_figures, run = measure(llm, workload.requests, params, bench.slo_ttft_s, bench.slo_tpot_s)
            figures.append(repeat_figures)
            runs.append(run)
        timeline_files = write_run_records(output_dir, runs, bench.timeline)
        return {
            **aggregate_repeats(figures),
            "requests_file": "requests.jsonl",
            **({"timeline_files": timeline_files} if timeline_files else {}),
            "workload": workload.summary(),
            "plugins": resolved_plugins(llm),
            "plugin_options": {
                kind: settings[f"{kind}_options"] for kind in ("model", "scheduler", "kv_cache", "attention", "sampler")
            },
            "engine": {k: v for k, v in asdict(llm.config).items() if k not in PLUGIN_FIELDS},
            "num_kvcache_blocks": llm.kv_manager.num_blocks,
            "model_path": llm.model_path,
            **environment(llm),
        }
