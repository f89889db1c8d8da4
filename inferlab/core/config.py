"""Engine settings: nano-vllm's, plus the device, the dtype and the plugin choices."""

from dataclasses import dataclass, field, fields

from inferlab.core.kv_cache_dtype import KV_CACHE_DTYPES


@dataclass(slots=True)
class EngineConfig:
    """Everything that shapes an engine. Plugin fields hold registered names; `*_options` hold the
    keyword arguments passed to the chosen plugin's factory (Hydra config nodes land there)."""

    model_path: str | None = None  # None: the embedded tiny model
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    tp_step_timeout_s: float = 30.0  # a tensor-parallel rank silent through a step this long is taken for hung
    enforce_eager: bool = False
    # Steps with prefill of at most this many tokens replay CUDA graphs (cuda_graphs.prefill_graph_sizes)
    # where the attention backend supports it; 0: they run eagerly; None: up to the size whose
    # matmuls take the device about as long as an eager launch can take the host (16,384 tokens for
    # Qwen3-0.6B shapes, 1,024 for 8B ones: cuda_graphs.auto_graph_prefill_tokens), at most
    # max_num_batched_tokens.
    graph_prefill_tokens: int | None = None
    # Compile every Triton kernel variant the engine's step shapes can select while it starts (on
    # CUDA, in parallel threads), not inside the first generate; Triton caches them on disk.
    compile_at_start: bool = True
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1  # -1: sized from free device memory
    enable_prefix_caching: bool = True
    # None: on for CUDA, where the CPU can run ahead of the GPU, and for a simulation of it
    overlap_scheduling: bool | None = None
    device: str = "auto"  # "auto": cuda when available, else cpu
    dtype: str = "auto"  # "auto": the checkpoint's on GPU, float32 on CPU
    kv_cache_dtype: str = "auto"  # "auto": dtype's; "fp8": float8 e4m3 (inferlab/core/kv_cache_dtype.py)
    seed: int = 0  # draws the seeds of requests that bring none
    cpu_kv_cache_gib: float = 1.0  # KV budget on CPU when num_kvcache_blocks is -1
    scheduler: str = "fcfs"
    kv_cache: str = "paged"
    attention: str = "auto"  # "auto": the device's best available backend
    model: str = "auto"  # "auto": the plugin serving the checkpoint's `architectures`
    sampler: str = "default"
    scheduler_options: dict = field(default_factory=dict)
    kv_cache_options: dict = field(default_factory=dict)
    attention_options: dict = field(default_factory=dict)
    model_options: dict = field(default_factory=dict)
    sampler_options: dict = field(default_factory=dict)
    # Who runs the steps: "real" (this machine's devices; tensor-parallel when tensor_parallel_size > 1),
    # "tensor_parallel", or "simulated" (a step-cost model on a virtual clock stands in for the device)
    executor: str = "real"
    executor_options: dict = field(default_factory=dict)
    # Which values SamplingParams.logprobs reports, as vLLM's logprobs_mode: the log-probabilities or
    # logits of the distribution each token was drawn from ("processed_*": after penalties, logit
    # bias, constraints, temperature and filters) or of the model's own ("raw_*").
    logprobs_mode: str = "processed_logprobs"

    def __post_init__(self):
        for name in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_model_len",
            "tensor_parallel_size",
            "kvcache_block_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not (
            isinstance(self.num_kvcache_blocks, int) and (self.num_kvcache_blocks == -1 or self.num_kvcache_blocks >= 1)
        ):
            raise ValueError(
                f"num_kvcache_blocks must be -1 (size from memory) or >= 1, got {self.num_kvcache_blocks!r}"
            )
        if not (_is_number(self.tp_step_timeout_s) and 0 < self.tp_step_timeout_s < float("inf")):
            raise ValueError(f"tp_step_timeout_s must be a positive number of seconds, got {self.tp_step_timeout_s!r}")
        graph_tokens = self.graph_prefill_tokens
        if graph_tokens is not None and (not isinstance(graph_tokens, int) or isinstance(graph_tokens, bool)):
            raise ValueError(f"graph_prefill_tokens must be a whole number of tokens or None, got {graph_tokens!r}")
        if graph_tokens is not None and graph_tokens < 0:
            raise ValueError(
                f"graph_prefill_tokens must be >= 0 (0: steps with prefill run eagerly; None: sized to the model), "
                f"got {graph_tokens}"
            )
        if not (_is_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not (_is_number(self.cpu_kv_cache_gib) and 0 < self.cpu_kv_cache_gib < float("inf")):
            raise ValueError(f"cpu_kv_cache_gib must be a positive number of GiB, got {self.cpu_kv_cache_gib!r}")
        # a string such as "false" would otherwise count as true
        for name in ("enforce_eager", "compile_at_start", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.overlap_scheduling is not None and not isinstance(self.overlap_scheduling, bool):
            raise ValueError(
                f"overlap_scheduling must be True, False or None (on where the device runs ahead), "
                f"got {self.overlap_scheduling!r}"
            )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")

    @classmethod
    def from_kwargs(cls, model_path: str | None, kwargs: dict) -> "EngineConfig":
        """Builds a config from LLM(...) keyword arguments; an unknown one is an error, not ignored."""
        names = {f.name for f in fields(cls)} - {"model_path"}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine setting(s) {unknown}; allowed: {sorted(names)}")
        return cls(model_path=model_path, **kwargs)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


DTYPES = {"auto", "float32", "float16", "bfloat16"}
LOGPROBS_MODES = ("processed_logprobs", "processed_logits", "raw_logprobs", "raw_logits")
