"""The simulated executor: the engine's runner replaced by a step-cost model on a virtual clock.

The scheduler policy, the KV cache manager and the engine loop run as they do on a GPU; only the
forward pass and sampling are replaced: each launched step occupies a virtual device for the time
the cost model predicts for it, after the steps launched before it, and reading its tokens moves
the virtual clock to its end (launching a step moves the clock by the host's time to launch it,
and by the engine's own host work for the step, and each added request by the host's time to
admit it; a launch whose sampling rows changed pays the runner's rebuild of their settings, and a
launch onto an idle engine pays its waking up, where the profile measured these).
So under overlap scheduling (on by default, as on a GPU) the next step is scheduled and launched
while one runs, and a request that arrives meanwhile waits for both, as on the device. Every
sampling row gets a synthetic token, never EOS or another special token, so output lengths come
from max_tokens (the workloads use ignore_eos) and streams carry visible text: the steps' tokens
spell SYNTHETIC_TEXT over and over. The KV cache holds as
many blocks as the profiled engine had (or `num_kvcache_blocks`), so preemption and prefix-cache
eviction happen as on the device. With `noise` (the default), each step's time is a seeded draw
around its prediction with the spread the profile measured for it (inferlab.sim.cost_model.StepNoise).

With `real_time` the same runner keeps this host's clock instead: the host's times are spent in a
busy loop that holds the GIL and the device's pass while reading tokens sleeps without it, so
the engine serves (and loads a server's event loop) as one on the profiled GPU would, for
measuring the HTTP side on a machine without one.
"""

import logging
import os
from dataclasses import dataclass
from time import perf_counter

import torch

from inferlab.core.checkpoint import Checkpoint, fit_model_len, load_checkpoint_files, open_checkpoint
from inferlab.core.hookspecs import hookimpl
from inferlab.core.kv_cache_dtype import resolve_kv_cache_dtype
from inferlab.core.model_config import native_model_config
from inferlab.core.model_runner import sleep_until
from inferlab.core.protocols import DecodeRun
from inferlab.sim.cost_model import MeasuredCostModel, StepNoise, StepShape
from inferlab.sim.profile import (
    KNOWN_DEVICES,
    SIZE_FIELDS,
    Profile,
    finite_number,
    load_profile,
    model_fields,
    roofline_profile,
)
from inferlab.sim.shared_gpu import SharedGPU
from inferlab.tiny_model import default_model_path

log = logging.getLogger("inferlab")

# What the synthetic tokens spell, so that a simulated server's streams carry text (clients time
# tokens by the text they see): ordinary words, nothing a stop string or EOS would end.
SYNTHETIC_TEXT = " the quick brown fox jumps over the lazy dog"


@dataclass
class SimulatedOptions:
    """`executor=simulated` settings (`executor.profile=...`)."""

    # A shipped profile's name (inferlab.sim.profile.shipped_profiles()), a profile file, or
    # "roofline" for an estimate from roofline_device's rates that serves any model shape.
    profile: str = "roofline"
    roofline_device: str = "h200"
    roofline_step_overhead_s: float = 0.0005  # per step, for the roofline estimate only
    # On this host's clock instead of a virtual one: the profile's host times are spent holding
    # the GIL (busy), its device times pass while reading tokens sleeps. A stand-in for the GPU
    # that serves, and loads the HTTP server and its clients, as a GPU-backed engine would.
    real_time: bool = False
    # Times the spread the profile measured for each step composition: each step's time is a draw
    # around its prediction (seeded by engine.seed; a bench's repeat i by bench.seed + i). 0: none.
    noise: float = 1.0
    # Replicas sharing one GPU (cluster.gpus_per_replica < 1) time-slice it as CUDA does without
    # MPS (inferlab.sim.shared_gpu): how long a context keeps the GPU while another waits (None: a
    # step is never cut, steps run in launch order) and the device time a switch of context costs.
    # Measured on a card by inferlab.experiment.timeslice (docs/cluster.md).
    timeslice_s: float | None = None
    context_switch_s: float = 0.0

    def __post_init__(self):
        if not isinstance(self.profile, str) or not self.profile:
            raise ValueError(
                f"executor.profile must name a shipped profile, a profile file or 'roofline', got {self.profile!r}"
            )
        if self.roofline_device not in KNOWN_DEVICES:
            raise ValueError(
                f"executor.roofline_device must be one of {sorted(KNOWN_DEVICES)}, got {self.roofline_device!r}"
            )
        overhead = self.roofline_step_overhead_s
        # a NaN would pass a comparison and surface only as a run of zero seconds at its end
        if not finite_number(overhead, 0.0):
            raise ValueError(
                f"executor.roofline_step_overhead_s must be a finite number of seconds >= 0, got {overhead!r}"
            )
        if not isinstance(self.real_time, bool):  # a string such as "false" would otherwise count as true
            raise ValueError(f"executor.real_time must be True or False, got {self.real_time!r}")
        if not finite_number(self.noise, 0.0):
            raise ValueError(
                f"executor.noise must be a finite number >= 0 (1: the profile's measured spread, 0: none), "
                f"got {self.noise!r}"
            )
        if self.timeslice_s is not None and not (finite_number(self.timeslice_s, 0.0) and self.timeslice_s > 0):
            raise ValueError(
                f"executor.timeslice_s must be a finite number of seconds > 0, or null for none, got {self.timeslice_s!r}"
            )
        if not finite_number(self.context_switch_s, 0.0):
            raise ValueError(
                f"executor.context_switch_s must be a finite number of seconds >= 0, got {self.context_switch_s!r}"
            )


class VirtualClock:
    """Seconds since the simulation began; only steps and waits move it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)

    def spend(self, seconds: float) -> None:
        """The host's work of `seconds`."""
        self.now += seconds


class RealTimeClock:
    """perf_counter's seconds, for a simulation in real time: waiting for the device sleeps
    (releasing the GIL, as waiting for a GPU does; as precisely as the real runner's) and the
    host's work is a busy loop (holding it, as launching does)."""

    def __call__(self) -> float:
        return perf_counter()

    advance_to = staticmethod(sleep_until)

    def spend(self, seconds: float) -> None:
        end = perf_counter() + seconds
        while perf_counter() < end:
            pass


def load_simulated_profile(options: SimulatedOptions, hf_config, config) -> Profile:
    if options.profile != "roofline":
        return load_profile(options.profile)
    dtype = "bfloat16" if config.dtype == "auto" else config.dtype
    kv_dtype = dtype if config.kv_cache_dtype == "auto" else "float8_e4m3fn"
    return roofline_profile(
        hf_config,
        options.roofline_device,
        dtype,
        kv_dtype,
        config.tensor_parallel_size,
        config.gpu_memory_utilization,
        options.roofline_step_overhead_s,
    )


def simulated_checkpoint(
    config, model_path: str | None, options: SimulatedOptions, registry
) -> tuple[Profile, Checkpoint]:
    """The profile and checkpoint of a simulated engine. With a checkpoint directory, its
    config.json and tokenizer (no weights are read); without one, a measured profile's own model
    shape with the embedded model's tokenizer (prompts are token ids)."""
    if model_path is None and options.profile != "roofline":
        profile = load_profile(options.profile)
        config_defaults = registry.model_config_defaults()
        tokenizer = embedded_tokenizer(config_defaults)
        hf_config = profile_model_config(profile, config_defaults)
        fit_model_len(config, hf_config)
        # the "path" a server names the model by: the profiled model's name (older profiles lack one)
        name = profile.model_name or os.path.splitext(os.path.basename(options.profile))[0]
        return profile, Checkpoint(name, hf_config, tokenizer)
    checkpoint = open_checkpoint(config, model_path, registry)
    return load_simulated_profile(options, checkpoint.hf_config, config), checkpoint


# The embedded model's tokenizer, read once: a fleet's simulated replicas each take it, and no engine
# changes its tokenizer.
_EMBEDDED_TOKENIZER: list = []


def embedded_tokenizer(config_defaults: dict[str, dict]):
    if not _EMBEDDED_TOKENIZER:
        _EMBEDDED_TOKENIZER.append(load_checkpoint_files(default_model_path(announce=False), config_defaults)[1])
    return _EMBEDDED_TOKENIZER[0]


def profile_model_config(profile: Profile, config_defaults: dict[str, dict]):
    """The model config of the profile's model shape, for an engine given no checkpoint."""
    fields = {k: v for k, v in profile.model.items() if v is not None}
    fields["model_type"] = fields.get("model_type") or "qwen3"
    config = native_model_config(fields, config_defaults, source="the profile's model fields")
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config.architectures = profile.model.get("architectures")
    return config


class SimulatedRunner:
    """The `simulated` executor's runner (inferlab.core.protocols.Runner, AdmissionCost,
    SimulatedDevice, VirtualTime, DecodeRuns, KVBlockBytes, SharedDevice): launch() and handles as
    the real runner's, no device work."""

    runs_ahead = True  # it stands in for a GPU engine, so it overlaps as that engine would

    def __init__(self, config, checkpoint: Checkpoint, profile: Profile, options: SimulatedOptions):
        self.config = config
        self.checkpoint = checkpoint
        self.profile = profile
        self._check_shape(checkpoint.hf_config, options.profile)
        self._check_settings(options.profile)
        self.real_time = options.real_time
        self.virtual_time = not self.real_time  # inferlab.core.protocols.VirtualTime
        self.clock = RealTimeClock() if self.real_time else VirtualClock()
        self.wait_until = self.clock.advance_to
        self.attention = profile.attention  # no backend runs: the one the profile was measured with
        self.cost_model = profile.cost_model()
        self.host_launch_model = profile.host_launch_model()
        self.noise = StepNoise(profile.measurements, options.noise, config.seed)
        self.device_free_at = 0.0  # when the virtual device finishes the steps launched so far
        self.timeslice_s, self.context_switch_s = options.timeslice_s, options.context_switch_s
        self.shared: SharedGPU | None = None  # the GPU it shares with other replicas' runners (share_device)
        self.context = 0  # its number on that GPU
        self.gpu_step = None  # its step launched last on that GPU (inferlab.sim.shared_gpu.GPUStep)
        self.num_sharing = 1
        self.sampling_rows: list[int] | None = None  # the request ids the last launch sampled, as the runner keys them
        self.dtype = getattr(torch, profile.dtype)
        self.kv_cache_dtype = getattr(torch, profile.kv_cache_dtype)
        self.block_size = config.kvcache_block_size
        self.graph_limits = profile.graph_limits(config)
        self.kv_block_bytes = self._block_bytes()  # inferlab.core.protocols.KVBlockBytes
        self.num_kv_blocks = (
            config.num_kvcache_blocks
            if config.num_kvcache_blocks > 0
            else max(1, profile.kv_cache_bytes // self.kv_block_bytes)
        )
        self.tokens = synthetic_tokens(checkpoint.tokenizer, checkpoint.hf_config.vocab_size)
        self.sampled_token_ids = frozenset(self.tokens)  # inferlab.core.protocols.DecodeRuns
        self.num_steps = 0
        self.simulated_seconds = 0.0

    def _block_bytes(self) -> int:
        """One KV block's bytes on one rank of the profiled model."""
        model = self.profile.model
        kv_heads = max(1, model["num_key_value_heads"] // self.profile.tensor_parallel_size)
        block_bytes = 2 * model["num_hidden_layers"] * kv_heads * model["head_dim"] * self.block_size
        return block_bytes * self.kv_cache_dtype.itemsize

    def _check_shape(self, hf_config, profile_name: str) -> None:
        """A measured profile predicts only the model it was measured on."""
        if self.profile.kind != "measured":
            return
        mine, theirs = model_fields(hf_config), self.profile.model
        differ = [k for k in SIZE_FIELDS if mine.get(k) != theirs.get(k)]
        if differ:
            raise ValueError(
                f"the profile {profile_name} was measured on another model shape "
                f"({', '.join(f'{k}: {theirs.get(k)} != {mine.get(k)}' for k in differ)}); "
                "use a profile of this model (inferlab job=profile on a GPU) or executor.profile=roofline"
            )
        if self.config.tensor_parallel_size != self.profile.tensor_parallel_size:
            raise ValueError(
                f"the profile was measured with tensor_parallel_size={self.profile.tensor_parallel_size}, "
                f"not {self.config.tensor_parallel_size}"
            )

    def _check_settings(self, profile_name: str) -> None:
        """A measured profile holds the step times of one attention backend, dtype and KV cache
        dtype: another would run at other speeds (and an fp8 cache hold twice the blocks), which
        the profile cannot tell, so it is refused rather than timed as the profile's. 'auto' takes
        the profile's backend and dtype; kv_cache_dtype 'auto' is the dtype's, as on a device."""
        profile, config = self.profile, self.config
        if profile.kind != "measured":
            return
        dtype = profile.dtype if config.dtype == "auto" else config.dtype
        kv_cache_dtype = str(resolve_kv_cache_dtype(config.kv_cache_dtype, getattr(torch, dtype)))
        asked = {
            "attention": (config.attention, profile.attention if config.attention == "auto" else config.attention),
            "dtype": (config.dtype, dtype),
            "kv_cache_dtype": (config.kv_cache_dtype, kv_cache_dtype.replace("torch.", "")),
        }
        differ = [
            (name, setting, resolved)
            for name, (setting, resolved) in asked.items()
            if resolved != getattr(profile, name)
        ]
        if differ:
            settings = ", ".join(
                f"{name}={setting}" + (f" ({resolved})" if resolved != setting else "")
                for name, setting, resolved in differ
            )
            measured = ", ".join(f"{name}={getattr(profile, name)}" for name, _, _ in differ)
            raise ValueError(
                f"{settings} is not what the profile {profile_name} was measured with ({measured}), and a "
                f"measured profile times only its own settings: set those (or 'auto' where it resolves to them), "
                "measure a profile with these (inferlab job=profile on a GPU) or use executor.profile=roofline"
            )

    def admit(self, request) -> None:
        """The host's work of adding a request, on the virtual clock (the profile's admission
        costs): the engine does it between steps, so it delays the next one."""
        self.clock.spend(self.profile.admission_seconds(request.num_prompt_tokens))

    def reseed(self, seed: int) -> None:
        """Restarts the step-time noise's draws from seed (a bench's repeat draws from its own)."""
        self.noise.reseed(seed)

    def launch(self, batch) -> "SimulatedStep":
        """Queues the step on the virtual device; its tokens are ready when it ends. Before the
        launch, the host pays on the clock for waking up when the engine was idle and, on the
        virtual clock, for the engine's own work on the step (scheduling and book-keeping, which
        run here in no virtual time). Launching then takes the host the profile's launch time for
        the step, plus the rebuild of the sampling settings when the sampling rows are not the last
        launch's (the real runner keeps them while they stay), both times the profile's factor for
        launching in a run rather than relaunching one batch: a CUDA graph runs once launched; an
        eager step's kernels run as they are launched, so it starts at once but ends no earlier
        than its launch. Back to back, a device step longer than the next launch hides that
        launch; a step onto an idle device waits for its own."""
        shape, sample_rows = StepShape.sampling(batch, self.graph_limits)
        requests = batch.requests
        rows = [requests[row].request_id for row in sample_rows]
        token = self._launched(shape, len(requests), rows)
        if self.gpu_step is not None:
            return SharedStep(len(requests), sample_rows, token, self.clock, self.shared, self.gpu_step)
        return SimulatedStep(len(requests), sample_rows, token, self.clock, self.device_free_at)

    def _launched(self, shape: StepShape, num_requests: int, rows: list[int]) -> int:
        """launch()'s timing of a step of this shape and request count whose sampling rows are
        these request ids: moves the clock and the device's end, counts the step, and returns the
        token its rows sample."""
        seconds = self.cost_model(shape)
        if self.noise.active:
            seconds = self.noise(shape, seconds)
        clock, profile = self.clock, self.profile
        if self.gpu_step is not None:  # the step before's end: the tokens this launch is before (overlap) were read
            self.device_free_at = self.shared.end(self.gpu_step)
        idle = clock() - self.device_free_at
        if idle > 0 and profile.idle_wake:
            clock.spend(profile.idle_wake_seconds(idle))
        if not self.real_time:  # in real time the engine's own work takes this host's time already
            clock.spend(profile.step_host_seconds(num_requests, shape.prefill_tokens))
        start = clock()
        host = self.host_launch_model(shape) if self.host_launch_model else 0.0
        if rows:
            if rows != self.sampling_rows:
                host += profile.sampling_setup_seconds(len(rows))
                self.sampling_rows = rows
        clock.spend(host * profile.launch_in_run_factor)
        launched = clock()
        if self.shared is not None:  # its end is the shared timeline's to tell, when it is read
            self.gpu_step = self.shared.place(self.context, launched if shape.graph else start, seconds, launched)
        elif shape.graph:
            self.device_free_at = max(self.device_free_at, launched) + seconds
        else:
            self.device_free_at = max(max(self.device_free_at, start) + seconds, launched)
        self.simulated_seconds += seconds
        self.num_steps += 1
        return self.tokens[self.num_steps % len(self.tokens)]  # every row of a step samples the same one

    def launch_decodes(self, requests: list, pending: "SimulatedStep", until: float, max_steps: int) -> DecodeRun:
        """inferlab.core.protocols.DecodeRuns: the steps launch() would time for a run of decode
        steps of these requests, each followed by the wait for the step before's tokens, with no
        work per request (a step's context grows by one token a request)."""
        num = len(requests)
        # StepShape.of's shape of a decode-only batch, without its pass over the rows for prefill
        shape = StepShape.decodes(
            num, num + sum([request.num_computed_tokens for request in requests]), self.graph_limits
        )
        rows = [request.request_id for request in requests]
        clock = self.clock
        starts: list[float] = []
        ends: list[float] = []
        read = [pending.token]
        ends_at = pending.ends_at
        if self.real_time or self.shared is not None:  # a shared GPU's ends wait for the other replicas' steps
            return DecodeRun(starts, ends, [], pending)
        lines = isinstance(self.cost_model, MeasuredCostModel) and not self.noise.active
        if lines and isinstance(self.clock, VirtualClock):
            return self._decode_lines(shape, rows, pending, until, max_steps)
        for _ in range(max_steps):
            start = clock()
            if start >= until:
                break
            starts.append(start)
            read.append(self._launched(shape, num, rows))
            clock.advance_to(ends_at)
            ends_at = self.device_free_at
            ends.append(clock())
            shape = StepShape(0, 0, 0, num, shape.decode_context + num, shape.graph, 0)
        token = read.pop()  # the last step's, read by the step after the run
        return DecodeRun(starts, ends, read, SimulatedStep(num, list(range(num)), token, clock, ends_at))

    def _decode_lines(
        self, shape: StepShape, rows: list[int], pending: "SimulatedStep", until: float, max_steps: int
    ) -> DecodeRun:
        """launch_decodes without a call a step: a measured profile's decode steps and launches
        take a fixed time plus one per context token, which grows by one a request each step;
        every sum is the one _launched makes, in its order."""
        num, graph, context = shape.decode_requests, shape.graph, shape.decode_context
        profile, clock, tokens = self.profile, self.clock, self.tokens
        fixed, per_token = self.cost_model.decode_line(num, graph)
        launch_fixed, launch_per_token = (
            self.host_launch_model.decode_line(num, graph) if self.host_launch_model else (0.0, 0.0)
        )
        hosted = self.host_launch_model is not None
        wake = bool(profile.idle_wake)
        step_host = profile.step_host_seconds(num, 0)
        factor = profile.launch_in_run_factor
        setup = profile.sampling_setup_seconds(num) if rows != self.sampling_rows else None
        now, free_at, simulated, num_steps = clock.now, self.device_free_at, self.simulated_seconds, self.num_steps
        starts: list[float] = []
        ends: list[float] = []
        read = [pending.token]
        ends_at = pending.ends_at
        num_tokens = len(tokens)
        # max(a, b) written `b if b > a else a`, which picks the same float without a call
        for _ in range(max_steps):
            if now >= until:
                break
            starts.append(now)
            seconds = fixed + per_token * context
            if wake:
                idle = now - free_at
                if idle > 0:
                    now += profile.idle_wake_seconds(idle)
            now += step_host
            start = now
            host = launch_fixed + launch_per_token * context if hosted else 0.0
            if setup is not None:
                host += setup
                setup = None
            now += host * factor
            if graph:
                free_at = (now if now > free_at else free_at) + seconds
            else:
                began = (start if start > free_at else free_at) + seconds
                free_at = now if now > began else began
            simulated += seconds
            num_steps += 1
            read.append(tokens[num_steps % num_tokens])
            if ends_at > now:  # the step before's tokens
                now = ends_at
            ends_at = free_at
            ends.append(now)
            context += num
        clock.now, self.device_free_at, self.simulated_seconds, self.num_steps = now, free_at, simulated, num_steps
        if starts:
            self.sampling_rows = rows
        token = read.pop()
        return DecodeRun(starts, ends, read, SimulatedStep(num, list(range(num)), token, clock, ends_at))

    def share_device(self, runners: list["SimulatedRunner"]) -> None:
        """inferlab.core.protocols.SharedDevice: these runners (this one among them) queue their
        steps on one GPU from now on, time-sliced with this runner's timeslice_s and
        context_switch_s."""
        gpu = SharedGPU(self.timeslice_s, self.context_switch_s, len(runners))
        for context, runner in enumerate(runners):
            runner.shared, runner.context, runner.num_sharing = gpu, context, len(runners)

    def pending_end(self) -> float:
        """inferlab.core.protocols.SharedDevice: when the step it launched last ends, given the
        steps queued on its GPU so far (its clock's start, 0.0, before any)."""
        return 0.0 if self.gpu_step is None else self.shared.pending_end(self.gpu_step)

    def describe(self) -> dict:
        """What stood in for the device: the profile and the fitted cost model."""
        profile = self.profile
        return {
            "profile": profile.label(),
            "profile_kind": profile.kind,
            "profile_source": profile.source,
            "cost_model": self.cost_model.describe(),
            "host_launch": self.host_launch_model.describe() if self.host_launch_model else None,
            "admission_s": {
                "per_request": profile.admission_s_per_request,
                "per_prompt_token": profile.admission_s_per_token,
            },
            "step_host_s": {
                "per_step": profile.step_host_s_per_step,
                "per_request": profile.step_host_s_per_request,
                "per_prefill_token": profile.step_host_s_per_prefill_token,
            },
            "sampling_setup_s": {
                "per_step": profile.sampling_setup_s_per_step,
                "per_row": profile.sampling_setup_s_per_row,
            },
            "idle_wake": profile.idle_wake,
            "launch_in_run_factor": profile.launch_in_run_factor,
            "noise": self.noise.describe(),
            "shared_gpu": self._shared_described(),
            "num_steps": self.num_steps,
            "real_time": self.real_time,  # on this host's clock (its wall time), not a virtual one
        }

    def _shared_described(self) -> dict | None:
        """The GPU it shares: its options, and the switches and cuts of the steps queued on it so far."""
        if self.shared is None:
            return None
        timeline = self.shared.drained()
        return {
            "replicas": self.num_sharing,
            "timeslice_s": self.timeslice_s,
            "context_switch_s": self.context_switch_s,
            "num_switches": timeline.num_switches,
            "num_preemptions": timeline.num_preemptions,
        }

    def close(self) -> None:
        """Nothing to release: the simulation holds no device memory."""


def synthetic_tokens(tokenizer, vocab_size: int) -> list[int]:
    """The ids the steps sample in turn: SYNTHETIC_TEXT's, less any special token (EOS ends
    requests; the others decode to nothing). A tokenizer that spells it only with special tokens
    gets id 1 (or 2 where 1 is EOS), as before there was text."""
    special = set(tokenizer.all_special_ids) | {tokenizer.eos_token_id}
    tokens = [t for t in tokenizer.encode(SYNTHETIC_TEXT, add_special_tokens=False) if t not in special]
    tokens = [t for t in tokens if 0 <= t < vocab_size]
    return tokens or [1 if tokenizer.eos_token_id != 1 else 2]


def simulated(config, model_path, registry, **options) -> SimulatedRunner:
    settings = SimulatedOptions(**options)
    profile, checkpoint = simulated_checkpoint(config, model_path, settings, registry)
    return SimulatedRunner(config, checkpoint, profile, settings)


@hookimpl
def register_executors(register):
    register("simulated", simulated, options=SimulatedOptions)


class SimulatedStep:
    def __init__(self, num_rows: int, sample_rows: list[int], token: int, clock, ends_at: float):
        self.num_rows, self.sample_rows, self.token = num_rows, sample_rows, token
        self.clock, self.ends_at = clock, ends_at

    def tokens(self) -> list[int | None]:
        """The step's tokens, once the virtual device has run it."""
        self.clock.advance_to(self.ends_at)
        num_rows, sample_rows = self.num_rows, self.sample_rows
        if len(sample_rows) == num_rows:  # every row samples (the rows are distinct, in order)
            return [self.token] * num_rows
        out: list[int | None] = [None] * num_rows
        for row in sample_rows:
            out[row] = self.token
        return out

    def placeholders(self) -> list[int | None]:
        num_rows, sample_rows = self.num_rows, self.sample_rows
        if len(sample_rows) == num_rows:
            return list(range(-1, -num_rows - 1, -1))
        out: list[int | None] = [None] * num_rows
        for k, row in enumerate(sample_rows):
            out[row] = -(k + 1)
        return out


class SharedStep(SimulatedStep):
    """A step on a GPU shared with other replicas: when it ends is asked of the shared timeline as
    its tokens are read, once the steps of the others that could delay it have been queued."""

    def __init__(self, num_rows: int, sample_rows: list[int], token: int, clock, gpu: SharedGPU, step):
        self.num_rows, self.sample_rows, self.token = num_rows, sample_rows, token
        self.clock, self.gpu, self.step = clock, gpu, step

    @property
    def ends_at(self) -> float:
        return self.gpu.end(self.step)
