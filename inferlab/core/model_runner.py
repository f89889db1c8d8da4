"""Owns the model, the KV cache tensors, the attention backend and the sampler on one device (one
tensor-parallel rank): turns a ScheduledBatch into tensors, runs the forward pass and samples."""

import ctypes
import gc
import glob
import importlib
import inspect
import logging
import os
import sys
import threading
import time
from dataclasses import fields, replace
from itertools import chain
from time import perf_counter

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from inferlab.core.batch import AttentionInputs, LogitsAdjustments, SamplingTensors, ScheduledBatch, StepInputs
from inferlab.core.checkpoint import Checkpoint
from inferlab.core.config import EngineConfig
from inferlab.core.cuda_graphs import (
    DecodeGraphs,
    GraphLimits,
    PrefillGraphs,
    SamplingGraphs,
    auto_graph_prefill_tokens,
    graph_batch_sizes,
    smallest_size_holding,
)
from inferlab.core.kv_cache_dtype import resolve_kv_cache_dtype
from inferlab.core.model_cost import model_cost
from inferlab.core.parallel import SINGLE, TPGroup
from inferlab.core.plugins import PluginError, PluginRegistry
from inferlab.core.protocols import (
    AutoPriority,
    GraphCapturableSampler,
    PrefillGraphCapture,
    RepresentativeLayers,
    ServesArchitectures,
    SplitDecodes,
)
from inferlab.core.request import Request
from inferlab.core.sampling_params import GREEDY_BELOW_TEMPERATURE, SamplingParams

log = logging.getLogger("inferlab")

# Prompt tokens whose logprobs one LM head call computes: 2,048 rows of a 151,936-token vocabulary
# take 1.2 GiB of float32 logits.
PROMPT_LOGITS_ROWS = 2048

# The sampling paths a warm-up step takes (warmup_shapes): argmax, the sampling kernels, and
# top-k/top-p/min-p filtering before them.
WARMUP_SAMPLING = {
    "greedy": SamplingParams(temperature=0),
    "sampled": SamplingParams(temperature=0.6),
    "filtered": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05),
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available; use device='cpu'")
    return device


def resolve_dtype(name: str, device: torch.device, hf_config) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None) or torch.bfloat16
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


PR_SET_TIMERSLACK = 29  # Linux prctl: how late a sleep may end
_sleeps = threading.local()  # .precise: this thread's sleeps end within 1 us of their time


def sleep_until(t: float) -> None:
    """Returns once perf_counter() reads t: the host's clock, for runners on a real device. Linux
    lets a thread's sleep end up to 50 us late by default, which a driver waiting for a request's
    arrival would count in its TTFT: the calling thread's slack is set to 1 us, once (a thread
    local, not a thread id: ids are reused by later threads)."""
    if not getattr(_sleeps, "precise", False) and sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0)
        _sleeps.precise = True
    while (remaining := t - perf_counter()) > 0:
        time.sleep(remaining)


class ModelRunner:
    """The `real` executor's runner (inferlab.core.protocols.Runner, OnDevice, KVBlockBytes,
    KVBlockStore): the model, its KV cache and sampler on one device, or one tensor-parallel rank of
    them."""

    clock = staticmethod(perf_counter)
    wait_until = staticmethod(sleep_until)

    def __init__(
        self, config: EngineConfig, checkpoint: Checkpoint, registry: PluginRegistry, tp_group: TPGroup = SINGLE
    ):
        self.config = config
        self.checkpoint = checkpoint
        self.hf_config = hf_config = checkpoint.hf_config
        model_path = checkpoint.path
        self.tp = tp_group
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and tp_group.size > 1:
            self.device = torch.device("cuda", tp_group.rank)
        self.runs_ahead = self.device.type == "cuda"  # a GPU's stream computes while the host schedules
        self.dtype = resolve_dtype(config.dtype, self.device, hf_config)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.block_size = config.kvcache_block_size
        self.vocab_size = hf_config.vocab_size
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        self.backend = self._make_backend(registry, head_dim)
        model_name = config.model if config.model != "auto" else self._model_for(registry, hf_config)
        default_dtype = torch.get_default_dtype()
        built = perf_counter()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = registry.create(
                    "model",
                    model_name,
                    hf_config,
                    backend=self.backend,
                    tp_group=tp_group,
                    dtype=self.dtype,
                    device=self.device,
                    max_model_len=config.max_model_len,
                    options=config.model_options,
                )
        finally:
            torch.set_default_dtype(default_dtype)
        self.model.load_weights(model_path)
        self.model.eval()
        log.info("built the model and loaded its weights in %.1f s", perf_counter() - built)
        self.sampler = registry.create("sampler", config.sampler, config, options=config.sampler_options)
        self.last_sampled: torch.Tensor | None = None  # the latest launch's samples, for placeholders
        self._sampling_cache = None  # (seq ids, SamplingTensors, logprob rows, adjusted rows) of the last sampling rows
        # Penalized rows' tokens as int64 arrays, by request id: (prompt, generated tokens known so
        # far), converted from Python ints once each rather than every step
        self._penalty_tokens: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # The LM head runs over a step's sampling rows padded to one of these counts
        # (graph_batch_sizes, as the decode graphs' batches), each run once at start-up: cuBLAS costs
        # the host a plan search at each row count new to the process, which made a fresh process's
        # first burst of prompts host-bound (BENCHMARKS.md, "Where the time goes").
        self.logits_sizes = graph_batch_sizes(config.max_num_seqs)
        # Step inputs go up, and samples come down, on streams of their own beside the compute
        # stream: with overlap scheduling a step's inputs are sent while the previous step
        # computes, so the copies leave the compute stream's path, where each would delay the step's
        # kernels. Two streams, since a download waits for its step's compute and an
        # upload queued behind it would wait too.
        cuda = self.device.type == "cuda"
        self.upload_stream = torch.cuda.Stream(self.device) if cuda else None
        self.staging = PinnedStaging()
        self.download_stream = torch.cuda.Stream(self.device) if cuda else None
        self.decode_graphs: DecodeGraphs | None = None  # captured once the KV cache exists
        self.prefill_graphs: PrefillGraphs | None = None
        self.sampling_graphs: SamplingGraphs | None = None
        self.graphs_supported = self._graphs_supported()
        self.prefill_graph_tokens = self._prefill_graph_tokens(hf_config)
        if cuda and config.compile_at_start:
            self._compile_kernels()
        self.num_kv_blocks = self._num_kv_blocks()
        if tp_group.size > 1:  # every rank must hold the same blocks: the smallest budget wins
            counts = torch.tensor([self.num_kv_blocks], device=self.device)
            dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=tp_group.group)
            self.num_kv_blocks = int(counts.item())
        self.kv_cache = self._new_kv_cache(self.num_kv_blocks)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.kv_block_bytes = self._kv_block_bytes()
        self.kv_block_axis = self._kv_block_axis()
        log.info(
            "KV cache: %d blocks of %d tokens in %s (%.2f GiB)",
            self.num_kv_blocks,
            self.block_size,
            str(self.kv_cache_dtype).replace("torch.", ""),
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**30,
        )
        self.decode_graphs = self._capture_decode_graphs()
        self.sampling_graphs = self._capture_sampling_graphs()
        self.prefill_graphs = self._capture_prefill_graphs()

    def close(self) -> None:
        """Frees what this runner holds on the device (weights, KV cache, CUDA graphs and their
        memory pool, staging buffers) and hands it back to the driver, so that another engine
        built next in this process can use it; the runner launches nothing afterwards."""
        for name in (
            "decode_graphs",
            "sampling_graphs",
            "prefill_graphs",
            "kv_cache",
            "model",
            "backend",
            "sampler",
            "last_sampled",
            "_sampling_cache",
            "staging",
        ):
            setattr(self, name, None)
        self.kv_caches = []
        # CUDA graphs and the model's modules hold one another in cycles: collect them before
        # the allocator can give their memory back.
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _graphs_supported(self) -> bool:
        """Whether this runner can capture decode graphs (those of steps with prefill need them)."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return False
        if not self.backend.supports_cuda_graphs:
            log.info("attention backend %r does not support CUDA graphs: decode runs eagerly", self.backend.name)
            return False
        try:  # the graphs' inputs are filled by a Triton kernel
            importlib.import_module("inferlab.kernels.graph_inputs")
        except ImportError as e:
            log.warning("CUDA graphs need Triton, which does not import (%s): decode runs eagerly", e)
            return False
        return True

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        return DecodeGraphs(*self._graph_settings()) if self.graphs_supported else None

    def _capture_sampling_graphs(self) -> SamplingGraphs | None:
        """Graphs of decode batches' LM head and sampling, where the sampler allows them. Under
        tensor parallelism they run eagerly: the head's gather would be captured on every rank
        while only rank 0 samples."""
        if (
            self.decode_graphs is None
            or self.tp.size > 1
            or not (isinstance(self.sampler, GraphCapturableSampler) and self.sampler.supports_cuda_graphs)
        ):
            return None
        return SamplingGraphs(self.decode_graphs, self.model.compute_logits, self.sampler, self.vocab_size)

    def graph_limits(self) -> GraphLimits:
        """Which steps replay the graphs this runner captured."""
        decodes, prefills = self.decode_graphs, self.prefill_graphs
        return GraphLimits(
            decodes.sizes[-1] if decodes is not None else 0,
            prefills.sizes[-1] if prefills is not None else 0,
            (prefills.max_decode_seq_len or 0) if prefills is not None else 0,
        )

    def _prefill_graph_tokens(self, hf_config) -> int:
        """The most tokens a step with prefill may hold to replay a graph (0: none are captured):
        graph_prefill_tokens, sized to the model when None, at most max_num_batched_tokens."""
        if not self.graphs_supported:
            return 0
        if not (isinstance(self.backend, PrefillGraphCapture) and self.backend.supports_prefill_graphs):
            log.info(
                "attention backend %r does not support graphs of steps with prefill: they run eagerly",
                self.backend.name,
            )
            return 0
        max_tokens = self.config.graph_prefill_tokens
        if max_tokens is None:
            cost = model_cost(hf_config, self.dtype, tensor_parallel_size=self.tp.size)
            flops_per_token = cost.flops_per_token - cost.head_flops_per_token
            return auto_graph_prefill_tokens(flops_per_token, self.config.max_num_batched_tokens)
        return max(0, min(max_tokens, self.config.max_num_batched_tokens))

    def _capture_prefill_graphs(self) -> PrefillGraphs | None:
        if self.decode_graphs is None or self.prefill_graph_tokens < 1:
            return None
        return PrefillGraphs(*self._graph_settings(), self.prefill_graph_tokens, self.decode_graphs.pool)

    def _graph_settings(self) -> tuple:
        """What both kinds of graphs are built from: the model, its backend and cache, and the sizes
        of their buffers."""
        config = self.config
        return (
            self.model,
            self.backend,
            self.kv_caches,
            config.max_num_seqs,
            config.max_model_len,
            self.block_size,
            self.hf_config.hidden_size,
            self.dtype,
            self.device,
        )

    def _make_backend(self, registry: PluginRegistry, head_dim: int):
        auto = self.config.attention == "auto"
        names = self._auto_attention_order(registry) if auto else [self.config.attention]
        reasons = [] if names else [f"no attention backend declares an auto_priority for {self.device.type}"]
        for name in names:
            try:
                backend = registry.create("attention", name, self.config, options=self.config.attention_options)
            except ImportError as e:
                reasons.append(f"{name}: {e}")
                if not auto:
                    raise PluginError(f"attention backend {name!r} cannot be used: {e}") from e
                continue
            problems = backend.validate(self.device, self.dtype, self.block_size, head_dim, self.kv_cache_dtype)
            if not problems:
                if reasons:
                    log.warning("attention=auto chose %r; skipped: %s", name, "; ".join(reasons))
                return backend
            reasons.append(f"{name}: {'; '.join(problems)}")
        raise ValueError(
            f"no attention backend can serve device={self.device.type}, dtype={self.dtype}, "
            f"kv_cache_dtype={self.kv_cache_dtype}, block size={self.block_size}, head_dim={head_dim}: "
            + " | ".join(reasons)
        )

    def _auto_attention_order(self, registry: PluginRegistry) -> list[str]:
        """The backends attention=auto tries on this device, highest auto_priority first (see
        AttentionBackend); ties in name order."""
        device = self.device.type
        priorities = {
            name: entry.factory.auto_priority
            for name, entry in registry.entries["attention"].items()
            if isinstance(entry.factory, AutoPriority) and not entry.qualified_only
        }
        candidates = [name for name, priority in priorities.items() if device in priority]
        return sorted(candidates, key=lambda name: (-priorities[name][device], name))

    @staticmethod
    def _model_for(registry: PluginRegistry, hf_config) -> str:
        architectures = list(getattr(hf_config, "architectures", None) or [])
        served = {
            name: list(registry.entries["model"][name].factory.architectures)
            for name in registry.names("model")
            if isinstance(registry.entries["model"][name].factory, ServesArchitectures)
            and not registry.entries["model"][name].qualified_only
        }
        for name, names in served.items():
            if any(a in names for a in architectures):
                return name
        raise PluginError(f"no model plugin serves architectures {architectures}; available: {served}")

    def _kv_block_axis(self) -> int:
        """Which axis of the whole cache ([layers, *the backend's layout]) counts the blocks."""
        _, num_kv_heads, head_dim = self.model.kv_cache_spec()
        one, two = (self.backend.kv_cache_shape(n, self.block_size, num_kv_heads, head_dim) for n in (1, 2))
        return 1 + next(axis for axis, (a, b) in enumerate(zip(one, two)) if a != b)

    def read_kv_blocks(self, blocks: list[int]) -> torch.Tensor:
        """KVBlockStore: the blocks of every layer as bytes (whatever the cache's dtype), in the
        cache's layout with len(blocks) blocks."""
        index = torch.tensor(blocks, dtype=torch.long).to(self.device, non_blocking=True)
        return self.kv_cache.view(torch.uint8).index_select(self.kv_block_axis, index)

    def write_kv_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        index = torch.tensor(blocks, dtype=torch.long).to(self.device, non_blocking=True)
        self.kv_cache.view(torch.uint8).index_copy_(self.kv_block_axis, index, data.to(self.device))

    def empty_kv_blocks(self, num_blocks: int) -> torch.Tensor:
        shape = list(self.kv_cache.view(torch.uint8).shape)
        shape[self.kv_block_axis] = num_blocks
        return torch.empty(shape, dtype=torch.uint8, device=self.device)

    def _kv_block_bytes(self) -> int:
        num_layers, num_kv_heads, head_dim = self.model.kv_cache_spec()
        return 2 * num_layers * self.block_size * num_kv_heads * head_dim * self.kv_cache_dtype.itemsize

    def _num_kv_blocks(self) -> int:
        if self.config.num_kvcache_blocks > 0:
            return self.config.num_kvcache_blocks
        block_bytes = self._kv_block_bytes()
        if self.device.type == "cpu":
            enough = self.config.max_num_seqs * -(-self.config.max_model_len // self.block_size)
            return max(1, min(enough, int(self.config.cpu_kv_cache_gib * 2**30) // block_bytes))
        return self._num_kv_blocks_from_gpu_memory(block_bytes)

    def _num_kv_blocks_from_gpu_memory(self, block_bytes: int) -> int:
        """As nano-vllm: run the largest batch once, then give the KV cache what is left of
        gpu_memory_utilization after the weights, that step's peak activations and those of the
        largest graph of steps with prefill (in a memory pool of its own; estimated from the
        step's, in proportion to tokens)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        warmup_cache, warmup_tokens = self._warmup()
        warmup_bytes = warmup_cache.numel() * warmup_cache.element_size()
        del warmup_cache
        # hand the warm-up's blocks back to the driver, or `used` would count the activations twice
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        peak_activations = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"] - warmup_bytes
        graph_activations = peak_activations * min(1.0, self.prefill_graph_tokens / warmup_tokens)
        used = total - free  # weights, CUDA context, other processes
        available = total * self.config.gpu_memory_utilization - used - peak_activations - graph_activations
        num_blocks = int(available) // block_bytes
        log.info(
            "GPU memory: %.2f GiB total, %.2f GiB used after warm-up, %.2f GiB peak activations "
            "(%.2f GiB more for graphs); %.2f GiB at gpu_memory_utilization=%.2f leaves %d KV blocks of %.1f MiB",
            total / 2**30,
            used / 2**30,
            peak_activations / 2**30,
            graph_activations / 2**30,
            total * self.config.gpu_memory_utilization / 2**30,
            self.config.gpu_memory_utilization,
            max(num_blocks, 0),
            block_bytes / 2**20,
        )
        if num_blocks < 1:
            raise ValueError(
                f"no GPU memory left for the KV cache at gpu_memory_utilization="
                f"{self.config.gpu_memory_utilization}; raise it or lower max_num_batched_tokens"
            )
        return num_blocks

    def _new_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """A zeroed KV cache of num_blocks blocks for every layer, in the backend's layout."""
        num_layers, num_kv_heads, head_dim = self.model.kv_cache_spec()
        shape = self.backend.kv_cache_shape(num_blocks, self.block_size, num_kv_heads, head_dim)
        return torch.zeros((num_layers, *shape), dtype=self.kv_cache_dtype, device=self.device)

    def _warmup(self) -> tuple[torch.Tensor, int]:
        """One prefill of max_num_batched_tokens tokens (sequences of max_model_len) on a scratch cache
        as large as they need; returns the cache and the step's tokens."""
        max_len = self.config.max_model_len
        num_tokens = max(self.config.max_num_batched_tokens, max_len)
        lengths = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])
        lengths = lengths[: self.config.max_num_seqs]
        num_blocks = sum(-(-n // self.block_size) for n in lengths)
        cache = self._new_kv_cache(num_blocks)
        batch = self._scratch_batch(0, [(0, n) for n in lengths], num_blocks, "greedy")
        self.launch(batch, list(cache.unbind(0))).tokens()
        torch.cuda.synchronize(self.device)
        return cache, sum(lengths)

    def _compile_kernels(self) -> None:
        """Compiles the Triton kernel variants that steps of every shape a workload can bring
        (warmup_shapes) select, during start-up instead of inside the user's first generate: a dry
        run of those steps on a scratch cache finds them, then they compile together on a pool of
        threads (inferlab.kernels.ahead), then the steps run for real (the kernels load onto the
        device, cuBLAS and the allocator settle), and the LM head once at each of logits_sizes.
        Both runs go over the model's kernel_variant_layers only, where it names them. Every rank of a
        tensor-parallel engine runs the same steps in the same order, as their collectives need.
        So nano-vllm's bench compiles nothing in its first pass, which runs as fast as a warm one
        (BENCHMARKS.md, "Start-up and the first pass")."""
        start = perf_counter()
        backend = self.backend
        split = isinstance(backend, SplitDecodes)
        shapes = warmup_shapes(
            self.config, backend.min_split_len if split else 256, backend.mixed_decode_split_len if split else None
        )
        # Sequences share the scratch blocks: warm-up values do not matter, only the kernels run.
        num_blocks = min(64, -(-self.config.max_model_len // self.block_size))
        scratch = list(self._new_kv_cache(num_blocks).unbind(0))
        batches = [self._scratch_batch(i, parts, num_blocks, kind) for i, (parts, kind) in enumerate(shapes)]
        # Later layers repeat the first ones' kernels and GEMM shapes. Over those alone, the dry run
        # launches fewer kernels through Triton's slow Python launch path, and the real run fewer
        # eager launches, which cost the host far more than the device.
        representative = self.model.kernel_variant_layers if isinstance(self.model, RepresentativeLayers) else None
        layers = scratch[:representative] if representative else scratch

        def run_steps(caches: list[torch.Tensor]) -> None:
            for batch in batches:
                self.launch(batch, caches).tokens()

        threads = min(16, os.cpu_count() or 1)
        compiled = 0
        if self.device.type == "cuda":
            try:
                from inferlab.kernels.ahead import compile_ahead
            except ImportError:  # no Triton (or one without the cache hook): the steps compile as they run
                pass
            else:
                log.info("compiling kernels for %d step shapes on %d threads", len(batches), threads)
                compiled = compile_ahead(
                    lambda: run_steps(layers),
                    threads,
                    self.device,
                    self._kernel_variants_file(shapes, representative),
                    self._on_every_rank,
                )
        run_steps(layers)
        with torch.inference_mode():
            hidden = torch.zeros(
                self.logits_sizes[-1], self.hf_config.hidden_size, dtype=self.dtype, device=self.device
            )
            for size in self.logits_sizes:
                self.logits(hidden[:size])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_sampled = None
        self._sampling_cache = None
        log.info(
            "compiled %d kernel variants and ran %d step shapes in %.1f s",
            compiled,
            len(batches),
            perf_counter() - start,
        )

    def _kernel_variants_file(self, shapes: list, layers: int | None) -> str:
        """Where compile_ahead keeps the kernel variants of these start-up steps: named by the
        steps, the engine's settings, the model, dtypes, device and versions, and the source of
        inferlab and of the plugins that launch kernels."""
        import triton

        from inferlab.kernels.ahead import variants_file

        description = {
            "steps": shapes,
            "layers": layers,
            # shallow: an option's value may be any object (str() names it), which asdict would deep-copy
            "engine": {f.name: getattr(self.config, f.name) for f in fields(self.config) if f.name != "model_path"},
            "model": {k: v for k, v in vars(self.hf_config).items() if not k.startswith("_")},
            "dtypes": (self.dtype, self.kv_cache_dtype),
            "device": (torch.cuda.get_device_name(self.device), torch.cuda.get_device_capability(self.device)),
            "versions": (torch.__version__, triton.__version__),
        }
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sources = glob.glob(os.path.join(package, "**", "*.py"), recursive=True)
        sources += [inspect.getsourcefile(type(plugin)) for plugin in (self.model, self.backend, self.sampler)]
        return variants_file(description, [s for s in sources if s])

    def _on_every_rank(self, holds: bool) -> bool:
        if self.tp.size == 1:
            return holds
        count = self.tp.all_reduce(torch.tensor([int(holds)], device=self.device))
        return int(count.item()) == self.tp.size

    def _scratch_batch(self, index: int, parts: list[tuple[int, int]], num_blocks: int, kind: str) -> ScheduledBatch:
        """Warm-up step `index`: requests with (cached context, new tokens) each, block tables cycling
        through the scratch cache's blocks (values do not matter to a warm-up, only shapes). Their
        ids are negative, each step's its own: the runner caches sampling settings by request ids,
        and the engine's own requests (ids from 0) must never meet a warm-up's settings there."""
        params = WARMUP_SAMPLING[kind]
        requests, tables = [], []
        for i, (context, new) in enumerate(parts):
            request_id = -(index * 100_000 + i) - 1
            request = Request(request_id, [i % min(1000, self.vocab_size)] * (context + new), params)
            request.num_computed_tokens = context
            requests.append(request)
            used = -(-(context + new) // self.block_size)
            tables.append([(i + b) % num_blocks for b in range(used)])
        return ScheduledBatch(requests, [new for _, new in parts], tables)

    @torch.inference_mode()
    def launch(
        self, batch: ScheduledBatch, kv_caches: list[torch.Tensor] | None = None, step: StepInputs | None = None
    ) -> "StepHandle":
        """Queues one step's work on the device and returns without waiting for it. Input tokens
        may be placeholders for the previous launch's samples (see StepHandle.placeholders).
        `step`: the batch's prepared inputs, when the caller built them already."""
        step = step if step is not None else self.prepare_inputs(batch)
        uploaded = self.upload(step)
        hidden = self.forward(step, kv_caches, uploaded)
        if hidden is None:
            return StepHandle(len(batch), step.sample_rows, None)
        rows = [batch.requests[i] for i in step.sample_rows]
        num_rows = len(rows)
        logits = None
        sampled = logprobs = None
        replayed = False
        if rows:
            params, wanted = self.sampling_tensors(rows, uploaded[-1][:num_rows])
            graphs = self.sampling_graphs
            replayed = (
                graphs is not None
                and graphs.sampler is self.sampler
                and wanted is None
                and not step.num_prompt_rows
                and graphs.run(hidden, params)
            )
            if replayed:
                sampled = graphs.tokens[:num_rows]
            else:
                logits = self.logits(hidden[:num_rows])
                if wanted is None:
                    sampled = self.sampler(logits, params)
                else:
                    sampled, processed = self.sampler.sample_with_logits(logits, params)
                    logprobs = self._sample_logprobs(logits, processed, sampled, wanted)
            # other ranks' placeholders stand for rank 0's samples
            self.last_sampled = self.tp.broadcast(sampled.long())
        prompt = None
        if step.num_prompt_rows:
            prompt = self._prompt_logprobs(hidden[num_rows:], uploaded[-1][num_rows:], step, batch)
        extras = None
        if logprobs is not None or prompt is not None:
            extras = StepLogprobs(step.sample_rows, logprobs, prompt)
        handle = StepHandle(len(batch), step.sample_rows, sampled, self.download_stream, extras)
        if replayed:
            graphs.tokens_copied = handle.ready  # the next replay overwrites the samples once they are copied
        return handle

    def _sample_logprobs(self, raw: torch.Tensor, processed: torch.Tensor, sampled: torch.Tensor, wanted) -> tuple:
        """The sampling rows' logprobs as logprobs_mode says, for the rows that asked: (rows, the
        sampled tokens' values [m], the top k values [m, k] and their ids [m, k])."""
        rows, k = wanted
        mode = self.config.logprobs_mode
        values = (raw if mode.startswith("raw") else processed)[rows].float()
        if mode.endswith("logprobs"):
            values = values.log_softmax(dim=-1)
        chosen = values.gather(1, sampled[rows].long()[:, None])[:, 0]
        top_values, top_ids = values.topk(k, dim=-1) if k else (values[:, :0], sampled[rows, None][:, :0].long())
        return rows, chosen, top_values, top_ids

    def _prompt_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, step: StepInputs, batch) -> tuple:
        """The raw logprobs of the prompt tokens this step scores (hidden: their rows; each scores
        its next token, `targets`), with the top k of the most any request in the step asked for:
        (spans as (request, first position, count), values [q], top values [q, k], top ids [q, k])."""
        spans = [(batch.requests[i], first, count) for i, first, count in step.prompt_spans]
        k = max(request.params.prompt_logprobs for request, _, _ in spans)
        parts = []
        for start, logits in self.prompt_logits(hidden):
            values = logits.float().log_softmax(dim=-1)
            chosen = values.gather(1, targets[start : start + len(values), None])[:, 0]
            parts.append((chosen, *values.topk(k, dim=-1)))
        chosen, top_values, top_ids = (torch.cat(column) for column in zip(*parts))
        return spans, chosen, top_values, top_ids

    def prompt_logits(self, hidden: torch.Tensor):
        """(first row, logits) of hidden's rows, PROMPT_LOGITS_ROWS at a time: a long prompt's
        logits at once would take gigabytes. Every tensor-parallel rank runs the same chunks."""
        for start in range(0, hidden.shape[0], PROMPT_LOGITS_ROWS):
            yield start, self.logits(hidden[start : start + PROMPT_LOGITS_ROWS])

    @torch.inference_mode()
    def follow(self, step: StepInputs) -> None:
        """A worker rank's part of a step that rank 0 launches, in rank 0's order (the LM head
        gathers across ranks): the forward pass, the sampling rows' logits and rank 0's samples
        (which the next step's placeholders stand for), then the prompt-logprob rows' logits."""
        hidden = self.forward(step)
        if hidden is None:
            return
        num_rows = len(step.sample_rows)
        if num_rows:  # a step may score prompt tokens alone: then rank 0 samples and broadcasts nothing
            self.logits(hidden[:num_rows])
            sampled = torch.empty(num_rows, dtype=torch.int64, device=self.device)
            self.last_sampled = self.tp.broadcast(sampled)
        for _ in self.prompt_logits(hidden[num_rows:]):
            pass

    def forward_logits(self, step: StepInputs) -> torch.Tensor | None:
        """The forward pass of one step and the logits of its sampling rows (None when none samples)."""
        hidden = self.forward(step)
        num_rows = len(step.sample_rows)
        return None if hidden is None or not num_rows else self.logits(hidden[:num_rows])

    def forward(
        self, step: StepInputs, kv_caches: list[torch.Tensor] | None = None, uploaded: tuple | None = None
    ) -> torch.Tensor | None:
        """The forward pass of one step and the hidden states of its sampling rows (None when none
        samples). Every tensor-parallel rank runs it on the same step. uploaded: upload(step), if done."""
        input_ids, positions, inputs, logits_indices, _ = uploaded or self.upload(step)
        if inputs.has_placeholders and self.last_sampled is None:
            raise RuntimeError("a batch refers to sampled tokens of a step that was never launched")
        sampled = self.last_sampled if inputs.has_placeholders else None
        kv_caches = self.kv_caches if kv_caches is None else kv_caches
        hidden = None
        graphs = self.decode_graphs if inputs.is_decode else self.prefill_graphs
        if graphs is not None and kv_caches is self.kv_caches:
            hidden = graphs.run(input_ids, positions, inputs, sampled)  # resolves placeholders itself
        if hidden is None:
            if sampled is not None:
                input_ids = torch.where(input_ids < 0, sampled[(-input_ids - 1).clamp(min=0)], input_ids)
            hidden = self.model(input_ids, positions, kv_caches, self.backend.build_metadata(inputs))
        if not step.sample_rows and not step.num_prompt_rows:
            return None
        # a decode step samples every row, in order: no gather needed
        return hidden if step.is_decode else hidden[logits_indices]

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """The LM head over hidden states [n, hidden], run on n rows padded to the next of
        logits_sizes (zero rows, whose logits are dropped)."""
        n = rows.shape[0]
        padded = smallest_size_holding(self.logits_sizes, n) or n
        if padded == n:
            return self.model.compute_logits(rows)
        return self.model.compute_logits(F.pad(rows, (0, 0, 0, padded - n)))[:n]

    def prepare_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """Host-side batch layout, vectorized with numpy (no per-token Python loop), packed in two
        buffers (int64 and int32) that go to the device in two copies."""
        seqs, n, bs = batch.requests, len(batch.requests), self.block_size
        counts = np.array(batch.num_scheduled_tokens, dtype=np.int64)
        tables = batch.block_tables
        # Sequences computing one token each lead the layout, so that attention backends can run them
        # as decodes (split over their context) beside the prefill rows: in the prefill kernel one
        # program loops over a decode's whole context, which a 30k-token one makes the step's longest.
        single = counts == 1
        num_decodes = int(single.sum())
        layout = None  # layout position -> batch index, where they differ
        if 0 < num_decodes < n and not single[:num_decodes].all():
            layout = np.concatenate([np.flatnonzero(single), np.flatnonzero(~single)])
            seqs, counts, tables = [seqs[i] for i in layout], counts[layout], [tables[i] for i in layout]
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=n)
        totals = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=n)
        ends = starts + counts
        num_tokens = int(ends.sum() - starts.sum())
        if num_tokens == n:  # one new token each (decode): no per-sequence slicing
            input_ids = np.fromiter((s.token_ids[a] for s, a in zip(seqs, starts.tolist())), dtype=np.int64, count=n)
            seq_index, positions = np.arange(n), starts
        else:
            input_ids = np.fromiter(
                chain.from_iterable(s.token_ids[a:b] for s, a, b in zip(seqs, starts.tolist(), ends.tolist())),
                dtype=np.int64,
                count=num_tokens,
            )
            seq_index = np.repeat(np.arange(n), counts)
            positions = np.arange(num_tokens) - np.repeat(np.cumsum(counts) - counts, counts) + starts[seq_index]
        query_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        table_lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
        block_tables = np.zeros((n, int(table_lens.max())), dtype=np.int64)
        flat_rows = np.repeat(np.arange(n), table_lens)
        block_tables[
            flat_rows, np.arange(len(flat_rows)) - np.repeat(np.cumsum(table_lens) - table_lens, table_lens)
        ] = np.fromiter(chain.from_iterable(tables), dtype=np.int64, count=len(flat_rows))
        slot_mapping = block_tables[seq_index, positions // bs] * bs + positions % bs
        samples = np.flatnonzero(ends == totals)  # layout positions of the sequences that sample
        logits_indices = query_start[1:][samples] - 1  # each sampling sequence's last new token
        sample_steps = totals[samples]
        # prompt tokens are computed only in steps with more tokens than sequences or some not sampling
        spans, prompt_rows = (), None
        if num_tokens > n or len(samples) < n:
            spans, prompt_rows = prompt_logprob_rows(seqs, starts, ends, query_start, layout)
        if layout is not None:  # samples go back in batch order
            by_batch = np.argsort(layout[samples], kind="stable")
            samples, logits_indices, sample_steps = (
                layout[samples][by_batch],
                logits_indices[by_batch],
                sample_steps[by_batch],
            )
        if prompt_rows is not None:  # their rows join the logits indices, the tokens they score go last
            logits_indices = np.concatenate([logits_indices, prompt_rows[: len(prompt_rows) // 2]])
            sample_steps = np.concatenate([sample_steps, prompt_rows[len(prompt_rows) // 2 :]])
        return StepInputs(
            longs=np.concatenate([input_ids, positions, slot_mapping, logits_indices, sample_steps]),
            ints=np.concatenate([query_start, ends, starts, block_tables.ravel()]).astype(np.int32),
            num_tokens=num_tokens,
            num_seqs=n,
            table_width=block_tables.shape[1],
            sample_rows=samples.tolist(),
            max_query_len=int(counts.max()),
            max_seq_len=int(ends.max()),
            num_decodes=num_decodes,
            max_decode_seq_len=int(ends[:num_decodes].max()) if num_decodes else 0,
            is_decode=num_tokens == n and len(samples) == n,
            has_placeholders=bool(input_ids.size) and int(input_ids.min()) < 0,
            num_prompt_rows=0 if prompt_rows is None else len(prompt_rows) // 2,
            prompt_spans=spans,
        )

    def upload(self, step: StepInputs):
        """The step's two buffers to the device in one copy (each costs the host tens of
        microseconds), as input ids, positions, attention inputs, the rows whose logits are needed
        and the index of the token each of those samples."""
        t, n, s = step.num_tokens, step.num_seqs, len(step.sample_rows)
        split = step.longs.nbytes
        packed = self._to_device(np.concatenate([step.longs.view(np.uint8), step.ints.view(np.uint8)]), torch.uint8)
        longs, ints = packed[:split].view(torch.int64), packed[split:].view(torch.int32)
        q = step.num_prompt_rows
        # sample_steps carries, after the S sampling rows' steps, the Q prompt tokens the prompt rows score
        input_ids, positions, slot_mapping, logits_indices, sample_steps = longs.split([t, t, t, s + q, s + q])
        query_start, seq_lens, context_lens, block_tables = ints.split([n + 1, n, n, n * step.table_width])
        inputs = AttentionInputs(
            query_start_loc=query_start,
            seq_lens=seq_lens,
            context_lens=context_lens,
            block_tables=block_tables.view(n, step.table_width),
            slot_mapping=slot_mapping,
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            num_decodes=step.num_decodes,
            max_decode_seq_len=step.max_decode_seq_len,
            is_decode=step.is_decode,
            block_size=self.block_size,
            has_placeholders=step.has_placeholders,
        )
        return input_ids, positions, inputs, logits_indices, sample_steps

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.from_numpy(array).to(dtype)
        # From pinned memory the copy is truly asynchronous; on the upload stream it also overlaps
        # the kernels queued before it, and the compute stream waits only for the copy itself.
        compute = torch.cuda.current_stream(self.device)
        on_device = self.staging.upload(array, dtype, self.upload_stream, self.device)
        compute.wait_stream(self.upload_stream)
        on_device.record_stream(compute)  # its memory is not reused before the compute stream is done with it
        return on_device

    def sampling_tensors(self, seqs, steps: torch.Tensor) -> tuple[SamplingTensors, tuple | None]:
        """Per-row settings, and (rows, k) of the rows that want logprobs (k: the most top logprobs
        any asks for) or None; rebuilt only when the rows change (decode repeats the same batch),
        except the adjustments of rows with penalties or constraints, which change every step.
        steps: the index of the token each row samples, on the device (upload sends it each step)."""
        key = [s.request_id for s in seqs]
        cached = self._sampling_cache
        if cached is None or cached[0] != key:
            cached = self._sampling_cache = (key, *self._new_sampling_tensors(seqs))
            if self._penalty_tokens:  # forget rows that left
                alive = set(key)
                self._penalty_tokens = {i: v for i, v in self._penalty_tokens.items() if i in alive}
        _, tensors, wanted, adjusted = cached
        if adjusted:
            return replace(tensors, steps=steps, adjustments=self._adjustments(seqs, adjusted)), wanted
        return replace(tensors, steps=steps), wanted

    def _new_sampling_tensors(self, seqs) -> tuple[SamplingTensors, tuple | None, list[int]]:
        params = [s.params for s in seqs]
        vocab = self.vocab_size
        floats = np.array(
            [
                [0.0 if p.temperature < GREEDY_BELOW_TEMPERATURE else p.temperature for p in params],
                [p.top_p for p in params],
                [p.min_p for p in params],
            ],
            dtype=np.float32,
        )
        # seeds are below 2**32 (SamplingParams and the engine's draws): the sampler hashes one 32-bit word
        ints = np.array(
            [[p.top_k if 0 < p.top_k < vocab else vocab for p in params], [s.seed for s in seqs]], dtype=np.int64
        )
        float_t, int_t = self._to_device(floats, torch.float32), self._to_device(ints, torch.int64)
        tensors = SamplingTensors(
            temperatures=float_t[0],
            top_p=float_t[1],
            min_p=float_t[2],
            top_k=int_t[0],
            seeds=int_t[1],
            steps=None,  # set by sampling_tensors each step
            all_greedy=not floats[0].any(),
            any_top_k=bool((ints[0] < self.vocab_size).any()),
            any_top_p=bool((floats[1] < 1).any()),
            any_min_p=bool((floats[2] > 0).any()),
        )
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        wanted = None
        if logprob_rows:
            k = max(params[i].logprobs for i in logprob_rows)
            wanted = (torch.tensor(logprob_rows, dtype=torch.int64, device=self.device), k)
        adjusted = [i for i, s in enumerate(seqs) if s.params.penalized or s.constraint is not None]
        return tensors, wanted, adjusted

    def _tokens_of(self, seq) -> tuple[np.ndarray, np.ndarray]:
        """seq's prompt and generated tokens as int64 arrays; only tokens new since the last step
        are converted (the newest may be a placeholder: converted again next step)."""
        cached = self._penalty_tokens.get(seq.request_id)
        start = seq.num_prompt_tokens
        if cached is None or len(cached[1]) > len(seq.token_ids) - start:  # new, or recomputed after preemption
            cached = (np.array(seq.token_ids[:start], dtype=np.int64), np.zeros(0, dtype=np.int64))
        prompt, known = cached
        new = np.array(seq.token_ids[start + len(known) :], dtype=np.int64)
        generated = np.concatenate([known, new]) if len(new) else known
        settled = len(generated) - int(len(new) > 0 and new[-1] < 0)  # a placeholder is not kept
        self._penalty_tokens[seq.request_id] = (prompt, generated[:settled])
        return prompt, generated

    def _adjustments(self, seqs, adjusted: list[int]) -> LogitsAdjustments:
        """The penalties, biases, bans and allowed-token masks of rows `adjusted` for this step, from
        the tokens each has now (an output token may be a placeholder for the previous step's
        sample: swapped for it on the device)."""
        vocab = self.vocab_size
        empty = np.zeros(0, dtype=np.int64)
        outputs, output_rows, prompts, bias_index, bias, banned = [], [], [], [], [], []
        settings = np.ones((3, len(adjusted)), dtype=np.float32)
        constrained = []
        for position, row in enumerate(adjusted):
            seq = seqs[row]
            p = seq.params
            base = position * vocab
            settings[:, position] = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
            if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1:
                prompt, generated = self._tokens_of(seq)
                outputs.append(generated)
                output_rows.append(np.full(len(generated), base, dtype=np.int64))
                if p.repetition_penalty != 1:
                    prompts.append(base + prompt)
            if p.logit_bias:
                bias_index.append(base + np.fromiter(p.logit_bias.keys(), np.int64, len(p.logit_bias)))
                bias.append(np.fromiter(p.logit_bias.values(), np.float32, len(p.logit_bias)))
            if len(seq.token_ids) - seq.num_prompt_tokens < p.min_tokens:
                stops = list(p.stop_token_ids) + ([seq.eos_token_id] if seq.eos_token_id is not None else [])
                banned.append(base + np.array(stops, dtype=np.int64))
            if seq.constraint is not None:
                constrained.append(position)
        any_penalty = bool(outputs)
        longs = [
            np.concatenate(part) if part else empty for part in (outputs, output_rows, prompts, bias_index, banned)
        ] + [np.array(adjusted, dtype=np.int64), np.array(constrained, dtype=np.int64)]
        sizes = [len(part) for part in longs]
        on_device = self._to_device(np.concatenate(longs), torch.int64).split(sizes)
        generated, generated_rows, prompt_index, bias_index_t, banned_t, rows_t, constrained_t = on_device
        if self.last_sampled is not None and generated.numel():
            placeholders = generated < 0
            generated = torch.where(
                placeholders,
                self.last_sampled[(-generated - 1).clamp(min=0, max=len(self.last_sampled) - 1)],
                generated,
            )
        floats = self._to_device(np.concatenate([settings.ravel(), *bias]) if bias else settings.ravel(), torch.float32)
        allowed = None
        if constrained:
            allowed = torch.full((len(constrained), -(-vocab // 32)), -1, dtype=torch.int32)
            for k, position in enumerate(constrained):
                seq = seqs[adjusted[position]]
                try:
                    seq.constraint.fill_bitmask(allowed, k)
                except Exception as e:  # its request ends with this error once the step's token is known
                    seq.error = f"its constraint's fill_bitmask raised {type(e).__name__}: {e}"
            allowed = allowed.to(self.device, non_blocking=True)
        count = len(adjusted)
        return LogitsAdjustments(
            rows=rows_t,
            presence=floats[:count],
            frequency=floats[count : 2 * count],
            repetition=floats[2 * count : 3 * count],
            output_tokens=generated_rows + generated,
            prompt_tokens=prompt_index,
            bias_index=bias_index_t,
            bias=floats[3 * count :],
            banned=banned_t,
            allowed_rows=constrained_t if constrained else None,
            allowed=allowed,
            any_penalty=any_penalty,
        )


def prompt_logprob_rows(seqs, starts, ends, query_start, layout) -> tuple[tuple, np.ndarray | None]:
    """The rows of a step's tokens whose logits score a prompt token of a request asking for
    prompt_logprobs (row p scores token p + 1; the prompt's last row samples instead), and the
    spans (batch index, first scored position, count); ((), None) when none asks."""
    wanting = [i for i, s in enumerate(seqs) if s.prompt_logprobs is not None]
    spans, rows, targets = [], [], []
    for i in wanting:
        start, end = int(starts[i]), min(int(ends[i]), seqs[i].num_prompt_tokens - 1)
        if end > start:
            spans.append((int(layout[i]) if layout is not None else i, start + 1, end - start))
            rows.append(np.arange(query_start[i], query_start[i] + end - start))
            targets.append(np.array(seqs[i].token_ids[start + 1 : end + 1], dtype=np.int64))
    if not rows:
        return (), None
    return tuple(spans), np.concatenate(rows + targets)


class StepLogprobs:
    """A step's log-probabilities, on their way to the host beside its samples: those of the
    sampling rows that asked (rows: positions among the sampling rows) and of the prompt tokens
    it scored. Read with sampled() and prompt() once the step's tokens are known."""

    def __init__(self, sample_rows: list[int], sample: tuple | None, prompt: tuple | None):
        self.sample_rows = sample_rows
        self.rows: list[int] = []
        self.spans: list = []
        parts = []
        if sample is not None:
            rows, chosen, top_values, top_ids = sample
            self.rows = rows.tolist()
            parts.append((chosen, top_values, top_ids))
        if prompt is not None:
            self.spans, chosen, top_values, top_ids = prompt
            parts.append((chosen, top_values, top_ids))
        self.parts = parts
        self.host: list | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for part in self.parts for t in part]

    def read(self, host: list[torch.Tensor]) -> None:
        self.host = [t.tolist() for t in host]

    def _entries(self, part: int) -> list[tuple[float, list[int], list[float]]]:
        chosen, top_values, top_ids = self.host[3 * part : 3 * part + 3]
        return list(zip(chosen, top_ids, top_values))

    def sampled(self) -> dict[int, tuple[float, list[int], list[float]]]:
        """Batch row -> (the sampled token's value, the top ids, their values)."""
        if not self.rows:
            return {}
        return {self.sample_rows[row]: entry for row, entry in zip(self.rows, self._entries(0))}

    def prompt(self):
        """(request, first scored position, [(value, top ids, top values)] a prompt token)."""
        if not self.spans:
            return
        entries = self._entries(1 if self.rows else 0)
        offset = 0
        for request, first, count in self.spans:
            yield request, first, entries[offset : offset + count]
            offset += count


class PinnedStaging:
    """Pinned host buffers that a step's inputs pass through on their way to the device, reused in
    turn. A fresh pin_memory() for every upload asked the caching host allocator for a new pinned
    block whenever the previous one's copy was not yet seen to finish, which stalled the host in
    large steps (BENCHMARKS.md, "Why the defaults are what they are"). A buffer is refilled only after the copy from it has finished (an
    event each, long done by its turn: a step makes one to three uploads)."""

    SLOTS = 16

    def __init__(self):
        self.buffers: list[torch.Tensor | None] = [None] * self.SLOTS
        self.copied: list[torch.cuda.Event | None] = [None] * self.SLOTS
        self.next = 0

    def upload(self, array: np.ndarray, dtype: torch.dtype, stream, device: torch.device) -> torch.Tensor:
        """array converted to dtype, copied asynchronously to device on stream."""
        slot = self.next
        self.next = (slot + 1) % self.SLOTS
        if self.copied[slot] is not None:
            self.copied[slot].synchronize()
        num_bytes = array.size * dtype.itemsize
        buffer = self.buffers[slot]
        if buffer is None or buffer.numel() < num_bytes:  # grown to twice the need: steps vary in size
            buffer = self.buffers[slot] = torch.empty(max(2 * num_bytes, 4096), dtype=torch.uint8, pin_memory=True)
        staged = buffer[:num_bytes].view(dtype).view(array.shape)
        staged.copy_(torch.from_numpy(array))
        with torch.cuda.stream(stream):
            on_device = staged.to(device, non_blocking=True)
            event = self.copied[slot] or torch.cuda.Event()
            event.record(stream)
        self.copied[slot] = event
        return on_device


def warmup_shapes(
    config: EngineConfig, min_split_len: int, mixed_decode_split_len: int | None = None
) -> list[tuple[list, str]]:
    """The steps ModelRunner._compile_kernels runs, as ([(cached context, new tokens)], sampling kind):
    prefill chunks on both sides of each token count at which a kernel's tiling changes (16, 32,
    64, 128, 256), alone, after cached context and beside decodes; decode batches of every power of
    two up to max_num_seqs (the GEMM tilings, the decode order's block), and of one sequence at
    contexts that split into each power of two of parts (the decode reduction's variants), and at
    mixed_decode_split_len beside a prompt (where the backend splits such decodes after the
    model's q/k kernel, not from the QKV rows as in decode steps); each sampling path (greedy,
    sampled, filtered)."""
    max_len, max_seqs = config.max_model_len, config.max_num_seqs
    max_tokens = min(config.max_num_batched_tokens, max_len)
    shapes: list[tuple[list, str]] = []

    def add(parts, kind="sampled"):
        fits = len(parts) <= max_seqs and sum(n for _, n in parts) <= config.max_num_batched_tokens
        if fits and all(c + n <= max_len for c, n in parts):
            shapes.append((parts, kind))

    for tokens in sorted({min(t, max_tokens) for t in (2, 8, 24, 48, 96, 200, 400, 1024, max_tokens)}):
        add([(0, tokens)])
        add([(min(300, max_len - tokens), tokens)])
    for decodes in (1, 16, 100):
        add([(0, 100)] + [(128, 1)] * decodes)
    batch = 1
    while batch < max_seqs:
        add([(128, 1)] * batch)
        batch *= 2
    for batch in (3, 17, 48, 100, max_seqs):
        add([(128, 1)] * batch)
    context = min_split_len
    while context < max_len:
        add([(context, 1)])
        context *= 2
    add([(max_len - 1, 1)])
    if mixed_decode_split_len is not None:
        add([(mixed_decode_split_len, 1), (0, 16)])
    add([(128, 1)] * 4, "greedy")
    add([(0, 64)] + [(128, 1)] * 4, "filtered")
    return shapes


class StepHandle:
    """A launched step. tokens() waits for its samples; placeholders() names them before they
    exist, so the engine can schedule the next step while this one runs on the device."""

    def __init__(
        self,
        num_seqs: int,
        sample_rows: list[int],
        sampled: torch.Tensor | None,
        copy_stream: torch.cuda.Stream | None = None,
        extras: StepLogprobs | None = None,
    ):
        """copy_stream: for samples on a CUDA device, the stream they go to the host on, so the
        compute stream moves on to the next step without waiting for the copy. extras: the step's
        logprobs, which travel with the samples."""
        self.num_seqs = num_seqs
        self.sample_rows = sample_rows
        self.sampled = sampled
        self.extras = extras
        self.host = None
        self.extras_host: list[torch.Tensor] | None = None
        device_tensors = extras.tensors() if extras is not None else []
        on_cuda = (sampled is not None and sampled.is_cuda) or any(t.is_cuda for t in device_tensors)
        if on_cuda:
            device = (sampled if sampled is not None else device_tensors[0]).device
            copy_stream.wait_stream(torch.cuda.current_stream(device))  # the samples are written
            with torch.cuda.stream(copy_stream):
                if sampled is not None:
                    self.host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
                    self.host.copy_(sampled, non_blocking=True)
                self.extras_host = [t.to("cpu", non_blocking=True) for t in device_tensors]
                self.ready = torch.cuda.Event()
                self.ready.record()
            for tensor in [sampled, *device_tensors]:
                if tensor is not None:
                    tensor.record_stream(copy_stream)

    def placeholders(self) -> list[int | None]:
        """-(k + 1) for the k-th sampling row: the runner swaps these ids for the samples on device."""
        out: list[int | None] = [None] * self.num_seqs
        for k, row in enumerate(self.sample_rows):
            out[row] = -(k + 1)
        return out

    def tokens(self) -> list[int | None]:
        out: list[int | None] = [None] * self.num_seqs
        if self.extras is not None and self.extras.host is None:
            if self.extras_host is not None:
                self.ready.synchronize()
            self.extras.read(self.extras_host if self.extras_host is not None else self.extras.tensors())
        if self.sampled is None:
            return out
        if self.host is not None:
            self.ready.synchronize()
            values = self.host.tolist()
        else:
            values = self.sampled.tolist()
        for row, token in zip(self.sample_rows, values):
            out[row] = token
        return out

    def logprobs(self) -> StepLogprobs | None:
        """The step's logprobs (once tokens() has returned), or None when nothing asked for them."""
        return self.extras
