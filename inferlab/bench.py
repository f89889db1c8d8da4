"""`inferlab job=bench`: nano-vllm's bench.py workload on the configured engine, with the result
(throughput, what ran, where) written to result.json in the run's output directory.

bench.py: random.seed(0); 256 prompts of randint(100, 1024) token ids randint(0, 10000); then for
each a max_tokens of randint(100, 1024); temperature 0.6, ignore_eos; one warm-up generate; then
output tokens / wall time of one generate over all of them. bench.shared_prefix_len and
bench.num_prefixes put one of a few shared prefixes before each prompt, for prefix-cache ablations.

The workload itself (arrival processes, traces, fitting, validation) is inferlab.workload; the
latency figures of per-request records, inferlab.latency; a run's Perfetto trace, inferlab.timeline.
"""

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from importlib import metadata

import torch
from omegaconf import DictConfig, OmegaConf

from inferlab.latency import RunRecords, aggregate_repeats, latency_figures, write_requests_jsonl
from inferlab.timeline import write_timeline
from inferlab.workload import bench_workload, build_workload, validate_bench

__all__ = ["bench_workload", "build_workload", "measure", "run_bench", "validate_bench", "write_latency_outputs"]
TRUE_VALUES = ("1", "true", "yes", "on")  # how Triton reads TRITON_INTERPRET


def resolved_plugins(llm) -> dict[str, str]:
    """The plugin actually serving each kind (`auto` resolved)."""
    config = llm.config
    plugins = {kind: getattr(config, kind) for kind in ("model", "scheduler", "kv_cache", "attention", "sampler")}
    backend = getattr(llm.runner, "backend", None)
    if plugins["attention"] == "auto" and backend is not None:
        plugins["attention"] = type(backend).name
    if plugins["model"] == "auto":
        from inferlab.core.model_runner import ModelRunner

        plugins["model"] = ModelRunner._model_for(llm.registry, llm.hf_config)
    return plugins


def measure(llm, prompts, params, warmup: bool = True) -> dict:
    """Times one generate over the whole workload, after bench.py's warm-up generate."""
    from inferlab.core.engine import EngineStats
    from inferlab.core.protocols import PrefixCacheStats
    from inferlab.core.sampling_params import SamplingParams

    if warmup:
        llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    llm.stats = EngineStats()
    preemptions_before = llm.scheduler.num_preemptions
    counts_hits = isinstance(llm.kv_manager, PrefixCacheStats)
    hits_before = llm.kv_manager.prefix_cache_stats()[0] if counts_hits else 0
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    stats = llm.stats
    num_output = sum(len(o["token_ids"]) for o in outputs)
    num_prompt = sum(len(p) for p in prompts)
    figures = {
        "output_tokens_per_s": num_output / wall,
        "prefill_tokens_per_s": stats.num_prefill_tokens / stats.prefill_seconds if stats.prefill_seconds else None,
        "decode_tokens_per_s": stats.num_decode_tokens / stats.decode_seconds if stats.decode_seconds else None,
        "wall_time_s": wall,
        "num_requests": len(prompts),
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "num_prefill_tokens": stats.num_prefill_tokens,  # computed, so prefix-cache hits are not in it
        "num_decode_tokens": stats.num_decode_tokens,
        "num_steps": stats.num_steps,
        "num_preemptions": llm.scheduler.num_preemptions - preemptions_before,
        "prefix_cache_hit_rate": None,
    }
    if counts_hits:
        figures["prefix_cache_hit_rate"] = (llm.kv_manager.prefix_cache_stats()[0] - hits_before) / num_prompt
    figures["wait_seconds"] = stats.wait_seconds  # blocked on the device; the rest of the wall time is CPU work
    figures.update(floor_figures(llm, prompts, outputs, wall))
    return figures


def floor_figures(llm, prompts, outputs, wall: float) -> dict:
    """The workload's hardware floor on this device (inferlab.floor) and how close the run came."""
    from inferlab.floor import device_rates, model_cost, workload_floor

    floor = workload_floor(
        [len(p) for p in prompts],
        [len(o["token_ids"]) for o in outputs],
        model_cost(llm.hf_config, llm.runner.dtype, llm.runner.kv_cache_dtype, llm.config.tensor_parallel_size),
        device_rates(llm.runner.device, llm.runner.dtype),
    )
    return {**floor, "percent_of_floor": 100 * floor["floor_seconds"] / wall}


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


def needs_latency_driver(bench) -> list[str]:
    """The settings that ask for per-request timings, which one generate over the workload (measure)
    cannot give: they need the engine's step loop with arrivals (the latency driver)."""
    asked = []
    if bench.arrival != "burst":
        asked.append(f"bench.arrival={bench.arrival}")
    asked += [f"bench.{name}" for name in ("slo_ttft_s", "slo_tpot_s") if getattr(bench, name) is not None]
    if bench.timeline:
        asked.append("bench.timeline=true")
    return asked


def write_latency_outputs(output_dir: str, bench, runs: Sequence[RunRecords]) -> dict:
    """What a latency run writes beside result.json, and the figures result.json holds: one
    RunRecords per repeat (bench.repeats of them, each on a fresh prefix cache). Writes
    requests.jsonl (every request of every repeat) and, with bench.timeline, timeline.json (one
    run) or timeline-<repeat>.json (several). Returns the latency figures (latency_figures with
    bench's SLOs), aggregated over repeats (aggregate_repeats)."""
    if not runs:
        raise ValueError("no runs to write: bench.repeats is at least 1")
    os.makedirs(output_dir, exist_ok=True)
    write_requests_jsonl(os.path.join(output_dir, "requests.jsonl"), [run.requests for run in runs])
    figures = aggregate_repeats(
        [latency_figures(run.requests, run.wall_time_s, bench.slo_ttft_s, bench.slo_tpot_s) for run in runs]
    )
    if bench.timeline:
        names = ["timeline.json"] if len(runs) == 1 else [f"timeline-{i}.json" for i in range(len(runs))]
        for name, run in zip(names, runs):
            write_timeline(os.path.join(output_dir, name), run.steps, run.requests)
        figures["timeline_files"] = names
    return figures


def run_bench(cfg: DictConfig, output_dir: str | None = None) -> dict:
    """Runs the benchmark cfg describes and writes result.json into output_dir (default: the Hydra
    run's output directory). The bench settings are checked first (BenchConfigError), before
    anything is built. A run that fails writes result.json with its error and settings (so that a
    sweep's report lists it), then raises. With bench.url, the workload goes to that server over
    HTTP instead (inferlab.server.load)."""
    if cfg.bench.url:
        from inferlab.server.load import run_http_bench

        return run_http_bench(cfg, output_dir)
    from inferlab.conf import flat_choices

    overrides = []
    if output_dir is None:
        from hydra.core.hydra_config import HydraConfig

        output_dir = HydraConfig.get().runtime.output_dir
        overrides = list(HydraConfig.get().overrides.task)
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "result.json")
    context = {
        "bench": OmegaConf.to_container(cfg.bench, resolve=True),
        "choices": flat_choices(cfg),
        "overrides": overrides,
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
    }
    try:
        validate_bench(cfg.bench)
        result = {**_bench_figures(cfg), **context, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    except Exception as e:
        with open(path, "w") as f:
            json.dump({"error": f"{type(e).__name__}: {e}", **context}, f, indent=2)
        raise
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    rate = lambda value: f"{value:.0f}" if value is not None else "-"  # noqa: E731
    repeats = f" (mean of {result['num_repeats']} repeats)" if "num_repeats" in result else ""
    print(
        f"{result['num_output_tokens']} output tokens in {result['wall_time_s']:.2f} s: "
        f"{result['output_tokens_per_s']:.0f} tok/s{repeats} (prefill {rate(result['prefill_tokens_per_s'])} tok/s, "
        f"decode {rate(result['decode_tokens_per_s'])} tok/s, {result['num_preemptions']} preemptions) -> {path}"
    )
    print(
        f"floor on this device: {result['floor_seconds']:.3f} s ({result['floor_output_tokens_per_s']:.0f} tok/s, "
        f"{result['bandwidth_GBps']:.0f} GB/s and {result['matmul_TFLOPs']:.3g} TFLOP/s measured): "
        f"this run reached {result['percent_of_floor']:.1f}% of it"
    )
    return result


def _bench_figures(cfg: DictConfig) -> dict:
    """Builds the engine, runs the burst workload bench.repeats times (a fresh prefix cache each
    time after the first) and returns the figures with what ran and where."""
    from inferlab import LLM
    from inferlab.conf import PLUGIN_FIELDS, engine_arguments

    asked = needs_latency_driver(cfg.bench)
    if asked:
        raise NotImplementedError(
            f"{', '.join(asked)} need per-request timings from the engine's step loop, which this version's "
            "bench job does not drive yet; it runs bench.arrival=burst without SLOs or a timeline"
        )
    model_path, settings = engine_arguments(cfg)
    with LLM(model_path, **settings) as llm:
        workload = build_workload(cfg.bench, llm.hf_config.vocab_size, llm.config.max_model_len)
        prompts = [r.prompt_token_ids for r in workload.requests]
        params = workload.sampling_params(cfg.bench)
        runs = []
        for repeat in range(cfg.bench.repeats):
            if repeat:
                llm.reset_prefix_cache()
            runs.append(measure(llm, prompts, params, warmup=cfg.bench.warmup and not repeat))
        return {
            **aggregate_repeats(runs),
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
