"""The plugin kinds, each Protocol the whole contract a plugin must satisfy, and the optional
capabilities a plugin may add, each a small Protocol of its own that the core checks with isinstance.
Every member the core reads of a plugin is declared here."""

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from inferlab.core.batch import AttentionInputs, SamplingTensors, ScheduledBatch
from inferlab.core.checkpoint import Checkpoint
from inferlab.core.request import Request, RequestView
from inferlab.core.routing import ReplicaView, RoutedRequest


@runtime_checkable
class KVCacheManager(Protocol):
    """Block book-keeping for the paged KV cache: which blocks each request holds, which cached
    prefixes can be reused, whether a request could ever fit. Knows no tensors (the runner owns
    the cache, the attention backend its layout) and never changes a request: it reads a
    request's `request_id`, `token_ids` and `num_computed_tokens`."""

    block_size: int
    num_blocks: int

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free ones, including freed blocks still cached)."""

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Leading tokens of a request holding no blocks that the prefix cache holds, without side
        effects. Always leaves at least the last token to compute, so that it yields logits."""

    def allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        """Makes room for num_new_tokens more tokens after request.num_computed_tokens. For a
        request holding no blocks, num_cached_tokens is what num_cached_prefix_tokens has just
        answered for it: its first num_cached_tokens tokens are taken from the prefix cache and
        the new ones follow them. Returns False, changing nothing, when free blocks do not
        suffice."""

    def block_table(self, request: Request) -> list[int]:
        """The blocks holding request's tokens, in order (empty when it holds none). The caller
        reads it and never changes it."""

    def commit(self, request: Request) -> None:
        """Called after a step computed more of request's tokens (request.num_computed_tokens has
        grown): registers its newly full blocks in the prefix cache."""

    def free(self, request: Request) -> None:
        """Releases everything held for the request (cached blocks stay reusable until evicted).
        Called when it is preempted and when it finishes, wherever it was."""

    def could_ever_fit(self, num_tokens: int) -> bool:
        """Whether one request holding num_tokens tokens of K/V fits in the whole cache, with
        nothing else running: False means no schedule could ever serve it."""


@runtime_checkable
class PrefixCacheStats(Protocol):
    """Optional KV manager capability: how much of the prompts the prefix cache served."""

    def prefix_cache_stats(self) -> tuple[int, int]:
        """(tokens served from the cache, tokens looked up) since the manager was built, counted
        at each admission."""


@runtime_checkable
class PrefixCacheReset(Protocol):
    """Optional KV manager capability: forgetting cached prefixes, so that a benchmark's timed
    pass does not reuse the previous pass's K/V."""

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block that no request holds."""


@dataclass(frozen=True, slots=True)
class SchedulerState:
    """What a policy may consult besides the requests, as of the step being scheduled."""

    now: float  # the engine's clock, in seconds (virtual under simulation)
    step: int  # steps scheduled so far
    running: tuple[RequestView, ...]  # in admission order, oldest first
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int


@runtime_checkable
class SchedulerPolicy(Protocol):
    """A scheduler plugin: the decisions of scheduling, over read-only request views. The core
    scheduler carries them out: token budgets, chunked prefill, KV allocation, recompute
    preemption, and finishing requests. Each step it first continues the running requests
    (decodes and unfinished prefill chunks, oldest admitted first), then admits waiting ones."""

    def admission_order(self, waiting: tuple[RequestView, ...], state: SchedulerState) -> Iterable[RequestView]:
        """The waiting requests to try admitting this step, first first, each at most once
        (waiting is in queue order: arrival, preempted requests in front). The core admits them
        in this order while the token budget, max_num_seqs and free KV blocks allow, and stops at
        the first that does not fit. Leaving requests out (all of them, even) declines to admit
        them this step.
        Called only when there are waiting requests and room to admit one (or when the policy is
        a PreemptivePolicy)."""

    def preemption_victim(self, running: tuple[RequestView, ...], state: SchedulerState) -> RequestView:
        """Which of the running requests (admission order, oldest first) to preempt when KV blocks
        run out while continuing them: its blocks are freed and it is recomputed from its prompt
        and outputs when admitted again. It may be the request that needed the blocks, or one
        already scheduled this step (which is then taken out of the step)."""


@runtime_checkable
class PreemptivePolicy(Protocol):
    """Optional policy capability: a waiting request may displace a running one."""

    def preempts(
        self, request: RequestView, running: tuple[RequestView, ...], state: SchedulerState
    ) -> RequestView | None:
        """Called when the waiting `request`, next in admission order, cannot be admitted for lack
        of KV blocks or of a sequence slot: the running request to preempt in its favour, or None
        to stop admitting this step. `running` leaves out requests admitted this step."""


@runtime_checkable
class BudgetPolicy(Protocol):
    """Optional policy capability: the step's token budget and each prefill's chunk size, in
    place of max_num_batched_tokens and 'as much of the prompt as the budget allows'."""

    def token_budget(self, state: SchedulerState) -> int:
        """The most tokens this step computes (decodes count one each); at least 1."""

    def chunk_size(self, request: RequestView, budget_left: int) -> int:
        """How many of request's remaining prefill tokens to compute this step, from 1 to
        budget_left (the core clamps to what remains of the prompt)."""


@runtime_checkable
class ObservingPolicy(Protocol):
    """Optional policy capability: seeing each step's work, for policies that account for the
    service requests receive (fair share, for instance)."""

    def observe(self, scheduled: tuple[tuple[RequestView, int], ...], state: SchedulerState) -> None:
        """Called once each step is scheduled, with the requests it computes and how many tokens
        each (their views still show the counts before the step)."""


@runtime_checkable
class PureAdmissionOrder(Protocol):
    """Optional policy capability: with admission_order_is_pure True, admission_order only reads its
    arguments, changes nothing (it keeps no state that its calls change) and raises for no input, so
    that a simulation may skip asking it in steps where no order it could return admits anything: a
    replica of a simulated fleet then runs decode steps at once while requests wait that its KV cache
    cannot take (LLMEngine.run_decodes). Without it, the policy is asked in every step it would be
    asked in, and such steps run one at a time."""

    admission_order_is_pure: bool


@runtime_checkable
class FixedAdmissionOrder(Protocol):
    """Optional policy capability, with PureAdmissionOrder: with admission_order_is_fixed True, the
    order admission_order gives the same waiting requests depends on nothing else: not on the state,
    nor on what changes while they wait (a waiting request's num_cached_prefix_tokens), only on what
    a waiting request keeps (arrival, priority, tokens, metadata). A simulation may then ask it once
    for a run of decode steps in which the same requests wait, and run while the request it puts
    first cannot be admitted (the core stops admitting there)."""

    admission_order_is_fixed: bool


@runtime_checkable
class ReadsMetadata(Protocol):
    """Optional policy capability: the request metadata fields the policy reads, each with the
    type (or tuple of types) its value must have, e.g. `metadata_fields = {"deadline": (int,
    float)}` as a class attribute. A request whose metadata holds one of these keys with a value of
    another type is refused when it is added (ValueError naming the field and the policy; the
    server answers 400), before the policy ever sees it. bool counts as a type of its own, not as
    an int; keys absent from a request's metadata are allowed."""

    metadata_fields: Mapping[str, type | tuple[type, ...]]


@runtime_checkable
class KVCacheEvents(Protocol):
    """Optional KV manager capability: what entered and left the prefix cache, named by the chained
    block hashes of inferlab.core.blocks (block_hashes of a request's tokens), so that a router in
    another process can count a replica's cached prefix (a cluster on Ray)."""

    def take_kv_events(self) -> dict[int, bool]:
        """The hashes whose presence in the prefix cache changed since the previous call, each
        with whether it is cached now. The first call returns every cached hash (True) and starts
        the record; before it, nothing is recorded."""


@runtime_checkable
class CachedPrefixLookup(Protocol):
    """Optional KV manager capability: a router's question, how much of a prompt another replica's
    cache holds, answered from the prompt's block names alone (computed once for every replica)."""

    def cached_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many of the leading blocks these chained hashes (inferlab.core.blocks) name the prefix
        cache holds now, without side effects. The names are trusted: two prompts whose names collide
        in 64 bits would be counted alike (admission, which confirms every hit, never is)."""


@runtime_checkable
class UnheldPrefixBlocks(Protocol):
    """Optional KV manager capability: how many blocks of a request's cached prefix no request holds
    now. Admitting the request takes those out of the free blocks too, so it fits only where the
    free blocks cover them besides the blocks it computes into: the engine counts them to tell that
    no step of a run of decode steps could admit a waiting request (LLMEngine.run_decodes)."""

    def num_unheld_prefix_blocks(self, request: Request, num_cached_tokens: int) -> int:
        """Of the blocks holding the request's first num_cached_tokens tokens (a multiple of the
        block size, at most num_cached_prefix_tokens(request) now), how many no request holds."""


@dataclass(frozen=True, slots=True)
class ClusterState:
    """What a router may consult besides the request and the replicas it is offered."""

    now: float  # the cluster's clock, in seconds (virtual under simulation)
    num_routed: int  # requests routed before this one
    num_replicas: int  # replicas in the cluster, those not offered (a dead one) included


@runtime_checkable
class WakeableStep(Protocol):
    """Optional capability of an engine that a server's loop drives (inferlab.cluster.Cluster has
    it): its step may wait for others (a Ray cluster's for its actors' reports) while the loop's
    inbox fills. The loop calls wake() with each thing it is given, so that a request that comes
    during that wait is added and routed when it comes, not when the wait ends."""

    def wake(self) -> None:
        """Ends the wait of the step in progress now, or of the next step if none waits; safe from
        any thread."""


@runtime_checkable
class Router(Protocol):
    """A router plugin: which replica of a cluster serves each request, over read-only views (see
    inferlab.core.routing). The cluster carries the choice out: the chosen replica's engine
    queues the request, and its scheduler policy takes it from there."""

    def route(self, request: RoutedRequest, replicas: tuple[ReplicaView, ...], state: ClusterState) -> ReplicaView:
        """One of `replicas` (at least one, in replica_id order; a replica that died is left out) to
        serve `request`, called once per request when it arrives, in arrival order. Returning
        anything else, or raising, fails that request with a PolicyError naming the router; the
        others go on."""


@runtime_checkable
class ObservingRouter(Protocol):
    """Optional router capability: seeing requests end, for routers that keep their own account
    of each replica's load."""

    def observe(self, request: RoutedRequest, replica: ReplicaView, state: ClusterState) -> None:
        """Called once for each routed request when it finishes or is aborted on `replica`
        (request.finish_reason says how; "error" when its replica died)."""


@runtime_checkable
class PairRouter(Protocol):
    """Optional router capability: in a disaggregated cluster (cluster.prefill_replicas and
    cluster.decode_replicas, docs/disaggregation.md), both replicas of a request chosen together:
    the one that computes its prompt and first token, and the one its K/V moves to for decoding.
    Without it the cluster asks route() twice: over the prefill replicas, then the decode ones."""

    def route_pair(
        self,
        request: RoutedRequest,
        prefill: tuple[ReplicaView, ...],
        decode: tuple[ReplicaView, ...],
        state: ClusterState,
    ) -> tuple[ReplicaView, ReplicaView]:
        """(one of `prefill`, one of `decode`) for `request`, called once per request when it
        arrives (each tuple holds at least one view, in replica_id order, alive ones only). An answer
        that is not such a pair, or an exception, fails that request with a PolicyError naming the
        router; the others go on."""


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

    A backend's factory may implement AutoPriority (`attention=auto` may choose it). A backend may
    also implement PrefillGraphCapture (steps with prefill replayed from CUDA graphs), SplitDecodes
    (decode attention split over long contexts), FusedKVStore (a model stores the new K and V
    itself) and DecodesFromQKV (a decode step's attention starts from the QKV projection's output)."""

    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool]

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
class AutoPriority(Protocol):
    """Optional capability of an AttentionBackend's factory: where `attention=auto` may choose the
    backend, read before any backend is built. auto_priority maps a device type ("cuda", "cpu") to a
    priority; on a device auto tries the backends that name its type, highest priority first, and
    takes the first that builds and validates. A backend whose factory lacks it, or whose
    auto_priority lacks the device type (`{}`), is used only when selected by name."""

    auto_priority: ClassVar[dict[str, int]]


@runtime_checkable
class PrefillGraphCapture(Protocol):
    """Optional AttentionBackend capability (supports_prefill_graphs True): the runner also captures
    small steps with prefill (CUDA graphs by token count, up to the engine's graph_prefill_tokens),
    whose AttentionInputs have static_shapes set: the token and sequence tensors are padded to the
    graph's capacity (padding sequences: no new tokens, seq_len 0; padding tokens: slot -1),
    max_query_len is that capacity, and num_decodes is 0. Launch grids must follow the tensors'
    sizes, never the batch's contents. Without it (or with False), steps with prefill run eagerly."""

    supports_prefill_graphs: bool


@runtime_checkable
class SplitDecodes(Protocol):
    """Optional AttentionBackend capability: decode attention split over a long context, each part
    of at least min_split_len keys, then reduced (flash-decoding). The runner's start-up compiles
    the variants each number of parts selects, and a step with prefill whose decodes reach
    mixed_decode_split_len tokens of context (which the backend splits apart from the prompt)
    stays out of the prefill graphs."""

    min_split_len: int
    mixed_decode_split_len: int


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
class DecodesFromQKV(Protocol):
    """Optional for an AttentionBackend whose decode attention can start from the QKV projection's
    output as it comes: it normalizes q and k per head (where the model does), rotates them, stores
    the new k and v into the cache and attends, all in one kernel where a model would otherwise
    launch its q/k kernel, then the store and attention. A model whose rotary is a cos/sin table
    may call decode_qkv in place of those in the steps for which decodes_qkv says so (inferlab's
    decoder does after its one-token GEMVs). Checked with isinstance(backend, DecodesFromQKV)."""

    def decodes_qkv(self, metadata: Any) -> bool:
        """Whether the step that metadata (build_metadata's result) describes goes through
        decode_qkv: for instance, every sequence computes one new token."""

    def decode_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
        num_heads: int,
        kv_cache: torch.Tensor,
        metadata: Any,
        scale: float,
    ) -> torch.Tensor:
        """Attention [B, H, D] of each sequence's new token. qkv [B, (H + 2 * Hkv) * D]: q's heads,
        then k's, then v's. positions [B] (int64). cos_sin: float32 [positions, D], each row D / 2
        cosines of the rotary angles, then their sines (the first half of a head pairs with the
        second). qk_norm: (q_weight [D], k_weight [D], eps) of the per-head RMSNorm before the
        rotary, rounded to the model dtype after the normalization and after the weight, or None.
        The new k (rotated) and v go into the cache at the step's slots, as forward stores them."""


@runtime_checkable
class Model(Protocol):
    """A causal LM as an nn.Module built from a HF config; attention layers call the backend.

    A model's factory may implement ServesArchitectures (`model=auto` may choose it) and
    ConfigDefaults (config.json read without transformers' config classes); the model itself may
    implement RepresentativeLayers."""

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

    def eval(self) -> Any:
        """Puts the model in inference mode (nn.Module's); called once, after load_weights. The runner
        then calls the model itself, which runs forward, as an nn.Module does."""


@runtime_checkable
class ServesArchitectures(Protocol):
    """Optional capability of a Model's factory: the HF architectures (config.json's
    `architectures`) it serves, read before any model is built. `model=auto` takes the first model
    plugin, in name order, serving one of the checkpoint's; a plugin whose factory lacks it is used
    only when selected by name."""

    architectures: ClassVar[tuple[str, ...]]


@runtime_checkable
class ConfigDefaults(Protocol):
    """Optional capability of a Model's factory: the defaults of transformers' config class for
    each model_type the plugin reads (model_type -> {field: default}), with every field a model of
    that type reads. A checkpoint whose config.json names one of those model types is read without
    importing transformers' config classes, which is slow: its fields over these defaults, plus
    what transformers derives from them, which the core computes (num_key_value_heads, head_dim
    where its default is None, layer_types and sliding_window where use_sliding_window is a field,
    rope_parameters, dtype). Each field whose default is an integer, number, boolean or string
    must hold one in config.json (token ids aside). Other model types go through transformers."""

    config_defaults: ClassVar[dict[str, dict[str, Any]]]


@runtime_checkable
class Sampler(Protocol):
    """Turns logits into the next token of each sequence, vectorized over the batch."""

    def __call__(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        """Next token ids [N] for logits [N, vocab] (in the model's dtype), on the logits' device."""


@runtime_checkable
class RepresentativeLayers(Protocol):
    """Optional Model capability: forward, given the caches of its first kernel_variant_layers
    layers only, runs those layers and every kernel variant and GEMM shape the whole model would.
    Start-up then finds the variants to compile, loads them and runs each step shape, and loads
    each graph's kernels before its capture, over those layers instead of all of them."""

    kernel_variant_layers: int


@runtime_checkable
class GraphCapturableSampler(Protocol):
    """Optional Sampler capability (supports_cuda_graphs True): a call launches only device work a
    CUDA graph can capture (it never reads a tensor back to the host), chosen from the logits'
    shape and the settings' flags alone, and each row's token depends on its own logits and
    settings only. The runner then replays decode batches' LM head and sampling from graphs, whose
    padding rows carry stale settings, for all-greedy batches and for sampled ones without top-k,
    top-p or min-p."""

    supports_cuda_graphs: bool


@runtime_checkable
class StepHandle(Protocol):
    """A step a Runner launched. Under overlap scheduling the engine schedules and launches the next
    step before it reads this one's tokens, through placeholders that stand for them."""

    def tokens(self) -> list[int | None]:
        """Each row's sampled token, in the batch's order, once the step has run (this waits for
        it): None for a row that samples nothing (a prefill chunk short of its prompt's end)."""

    def placeholders(self) -> list[int | None]:
        """The same rows before the step has run: -(k + 1) for the k-th sampling row, None for the
        others. The runner reads a placeholder in a later batch as the token it stands for."""


@runtime_checkable
class Runner(Protocol):
    """An executor plugin: who runs the steps the core scheduler decides. The real runner computes
    them on this machine's device (tensor-parallel: over worker processes), the simulated one
    times them with a step-cost model on a virtual clock; the engine treats them alike.

    checkpoint: the model the engine serves (its config and tokenizer, which the engine reads).
    num_kv_blocks: how many KV blocks the runner's cache holds, which the KV cache manager hands out.
    runs_ahead: whether steps run beside the host (a GPU's stream, or a simulated device), so that
    overlap scheduling is on by default (engine setting overlap_scheduling=None)."""

    checkpoint: Checkpoint
    num_kv_blocks: int
    runs_ahead: bool

    def clock(self) -> float:
        """The time requests and steps are stamped with, in seconds: the host's, or a simulation's
        virtual time."""

    def wait_until(self, t: float) -> None:
        """Returns once clock() reads t: the host sleeps; a virtual clock moves there at once."""

    def launch(self, batch: ScheduledBatch) -> StepHandle:
        """Starts computing one step and returns at once with its handle. Steps run in launch
        order; a batch may hold placeholders of a step launched before it."""

    def close(self) -> None:
        """Releases what the runner holds (device memory, worker processes); it launches nothing
        afterwards. Called once, by the engine's close()."""


@runtime_checkable
class AdmissionCost(Protocol):
    """Optional Runner capability: the host's time to add a request, for a runner whose clock is
    not the host's (a simulation charges what the real engine's admission costs)."""

    def admit(self, request: Request) -> None:
        """Called as each request is queued, before any step that may schedule it."""


@runtime_checkable
class OnDevice(Protocol):
    """Optional Runner capability: the runner computes on a device, whose rates bound a workload
    (a bench's hardware floor) and whose name goes into a run's records."""

    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    backend: AttentionBackend  # the attention backend that runs (attention=auto resolved)


@runtime_checkable
class VirtualTime(Protocol):
    """Optional Runner capability: with virtual_time True, clock() is a simulation's own time, which
    moves only with the steps, host work and waits the runner models; a cluster of such replicas
    runs them in the order of their clocks, one event at a time."""

    virtual_time: bool


@runtime_checkable
class DecodeRuns(Protocol):
    """Optional Runner capability (a simulation on a virtual clock): the steps of a run of
    decode-only steps of one unchanging batch, timed at once. The engine asks for one only where
    stepping one at a time would give the same steps (LLMEngine.run_decodes says when), and does
    the requests' books for the whole run itself.

    sampled_token_ids: every token id its steps may sample (the engine checks stop conditions
    against them)."""

    sampled_token_ids: frozenset[int]

    def launch_decodes(self, requests: list, pending: Any, until: float, max_steps: int) -> "DecodeRun":
        """Times up to max_steps decode steps of `requests` (each computing its one last token,
        sampling one), each as launch() would time it followed by the wait for the tokens of the
        step before it (`pending`, the handle of the step launched last, whose tokens the first step
        reads); stops before a step that would start at or after `until` on its clock. Its clock
        and counters move as that many launches and waits move them."""


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """What a DecodeRuns runner ran: each step's start and end on its clock (a step ends once the
    tokens of the step before it are read, as a step of the overlapping engine does), the token
    each step read (that of the step before it), and the handle of the last step, whose tokens are
    read by the next step."""

    starts: list[float]
    ends: list[float]
    read_tokens: list[int]
    handle: Any


@runtime_checkable
class BlockAligned(Protocol):
    """Optional KV manager capability: with block_aligned True, allocate for tokens that fit in the
    blocks a request holds changes nothing (and returns True), and commit changes something only
    when request.num_computed_tokens has reached a multiple of block_size since the last commit, so
    that a run of decode steps (DecodeRuns) calls them only at block boundaries, the core
    scheduler allocates for a running request only when its new tokens go past the block of its
    last computed token (which it holds), and commits after a step only the requests whose step
    filled a block. It also keeps a paged cache's accounting, which a run while requests wait
    relies on (PureAdmissionOrder): a request holding no blocks whose num_cached_prefix_tokens is c
    (a multiple of block_size) allocates only if at least the blocks past c that its new tokens
    fill are free, and only a commit makes a request's cached prefix longer, by at most one block
    for each block it fills."""

    block_aligned: bool


@runtime_checkable
class SharedDevice(Protocol):
    """Optional Runner capability (a simulation): replicas placed on one GPU
    (cluster.gpus_per_replica below 1) queue their steps on one device, which time-slices them as
    a GPU does two processes."""

    def share_device(self, runners: list) -> None:
        """From now on these runners (this one among them, all of its kind) share one device: their
        steps never overlap on it, as this runner's options say it switches between them."""

    def pending_end(self) -> float:
        """When the step it launched last ends, given the steps the runners sharing its device have
        launched so far (a later launch of theirs may delay it). A fleet steps a replica no earlier
        than this: its next step reads that step's tokens, and then every launch that could delay
        it must have been made."""


@runtime_checkable
class SimulatedDevice(Protocol):
    """Optional Runner capability: the runner's steps take modeled time, not measured time. A bench
    reports what stood in for the device and what the simulation cost the host."""

    num_steps: int
    attention: str  # the attention backend whose times the model predicts

    def describe(self) -> dict:
        """What stood in for the device (profile, cost model, ...), as JSON-ready values."""

    def reseed(self, seed: int) -> None:
        """Restarts the modeled times' random draws (step-time noise) from seed, so that a bench's
        repeats each draw their own, reproducibly."""


@runtime_checkable
class SamplesLogits(Protocol):
    """Optional Runner capability: the runner computes logits and draws from them with a sampler
    plugin (the real runners; a simulated one does not), whose capabilities below decide what a
    request may ask beyond plain sampling (logprobs, penalties, constraints). Its launch returns
    LogprobsStepHandles."""

    sampler: "Sampler"


@runtime_checkable
class LogprobsStepHandle(StepHandle, Protocol):
    """The step handle of a runner that SamplesLogits: the step's logprobs beside its tokens."""

    def logprobs(self) -> Any:
        """Once tokens() has returned: the step's logprobs (inferlab.core.model_runner.StepLogprobs:
        its sampled() and prompt()), or None when no request of the step asked for any."""


@runtime_checkable
class LogprobsSampler(Protocol):
    """Optional sampler capability: the logits each row was drawn from, so that the engine can
    report log-probabilities of the distribution actually sampled (SamplingParams.logprobs,
    EngineConfig.logprobs_mode). Requests asking for logprobs are refused with a sampler that
    lacks it."""

    def sample_with_logits(self, logits: torch.Tensor, params: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids [N], as __call__ draws them; float32 logits [N, vocab] whose softmax each row
        was drawn from: after params.adjustments, temperature (1 on greedy rows) and top-k, top-p
        and min-p, excluded tokens at -inf)."""


@runtime_checkable
class LogitsProcessingSampler(Protocol):
    """Optional sampler capability: honouring SamplingTensors.adjustments (presence, frequency
    and repetition penalties, logit_bias, min_tokens, and the allowed-token bitmask of grammars
    and TokenConstraints) in __call__ and, where it has it, sample_with_logits. Requests that need
    them are refused with a sampler that lacks it."""

    def adjust_logits(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        """The logits [N, vocab] with params.adjustments applied (float32; the rows without
        adjustments unchanged); logits itself when params.adjustments is None."""


@runtime_checkable
class TokenConstraint(Protocol):
    """One generated sequence's constraint on which token may come next: a compiled grammar
    (SamplingParams.structured_outputs) or a user's own (SamplingParams.constraint returns one).
    The engine asks it for the allowed tokens before each sampling step of its sequence and tells
    it each token drawn; it runs on the host, once per token of the sequences that have one."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into row `row` of bitmask (int32 [rows, ceil(vocab / 32)]
        on the CPU, all bits set beforehand): bit t % 32 of word t // 32 set means token t is allowed."""

    def accept_token(self, token_id: int) -> bool:
        """Advances past token_id, which the sampler drew from the allowed ones; False if it
        cannot (the sequence then ends with an error)."""

    def is_terminated(self) -> bool:
        """Whether the sequence is complete (the grammar accepted its end): it then stops."""


@runtime_checkable
class StructuredOutputSampler(Protocol):
    """Optional sampler capability: compiling SamplingParams.structured_outputs (JSON schema,
    JSON object, regex, choice, grammar) into TokenConstraints through a grammar library.
    Requests with structured_outputs are refused with a sampler that lacks it."""

    def compile_constraint(self, spec: Any, tokenizer: Any, vocab_size: int) -> Callable[[], TokenConstraint]:
        """A factory of fresh TokenConstraints (one per generated sequence) for spec (a
        StructuredOutputs) over the tokenizer's vocabulary, padded to vocab_size (the model's
        logits width). Raises ValueError naming what the library rejects in spec."""


@runtime_checkable
class KVBlockBytes(Protocol):
    """Optional Runner capability: the size of one KV block, for a transfer that prices moving
    blocks (kv_transfer=simulated)."""

    kv_block_bytes: int  # one block of K and V, every layer, on this runner (one tensor-parallel rank)


@runtime_checkable
class KVBlockStore(Protocol):
    """Optional Runner capability: a request's KV blocks as data, for a transfer that moves them
    between engines (kv_transfer=local, distributed). The data's layout is the runner's own: it
    goes into an engine with the same model, KV cache dtype, block size and attention backend."""

    def read_kv_blocks(self, blocks: list[int]) -> torch.Tensor:
        """A contiguous copy of the blocks' K and V in every layer, on the runner's device, as bytes
        (uint8): the shape empty_kv_blocks(len(blocks)) has. Queued on the device after every step
        launched so far."""

    def write_kv_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """Stores what read_kv_blocks returned (here or on a like engine, on any device) into the
        blocks, queued before any step launched after it."""

    def empty_kv_blocks(self, num_blocks: int) -> torch.Tensor:
        """An uninitialized tensor of the shape and dtype read_kv_blocks gives num_blocks blocks:
        a buffer to receive them into."""


@dataclass(frozen=True, slots=True)
class KVMove:
    """One request's K/V moving from the replica that computed its prompt (sender) to the one that
    decodes it (receiver); replicas are named by their ids, the transfer's endpoints."""

    request_id: int
    sender: int
    receiver: int


@dataclass(frozen=True, slots=True)
class KVMoveEnded:
    """What a transfer reports of a move at one endpoint: it ended there, well or (error) not."""

    move: KVMove
    error: str | None = None  # why it failed; None when the blocks moved
    seconds: float = 0.0  # how long the blocks took to move, from the receive's start
    num_bytes: int = 0  # bytes moved


@runtime_checkable
class KVTransfer(Protocol):
    """A kv_transfer plugin: moves a request's KV blocks from the engine that prefilled it to the
    engine that decodes it (prefill/decode disaggregation). One object serves the engines of this
    process, each attached as an endpoint; a move between processes or machines goes through a
    library (torch.distributed, NIXL), never a transport of inferlab's own.

    The core calls, for each move: send on the sender once the prompt's K/V and first token are
    computed (the blocks stay held there); receive on the receiver once it has allocated blocks for
    the prompt; poll on each side until the move is reported there, then frees the sender's blocks,
    and on the receiver counts the blocks computed and decodes on, or fails the request. Each move
    is reported once at each endpoint. A move fails rather than hangs: the plugin reports a move
    that takes longer than its own timeout as an error, on both sides."""

    def attach(self, endpoint: int, runner: Runner, block_size: int) -> None:
        """The engine whose runner this is, with KV blocks of block_size tokens, is endpoint
        (its replica id) here. Called once per engine, before any move names it; the runner's
        clock is the endpoint's."""

    def send(self, move: KVMove, blocks: list[int]) -> None:
        """Called on move.sender: blocks (in order) hold the K/V of the request's prompt, and stay
        untouched until the move is reported at the sender."""

    def receive(self, move: KVMove, blocks: list[int], first_block: int) -> None:
        """Called on move.receiver: fill blocks with the sender's blocks first_block,
        first_block + 1, ... (the receiver's prefix cache held the ones before). May come before the
        matching send (another process), or with no blocks (the cache held all of them): the move
        still ends at both sides."""

    def poll(self, endpoint: int) -> list[KVMoveEnded]:
        """The moves that ended at endpoint since the previous call, each once: at the sender, its
        blocks may be freed; at the receiver, its blocks hold the data. Never blocks."""

    def wait(self, endpoint: int) -> None:
        """Called by an engine with nothing to compute while moves of its own are in flight (K/V
        to receive, or sends holding the blocks it needs): returns once one of them may have ended
        there, or soon (a short sleep, or at once when the move waits for another engine of this
        process); a simulated transfer moves the endpoint's virtual clock to the earliest known end
        instead."""

    def cancel(self, move: KVMove, endpoint: int) -> None:
        """The core frees the move's blocks at endpoint before it ended there (the request was
        aborted): the plugin must not read or write them any more, nor report the move there."""

    def close(self) -> None:
        """Releases what the transfer holds (threads, process groups); called once by its owner."""
