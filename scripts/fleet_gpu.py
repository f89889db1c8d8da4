"""A fleet, real against simulated: two replicas with Qwen3-0.6B's shapes (random weights) on one GPU
through Ray (cluster.gpus_per_replica=0.5), replaying a shared-prefix trace with two routers; then
the same settings in simulation (executor=simulated), with a profile measured on that card by
`inferlab job=profile` (or the one --profile names). Writes under --out: ray-check.json (Ray and two
half-GPU actors), the trace, the profile, each run's result.json, and comparison.json / .md: output
tokens/s, TTFT and TPOT p50, and the router's host time per request, real and simulated, and their
differences.

    # on the device, one call (about 6-8 minutes), after `source .device/ray/install.sh`:
    python scripts/fleet_gpu.py --out $OUT
    # the same steps on this CPU with the embedded model and tiny settings (a slow test runs it):
    python scripts/fleet_gpu.py --out /tmp/fleet --tiny

Every inferlab run is a process of its own (`python -m inferlab ...`), as a user would run it: the
profile is measured with the GPU to itself, then each real run starts Ray and its two actors.
"""

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUTERS = ("round_robin", "kv_aware")
FIGURES = (("output_tokens_per_s", "output tok/s"), ("ttft_s.p50", "TTFT p50 s"), ("tpot_s.p50", "TPOT p50 s"))

# Settings for the card, and the tiny ones that run the same steps on a CPU in a few minutes.
DEVICE = dict(
    tenants=8,
    system_blocks=4,  # a 2,048-token system prompt per tenant
    query_tokens=(256, 1024),
    output_tokens=(64, 256),
    rate=12.0,
    num_requests=360,
    engine=[
        "attention=triton",
        "engine.max_model_len=8192",
        "engine.kvcache_block_size=256",
        "engine.num_kvcache_blocks=600",  # the same cache for both replicas, real and simulated
        "engine.gpu_memory_utilization=0.45",
    ],
    gpus_per_replica=0.5,
    profile=[
        "profile.repeats=5",
        "profile.decode_batches=[1,2,4,8,16,32,64,128]",
        "profile.decode_contexts=[512,1024,2048,4096]",
        "profile.prefill_tokens=[64,256,1024,2048,4096,8192]",
    ],
)
TINY = dict(
    tenants=2,
    system_blocks=1,
    query_tokens=(16, 128),
    output_tokens=(4, 8),
    rate=4.0,
    num_requests=12,
    engine=[
        "engine.device=cpu",
        "engine.max_model_len=1024",
        "engine.kvcache_block_size=16",
        "engine.num_kvcache_blocks=256",
    ],
    gpus_per_replica=0.0,
    profile=dict(repeats=2, decode_batches=[1, 2, 4], decode_contexts=[16, 128, 512], prefill_tokens=[16, 128, 512]),
)


def ray_check(out: str, gpus: float) -> dict:
    """ray.init() and two actors of `gpus` GPUs each: what each one sees."""
    import ray

    started = time.perf_counter()
    ray.init(include_dashboard=False, log_to_driver=False)
    init_s = time.perf_counter() - started

    @ray.remote(num_gpus=gpus, num_cpus=0)
    class Probe:
        def where(self):
            import torch

            cuda = torch.cuda.is_available()
            return {
                "pid": os.getpid(),
                "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "cuda": cuda,
                "device": torch.cuda.get_device_name(0) if cuda else None,
            }

    actors = [Probe.remote() for _ in range(2)]
    found = {"ray_version": ray.__version__, "init_s": init_s, "resources": ray.cluster_resources(), "actors": []}
    found["actors"] = ray.get([a.where.remote() for a in actors], timeout=120)
    ray.shutdown()
    with open(os.path.join(out, "ray-check.json"), "w") as f:
        json.dump(found, f, indent=2)
    print(f"ray-check: Ray {found['ray_version']}, init {init_s:.1f} s, actors {found['actors']}", flush=True)
    return found


def write_trace(path: str, settings: dict, seed: int = 0) -> None:
    """A Mooncake-format trace: tenants, each with a system prompt of its own (system_blocks hash
    blocks of 512 tokens), and short queries of their own after it, arriving as a Poisson process."""
    rng = random.Random(seed)
    next_id = settings["tenants"] * settings["system_blocks"]
    t = 0.0
    with open(path, "w") as f:
        for _ in range(settings["num_requests"]):
            t += rng.expovariate(settings["rate"])
            tenant = rng.randrange(settings["tenants"])
            system = list(range(tenant * settings["system_blocks"], (tenant + 1) * settings["system_blocks"]))
            query = rng.randint(*settings["query_tokens"])
            own = -(-query // 512)
            record = {
                "timestamp": round(t * 1000, 3),
                "input_length": len(system) * 512 + query,
                "output_length": rng.randint(*settings["output_tokens"]),
                "hash_ids": system + list(range(next_id, next_id + own)),
            }
            next_id += own
            f.write(json.dumps(record) + "\n")


def cpu_profile(path: str, settings: dict) -> None:
    """A profile of the embedded model on this CPU (job=profile measures GPUs only; its measurement
    runs on a CPU engine as well, which is what --tiny needs)."""
    from inferlab import LLM
    from inferlab.conf import ProfileConfig
    from inferlab.experiment.profile_job import run_profile

    engine = {k.split(".", 1)[1]: v for k, v in (item.split("=", 1) for item in settings["engine"])}
    engine = {k: v if k == "device" else int(v) for k, v in engine.items()}
    with LLM(**engine) as llm:
        run_profile(llm, ProfileConfig(out=path, **settings["profile"]), "scripts/fleet_gpu.py --tiny").save(path)


def checkpoint() -> str:
    spec = importlib.util.spec_from_file_location("bench_gpu", os.path.join(REPO, "scripts", "bench_gpu.py"))
    bench_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_gpu)
    return bench_gpu.build_checkpoint("/tmp/inferlab-fleet-qwen3-0.6b", 28, bench_gpu.QWEN3_0_6B)


def inferlab(args: list[str], log: str) -> None:
    """`python -m inferlab args`, its output to log; raises when it fails."""
    started = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run([sys.executable, "-m", "inferlab", *args], stdout=f, stderr=subprocess.STDOUT).returncode
    with open(log) as f:
        tail = f.read()[-3000:]
    print(
        f"  {' '.join(a for a in args if not a.startswith('hydra'))}: {time.perf_counter() - started:.0f} s", flush=True
    )
    if code:
        raise RuntimeError(f"inferlab {' '.join(args)} failed ({code}):\n{tail}")


def figure(result: dict, key: str):
    value = result
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where everything is written")
    parser.add_argument("--tiny", action="store_true", help="the embedded model on this CPU, tiny settings")
    parser.add_argument("--profile", help="a profile measured before, instead of measuring one")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    args = parser.parse_args()
    settings = TINY if args.tiny else DEVICE
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    started = time.perf_counter()

    ray_check(out, settings["gpus_per_replica"])
    trace = os.path.join(out, "shared_prefix_trace.jsonl")
    write_trace(trace, settings)
    model = [] if args.tiny else [f"model.path={checkpoint()}"]
    engine = model + settings["engine"]
    profile = args.profile
    if profile is None:
        profile = os.path.join(out, "profile.json")
        if args.tiny:
            cpu_profile(profile, settings)
        else:
            inferlab(
                ["job=profile", *engine, f"profile.out={profile}", *settings["profile"]],
                os.path.join(out, "profile.log"),
            )
    bench = ["job=bench", "bench.arrival=trace", f"bench.trace={trace}", "cluster.replicas=2"]

    runs = {}
    for router in args.routers.split(","):
        for kind, extra in (
            ("real", ["cluster.backend=ray", f"cluster.gpus_per_replica={settings['gpus_per_replica']}"]),
            ("sim", ["executor=simulated", f"executor.profile={profile}"]),
        ):
            run_dir = os.path.join(out, f"{kind}-{router}")
            inferlab([*bench, *engine, *extra, f"router={router}", f"hydra.run.dir={run_dir}"], f"{run_dir}.log")
            with open(os.path.join(run_dir, "result.json")) as f:
                runs[kind, router] = json.load(f)

    comparison, lines = {}, ["| router | figure | real | simulated | sim - real |", "|---|---|---:|---:|---:|"]
    for router in args.routers.split(","):
        real, sim = runs["real", router], runs["sim", router]
        rows = {}
        for key, title in FIGURES:
            a, b = figure(real, key), figure(sim, key)
            diff = (b - a) / a if a and b is not None else None
            rows[key] = {"real": a, "sim": b, "relative_difference": diff}
            lines.append(f"| {router} | {title} | {a:.4g} | {b:.4g} | {100 * diff:+.1f}% |")
        overhead = {kind: figure(runs[kind, router], "router_us_per_request") for kind in ("real", "sim")}
        rows["router_us_per_request"] = overhead
        lines.append(f"| {router} | router µs a request | {overhead['real']:.1f} | {overhead['sim']:.1f} | |")
        rows["load_imbalance"] = {kind: figure(runs[kind, router], "load_imbalance") for kind in ("real", "sim")}
        rows["prefix_cache_hit_rate"] = {
            kind: figure(runs[kind, router], "prefix_cache_hit_rate") for kind in ("real", "sim")
        }
        comparison[router] = rows
    comparison["device"] = runs["real", args.routers.split(",")[0]].get("device_name")
    comparison["seconds"] = time.perf_counter() - started
    with open(os.path.join(out, "comparison.json"), "w") as f:
        json.dump(comparison, f, indent=2)
    with open(os.path.join(out, "comparison.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    print(f"fleet_gpu: {comparison['seconds']:.0f} s in all, on {comparison['device']}", flush=True)


if __name__ == "__main__":
    main()
