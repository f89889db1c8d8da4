"""A run's records: result.json (the figures with what ran, where and how it was asked for),
requests.jsonl beside it, and the timeline; shared by the in-process bench, the HTTP bench and
the profile job."""

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata

import torch
from omegaconf import DictConfig, OmegaConf

import inferlab
from inferlab.cluster import Cluster
from inferlab.core.model_runner import ModelRunner
from inferlab.core.protocols import OnDevice, SimulatedDevice
from inferlab.experiment.latency import RunRecords, write_requests_jsonl
from inferlab.experiment.timeline import write_timeline

TRUE_VALUES = ("1", "true", "yes", "on")  # how Triton reads TRITON_INTERPRET


def resolved_plugins(llm) -> dict[str, str]:
    """The plugin actually serving each kind (`auto` resolved); for a cluster, its replicas' and
    its router (and, prefill split from decode, its KV transfer)."""
    if isinstance(llm, Cluster):
        plugins = {**llm.fleet.on_front(resolved_plugins), "router": llm.router_name}
        if llm.roles is not None:  # `auto` resolved to the transfer its replicas use
            plugins["kv_transfer"] = llm.kv_transfer_name
        return plugins
    config = llm.config
    plugins = {kind: getattr(config, kind) for kind in ("model", "scheduler", "kv_cache", "attention", "sampler")}
    runner = llm.runner
    if isinstance(runner, SimulatedDevice):  # no backend runs: the one the profile was measured with
        plugins["attention"] = runner.attention
    elif plugins["attention"] == "auto" and isinstance(runner, OnDevice):
        plugins["attention"] = type(runner.backend).name
    if plugins["model"] == "auto":
        plugins["model"] = ModelRunner._model_for(llm.registry, llm.hf_config)
    return plugins


def num_kvcache_blocks(llm) -> int:
    """The KV cache's blocks (the first replica's, for a cluster)."""
    return llm.fleet.on_front(num_kvcache_blocks) if isinstance(llm, Cluster) else llm.kv_manager.num_blocks


def environment(llm) -> dict:
    if isinstance(llm, Cluster):  # the replicas' engine, read where it runs
        return llm.fleet.on_front(environment)
    runner = llm.runner
    device = runner.device if isinstance(runner, OnDevice) else torch.device("cpu")
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = platform.processor() or platform.machine()
    return {
        "device": str(device),
        "device_name": device_name,
        "dtype": str(getattr(runner, "dtype", "")).replace("torch.", ""),
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
    if not isinstance(llm.runner, SimulatedDevice):
        return {}
    return {"simulated": llm.runner.describe()}


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
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
