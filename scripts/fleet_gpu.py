"""A fleet, real against simulated: two replicas with Qwen3-0.6B's shapes on one GPU through Ray,
replaying a shared-prefix trace with two routers, then the same settings simulated with a profile
measured on that card (or the one --profile names). Writes under --out ray-check.json, the trace,
the profile, each run's result.json and comparison.json / .md; docs/cluster.md ("Real against
simulated") tells more. Every inferlab run is a process of its own (`python -m inferlab ...`).

    python scripts/fleet_gpu.py --out $OUT               # on the device (about 6-8 minutes), with Ray
    python scripts/fleet_gpu.py --out /tmp/fleet --tiny  # the embedded model on this CPU, tiny settings
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time

from inferlab.experiment.report import figure

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import QWEN3_0_6B, build_checkpoint  # noqa: E402

ROUTERS = ("round_robin", "kv_aware")
FIGURES = (("output_tokens_per_s", "output tok/s"), ("ttft_s.p50", "TTFT p50 s"), ("tpot_s.p50", "TPOT p50 s"))
# Settings for the card (a 2,048-token system prompt per tenant; the same cache for both replicas,
# real and simulated), and the tiny ones that run the same steps on a CPU in a few minutes.
DEVICE = dict(tenants=8, system_blocks=4, query_tokens=(256, 1024), output_tokens=(64, 256), rate=12.0,
              num_requests=360, gpus_per_replica=0.5, sharing_s=1.0,
              engine=["attention=triton", "engine.max_model_len=8192", "engine.kvcache_block_size=256",
                      "engine.num_kvcache_blocks=600", "engine.gpu_memory_utilization=0.45"],
              profile=["profile.repeats=5", "profile.decode_batches=[1,2,4,8,16,32,64,128]",
                       "profile.decode_contexts=[512,1024,2048,4096]",
                       "profile.prefill_tokens=[64,256,1024,2048,4096,8192]"])  # fmt: skip
TINY = dict(tenants=2, system_blocks=1, query_tokens=(16, 128), output_tokens=(4, 8), rate=4.0, num_requests=12,
            gpus_per_replica=0.0, sharing_s=0.2,
            engine=["engine.device=cpu", "engine.max_model_len=1024", "engine.kvcache_block_size=16",
                    "engine.num_kvcache_blocks=256"],
            profile=dict(repeats=2, decode_batches=[1, 2, 4], decode_contexts=[16, 128, 512],
                         prefill_tokens=[16, 128, 512]))  # fmt: skip


def ray_check(out: str, gpus: float, seconds: float) -> dict:
    """ray.init() and two actors of `gpus` GPUs each: what each one sees, and how the card
    time-slices them (inferlab.experiment.timeslice), into ray-check.json; returns the latter."""
    import ray

    from inferlab.experiment.timeslice import Spinner, measure

    started = time.perf_counter()
    ray.init(include_dashboard=False, log_to_driver=False)
    init_s = time.perf_counter() - started
    actors = [ray.remote(num_gpus=gpus, num_cpus=0)(Spinner).remote() for _ in range(2)]
    found = {"ray_version": ray.__version__, "init_s": init_s, "resources": ray.cluster_resources()}
    found["actors"] = ray.get([a.where.remote() for a in actors], timeout=120)
    found["sharing"] = measure(actors, seconds=seconds)
    ray.shutdown()
    with open(os.path.join(out, "ray-check.json"), "w") as f:
        json.dump(found, f, indent=2)
    sharing = {k: found["sharing"][k] for k in ("context_switch_s", "timeslice_s")}
    print(f"ray-check: Ray {found['ray_version']}, init {init_s:.1f} s, {found['actors']}, {sharing}", flush=True)
    return sharing


def write_trace(path: str, settings: dict, seed: int = 0) -> None:
    """A Mooncake-format trace: tenants, each with a system prompt of its own (system_blocks hash
    blocks of 512 tokens), and short queries of their own after it, arriving as a Poisson process."""
    rng, blocks = random.Random(seed), settings["system_blocks"]
    next_id, t = settings["tenants"] * blocks, 0.0
    with open(path, "w") as f:
        for _ in range(settings["num_requests"]):
            t += rng.expovariate(settings["rate"])
            tenant = rng.randrange(settings["tenants"])
            query = rng.randint(*settings["query_tokens"])
            own = range(next_id, next_id - (-query // 512))
            record = {"timestamp": round(t * 1000, 3), "input_length": blocks * 512 + query,
                      "output_length": rng.randint(*settings["output_tokens"]),
                      "hash_ids": [*range(tenant * blocks, (tenant + 1) * blocks), *own]}  # fmt: skip
            next_id = own.stop
            f.write(json.dumps(record) + "\n")


def cpu_profile(path: str, settings: dict) -> None:
    """A profile of the embedded model on this CPU (job=profile measures GPUs only; its measurement
    runs on a CPU engine as well, which is what --tiny needs)."""
    from inferlab import LLM
    from inferlab.conf import ProfileConfig
    from inferlab.experiment.profile_job import run_profile

    engine = dict(item.split(".", 1)[1].split("=", 1) for item in settings["engine"])
    engine = {k: v if k == "device" else int(v) for k, v in engine.items()}
    with LLM(**engine) as llm:
        run_profile(llm, ProfileConfig(out=path, **settings["profile"]), "scripts/fleet_gpu.py --tiny").save(path)


def inferlab(args: list[str], log: str) -> None:
    """`python -m inferlab args`, its output to log; raises when it fails."""
    started = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run([sys.executable, "-m", "inferlab", *args], stdout=f, stderr=subprocess.STDOUT).returncode
    shown = " ".join(a for a in args if not a.startswith("hydra"))
    print(f"  {shown}: {time.perf_counter() - started:.0f} s", flush=True)
    if code:
        with open(log) as f:
            raise RuntimeError(f"inferlab {' '.join(args)} failed ({code}):\n{f.read()[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where everything is written")
    parser.add_argument("--tiny", action="store_true", help="the embedded model on this CPU, tiny settings")
    parser.add_argument("--profile", help="a profile measured before, instead of measuring one")
    args = parser.parse_args()
    settings = TINY if args.tiny else DEVICE
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    started = time.perf_counter()

    sharing = ray_check(out, settings["gpus_per_replica"], settings["sharing_s"])
    trace = os.path.join(out, "shared_prefix_trace.jsonl")
    write_trace(trace, settings)
    if args.tiny:
        engine = settings["engine"]
    else:
        checkpoint = build_checkpoint("/tmp/inferlab-fleet-qwen3-0.6b", 28, QWEN3_0_6B)
        engine = [f"model.path={checkpoint}", *settings["engine"]]
    profile = args.profile or os.path.join(out, "profile.json")
    if args.profile is None and args.tiny:
        cpu_profile(profile, settings)
    elif args.profile is None:
        inferlab(["job=profile", *engine, f"profile.out={profile}", *settings["profile"]], f"{out}/profile.log")
    runs, sim = {}, [f"executor.{k}={'null' if v is None else v}" for k, v in sharing.items()]
    for router in ROUTERS:
        for kind, extra in (
            ("real", ["cluster.backend=ray"]),
            ("sim", ["executor=simulated", f"executor.profile={profile}", *sim]),
        ):
            run_dir = os.path.join(out, f"{kind}-{router}")
            bench = ["job=bench", "bench.arrival=trace", f"bench.trace={trace}", "cluster.replicas=2",
                     f"cluster.gpus_per_replica={settings['gpus_per_replica']}"]  # fmt: skip
            inferlab([*bench, *engine, *extra, f"router={router}", f"hydra.run.dir={run_dir}"], f"{run_dir}.log")
            with open(os.path.join(run_dir, "result.json")) as f:
                runs[kind, router] = json.load(f)

    comparison, lines = {}, ["| router | figure | real | simulated | sim - real |", "|---|---|---:|---:|---:|"]
    for router in ROUTERS:
        real, sim = runs["real", router], runs["sim", router]
        rows = comparison[router] = {}
        for key, title in FIGURES:
            a, b = figure(real, key), figure(sim, key)
            diff = (b - a) / a if a and b is not None else None
            rows[key] = {"real": a, "sim": b, "relative_difference": diff}
            lines.append(f"| {router} | {title} | {a:.4g} | {b:.4g} | {100 * diff:+.1f}% |")
        for key in ("router_us_per_request", "load_imbalance", "prefix_cache_hit_rate"):
            rows[key] = {"real": figure(real, key), "sim": figure(sim, key)}
        overhead = rows["router_us_per_request"]
        lines.append(f"| {router} | router µs a request | {overhead['real']:.1f} | {overhead['sim']:.1f} | |")
    comparison["device"] = runs["real", ROUTERS[0]].get("device_name")
    comparison["sharing"], comparison["seconds"] = sharing, time.perf_counter() - started
    with open(os.path.join(out, "comparison.json"), "w") as f:
        json.dump(comparison, f, indent=2)
    with open(os.path.join(out, "comparison.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    print(f"fleet_gpu: {comparison['seconds']:.0f} s in all, on {comparison['device']}", flush=True)


if __name__ == "__main__":
    main()
