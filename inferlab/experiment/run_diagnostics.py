"""Per-step and per-request records of the real engine's runs (scripts/sim_vs_real_gpu.py), and their
analysis offline against the step-time profile, to find where the simulator departs from the device.

`StepDiagnostics` wraps an engine's step and its runner's launch during the real runs and keeps every
step: its host start and end (on the run's clock, t=0 at the run's start), its shape, its launch,
the host's wait for tokens (under overlap scheduling, for the step launched before it), the engine's
own work, the idle time before it, whether it rebuilt its sampling rows, and on a GPU the device's
span of it (CUDA events around its launch, on the device's timeline: from the device reaching the
step to the end of its work, so where the device had caught up with the host it includes the host's
launch). The garbage collector's pauses are kept too. `finish` writes them with the run's requests
(arrival, first scheduled, first token, finish, every token's time) as steps-<size>-<workload>.npz;
`save_simulated` writes a simulated run's requests and steps as sim-<size>-<workload>.npz.

`analyze` reads those files with the profile and tells, for each workload, (a) what the requests
with the longest TTFT met between their arrival and first token, and (b) the device's span of the
steps against the profile's prediction for their shapes, by batch size, context spread and prefill
tokens.
"""

import gc
import glob
import json
import os
import re
import time

import numpy as np
import torch

from inferlab.experiment.profile_job import TimedSteps
from inferlab.sim.cost_model import StepShape
from inferlab.sim.profile import PROFILE_DIR, load_profile

SHAPE_FIELDS = StepShape.__slots__
# a device gap shorter than this before a step: the device was still busy when the host launched it,
# so the step's device span is the device's own work
BUSY_GAP_S = 20e-6


def workload_file(kind: str, size: str, workload: str) -> str:
    return f"{kind}-{size}-{re.sub(r'[^A-Za-z0-9.]+', '-', workload).strip('-')}.npz"


class _RecordedLaunches(TimedSteps):
    """TimedSteps that also keeps, per launch, its longest context and (on a GPU) CUDA events around
    it; their cost is the timer's overhead, not the engine's."""

    def __init__(self, llm, shapes, events: bool):
        super().__init__(llm, shapes)
        self.events = events and self.runner.device.type == "cuda"
        self.extra: list[tuple] = []

    def _launch(self, batch):
        first = time.perf_counter()
        start = torch.cuda.Event(enable_timing=True) if self.events else None
        if start is not None:
            start.record()
        launched = time.perf_counter()
        handle = super()._launch(batch)
        returned = time.perf_counter()
        end = None
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        longest = max(
            (r.num_computed_tokens + n for r, n in zip(batch.requests, batch.num_scheduled_tokens)), default=0
        )
        self.extra.append((longest, start, end, first))
        self.overhead_s += launched - first + time.perf_counter() - returned
        return handle


class StepDiagnostics:
    """During the real runs: every step's record (see the module docstring), and per workload the
    medians of the host's launch, own work and wake-up against the profile's host model."""

    def __init__(self, llm, profile, out: str, size: str, profile_file: str, events: bool = True):
        self.llm, self.profile, self.launch_model = llm, profile, profile.host_launch_model()
        self.out, self.size, self.profile_file, self.pauses, self.collecting = out, size, profile_file, [], None
        self.steps = _RecordedLaunches(llm, llm.runner.graph_limits(), events)
        self.step, llm.step = llm.step, self._step  # an instance attribute over the method, until close()
        gc.callbacks.append(self._collected)
        self.by_workload: dict[str, dict] = {}

    def start(self, name: str) -> None:
        self.name, self.rows, self.previous_end, self.pauses, self.collecting = name, [], None, [], None
        self.steps.launches.clear()
        self.steps.extra.clear()

    def _collected(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.collecting = time.perf_counter()
        elif self.collecting is not None:
            self.pauses.append((self.collecting, time.perf_counter(), info.get("generation", -1)))

    def _step(self):
        steps, launches = self.steps, len(self.steps.launches)
        steps.launch_s = steps.wait_s = steps.overhead_s = 0.0
        start = time.perf_counter()
        output = self.step()
        end = time.perf_counter()
        idle = start - self.previous_end if self.previous_end is not None else 0.0
        host = end - start - steps.launch_s - steps.wait_s - steps.overhead_s
        launch = len(steps.launches) - 1 if len(steps.launches) > launches else -1
        self.rows.append((start, end, steps.launch_s, steps.wait_s, host, idle, steps.overhead_s, launch))
        self.previous_end = end
        return output

    def finish(self, run, figures: dict) -> None:
        """The workload's medians against the host model, and its records written under out."""
        self.by_workload[self.name] = self._summaries()
        rows = np.array([r[:7] for r in self.rows], dtype=np.float64).reshape(-1, 7)
        # the run's t=0 on the host's clock: the driver stamps each step just before calling it
        origin = float(np.median(rows[:, 0] - [s.start_s for s in run.steps])) if len(run.steps) == len(rows) else 0.0
        index = np.array([r[7] for r in self.rows], dtype=np.int64)
        launched = index >= 0
        arrays = {
            "start_s": rows[:, 0] - origin,
            "end_s": rows[:, 1] - origin,
            "launch_s": rows[:, 2],
            "wait_s": rows[:, 3],
            "host_s": rows[:, 4],
            "idle_s": rows[:, 5],
            "timer_s": rows[:, 6],
            "launched": launched,
            "rebuilt": np.zeros(len(rows), np.int32),
            "max_context": np.zeros(len(rows), np.int64),
            **{name: np.zeros(len(rows), np.int64) for name in SHAPE_FIELDS},
            "device_start_s": np.full(len(rows), np.nan),
            "device_end_s": np.full(len(rows), np.nan),
        }
        events = [self.steps.extra[i] for i in index[launched]]
        for name in SHAPE_FIELDS:
            arrays[name][launched] = [getattr(self.steps.launches[i][0], name) for i in index[launched]]
        arrays["rebuilt"][launched] = [self.steps.launches[i][2] for i in index[launched]]
        arrays["max_context"][launched] = [e[0] for e in events]
        if events and events[0][1] is not None:
            torch.cuda.synchronize()
            first, at = events[0][1], events[0][3] - origin  # the device reached it no earlier than its record
            arrays["device_start_s"][launched] = [at + first.elapsed_time(e[1]) / 1e3 for e in events]
            arrays["device_end_s"][launched] = [at + first.elapsed_time(e[2]) / 1e3 for e in events]
        pauses = np.array(self.pauses, dtype=np.float64).reshape(-1, 3)
        arrays.update(gc_start_s=pauses[:, 0] - origin, gc_end_s=pauses[:, 1] - origin, gc_generation=pauses[:, 2])
        meta = {"size": self.size, "workload": self.name, "profile": self.profile_file, **figures}
        save_requests(os.path.join(self.out, workload_file("steps", self.size, self.name)), run, arrays, meta)
        self.steps.launches.clear()
        self.steps.extra.clear()

    def _summaries(self) -> dict:
        profile = self.profile
        launch_same, launch_new, engine, wake = [], [], [], []
        for *_, launch_s, _, host, idle, _, index in self.rows:
            if index < 0:
                continue
            shape, launch_s, rebuilt = self.steps.launches[index]
            predicted = self.launch_model(shape) if self.launch_model else 0.0
            if rebuilt:
                predicted += profile.sampling_setup_seconds(rebuilt)
            predicted *= profile.launch_in_run_factor
            (launch_new if rebuilt else launch_same).append((launch_s, predicted))
            modeled_host = profile.step_host_seconds(
                shape.prefill_requests + shape.decode_requests, shape.prefill_tokens
            )
            engine.append((host, modeled_host))
            if idle > 0.002:  # the host's part of waking up: its launch and own work past the model's
                extra = launch_s + host - predicted - modeled_host
                wake.append((max(extra, 1e-9), profile.idle_wake_seconds(idle)))

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

        return {
            "launch, same sampling rows": summary(launch_same),
            "launch, new sampling rows": summary(launch_new),
            "engine's own work per step": summary(engine),
            "host's extra after > 2 ms idle (model: idle_wake)": summary(wake),
        }

    def close(self) -> None:
        self.steps.close()
        gc.callbacks.remove(self._collected)
        del self.llm.step


def save_requests(path: str, run, arrays: dict, meta: dict) -> None:
    """arrays and the run's requests (their times on the run's clock, NaN where none) in one npz."""
    requests = run.requests

    def times(name):
        return np.array([np.nan if getattr(r, name) is None else getattr(r, name) for r in requests], np.float64)

    np.savez_compressed(
        path,
        **arrays,
        **{f"request_{name}": times(name) for name in ("arrival_s", "first_scheduled_s", "first_token_s", "finish_s")},
        **{
            f"request_{name}": np.array([getattr(r, name) for r in requests], np.int64)
            for name in ("num_prompt_tokens", "num_output_tokens", "num_cached_tokens", "num_preemptions")
        },
        token_times_s=np.concatenate([np.asarray(r.token_times_s, np.float64) for r in requests]),
        token_offsets=np.cumsum([0] + [len(r.token_times_s) for r in requests]),
        meta=np.array(json.dumps(meta, default=str)),
    )


def save_simulated(out: str, size: str, workload: str, run) -> None:
    """A simulated run's requests and steps (times on its virtual clock), beside the real run's."""
    steps = run.steps
    arrays = {
        "start_s": np.array([s.start_s for s in steps], np.float64),
        "end_s": np.array([s.end_s for s in steps], np.float64),
        "prefill_tokens": np.array([s.num_prefill_tokens for s in steps], np.int64),
        "decode_requests": np.array([s.num_decode_tokens for s in steps], np.int64),
        "requests": np.array([s.num_seqs for s in steps], np.int64),
    }
    save_requests(
        os.path.join(out, workload_file("sim", size, workload)), run, arrays, {"size": size, "workload": workload}
    )


def _load(path: str) -> tuple[dict, dict]:
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files if name != "meta"}
        return arrays, json.loads(str(data["meta"]))


def _predictions(steps: dict, profile) -> tuple[np.ndarray, np.ndarray]:
    """The profile's device time and host launch time for each step's shape (0 where none launched)."""
    cost, launch_model = profile.cost_model(), profile.host_launch_model()
    device, launch = np.zeros(len(steps["start_s"])), np.zeros(len(steps["start_s"]))
    for i in np.flatnonzero(steps["launched"]):
        shape = StepShape(*(int(steps[name][i]) for name in SHAPE_FIELDS))
        device[i] = cost(shape)
        launch[i] = launch_model(shape) * profile.launch_in_run_factor if launch_model else 0.0
        if steps["rebuilt"][i]:
            launch[i] += profile.sampling_setup_seconds(int(steps["rebuilt"][i])) * profile.launch_in_run_factor
    return device, launch


def device_spans(steps: dict) -> tuple[np.ndarray, np.ndarray, str]:
    """Each step's device time and whether it is the device's own work (the device was busy when
    the step was launched); without CUDA events (a CPU run, whose launch runs the step), the launch."""
    launched = steps["launched"]
    if np.isfinite(steps["device_start_s"][launched]).any():
        span = steps["device_end_s"] - steps["device_start_s"]
        ends = steps["device_end_s"][launched]
        gap = np.full(len(span), np.inf)
        gap[np.flatnonzero(launched)[1:]] = steps["device_start_s"][launched][1:] - ends[:-1]
        return span, launched & (gap < BUSY_GAP_S), "device span (CUDA events), device busy at launch"
    return steps["launch_s"], launched, "launch (no CUDA events: the launch runs the step)"


def _bucket(values: np.ndarray, edges: tuple, unit: str = "") -> list[str]:
    """Each value's bucket between edges, labelled so that the labels sort in the edges' order."""
    labels, lower = [], 0
    for k, edge in enumerate(edges):
        labels.append(f"{k}: {lower}-{edge}{unit}" if lower != edge else f"{k}: {edge}{unit}")
        lower = edge + 1 if isinstance(edge, int) else edge
    labels.append(f"{len(edges)}: >{edges[-1]}{unit}")
    return [labels[int(np.searchsorted(edges, v, side="left"))] for v in values]


def device_table(steps: dict, predicted: np.ndarray) -> list[str]:
    """(b): the device's time of the steps against the profile, median ratio per bucket."""
    span, busy, what = device_spans(steps)
    usable = steps["launched"] & (predicted > 0) & np.isfinite(span)
    if not usable.any():
        return ["(no steps with a device time)"]
    every = f"all {usable.sum()} launched: sum real / sum model {span[usable].sum() / predicted[usable].sum():.3f}"
    if (busy & usable).sum() >= 20:  # else the spans of every step, the host's launch in those after idling
        usable = busy & usable
    else:
        what = what.replace(", device busy at launch", ", every step (too few launched onto a busy device)")
    ratio = span[usable] / predicted[usable]
    requests = (steps["prefill_requests"] + steps["decode_requests"])[usable]
    decodes = np.maximum(steps["decode_requests"][usable], 1)
    spread = np.where(
        steps["decode_requests"][usable] > 1,
        steps["max_context"][usable] / (steps["decode_context"][usable] / decodes + 1e-9),
        1.0,
    )
    kinds = np.where(steps["prefill_tokens"][usable] > 0, "with prefill", "decode only")
    kinds = np.char.add(kinds, np.where(steps["graph"][usable] > 0, ", graph", ", eager"))
    groups = {
        "kind": list(kinds),
        "batch": _bucket(requests, (1, 4, 16, 64, 128, 256)),  # 1 request: "0-1"
        "context max/mean": _bucket(spread, (1.25, 2.0, 4.0), "x"),
        "prefill tokens": _bucket(steps["prefill_tokens"][usable], (0, 64, 256, 1024, 4096)),
    }
    lines = [
        f"{what}: {usable.sum()} steps, sum real / sum model {span[usable].sum() / predicted[usable].sum():.3f}, "
        f"median ratio {np.median(ratio):.3f} ({every})",
        "",
        "| by | bucket | steps | real median | model median | median ratio | p90 ratio |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for by, labels in groups.items():
        labels = np.array(labels)
        for label in sorted(set(labels)):
            mask = labels == label
            lines.append(
                f"| {by} | {label} | {mask.sum()} | {1e3 * np.median(span[usable][mask]):.3f} ms | "
                f"{1e3 * np.median(predicted[usable][mask]):.3f} ms | {np.median(ratio[mask]):.3f} | "
                f"{np.quantile(ratio[mask], 0.9):.3f} |"
            )
    return lines


def ttft_table(steps: dict, device: np.ndarray, launch: np.ndarray, sim: dict | None, top: int) -> list[str]:
    """(a): the requests with the longest TTFT (and the p90 and p50 ones), and what they met between
    arrival and first token."""
    arrival, first_token = steps["request_arrival_s"], steps["request_first_token_s"]
    ttft = first_token - arrival
    order = [int(i) for i in np.argsort(-np.nan_to_num(ttft, nan=-1.0))]
    served = np.isfinite(ttft).sum()
    picks = order[:top] + [order[int(0.1 * served)], order[int(0.5 * served)]]
    names = [f"#{k + 1}" for k in range(top)] + ["p90", "p50"]
    span, _, _ = device_spans(steps)
    start, end = steps["start_s"], steps["end_s"]
    lines = [
        "| rank | req | arrival s | TTFT ms | sim TTFT ms | to 1st step ms | queued ms | prompt (cached) | prompts ahead "
        "| steps | device real / model ms | launch real / model ms | idle ms | max own work ms | gc ms | worst step real/model |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, i in zip(names, picks):
        t0, t1 = arrival[i], first_token[i]
        within = (end > t0) & (start < t1)
        after = np.flatnonzero(start >= t0)
        first_step = 1e3 * (start[after[0]] - t0) if len(after) else np.nan
        ahead = int(((arrival < t0) & (first_token > t0)).sum())
        gc_ms = 1e3 * np.clip(np.minimum(steps["gc_end_s"], t1) - np.maximum(steps["gc_start_s"], t0), 0, None).sum()
        idle = np.clip(np.minimum(start, t1) - np.maximum(start - steps["idle_s"], t0), 0, None)  # within the window
        with_device = within & steps["launched"] & (device > 0)
        worst = "-"
        if with_device.any():
            ratios = np.where(with_device, np.nan_to_num(span) / np.maximum(device, 1e-9), -1)
            w = int(np.argmax(ratios))
            worst = (
                f"{1e3 * span[w]:.2f}/{1e3 * device[w]:.2f} ms ({steps['prefill_tokens'][w]} prefill, "
                f"{steps['decode_requests'][w]} decodes)"
            )
        sim_ttft = "-"
        if sim is not None and i < len(sim["request_arrival_s"]):
            sim_ttft = f"{1e3 * (sim['request_first_token_s'][i] - sim['request_arrival_s'][i]):.2f}"
        lines.append(
            f"| {name} | {i} | {t0:.3f} | {1e3 * ttft[i]:.2f} | {sim_ttft} | {first_step:.2f} | "
            f"{1e3 * (steps['request_first_scheduled_s'][i] - t0):.2f} | {steps['request_num_prompt_tokens'][i]} "
            f"({steps['request_num_cached_tokens'][i]}) | {ahead} | {within.sum()} | "
            f"{1e3 * np.nansum(span[with_device]):.2f} / {1e3 * device[with_device].sum():.2f} | "
            f"{1e3 * steps['launch_s'][within].sum():.2f} / {1e3 * launch[within].sum():.2f} | "
            f"{1e3 * idle.sum():.2f} | {1e3 * steps['host_s'][within].max(initial=0):.2f} | "
            f"{gc_ms:.2f} | {worst} |"
        )
    return lines


def analyze(directory: str, profile_path: str | None = None, top: int = 3) -> str:
    """The analysis of a call's steps-*.npz (and sim-*.npz where present) as markdown; profile_path
    (default: the profile the call wrote beside them, else the shipped one of its name)."""
    paths = sorted(glob.glob(os.path.join(directory, "steps-*.npz")))
    if not paths:
        raise FileNotFoundError(f"no steps-*.npz under {directory}: the real runs of sim_vs_real_gpu.py write them")
    lines, profiles = ["# Steps and requests of the real runs against the profile", ""], {}
    for path in paths:
        steps, meta = _load(path)
        name = profile_path or meta.get("profile") or ""
        if name not in profiles:
            beside = os.path.join(directory, os.path.basename(name))
            profiles[name] = load_profile(beside if os.path.isfile(beside) else os.path.join(PROFILE_DIR, name))
        profile = profiles[name]
        device, launch = _predictions(steps, profile)
        sim_path = path.replace(f"{os.sep}steps-", f"{os.sep}sim-")
        sim = _load(sim_path)[0] if os.path.isfile(sim_path) else None
        gc_ms = 1e3 * (steps["gc_end_s"] - steps["gc_start_s"])
        lines += [
            f"## {meta['size']}, {meta['workload']} (profile {os.path.basename(name) or '-'})",
            "",
            f"{len(steps['start_s'])} steps ({steps['launched'].sum()} launched), "
            f"{len(steps['request_arrival_s'])} requests; host idle {steps['idle_s'].sum():.3f} s, "
            f"waiting for the device {steps['wait_s'].sum():.3f} s, own work {steps['host_s'].sum():.3f} s, "
            f"timer {1e3 * steps['timer_s'].sum():.1f} ms; {len(gc_ms)} collections, longest {gc_ms.max(initial=0):.2f} ms"
            + (f"; simulated steps {len(sim['start_s'])}" if sim is not None else ""),
            "",
            "(a) the longest TTFTs and what they met between arrival and first token",
            "",
            *ttft_table(steps, device, launch, sim, top),
            "",
            "(b) the device's time of the steps against the profile's prediction for their shapes",
            "",
            *device_table(steps, device),
            "",
        ]
    return "\n".join(lines)
