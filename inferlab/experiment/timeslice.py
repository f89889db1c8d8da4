"""How a GPU time-slices two processes (no MPS), measured on the card: the two characteristics of a
simulated shared GPU (inferlab.sim.shared_gpu), `executor.context_switch_s` and
`executor.timeslice_s`.

Two Ray actors of a fraction of the GPU each (two processes, two CUDA contexts, as two replicas
with cluster.gpus_per_replica=0.5) run kernels of a known length back to back, each keeping its
queue full and noting when each kernel ends (CUDA events, put on the host's monotonic clock, which
both processes share): first one actor alone, which gives the kernel's length d, then both at once.
estimate() tells what the second run shows; without a GPU (num_gpus=0) the kernel is a busy loop
on the host, so that the same path runs on a CPU (the OS runs the two at once: nothing to measure).
"""

import os
import statistics
import time
from time import perf_counter

DURATIONS_S = (0.0002, 0.001, 0.005)  # kernels shorter, about as long as, and longer than a timeslice


class Spinner:
    """A Ray actor's class: runs kernels of a given length back to back on its share of the GPU."""

    def __init__(self):
        import torch

        self.torch = torch
        self.cuda = torch.cuda.is_available()
        self.matrices: dict[float, tuple] = {}  # kernel length -> (a, out): a @ a of about that length

    def where(self) -> dict:
        """What this actor sees: its process, the GPUs Ray gave it, and the device."""
        device = self.torch.cuda.get_device_name(0) if self.cuda else None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return {"pid": os.getpid(), "CUDA_VISIBLE_DEVICES": visible, "cuda": self.cuda, "device": device}

    def _matrix(self, duration_s: float) -> tuple:
        """A square bf16 matrix whose product with itself takes about duration_s alone, and the
        product's buffer. A kernel of fixed work, unlike torch.cuda._sleep, which spins on the SM
        clock: that clock runs on while its context is switched out, so a sliced sleep kernel still
        ends on time and slicing of kernels longer than a slice goes unseen."""
        if duration_s not in self.matrices:
            torch = self.torch
            n, pair = 256, None
            while n <= 16384:
                a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
                out = torch.empty_like(a)
                torch.mm(a, a, out=out)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(5):
                    torch.mm(a, a, out=out)
                end.record()
                end.synchronize()
                pair = (a, out)
                # work grows as n**3: the size that lands on duration_s, rounded to 128
                seconds = start.elapsed_time(end) / 1000 / 5
                if seconds >= duration_s or n == 16384:
                    break
                n = min(16384, max(n + 128, int((duration_s / seconds) ** (1 / 3) * n) // 128 * 128))
            self.matrices[duration_s] = pair
        return self.matrices[duration_s]

    def spin(self, duration_s: float, seconds: float, start_at: float) -> list[float]:
        """Kernels of duration_s back to back for about `seconds` from start_at (perf_counter's
        clock): when each one ended, on that clock."""
        num = max(2, int(seconds / duration_s))
        while perf_counter() < start_at:
            time.sleep(min(0.001, max(0.0, start_at - perf_counter())))
        if not self.cuda:
            ends = []
            for _ in range(num):
                end = perf_counter() + duration_s
                while perf_counter() < end:
                    pass
                ends.append(perf_counter())
            return ends
        torch = self.torch
        a, out = self._matrix(duration_s)
        origin = torch.cuda.Event(enable_timing=True)
        origin.record()
        origin.synchronize()
        at = perf_counter()
        events = []
        for _ in range(num):
            torch.mm(a, a, out=out)
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
        torch.cuda.synchronize()
        return [at + origin.elapsed_time(event) / 1000 for event in events]


def estimate(solo: list[float], both: list[list[float]]) -> dict:
    """The switch cost and the timeslice from kernel end times: `solo`, one process's alone, and
    `both`, each process's while the other ran too (kernels of one length, on one clock).

    d is the median interval between ends alone. While both run, an interval of one process longer
    than d by more than the noise alone shows (thrice the p99's excess, at least 10 µs) is a gap: its
    kernel was switched out while the other process held the GPU. Over the window in which both ran
    (W long, n kernels ended in it), the GPU did n·d of work; the rest went to switches, and there
    is one switch per gap (each gap of one process is a hold of the other): context_switch_s =
    (W - n·d) / gaps. A gap's excess over d is the other's hold plus two switches:
    timeslice_s = median(excess) - 2·context_switch_s, how long a context keeps the GPU while the
    other waits. No gaps, or more than 1.5·W of work (the two ran at once, as on a CPU's cores):
    switch 0, timeslice None. This holds for kernels
    shorter than the timeslice: a longer one is cut more than once an interval, so its gaps
    undercount the switches (measure() reports such runs but does not use them)."""
    solo_intervals = [b - a for a, b in zip(solo, solo[1:])]
    d = statistics.median(solo_intervals)
    noise = max(10e-6, 3 * (sorted(solo_intervals)[int(0.99 * (len(solo_intervals) - 1))] - d))
    start, end = max(ends[0] for ends in both), min(ends[-1] for ends in both)
    gaps, num = [], 0
    for ends in both:
        inside = [t for t in ends if start <= t <= end]
        num += len(inside) - 1  # the first one's kernel began before the window
        gaps += [b - a - d for a, b in zip(inside, inside[1:]) if b - a - d > noise]
    window = end - start
    if num * d > 1.5 * window:  # more work than one GPU's time: they ran at once (a CPU's cores)
        gaps = []
    switch = max(0.0, (window - num * d) / len(gaps)) if gaps else 0.0
    timeslice = statistics.median(gaps) - 2 * switch if gaps else None
    both_intervals = [b - a for ends in both for a, b in zip(ends, ends[1:])]
    return {
        "kernel_s": d,
        "window_s": window,
        "kernels": num,
        "gaps": len(gaps),
        "busy_fraction": num * d / window if window > 0 else None,
        "slowdown_p50": statistics.median(both_intervals) / d,
        "context_switch_s": switch,
        "timeslice_s": timeslice if timeslice is None or timeslice > 0 else None,
    }


def measure(actors: list, durations_s=DURATIONS_S, seconds: float = 1.0) -> dict:
    """Runs the kernels on two Spinner actors (Ray handles on one GPU) for each duration, alone and
    together, and estimates; the result's timeslice_s is the shortest kernels' (the finest grain),
    its context_switch_s the median over the runs whose kernels are shorter than that timeslice."""
    import ray

    runs = []
    for duration in sorted(durations_s):
        solo = ray.get(actors[0].spin.remote(duration, seconds / 2, perf_counter() + 0.3))
        at = perf_counter() + 0.5  # both start together, once their calls have arrived
        both = ray.get([actor.spin.remote(duration, seconds, at) for actor in actors])
        runs.append({"duration_s": duration, **estimate(solo, both)})
    timeslice = runs[0]["timeslice_s"]
    usable = [run for run in runs if timeslice is None or run["duration_s"] < timeslice] or runs[:1]
    return {
        "context_switch_s": statistics.median(run["context_switch_s"] for run in usable),
        "timeslice_s": timeslice,
        "runs": runs,
    }
