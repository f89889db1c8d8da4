"""The simulator against the real engine on this GPU, in one call: for each model size, a
random-weight checkpoint with Qwen3's shapes, one engine that measures its step-time profile
(job=profile's measurement, run_profile) and then replays the workloads for real, and a simulated
engine on that profile replaying the same workloads. Writes the comparison (throughput, TTFT and
TPOT p50/p99, prefix-cache hit rate, preemptions, KV blocks: real, sim, % difference; each load as
a fraction of the real capacity), the host-time diagnostics of the real runs against the profile's
host model, and the profiles, under --out; with every real run's steps and requests
(steps-<size>-<workload>.npz, and the simulation's, sim-<size>-<workload>.npz) and their analysis
(analysis.md: inferlab.experiment.run_diagnostics). `--analyze DIR` redoes that analysis on any host.

From the repository root on the device (flash-attn is not needed: attention=triton):

    NO_FLASH_ATTN=1 source .device/setup.sh && python3 -m pip install -q --no-deps --no-build-isolation \\
        --no-index -e . && python3 scripts/sim_vs_real_gpu.py --out $OUT --budget-s 540

Workloads: the first --max-requests requests of a Mooncake-format trace at each --time-scales
(1 is the trace's own rate), and Poisson arrivals of bench.py's lengths at each --rates; the last
of each is meant to saturate the engine, and its request throughput is taken as the capacity that
the other loads are expressed in. Runs that would not finish before --budget-s are skipped (and
listed); results are rewritten after the real runs and after each simulation, so a call cut short
still leaves what it measured.
The simulated engine runs each workload with the full model and with ablations (the host costs
that relaunching hides left out; no step-time noise), to show what each part of the model does.

`--real-from DIR/sim_vs_real.json` runs the simulations alone (any host) against that call's real runs and
profile (the shipped one of its name, or `--profile FILE`): a simulator change checked against the device.

`--tiny` runs the same on the CPU with the embedded tiny model and tiny settings, to check the
script end to end before spending GPU time (tests/test_sim_vs_real_script.py does).
"""

import argparse
import copy
import functools
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field

import torch
from omegaconf import OmegaConf

from inferlab import LLM
from inferlab.conf import BenchConfig, ProfileConfig
from inferlab.core.protocols import SimulatedDevice
from inferlab.experiment.bench import measure
from inferlab.experiment.profile_job import host_cost_lines, run_profile
from inferlab.experiment.report import figure
from inferlab.experiment.run_diagnostics import StepDiagnostics, analyze, save_simulated
from inferlab.experiment.traces import read_trace
from inferlab.experiment.workload import build_workload
from inferlab.sim.profile import PROFILE_DIR, load_profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import SHAPES, build_checkpoint  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the first 200 requests of Mooncake's conversation trace, which travel with the repository
SMALL_TRACE = os.path.join(REPO, "tests", "data", "mooncake_conversation_200.jsonl")
# Compared figures: (result key, label); the hit rate and preemptions without a % difference
COLUMNS = (
    ("output_tokens_per_s", "tok/s"),
    ("request_throughput", "req/s"),
    ("ttft_s.p50", "TTFT p50"),
    ("ttft_s.p99", "TTFT p99"),
    ("tpot_s.p50", "TPOT p50"),
    ("tpot_s.p99", "TPOT p99"),
    ("prefix_cache_hit_rate", "prefix hit"),
    ("num_preemptions", "preemptions"),
)
# The host costs a profile carries beyond launching a step (left out in the "no host costs" ablation)
NEW_HOST_COSTS = (
    "launch_in_run_factor",
    "step_host_s_per_step",
    "step_host_s_per_request",
    "step_host_s_per_prefill_token",
    "sampling_setup_s_per_step",
    "sampling_setup_s_per_row",
)
# What a size needs before its first real run (checkpoint, engine start-up, profile) on an H100
SIZE_LEAST_S = {"0.6b": 150, "8b": 240}
# the 8B model's steps take several times the 0.6B's: a smaller grid keeps its profile to a minute
TRIMMED_GRID = dict(
    decode_batches=[1, 4, 16, 64, 128, 256, 512],
    decode_contexts=[512, 2048, 8192, 16384],
    prefill_tokens=[64, 256, 1024, 4096, 16384],
)
# the CPU check's engine and profile grid
TINY_ENGINE = dict(
    device="cpu",
    attention="torch",
    kvcache_block_size=16,
    num_kvcache_blocks=512,
    max_model_len=1024,
    max_num_batched_tokens=512,
    max_num_seqs=16,
    overlap_scheduling=False,  # the CPU runner does not run ahead; the sim must not either
)
TINY_GRID = dict(repeats=3, decode_batches=[1, 4, 16], decode_contexts=[16, 128], prefill_tokens=[16, 64, 256])
# the simulations, label: (the profile whole or ablated, its step-time noise's scale); the most telling first, as the
# budget may end
VARIANTS = {"sim": ("full", 1.0), "sim, no host costs": ("no host costs", 1.0), "sim, no noise": ("full", 0.0)}


@dataclass
class Workload:
    name: str
    bench: dict  # BenchConfig fields
    expected_s: float  # its arrivals' span: the least a real run takes
    saturating: bool = False  # the capacity run of its kind
    kind: str = ""
    results: dict = field(default_factory=dict)


def plan(args) -> list[Workload]:
    workloads = []
    _, requests = read_trace(args.trace)
    span = requests[min(args.max_requests, len(requests)) - 1].arrival_s
    scales = [float(s) for s in args.time_scales.split(",") if s]
    for i, scale in enumerate(scales):
        bench = dict(arrival="trace", trace=args.trace, max_requests=args.max_requests, time_scale=scale, fit=args.fit)
        workloads.append(Workload(f"trace x{scale:g}", bench, span * scale, i == len(scales) - 1, "trace"))
    rates = [float(r) for r in args.rates.split(",") if r]
    for i, rate in enumerate(rates):
        bench = dict(arrival="poisson", request_rate=rate, num_seqs=args.num_seqs, **args.lengths)
        workloads.append(Workload(f"poisson {rate:g}/s", bench, args.num_seqs / rate, i == len(rates) - 1, "poisson"))
    return workloads


def card_name(device_name: str) -> str:
    for card in ("h100", "h200", "a100", "b200", "l40"):
        if card in device_name.lower():
            return card
    return device_name.lower().replace("nvidia ", "").split()[0] if device_name else "cpu"


def percent(sim, real) -> str:
    if sim is None or real is None:
        return "-"
    if real == 0:
        return "0" if sim == 0 else "new"
    return f"{100 * (sim / real - 1):+.1f}%"


def cell(value, key: str) -> str:
    if value is None:
        return "-"
    if key.endswith(("p50", "p99")):
        return f"{1e3 * value:.3g} ms"
    if key == "prefix_cache_hit_rate":
        return f"{value:.3f}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def run_workloads(llm, workloads, deadline, reserve_s, label, log, diagnostics=None, records=None) -> None:
    """Each workload once on llm (a fresh prefix cache each), its figures under results[label];
    one that would end past deadline - reserve_s is skipped. records: (out, size) to write the
    simulation's requests and steps (diagnostics writes the real runs')."""
    for workload in workloads:
        if label == "real" and time.monotonic() + 1.3 * workload.expected_s + 5 > deadline - reserve_s:
            log(f"  skipped {workload.name}: {workload.expected_s:.0f} s would pass the budget")
            workload.results[label] = {"skipped": "budget"}
            continue
        bench = OmegaConf.structured(BenchConfig(**workload.bench))
        built = build_workload(bench, llm.hf_config.vocab_size, llm.config.max_model_len)
        params = built.sampling_params(bench)
        llm.reset_prefix_cache()
        if isinstance(llm.runner, SimulatedDevice):
            llm.runner.reseed(bench.seed)
        if diagnostics is not None:
            diagnostics.start(workload.name)
        started = time.monotonic()
        figures, run = measure(llm, built.requests, params)
        figures["offered_request_rate"] = built.summary()["offered_request_rate"]
        figures["num_kvcache_blocks"] = llm.kv_manager.num_blocks
        if diagnostics is not None:
            diagnostics.finish(run, figures)
        if records is not None:
            save_simulated(*records, workload.name, run)
        workload.results[label] = figures
        log(
            f"  {label:>14} {workload.name:<16} {time.monotonic() - started:6.1f} s: "
            f"{figures['output_tokens_per_s']:.0f} tok/s, TTFT p50 {1e3 * figures['ttft_s']['p50']:.2f} ms "
            f"p99 {1e3 * figures['ttft_s']['p99']:.2f} ms, TPOT p50 {1e3 * (figures['tpot_s']['p50'] or 0):.3f} ms, "
            f"hit {figures.get('prefix_cache_hit_rate') or 0:.3f}, preemptions {figures['num_preemptions']}"
        )


def ablated(profile, path: str, what: str) -> str:
    variant = copy.deepcopy(profile)
    if what == "no host costs":
        for name in NEW_HOST_COSTS:
            setattr(variant, name, 1.0 if name == "launch_in_run_factor" else 0.0)
        variant.idle_wake = []
    variant.save(path)
    return path


def simulate(model_path, engine, profile_path, workloads, deadline, log, variants, written, records) -> None:
    """Each variant of the simulation replays the workloads the real engine ran; written() after
    each, so that a call cut short keeps what it simulated."""
    profile = load_profile(profile_path)
    for label, (what, noise) in variants.items():
        if time.monotonic() > deadline:
            log(f"  skipped the simulation {label!r}: past the budget")
            continue
        path = (
            profile_path if what == "full" else ablated(profile, profile_path.replace(".json", "-ablated.json"), what)
        )
        options = {"profile": path, "noise": noise}
        with LLM(model_path, **engine, executor="simulated", executor_options=options) as sim:
            ran = [w for w in workloads if "skipped" not in w.results.get("real", {})]
            run_workloads(sim, ran, deadline, 0, label, log, records=records if label == "sim" else None)
        if what != "full":
            os.remove(path)
        written()


def capacity(workloads: list[Workload], kind: str) -> float | None:
    saturated = [w for w in workloads if w.kind == kind and w.saturating and "skipped" not in w.results.get("real", {})]
    if not saturated or "real" not in saturated[0].results:
        return None
    return saturated[0].results["real"]["request_throughput"]


def tables(size: str, device: str, workloads: list[Workload], variants: list[str], diagnostics) -> str:
    lines = [f"## {size} on {device}", ""]
    for label in variants:
        lines += [
            f"### real / {label} (sim - real)",
            "",
            "| workload | load | " + " | ".join(name for _, name in COLUMNS) + " | KV blocks |",
            "|---|---:|" + "---:|" * (len(COLUMNS) + 1),
        ]
        for w in workloads:
            real, sim = w.results.get("real", {}), w.results.get(label, {})
            if "skipped" in real or not real or not sim:
                lines.append(f"| {w.name} | skipped | " + " | ".join("-" for _ in COLUMNS) + " | - |")
                continue
            cap = capacity(workloads, w.kind)
            load = f"{100 * real['offered_request_rate'] / cap:.0f}%" if cap and real["offered_request_rate"] else "-"
            cells = []
            for key, _ in COLUMNS:
                r, s = figure(real, key), figure(sim, key)
                if key in ("prefix_cache_hit_rate", "num_preemptions"):
                    cells.append(f"{cell(r, key)} / {cell(s, key)}")
                else:
                    cells.append(f"{cell(r, key)} / {cell(s, key)} ({percent(s, r)})")
            lines.append(
                f"| {w.name} | {load} | "
                + " | ".join(cells)
                + f" | {real['num_kvcache_blocks']} / {sim['num_kvcache_blocks']} |"
            )
        lines.append("")
    if diagnostics is not None and diagnostics.by_workload:
        lines += [
            "### host time in the real runs against the profile's host model",
            "",
            "| workload | what | steps | measured median | model median | median ratio |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for name, parts in diagnostics.by_workload.items():
            for what, s in parts.items():
                if s:
                    lines.append(
                        f"| {name} | {what} | {s['steps']} | {s['measured_median_us']:.0f} us | "
                        f"{s['model_median_us']:.0f} us | {s['median_ratio']:.2f} |"
                    )
        lines.append("")
    return "\n".join(lines)


def measure_size(size: str, args, engine: dict, device_name: str, deadline: float, report, markdown, log) -> None:
    """One model size: its checkpoint, profile and real runs on one engine, then the simulations;
    sim_vs_real.json and .md rewritten with what it has measured so far after each part."""
    workloads, section = plan(args), len(markdown)
    if args.tiny:
        model_path, name, grid = None, "cpu-tiny-torch", TINY_GRID
    else:
        base = SHAPES[size]
        model_path = build_checkpoint(f"/tmp/sim-vs-real-qwen3-{size}", base["num_hidden_layers"], base)
        name = f"{card_name(device_name)}-qwen3-{size}-triton"
        grid = dict(repeats=args.profile_repeats, **(TRIMMED_GRID if size == "8b" else {}))
    log(f"{size}: checkpoint ready ({model_path}); building the engine")
    profile_path = os.path.join(args.out, f"{name}.json")
    with LLM(model_path, **engine) as llm:
        log(f"{size}: engine ready, {llm.kv_manager.num_blocks} KV blocks; profiling")
        profile = run_profile(llm, ProfileConfig(**grid), f"scripts/sim_vs_real_gpu.py {' '.join(args.argv)}")
        profile.save(profile_path)
        log(f"{size}: {len(profile.measurements)} compositions -> {profile_path}")
        for line in host_cost_lines(profile):
            log(f"  {line}")
        diagnostics = StepDiagnostics(llm, profile, args.out, size, os.path.basename(profile_path), args.device_events)
        # what the simulations need afterwards: about 30 s a size on the device's host
        run_workloads(llm, workloads, deadline, 45, "real", log, diagnostics)
        diagnostics.close()

    profile_file = os.path.basename(profile_path)
    written = functools.partial(
        write, args.out, report, markdown, size, section, device_name, workloads, diagnostics, profile_file
    )
    written()  # the real runs, before the simulations
    simulate(model_path, engine, profile_path, workloads, deadline, log, VARIANTS, written, (args.out, size))
    log(f"{size}: written sim_vs_real.md and .json")


def write(out, report, markdown, size, section, device, workloads, diagnostics, profile) -> None:
    """sim_vs_real.json and .md under out, with what size has so far."""
    by_workload = diagnostics.by_workload if diagnostics else {}
    workloads_json = {w.name: {"bench": w.bench, **w.results} for w in workloads}
    report["sizes"][size] = {"profile": profile, "workloads": workloads_json, "host_diagnostics": by_workload}
    markdown[section:] = [tables(size, device, workloads, list(VARIANTS), diagnostics)]
    with open(os.path.join(out, "sim_vs_real.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out, "sim_vs_real.md"), "w") as f:
        f.write("\n".join(markdown))


def resimulate(args, log) -> None:
    """--real-from: each size's simulations against an earlier call's real runs, on its profile."""
    with open(args.real_from) as f:
        earlier = json.load(f)
    report, markdown = {"device": earlier["device"], "args": dict(vars(args)), "sizes": {}}, []
    ran_with = earlier["args"]
    engine = TINY_ENGINE if ran_with.get("tiny") else dict(attention="triton", max_model_len=ran_with["max_model_len"])
    for size, part in earlier["sizes"].items():
        profile_path = shutil.copy(args.profile or os.path.join(PROFILE_DIR, part["profile"]), args.out)
        workloads = []
        for name, ran in part["workloads"].items():
            bench = {**ran["bench"], **({"trace": args.trace} if "trace" in ran["bench"] else {})}
            workloads.append(Workload(name, bench, 0.0, kind=bench["arrival"], results={"real": ran["real"]}))
        for kind in {w.kind for w in workloads}:  # the last of each kind was the capacity run
            [w for w in workloads if w.kind == kind][-1].saturating = True
        written = functools.partial(
            write, args.out, report, markdown, size, len(markdown), earlier["device"], workloads, None, part["profile"]
        )
        deadline = time.monotonic() + args.budget_s
        simulate(None, engine, profile_path, workloads, deadline, log, VARIANTS, written, (args.out, size))
    print("\n".join(markdown))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "sim-vs-real"))
    parser.add_argument("--sizes", default="0.6b", help="comma-separated: 0.6b, 8b (in this order)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="the whole script's wall time")
    parser.add_argument(
        "--trace", default=SMALL_TRACE, help="a Mooncake-format trace (default: its first 200 requests)"
    )
    parser.add_argument("--max-requests", type=int, default=200)
    parser.add_argument("--time-scales", default="1,0.5,0.25")
    parser.add_argument("--rates", default="4,16,40,80")
    parser.add_argument("--num-seqs", type=int, default=200)
    parser.add_argument("--fit", default="clip")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--profile-repeats", type=int, default=6)
    parser.add_argument("--tiny", action="store_true", help="the CPU, the embedded tiny model, tiny settings")
    parser.add_argument("--real-from", help="an earlier call's sim_vs_real.json: simulate alone against its real runs")
    parser.add_argument("--profile", help="with --real-from, --analyze: the profile file (default: the call's)")
    parser.add_argument("--analyze", help="a call's --out: its steps against the profile, its longest TTFTs")
    parser.add_argument("--no-device-events", dest="device_events", action="store_false", help="no CUDA events")
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    if args.analyze:  # reads a call's files and writes nothing
        return print(analyze(args.analyze, args.profile))
    started = time.monotonic()
    deadline = started + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "sim_vs_real.log"), "a")

    def log(line: str) -> None:
        line = f"[{time.monotonic() - started:6.1f} s] {line}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    if args.real_from:
        return resimulate(args, log)
    args.lengths = {}
    if args.tiny:
        args.trace, args.fit = SMALL_TRACE, "scale"
        args.max_requests, args.num_seqs = min(args.max_requests, 16), min(args.num_seqs, 12)
        args.lengths = dict(min_len=16, max_len=128, min_output_len=2, max_output_len=12)
        engine = TINY_ENGINE
    else:
        engine = dict(attention="triton", max_model_len=args.max_model_len)
    device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.tiny else "cpu"
    log(f"{device_name}; sizes {args.sizes}; budget {args.budget_s:.0f} s; trace {args.trace}")
    report = {"device": device_name, "args": dict(vars(args)), "sizes": {}}
    markdown = [f"# The simulator against the real engine on {device_name}", ""]
    for size in args.sizes.split(","):
        if time.monotonic() > deadline - SIZE_LEAST_S.get(size, 60):
            log(f"{size}: not started, {deadline - time.monotonic():.0f} s left of the budget")
            continue
        measure_size(size, args, engine, device_name, deadline, report, markdown, log)
    log(f"done in {time.monotonic() - started:.0f} s")
    print("\n".join(markdown))
    try:  # what --analyze prints, at once; the records stay for it if this fails
        with open(os.path.join(args.out, "analysis.md"), "w") as f:
            f.write(analyze(args.out))
    except Exception as e:
        log(f"analysis.md not written: {e!r}")


if __name__ == "__main__":
    main()
