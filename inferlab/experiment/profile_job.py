"""`inferlab job=profile`: measure step times of the real engine over a grid of step compositions
and write them as a step-time profile for the simulated executor.

Each composition (decode batches of several sizes and contexts, with and without CUDA graphs;
prefill chunks of several sizes with and without cached context, alone, split over requests and
mixed with decodes of short and long contexts) is built as requests holding real KV blocks and
launched back to back as the engine does under overlap scheduling (the next launch before the
previous tokens are read), so a step's time, the steady interval between two reads, is what a run
pays for it: the device's work or, where it is longer, the host's launch. Each measurement also
gives `host_seconds`, the host's time in launching it, `seconds_std`, the spread of the timed
intervals (the simulator's step-time noise), and on a GPU `device_seconds`, the device's own time
for the step: where `seconds` is well above it, the host bounds the step.

Besides the steps, the job measures the host's other costs that a run pays and relaunching one
batch does not: admitting a request (`measure_admission`), the engine's own work on a step besides
launching it and waiting for its tokens (`measure_step_host`: scheduling, KV book-keeping,
finishing), the runner's rebuild of per-row sampling settings when a batch's sampling rows change
(`measure_sampling_setup`), a step launched onto an engine that idled (`measure_idle_wake`), and
launches in a short run against the grid's relaunches of one batch (`measure_launch_in_run`).
"""

import itertools
import json
import os
import sys
import time
from collections.abc import Iterator

import numpy as np
import torch
from omegaconf import OmegaConf

import inferlab
from inferlab.conf import ProfileConfig, engine_arguments
from inferlab.core.batch import ScheduledBatch
from inferlab.core.cuda_graphs import GraphLimits
from inferlab.core.engine import EngineStats
from inferlab.core.model_runner import ModelRunner
from inferlab.core.protocols import OnDevice
from inferlab.core.request import Request
from inferlab.core.sampling_params import SamplingParams
from inferlab.experiment.driver import run_workload
from inferlab.experiment.records import git_state, resolved_plugins
from inferlab.experiment.workload import WorkloadRequest
from inferlab.sim.cost_model import HostLaunchModel, MeasuredCostModel, StepShape, nonnegative_least_squares
from inferlab.sim.profile import Profile, model_fields

EAGER_BATCHES = (1, 8, 64, 256)
PREFILL_CONTEXTS = (0, 4096, 16384)
LONG_DECODE_CONTEXT = 24576


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Builds steps of a given composition on an engine's own KV cache and times them."""

    def __init__(self, llm, repeats: int, seed: int = 0, fresh_prompts: bool = True):
        self.llm, self.repeats, self.fresh_prompts = llm, repeats, fresh_prompts
        self.rng = np.random.default_rng(seed)
        self.next_id = 10**9  # far from the engine's own request ids
        self.params = SamplingParams(temperature=0.6, max_tokens=1 << 20, ignore_eos=True, seed=0)

    def _request(self, context: int, new_tokens: int) -> Request:
        vocab = min(self.llm.hf_config.vocab_size, 10_000)
        tokens = self.rng.integers(0, vocab, context + new_tokens).tolist()
        request = Request(self.next_id, tokens, self.params)
        self.next_id += 1
        if not self.llm.kv_manager.allocate(request, context + new_tokens):
            raise MemoryError
        request.num_computed_tokens = context
        return request

    def fits(self, parts: list[tuple[int, int]]) -> bool:
        kv = self.llm.kv_manager
        return sum(-(-(c + n) // kv.block_size) for c, n in parts) <= kv.num_free_blocks

    def time(self, parts: list[tuple[int, int]], graphs: bool = True) -> dict | None:
        """Seconds a step of these (cached context, new tokens) requests takes, with its shape;
        None when the KV cache cannot hold them."""
        if not self.fits(parts):
            return None
        llm, runner = self.llm, self.llm.runner
        # A step that carries a prompt meets its rows for the first time in a run, so such steps
        # alternate between two sets of requests (as the KV cache allows): each launch brings rows
        # the previous one did not have, as the engine's would, instead of relaunching one batch.
        sets = 2 if self.fresh_prompts and any(n > 1 for _, n in parts) and self.fits(parts * 2) else 1
        requests, batches = [], []
        for _ in range(sets):
            rows = [self._request(c, n) for c, n in parts]
            requests += rows
            batches.append(ScheduledBatch(rows, [n for _, n in parts], [llm.kv_manager.block_table(r) for r in rows]))
        batch, turns = batches[0], itertools.cycle(batches)
        saved = runner.decode_graphs, runner.prefill_graphs
        if not graphs:
            runner.decode_graphs = runner.prefill_graphs = None
        limits = runner.graph_limits()
        try:
            for _ in range(3):
                runner.launch(next(turns)).tokens()
            synchronize(runner.device)
            # The step's time is the steady interval between reading one step's tokens and the
            # next's, each read after the next launch as the engine does: the device's step or the
            # host's launch, whichever is longer, without the first launch onto the idle device
            # (which the simulator puts on its clock itself).
            previous, launching, read = None, 0.0, []
            for _ in range(self.repeats + 1):
                launched = time.perf_counter()
                handle = runner.launch(next(turns))
                launching += time.perf_counter() - launched
                if previous is not None:
                    previous.tokens()
                    read.append(time.perf_counter())
                previous = handle
            previous.tokens()
            synchronize(runner.device)
            seconds = (read[-1] - read[0]) / (len(read) - 1)
            intervals = np.diff(read)
            device_seconds = self._device_seconds(turns, seconds) if runner.device.type == "cuda" else None
        finally:
            runner.decode_graphs, runner.prefill_graphs = saved
            for request in requests:
                llm.kv_manager.free(request)
        # host_seconds: the host's time in launch() (inputs, forward and sampler launched), which
        # bounds the step where it outlasts the device's work
        measurement = {
            **StepShape.of(batch, limits).as_dict(),
            "seconds": seconds,
            "host_seconds": launching / (self.repeats + 1),
        }
        if len(intervals) >= 2:  # the spread of the step's time between reads, for simulated noise
            measurement["seconds_std"] = float(intervals.std(ddof=1))
        if device_seconds is not None:
            measurement["device_seconds"] = device_seconds
        return measurement

    def _device_seconds(self, turns: Iterator[ScheduledBatch], step_seconds: float) -> float:
        """The device's own time for a step: the launches are queued behind a spin kernel that
        outlasts the host's work on them, so the events around them bracket device work alone
        (kernels and the gaps between them), not the host's launch and scheduling time."""
        runner = self.llm.runner
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # 2e9 cycles a second, no less than these GPUs' clocks: twice the steps' time and 10 ms more,
        # at most a quarter second (no step's host work comes near that)
        torch.cuda._sleep(int(2e9 * min(0.25, 2 * step_seconds * self.repeats + 0.01)))
        start.record()
        handles = [runner.launch(next(turns)) for _ in range(self.repeats)]
        end.record()
        handles[-1].tokens()
        synchronize(runner.device)
        return start.elapsed_time(end) / 1e3 / self.repeats


def measure(llm, settings: ProfileConfig) -> list[dict]:
    timer = StepTimer(llm, settings.repeats)
    config, out = llm.config, []
    max_len = config.max_model_len

    eager_too = isinstance(llm.runner, ModelRunner)  # rank 0 alone can go eager

    def add(parts, graphs=True):
        if len(parts) <= config.max_num_seqs and all(c + n <= max_len for c, n in parts):
            measurement = timer.time(parts, graphs)
            if measurement is not None:
                out.append(measurement)
                # a step with prefill that replayed a graph is timed eagerly too: the eager steps' fit
                # (and its host floor) needs small ones
                if measurement["graph"] and measurement["prefill_tokens"] and eager_too:
                    eager = timer.time(parts, graphs=False)
                    if eager is not None:
                        out.append(eager)

    for batch in settings.decode_batches:
        for context in settings.decode_contexts:
            add([(context, 1)] * batch)
    if eager_too and llm.runner.decode_graphs is not None:
        for batch in EAGER_BATCHES:
            add([(512, 1)] * batch, graphs=False)
    for tokens in settings.prefill_tokens:
        if tokens > config.max_num_batched_tokens:
            continue
        for context in PREFILL_CONTEXTS:
            add([(context, tokens)])
        if tokens >= 1024:  # the same tokens as a chunk of several prompts, and a burst of short ones
            add([(0, tokens // 8)] * 8)
            add([(0, tokens // 32)] * 32)
            add([(0, tokens // 32)] * 32 + [(512, 1)] * 128)
        for decodes in (16, 128):
            add([(0, tokens)] + [(1024, 1)] * decodes)
        add([(4096, tokens)] + [(8192, 1)] * 32)
        # a few long conversations decoding beside a prompt, as long-context traces bring them
        add([(0, tokens)] + [(LONG_DECODE_CONTEXT, 1)] * 4)
    return out


def measure_admission(llm, count: int = 64, rounds: int = 5) -> tuple[float, float]:
    """The host's time to add a request (add_request, as a workload's driver calls it), per request
    and per prompt token: `count` prompts of each of two lengths (128 and 2,048 tokens, or less as
    max_model_len allows) added in a row, the fastest of `rounds` rounds, a line through the two;
    the requests are aborted after each round, untimed."""
    max_len = llm.config.max_model_len
    lengths = (min(128, max_len // 4), min(2048, max_len))
    rng = np.random.default_rng(1)
    vocab = min(llm.hf_config.vocab_size, 10_000)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    per_request = []
    for length in lengths:
        prompts = [rng.integers(0, vocab, length).tolist() for _ in range(count)]
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            ids = [llm.add_request(prompt, params) for prompt in prompts]
            best = min(best, (time.perf_counter() - start) / count)
            for request_id in ids:
                llm.abort(request_id)
            llm.step()  # reports the aborted requests: the engine is idle again
        per_request.append(best)
    per_token = max(0.0, (per_request[1] - per_request[0]) / (lengths[1] - lengths[0]))
    return max(0.0, per_request[0] - per_token * lengths[0]), per_token


class TimedSteps:
    """Times the parts of an engine's steps: runner.launch is wrapped (an instance attribute over the
    method, removed by close()) so that each step's launch and its wait for tokens (under overlap,
    the previous step's) are measured apart from the rest, the engine's own work. With `shapes`
    (the runner's graph limits), each launch is also recorded as (StepShape, launch seconds, the
    rows whose sampling settings it rebuilt: 0 where it kept them); recording it takes overhead_s,
    which is the timer's, not the engine's."""

    def __init__(self, llm, shapes: GraphLimits | None = None):
        self.llm, self.runner, self.shapes = llm, llm.runner, shapes
        self.launch, self.sampling = self.runner.launch, getattr(self.runner, "sampling_tensors", None)
        self.runner.launch = self._launch
        if shapes is not None and self.sampling is not None:
            self.runner.sampling_tensors = self._sampling_tensors
        self.launch_s = self.wait_s = self.overhead_s = 0.0
        self.launches: list[tuple[StepShape, float, int]] = []
        self.rebuilt = 0

    def _sampling_tensors(self, rows, steps):
        cached = self.runner._sampling_cache
        tensors = self.sampling(rows, steps)
        self.rebuilt = len(rows) if self.runner._sampling_cache is not cached else 0
        return tensors

    def _launch(self, batch):
        self.rebuilt = 0
        start = time.perf_counter()
        handle = self.launch(batch)
        seconds = time.perf_counter() - start
        self.launch_s += seconds
        if self.shapes is not None:  # read after the launch, which changes no request
            self.launches.append((StepShape.of(batch, self.shapes), seconds, self.rebuilt))
            self.overhead_s += time.perf_counter() - start - seconds
        return _TimedHandle(handle, self)

    def engine_seconds(self) -> float:
        """One llm.step(), less its launch, its wait for tokens and the timer's own work."""
        self.launch_s = self.wait_s = self.overhead_s = 0.0
        start = time.perf_counter()
        self.llm.step()
        return time.perf_counter() - start - self.launch_s - self.wait_s - self.overhead_s

    def close(self) -> None:
        del self.runner.launch
        if "sampling_tensors" in vars(self.runner):
            del self.runner.sampling_tensors


class _TimedHandle:
    def __init__(self, handle, steps: TimedSteps):
        self.handle, self.steps = handle, steps

    def tokens(self):
        start = time.perf_counter()
        tokens = self.handle.tokens()
        self.steps.wait_s += time.perf_counter() - start
        return tokens

    def placeholders(self):
        return self.handle.placeholders()

    def __getattr__(self, name):  # whatever else the engine reads of a handle (its logprobs, ...)
        return getattr(self.handle, name)


def measure_step_host(llm, batches=(1, 8, 64, 256), prompts=(256, 2048, 8192), rounds: int = 5):
    """The engine's own host work on a step besides launching it and waiting for tokens
    (scheduling, KV book-keeping, finishing), as (per step, per request in the batch, per prefill
    token): real steps, each less its launch and its wait, so that the host runs the engine's code
    as cold as in a run (between launches that fill its caches with the runner's work), fitted to
    decode steps of `batches` requests and to steps admitting one prompt of each of `prompts`
    tokens (fresh tokens, so no cache hits); the median of `rounds` each (every step pays it, so
    its typical cost, not its best), all within the engine's limits. The engine's requests, cache
    and counters are left as they were."""
    config = llm.config
    vocab = min(llm.hf_config.vocab_size, 10_000)
    rng = np.random.default_rng(2)
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    rows, seconds = [], []
    saved_stats, llm.stats = llm.stats, EngineStats()
    steps = TimedSteps(llm)
    try:
        for size in batches:
            if size > config.max_num_seqs or size > llm.kv_manager.num_free_blocks:
                continue
            ids = [llm.add_request(rng.integers(0, vocab, 8).tolist(), params) for _ in range(size)]
            for _ in range(3):  # admitted, then decoding
                llm.step()
            rows.append([1.0, size, 0.0])
            seconds.append(float(np.median([steps.engine_seconds() for _ in range(rounds)])))
            for request_id in ids:
                llm.abort(request_id)
            while not llm.is_finished():
                llm.step()
        for length in prompts:
            length = min(length, config.max_model_len - 1, config.max_num_batched_tokens)
            if -(-length // llm.kv_manager.block_size) > llm.kv_manager.num_free_blocks:
                continue
            times = []
            for _ in range(rounds):
                request_id = llm.add_request(rng.integers(0, vocab, length).tolist(), params)
                times.append(steps.engine_seconds())
                llm.abort(request_id)
                while not llm.is_finished():
                    llm.step()
            rows.append([1.0, 1.0, float(length)])
            seconds.append(float(np.median(times)))
    finally:
        steps.close()
        llm.stats = saved_stats
        llm.reset_prefix_cache()
    rows, seconds = np.array(rows), np.array(seconds)
    return tuple(nonnegative_least_squares(rows / seconds[:, None], np.ones_like(seconds)))


def measure_sampling_setup(llm, sizes=(1, 16, 128, 512), rounds: int = 5) -> tuple[float, float]:
    """The runner's rebuild of its per-row sampling settings for rows it has not just sampled
    (ModelRunner.sampling_tensors with its cache cleared), as (per launch, per row): the median of
    `rounds` for each of `sizes` rows, a line through them. (0, 0) for a runner without them."""
    runner = llm.runner
    if not isinstance(runner, ModelRunner):
        return 0.0, 0.0
    params = SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True)
    points = []
    for size in sizes:
        size = min(size, llm.config.max_num_seqs)
        requests = [Request(-1 - i, [1], params) for i in range(size)]  # ids no engine request has
        steps = torch.zeros(size, dtype=torch.int64, device=runner.device)
        times = []
        for _ in range(rounds):
            runner._sampling_cache = None
            start = time.perf_counter()
            runner.sampling_tensors(requests, steps)
            times.append(time.perf_counter() - start)
        points.append((size, float(np.median(times))))
    runner._sampling_cache = None
    sizes_, seconds = map(np.array, zip(*points))
    per_step, per_row = nonnegative_least_squares(np.stack([np.ones_like(seconds), sizes_], 1), seconds)
    return per_step, per_row


IDLE_GAPS = (0.002, 0.02, 0.2)  # seconds the engine idles before a step, as arrivals leave it


def measure_idle_wake(llm, gaps=IDLE_GAPS, rounds: int = 9, prompt_tokens: int = 256) -> list[list[float]]:
    """What a step launched onto an idle engine costs beyond the same step launched right after
    another: one prompt of `prompt_tokens` launched and read, with fresh sampling rows each time,
    after each idle gap and back to back; [gap, median extra seconds >= 0] for each gap."""
    runner = llm.runner
    tokens = min(prompt_tokens, llm.config.max_num_batched_tokens, llm.config.max_model_len - 1)
    timer = StepTimer(llm, repeats=2, seed=3)
    if not timer.fits([(0, tokens)]):
        return []
    request = timer._request(0, tokens)
    batch = ScheduledBatch([request], [tokens], [llm.kv_manager.block_table(request)])

    def once() -> float:
        if isinstance(runner, ModelRunner):
            runner._sampling_cache = None
        start = time.perf_counter()
        runner.launch(batch).tokens()
        return time.perf_counter() - start

    try:
        for _ in range(3):
            once()
        synchronize(runner.device)
        back_to_back = float(np.median([once() for _ in range(rounds)]))
        points = []
        for gap in gaps:
            times = []
            for _ in range(rounds):
                time.sleep(gap)
                times.append(once())
            points.append([gap, max(0.0, float(np.median(times)) - back_to_back)])
    finally:
        llm.kv_manager.free(request)
    return points


def measure_launch_in_run(
    llm, measurements: list[dict], sampling_setup: tuple[float, float], num_requests: int = 48, seed: int = 4
) -> float:
    """How much longer the host takes to launch a step in a run than the grid's relaunches of one
    batch say (between a run's launches the engine's own work cools the host's caches): the median,
    over the launches of a short run through the driver (num_requests prompts of 64 to 1,024
    tokens, 8 to 64 output tokens, one every 4 ms), of each launch's time over the host launch
    model's (plus the sampling setup where it rebuilt its rows). 1 where the profile has no host
    times."""
    if not any(m.get("host_seconds") for m in measurements):
        return 1.0
    model = HostLaunchModel(measurements)
    config = llm.config
    rng = np.random.default_rng(seed)
    vocab = min(llm.hf_config.vocab_size, 10_000)
    longest = max(2, min(1024, config.max_model_len // 2, config.max_num_batched_tokens))
    requests, params = [], []
    for i in range(num_requests):
        length = int(rng.integers(min(64, longest - 1), longest))
        requests.append(WorkloadRequest(i, 0.004 * i, rng.integers(0, vocab, length).tolist(), 0))
        params.append(SamplingParams(max_tokens=int(rng.integers(8, 65)), ignore_eos=True, temperature=0.6))
    saved_stats, llm.stats = llm.stats, EngineStats()
    steps = TimedSteps(llm, llm.runner.graph_limits())
    try:
        run_workload(llm, requests, params)
    finally:
        steps.close()
        llm.stats = saved_stats
        llm.reset_prefix_cache()
    per_step, per_row = sampling_setup
    ratios = [
        seconds / (model(shape) + (per_step + per_row * rows if rows else 0.0))
        for shape, seconds, rows in steps.launches
    ]
    return float(np.median(ratios)) if ratios else 1.0


def run_profile(llm, settings: ProfileConfig, command: str) -> Profile:
    measurements = measure(llm, settings)
    admission_per_request, admission_per_token = measure_admission(llm)
    step_host = measure_step_host(llm)
    sampling_setup = measure_sampling_setup(llm)
    idle_wake = measure_idle_wake(llm)
    launch_in_run = measure_launch_in_run(llm, measurements, sampling_setup)
    runner = llm.runner
    model = model_fields(llm.hf_config)
    kv_heads = max(1, model["num_key_value_heads"] // llm.config.tensor_parallel_size)
    block_bytes = 2 * model["num_hidden_layers"] * kv_heads * model["head_dim"] * llm.config.kvcache_block_size
    block_bytes *= runner.kv_cache_dtype.itemsize
    limits = runner.graph_limits()
    return Profile(
        kind="measured",
        device=torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else "cpu",
        model=model,
        dtype=str(runner.dtype).replace("torch.", ""),
        kv_cache_dtype=str(runner.kv_cache_dtype).replace("torch.", ""),
        attention=resolved_plugins(llm)["attention"],
        tensor_parallel_size=llm.config.tensor_parallel_size,
        kv_cache_bytes=runner.num_kv_blocks * block_bytes,
        graph_batch_limit=limits.decode_batch,
        graph_prefill_tokens=limits.prefill_tokens,
        graph_decode_limit=limits.decode_context,
        measurements=measurements,
        admission_s_per_request=admission_per_request,
        admission_s_per_token=admission_per_token,
        model_name=os.path.basename(os.path.normpath(llm.model_path)),
        step_host_s_per_step=step_host[0],
        step_host_s_per_request=step_host[1],
        step_host_s_per_prefill_token=step_host[2],
        sampling_setup_s_per_step=sampling_setup[0],
        sampling_setup_s_per_row=sampling_setup[1],
        idle_wake=idle_wake,
        launch_in_run_factor=launch_in_run,
        source={
            "commit": settings.commit or git_state()["git_commit"],
            "date": time.strftime("%Y-%m-%d"),
            "command": command,
            "torch": torch.__version__,
            "engine": {
                k: getattr(llm.config, k)
                for k in (
                    "kvcache_block_size",
                    "max_num_seqs",
                    "max_num_batched_tokens",
                    "gpu_memory_utilization",
                    "enforce_eager",
                    "max_model_len",
                )
            },
        },
    )


def run_profile_job(cfg) -> None:
    """The `job=profile` entry point: the configured engine, measured, written to profile.out."""
    settings = ProfileConfig(**OmegaConf.to_container(cfg.profile, resolve=True))
    model_path, engine_settings = engine_arguments(cfg)
    with inferlab.LLM(model_path, **engine_settings) as llm:
        if not isinstance(llm.runner, OnDevice) or llm.runner.device.type != "cuda":
            raise ValueError("job=profile measures a GPU: run it on a CUDA device (the simulator then runs anywhere)")
        profile = run_profile(llm, settings, " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]))
    profile.save(settings.out)
    model = MeasuredCostModel(profile.measurements)
    errors = [abs(model(StepShape.from_measurement(m)) / m["seconds"] - 1) for m in profile.measurements]
    print(f"{len(profile.measurements)} step compositions measured -> {settings.out}")
    for line in host_cost_lines(profile):
        print(line)
    print(
        f"the fitted model on its own measurements: median error {100 * sorted(errors)[len(errors) // 2]:.1f}%, "
        f"worst {100 * max(errors):.1f}%"
    )
    for line in host_and_device_lines(profile.measurements):
        print(line)
    print(json.dumps(model.describe(), indent=1))


def host_cost_lines(profile: Profile) -> list[str]:
    """The host's costs the profile measured besides its steps, one line each."""
    lines = [
        f"admitting a request takes the host {1e6 * profile.admission_s_per_request:.1f} us and "
        f"{1e9 * profile.admission_s_per_token:.1f} ns a prompt token",
        f"the engine's own work on a step: {1e6 * profile.step_host_s_per_step:.1f} us, "
        f"{1e6 * profile.step_host_s_per_request:.2f} us a request and "
        f"{1e9 * profile.step_host_s_per_prefill_token:.1f} ns a prefill token",
        f"rebuilding the sampling settings of new rows: {1e6 * profile.sampling_setup_s_per_step:.1f} us and "
        f"{1e6 * profile.sampling_setup_s_per_row:.2f} us a row",
    ]
    lines.append(
        f"launching a step in a run takes the host {profile.launch_in_run_factor:.2f}x what relaunching one batch does"
    )
    if profile.idle_wake:
        wake = ", ".join(f"{1e6 * extra:.0f} us after {1e3 * gap:g} ms" for gap, extra in profile.idle_wake)
        lines.append(f"a step launched onto an idle engine takes longer by {wake}")
    return lines


def host_and_device_lines(measurements: list[dict], context: int = 512) -> list[str]:
    """For the decode steps replaying CUDA graphs at one context, the step's time beside the
    device's own: where the ratio is well above 1, the host bounds the step."""
    lines = []
    for m in measurements:
        decode_only = m["decode_requests"] > 0 and not m["prefill_tokens"]
        if (
            decode_only
            and m.get("graph")
            and "device_seconds" in m
            and m["decode_context"] == (context + 1) * m["decode_requests"]
        ):
            lines.append(
                f"decode batch {m['decode_requests']:>3} at {context} tokens of context: step "
                f"{1e3 * m['seconds']:.3f} ms, device {1e3 * m['device_seconds']:.3f} ms "
                f"({m['seconds'] / m['device_seconds']:.2f}x)"
            )
    return lines
