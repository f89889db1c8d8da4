"""The five plugin kinds. Each Protocol is the whole contract a plugin must satisfy."""

from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from inferlab.core.batch import AttentionInputs, SamplingTensors, ScheduledBatch
from inferlab.core.sequence import Sequence


@runtime_checkable
class KVCacheManager(Protocol):
    """Block bookkeeping for the paged KV cache. Knows no tensors: the runner owns the cache,
    the attention backend its layout. Writes each sequence's `block_table` and
    `num_computed_tokens`/`num_cached_tokens` on admission."""

    block_size: int
    num_blocks: int

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, including freed blocks still cached)."""

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of seq's prefix already in the cache, without side effects. Always leaves at
        least the last token to compute, so a fully cached prompt still yields logits."""

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Makes room for num_new_tokens more tokens of seq. For a sequence without blocks this
        first takes its cached prefix (setting num_computed_tokens). Returns False, changing
        nothing, when free blocks do not suffice."""

    def commit(self, seq: Sequence) -> None:
        """Called after a step computed seq's tokens: registers its newly full blocks in the prefix
        cache."""

    def free(self, seq: Sequence) -> None:
        """Releases seq's blocks (cached ones stay reusable until evicted) and clears its table."""


@runtime_checkable
class Scheduler(Protocol):
    """Decides each step's batch and owns the waiting/running queues and the preemption policy.
    Knows nothing about tensors."""

    def add(self, seq: Sequence) -> None:
        """Queues a new request."""

    def schedule(self) -> ScheduledBatch:
        """Picks the next batch within the token and sequence budgets, allocating KV blocks through
        the KVCacheManager and preempting when they run out. An empty batch means nothing can run."""

    def postprocess(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        """Advances the batch after the forward pass: sampled[i] is the new token of batch.seqs[i]
        or None for a prefill chunk that does not sample. Under overlap scheduling a token may be a
        negative placeholder, filled in by the engine before the next postprocess (only length can
        end a sequence on a placeholder). Skips sequences finished meanwhile. Returns the sequences
        that finished."""

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a running or waiting sequence now (a stop string matched, or an abort) and frees it."""

    def abort(self, seq_id: int) -> Sequence | None:
        """Removes the request wherever it is and frees its blocks; returns it, or None if unknown."""

    def is_finished(self) -> bool:
        """True when no request is waiting or running."""


@runtime_checkable
class AttentionBackend(Protocol):
    """Paged attention: declares its KV layout and constraints, builds per-batch metadata and
    computes attention for prefill (cached prefix, chunks) and decode.

    name: the name it registers under, which users select (`attention=name`).

    supports_cuda_graphs: when True, the runner captures decode steps in CUDA graphs. It then calls
    build_metadata and forward inside the capture, with AttentionInputs whose tensors are static
    buffers sized for the graph's batch (padding rows: seq_lens 0, slot_mapping -1, which must
    store nothing and attend to nothing) and max_seq_len the longest a sequence may grow; both must
    then do device work only (no host sync, no shapes read from tensor values). When False,
    decode runs eagerly.

    auto_priority: where `attention=auto` may choose this backend, a class attribute of its factory
    mapping a device type ("cuda", "cpu") to a priority. On a device auto tries the backends that
    name its type, highest priority first, and takes the first that builds and validates; a
    backend whose auto_priority lacks the device type is never chosen there by auto (`{}`: only
    when selected by name).

    A backend may also implement FusedKVStore, so that a model stores the new K and V itself."""

    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool]
    auto_priority: ClassVar[dict[str, int]]

    @classmethod
    def validate(
        cls, device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int, kv_cache_dtype: torch.dtype
    ) -> list[str]:
        """The reasons this backend cannot serve that configuration; empty when it can. dtype is the
        model's (q, k, v and the output); kv_cache_dtype the cache's: dtype itself, or
        torch.float8_e4m3fn (engine kv_cache_dtype=fp8, stored as inferlab.core.kv_cache_dtype says)."""

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor, K and V together."""

    def build_metadata(self, inputs: AttentionInputs) -> Any:
        """Per-step metadata the backend's forward reads, from the runner's batch description."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, metadata: Any, scale: float
    ) -> torch.Tensor:
        """Stores k, v [T, Hkv, D] into kv_cache (unless both are None: the model stored them, see
        FusedKVStore) and returns attention of q [T, H, D] over each sequence's cached context
        plus its new tokens, causally: [T, H, D]."""


@runtime_checkable
class FusedKVStore(Protocol):
    """Optional for an AttentionBackend whose cache holds K and V as contiguous
    [num_blocks, block_size, Hkv, D] arrays: a model may then write each new token's k and v into
    slot slot_mapping[t] itself (-1: none; e.g. from a kernel it runs anyway), converted to the
    cache's dtype as inferlab.core.kv_cache_dtype.to_cache_dtype does, and call the backend's
    forward with k = v = None. Checked with isinstance(backend, FusedKVStore)."""

    def kv_store_target(self, kv_cache: torch.Tensor, metadata: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache, slot_mapping) of one layer's cache for the step that metadata
        describes (build_metadata's result)."""


@runtime_checkable
class Model(Protocol):
    """A causal LM as an nn.Module built from a HF config; attention layers call the backend."""

    architectures: ClassVar[tuple[str, ...]]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], attn_metadata: Any
    ) -> torch.Tensor:
        """Hidden states [T, hidden] for the batch's new tokens."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [N, vocab] for the given rows (gathered across TP ranks)."""

    def load_weights(self, path: str) -> None:
        """Loads (and, under tensor parallelism, slices) the safetensors weights in path."""

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads on this rank, head_dim), for sizing the cache."""


@runtime_checkable
class Sampler(Protocol):
    """Turns logits into the next token of each sequence, vectorized over the batch."""

    def __call__(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        """Next token ids [N] for logits [N, vocab] (in the model's dtype), on the logits' device."""
