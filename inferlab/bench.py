"""`inferlab job=bench`: nano-vllm's bench.py workload on the configured engine, with the result
(throughput, what ran, where) written to result.json in the run's output directory.

bench.py: random.seed(0); 256 prompts of randint(100, 1024) token ids randint(0, 10000); then for
each a max_tokens of randint(100, 1024); temperature 0.6, ignore_eos; one warm-up generate; then
output tokens / wall time of one generate over all of them. bench.shared_prefix_len and
bench.num_prefixes put one of a few shared prefixes before each prompt, for prefix-cache ablations.
"""

import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import asdict

import torch
from omegaconf import DictConfig, OmegaConf

BENCH_TOKEN_RANGE = 10000  # bench.py draws token ids in [0, 10000]


def bench_workload(bench, vocab_size: int, max_model_len: int):
    """(prompt token ids, SamplingParams) per request, drawn in bench.py's order so that the default
    settings give bench.py's exact workload. Ids are taken modulo the vocabulary (a no-op for real
    vocabularies; clipping would make a tiny vocabulary's prompts runs of one token), and each
    request is cut to fit max_model_len: the prompt first, then max_tokens."""
    from inferlab.core.sampling_params import SamplingParams

    min_out = bench.min_len if bench.min_output_len is None else bench.min_output_len
    max_out = bench.max_len if bench.max_output_len is None else bench.max_output_len
    problems = [
        message
        for bad, message in (
            (bench.num_seqs < 1, f"bench.num_seqs must be >= 1, got {bench.num_seqs}"),
            (
                not 1 <= bench.min_len <= bench.max_len,
                f"bench needs 1 <= min_len <= max_len, got {bench.min_len}, {bench.max_len}",
            ),
            (
                not 1 <= min_out <= max_out,
                f"bench needs 1 <= min_output_len <= max_output_len, got {min_out}, {max_out}",
            ),
            (bench.shared_prefix_len < 0, f"bench.shared_prefix_len must be >= 0, got {bench.shared_prefix_len}"),
            (bench.num_prefixes < 1, f"bench.num_prefixes must be >= 1, got {bench.num_prefixes}"),
        )
        if bad
    ]
    if problems:
        raise ValueError("; ".join(problems))
    rng = random.Random(bench.seed)  # the same stream as bench.py's random.seed(seed) + randint
    prompts = [
        [rng.randint(0, BENCH_TOKEN_RANGE) for _ in range(rng.randint(bench.min_len, bench.max_len))]
        for _ in range(bench.num_seqs)
    ]
    max_tokens = [rng.randint(min_out, max_out) for _ in range(bench.num_seqs)]
    if bench.shared_prefix_len:  # drawn after bench.py's numbers, which stay the same
        prefixes = [
            [rng.randint(0, BENCH_TOKEN_RANGE) for _ in range(bench.shared_prefix_len)]
            for _ in range(bench.num_prefixes)
        ]
        prompts = [prefixes[rng.randrange(bench.num_prefixes)] + prompt for prompt in prompts]
    token_ids, params = [], []
    for prompt, num_tokens in zip(prompts, max_tokens):
        prompt = [t % vocab_size for t in prompt[: max_model_len - 1]]
        token_ids.append(prompt)
        params.append(
            SamplingParams(
                temperature=bench.temperature,
                ignore_eos=bench.ignore_eos,
                max_tokens=min(num_tokens, max_model_len - len(prompt)),
            )
        )
    return token_ids, params


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
    }


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


def run_bench(cfg: DictConfig, output_dir: str | None = None) -> dict:
    """Runs the benchmark cfg describes and writes result.json into output_dir (default: the Hydra
    run's output directory)."""
    from inferlab import LLM
    from inferlab.conf import PLUGIN_FIELDS, engine_arguments, flat_choices

    overrides = []
    if output_dir is None:
        from hydra.core.hydra_config import HydraConfig

        output_dir = HydraConfig.get().runtime.output_dir
        overrides = list(HydraConfig.get().overrides.task)
    model_path, settings = engine_arguments(cfg)
    with LLM(model_path, **settings) as llm:
        prompts, params = bench_workload(cfg.bench, llm.hf_config.vocab_size, llm.config.max_model_len)
        figures = measure(llm, prompts, params, warmup=cfg.bench.warmup)
        result = {
            **figures,
            "plugins": resolved_plugins(llm),
            "plugin_options": {
                kind: settings[f"{kind}_options"] for kind in ("model", "scheduler", "kv_cache", "attention", "sampler")
            },
            "engine": {k: v for k, v in asdict(llm.config).items() if k not in PLUGIN_FIELDS},
            "num_kvcache_blocks": llm.kv_manager.num_blocks,
            "model_path": llm.model_path,
            "bench": OmegaConf.to_container(cfg.bench, resolve=True),
            "choices": flat_choices(cfg),
            "overrides": overrides,
            **environment(llm),
            "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "result.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    rate = lambda value: f"{value:.0f}" if value is not None else "-"  # noqa: E731
    print(
        f"{figures['num_output_tokens']} output tokens in {figures['wall_time_s']:.2f} s: "
        f"{figures['output_tokens_per_s']:.0f} tok/s (prefill {rate(figures['prefill_tokens_per_s'])} tok/s, "
        f"decode {rate(figures['decode_tokens_per_s'])} tok/s, {figures['num_preemptions']} preemptions) -> {path}"
    )
    print(
        f"floor on this device: {figures['floor_seconds']:.3f} s ({figures['floor_output_tokens_per_s']:.0f} tok/s, "
        f"{figures['bandwidth_GBps']:.0f} GB/s and {figures['matmul_TFLOPs']:.3g} TFLOP/s measured): "
        f"this run reached {figures['percent_of_floor']:.1f}% of it"
    )
    return result
