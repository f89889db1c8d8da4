"""The simulator against the real engine on this GPU, in one call: for each model size, a
random-weight checkpoint with Qwen3's shapes, one engine that measures its step-time profile
(job=profile's measurement, run_profile) and then replays the workloads for real, and a simulated
engine on that profile replaying the same workloads. Writes the comparison (throughput, TTFT and
TPOT p50/p99, prefix-cache hit rate, preemptions, KV blocks: real, sim, % difference; each load as
a fraction of the real capacity), the host-time diagnostics of the real runs against the profile's
host model, and the profiles, under --out.

From the repository root on the device (flash-attn is not needed: attention=triton):

    NO_FLASH_ATTN=1 source .device/setup.sh && python3 -m pip install -q --no-deps --no-build-isolation \\
        --no-index -e . && python3 scripts/sim_vs_real_gpu.py --out $OUT --budget-s 540

Workloads: the first --max-requests requests of a Mooncake-format trace at each --time-scales
(1 is the trace's own rate), and Poisson arrivals of bench.py's lengths at each --rates; the last
of each is meant to saturate the engine, and its request throughput is taken as the capacity that
the other loads are expressed in. Runs that would not finish before --budget-s are skipped (and
listed); results are rewritten after every run, so a call cut short still leaves what it measured.
The simulated engine runs each workload with the full model and with ablations (the host costs
that relaunching hides left out; no step-time noise), to show what each part of the model does.

`--tiny` runs the same on the CPU with the embedded tiny model and tiny settings, to check the
script end to end before spending GPU time (tests/test_sim_vs_real_script.py does).
"""

import argparse
import copy
import functools
import json
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the first 200 requests of Mooncake's conversation trace, which travel with the repository
SMALL_TRACE = os.path.join(REPO, "tests", "data", "mooncake_conversation_200.jsonl")
# Compared figures: (result key, label, whether the sim-real difference is shown in %)
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
TRIMMED_GRID = dict(
    decode_batches=[1, 4, 16, 64, 128, 256, 512],
    decode_contexts=[512, 2048, 8192, 16384],
    prefill_tokens=[64, 256, 1024, 4096, 16384],
)


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
    trace = args.trace
    from inferlab.experiment.traces import read_trace

    _, requests = read_trace(trace)
    span = requests[min(args.max_requests, len(requests)) - 1].arrival_s
    scales = [float(s) for s in args.time_scales.split(",") if s]
    for i, scale in enumerate(scales):
        bench = dict(arrival="trace", trace=trace, max_requests=args.max_requests, time_scale=scale, fit=args.fit)
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


def figure(result: dict, key: str):
    value = result
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


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


def run_workloads(llm, workloads, deadline: float, reserve_s: float, label: str, log, diagnostics=None) -> None:
    """Each workload once on llm (a fresh prefix cache each), its figures under results[label];
    one that would end past deadline - reserve_s is skipped."""
    from omegaconf import OmegaConf

    from inferlab.conf import BenchConfig
    from inferlab.core.protocols import SimulatedDevice
    from inferlab.experiment.bench import measure
    from inferlab.experiment.workload import build_workload

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
        if diagnostics is not None:
            diagnostics.finish(run)
        figures["offered_request_rate"] = built.summary()["offered_request_rate"]
        figures["num_kvcache_blocks"] = llm.kv_manager.num_blocks
        workload.results[label] = figures
        log(
            f"  {label:>14} {workload.name:<16} {time.monotonic() - started:6.1f} s: "
            f"{figures['output_tokens_per_s']:.0f} tok/s, TTFT p50 {1e3 * figures['ttft_s']['p50']:.2f} ms "
            f"p99 {1e3 * figures['ttft_s']['p99']:.2f} ms, TPOT p50 {1e3 * (figures['tpot_s']['p50'] or 0):.3f} ms, "
            f"hit {figures.get('prefix_cache_hit_rate') or 0:.3f}, preemptions {figures['num_preemptions']}"
        )


class HostDiagnostics:
    """During the real runs: each step's host launch time (and whether it rebuilt its sampling
    settings), the engine's own host work (the step less its launch and its wait for tokens) and
    the idle time before it, against what the profile's host model charges for the same step."""

    def __init__(self, llm, profile):
        from inferlab.sim.cost_model import StepShape

        self.llm, self.profile, self.StepShape = llm, profile, StepShape
        self.launch_model = profile.host_launch_model()
        self.limits = llm.runner.graph_limits()
        self.by_workload: dict[str, dict] = {}
        runner = llm.runner
        self.launch, self.sampling, self.step = runner.launch, getattr(runner, "sampling_tensors", None), llm.step
        runner.launch, llm.step = self._launch, self._step  # instance attributes over the methods, until close()
        if self.sampling is not None:
            runner.sampling_tensors = self._sampling_tensors

    def start(self, name: str) -> None:
        self.name, self.rows, self.previous_end = name, [], None

    def _step(self):
        self.current = {"launch_s": 0.0, "wait_s": 0.0, "shape": None, "rebuilt": 0}
        start = time.perf_counter()
        output = self.step()
        end = time.perf_counter()
        row = self.current
        if row["shape"] is not None:
            row["step_s"] = end - start
            row["idle_s"] = start - self.previous_end if self.previous_end is not None else 0.0
            self.rows.append(row)
        self.previous_end = end
        return output

    def _sampling_tensors(self, rows, steps):
        cached = self.llm.runner._sampling_cache
        tensors = self.sampling(rows, steps)
        self.current["rebuilt"] = len(rows) if self.llm.runner._sampling_cache is not cached else 0
        return tensors

    def _launch(self, batch):
        row = self.current
        start = time.perf_counter()
        handle = self.launch(batch)
        launched = time.perf_counter()
        row["launch_s"] = launched - start
        # read after the launch (which changes no request): its cost is the diagnostics', not the engine's
        row["shape"], row["requests"] = self.StepShape.of(batch, self.limits), len(batch.requests)
        row["overhead_s"] = time.perf_counter() - launched
        return _TimedHandle(handle, self)

    def finish(self, run) -> None:
        profile = self.profile
        launch_same, launch_new, engine, wake = [], [], [], []
        for row in self.rows:
            shape = row["shape"]
            predicted = self.launch_model(shape) if self.launch_model else 0.0
            if row["rebuilt"]:
                predicted += profile.sampling_setup_seconds(row["rebuilt"])
            predicted *= profile.launch_in_run_factor
            (launch_new if row["rebuilt"] else launch_same).append((row["launch_s"], predicted))
            host = row["step_s"] - row["launch_s"] - row["wait_s"] - row["overhead_s"]
            modeled_host = profile.step_host_seconds(row["requests"], shape.prefill_tokens)
            engine.append((host, modeled_host))
            if row["idle_s"] > 0.002:  # the host's part of waking up: its launch and own work past the model's
                extra = row["launch_s"] + host - predicted - modeled_host
                wake.append((max(extra, 1e-9), profile.idle_wake_seconds(row["idle_s"])))

        def summary(pairs):
            if not pairs:
                return None
            measured, predicted = np.array(pairs)[:, 0], np.array(pairs)[:, 1]
            return {
                "steps": len(pairs),
                "measured_median_us": float(1e6 * np.median(measured)),
                "model_median_us": float(1e6 * np.median(predicted)),
                "median_ratio": float(np.median(measured / np.maximum(predicted, 1e-9))),
            }

        self.by_workload[self.name] = {
            "launch, same sampling rows": summary(launch_same),
            "launch, new sampling rows": summary(launch_new),
            "engine's own work per step": summary(engine),
            "host's extra after > 2 ms idle (model: idle_wake)": summary(wake),
        }

    def close(self) -> None:
        runner = self.llm.runner
        del runner.launch, self.llm.step
        if self.sampling is not None:
            del runner.sampling_tensors


class _TimedHandle:
    """A step's handle whose wait for tokens counts toward the step that waits (under overlap,
    the next one)."""

    def __init__(self, handle, diagnostics: HostDiagnostics):
        self.handle, self.diagnostics = handle, diagnostics

    def tokens(self):
        start = time.perf_counter()
        tokens = self.handle.tokens()
        self.diagnostics.current["wait_s"] += time.perf_counter() - start
        return tokens

    def placeholders(self):
        return self.handle.placeholders()

    def __getattr__(self, name):  # whatever else the engine reads of a handle (its logprobs, ...)
        return getattr(self.handle, name)


def ablated(profile, path: str, what: str) -> str:
    variant = copy.deepcopy(profile)
    if what == "no host costs":
        for name in NEW_HOST_COSTS:
            setattr(variant, name, 1.0 if name == "launch_in_run_factor" else 0.0)
        variant.idle_wake = []
    variant.save(path)
    return path


def simulate(model_path, engine, profile_path, workloads, deadline, log, variants, written) -> None:
    """Each variant of the simulation replays the workloads the real engine ran; written() after
    each, so that a call cut short keeps what it simulated."""
    from inferlab import LLM
    from inferlab.sim.profile import load_profile

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
            run_workloads(
                sim, [w for w in workloads if "skipped" not in w.results.get("real", {})], deadline, 0, label, log
            )
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


def write_results(
    out: str, report: dict, markdown: list, section: int, size, device, workloads, variants, diagnostics, profile
) -> None:
    """sim_vs_real.json and .md with what this size has measured so far (its section of the markdown
    rewritten)."""
    report["sizes"][size] = {
        "profile": os.path.basename(profile),
        "workloads": {w.name: {"bench": w.bench, **w.results} for w in workloads},
        "host_diagnostics": diagnostics.by_workload,
    }
    markdown[section:] = [tables(size, device, workloads, variants, diagnostics)]
    with open(os.path.join(out, "sim_vs_real.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out, "sim_vs_real.md"), "w") as f:
        f.write("\n".join(markdown))


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
    args = parser.parse_args(argv)
    started = time.monotonic()
    deadline = started + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "sim_vs_real.log"), "a")

    def log(line: str) -> None:
        line = f"[{time.monotonic() - started:6.1f} s] {line}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    import torch

    from inferlab import LLM
    from inferlab.conf import ProfileConfig
    from inferlab.experiment.profile_job import host_cost_lines, run_profile

    args.lengths = {}
    if args.tiny:
        args.trace, args.fit = SMALL_TRACE, "scale"
        args.max_requests, args.num_seqs = min(args.max_requests, 16), min(args.num_seqs, 12)
        engine = dict(
            device="cpu",
            attention="torch",
            kvcache_block_size=16,
            num_kvcache_blocks=512,
            max_model_len=1024,
            max_num_batched_tokens=512,
            max_num_seqs=16,
            overlap_scheduling=False,  # the CPU runner does not run ahead; the sim must not either
        )
        args.lengths = dict(min_len=16, max_len=128, min_output_len=2, max_output_len=12)
        profile_settings = ProfileConfig(
            repeats=3, decode_batches=[1, 4, 16], decode_contexts=[16, 128], prefill_tokens=[16, 64, 256]
        )
    else:
        engine = dict(attention="triton", max_model_len=args.max_model_len)
    device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.tiny else "cpu"
    card = card_name(device_name)
    log(f"{device_name}; sizes {args.sizes}; budget {args.budget_s:.0f} s; trace {args.trace}")
    report = {"device": device_name, "args": {k: v for k, v in vars(args).items()}, "sizes": {}}
    markdown = [f"# The simulator against the real engine on {device_name}", ""]
    # the most telling first, in case the budget ends
    variants = {"sim": ("full", 1.0), "sim, no host costs": ("no host costs", 1.0), "sim, no noise": ("full", 0.0)}

    for size in args.sizes.split(","):
        if time.monotonic() > deadline - SIZE_LEAST_S.get(size, 60):
            log(f"{size}: not started, {deadline - time.monotonic():.0f} s left of the budget")
            continue
        workloads = plan(args)
        if args.tiny:
            model_path, name = None, "cpu-tiny-torch"
        else:
            from bench_gpu import SHAPES, build_checkpoint

            base = SHAPES[size]
            model_path = build_checkpoint(f"/tmp/sim-vs-real-qwen3-{size}", base["num_hidden_layers"], base)
            name = f"{card}-qwen3-{size}-triton"
        if not args.tiny:
            # the 8B model's steps take several times the 0.6B's: a smaller grid keeps its profile to a minute
            profile_settings = ProfileConfig(repeats=args.profile_repeats, **(TRIMMED_GRID if size == "8b" else {}))
        log(f"{size}: checkpoint ready ({model_path}); building the engine")
        profile_path = os.path.join(args.out, f"{name}.json")
        with LLM(model_path, **engine) as llm:
            log(f"{size}: engine ready, {llm.kv_manager.num_blocks} KV blocks; profiling")
            command = f"scripts/sim_vs_real_gpu.py {' '.join(argv if argv is not None else sys.argv[1:])}"
            profile = run_profile(llm, profile_settings, command)
            profile.save(profile_path)
            log(f"{size}: {len(profile.measurements)} compositions -> {profile_path}")
            for line in host_cost_lines(profile):
                log(f"  {line}")
            diagnostics = HostDiagnostics(llm, profile)
            # what the simulations need afterwards: about 30 s a size on the device's host
            run_workloads(llm, workloads, deadline, 45, "real", log, diagnostics)
            diagnostics.close()
        written = functools.partial(
            write_results,
            args.out,
            report,
            markdown,
            len(markdown),
            size,
            device_name,
            workloads,
            list(variants),
            diagnostics,
            profile_path,
        )
        written()  # the real runs, before the simulations
        simulate(model_path, engine, profile_path, workloads, deadline, log, variants, written)
        log(f"{size}: written sim_vs_real.md and .json")
    log(f"done in {time.monotonic() - started:.0f} s")
    print("\n".join(markdown))


if __name__ == "__main__":
    main()
