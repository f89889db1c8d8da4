"""One request inside the engine, and the read-only view of it that scheduler policies get."""

from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from inferlab.core.blocks import BlockPrompt, block_hashes, block_identities
from inferlab.core.sampling_params import SamplingParams
from inferlab.core.text import TextStream

if TYPE_CHECKING:
    from inferlab.core.protocols import KVCacheManager, KVMove


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Token ids (prompt, then output), how far their K/V has been computed, and when things
    happened. Only the core (engine and core scheduler) changes a request; plugins read it.

    num_computed_tokens counts tokens whose K/V is in the cache, prefix-cache hits included.
    Under overlap scheduling the newest output token may be a placeholder (a negative id) until
    the step that sampled it is read back; token_times holds one host time per output token
    already known, so the known outputs are output_token_ids[:len(token_times)].

    Under prefill/decode disaggregation kv_send (on the replica that prefills it) says where its
    K/V goes once its prompt and first token are computed, and kv_receive (on the replica that
    decodes it) where its prompt's K/V comes from; the same request then continues there.
    """

    __slots__ = (
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "params",
        "priority",
        "metadata",
        "arrival_time",
        "eos_token_id",
        "max_model_len",
        "seed",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "finish_reason",
        "error",
        "first_scheduled_time",
        "token_times",
        "finish_time",
        "view",
        "leader",
        "index",
        "choices",
        "logprobs",
        "prompt_logprobs",
        "constraint",
        "stop_text",
        "reported",
        "kv_send",
        "kv_receive",
        "kv_transfer_s",
        "kv_transfer_bytes",
        "block_names",
        "block_identities",
    )

    def __init__(
        self,
        request_id: int,
        token_ids: "list[int] | BlockPrompt",
        params: SamplingParams,
        *,
        arrival_time: float = 0.0,
        priority: int = 0,
        metadata: dict[str, Any] | None = None,
        eos_token_id: int | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
    ):
        self.request_id = request_id
        # a prompt given by its blocks keeps their keys; its ids are made only where read
        self.token_ids = token_ids.token_list() if isinstance(token_ids, BlockPrompt) else list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.priority = priority
        self.metadata = dict(metadata or {})
        self.arrival_time = arrival_time
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.seed = seed  # params.seed, or one drawn for the request: its sampling noise is a function of it
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served at the latest admission
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.error: str | None = None  # why, when finish_reason is "error"
        self.first_scheduled_time: float | None = None
        self.token_times: list[float] = []
        self.finish_time: float | None = None
        self.view: RequestView | None = None  # set by the core scheduler, which knows the KV manager
        # With params.n > 1 the engine makes n requests of one prompt: choice `index` (0 for the
        # first), and the first one (`leader`, None for itself), whose prefill the others reuse.
        self.leader: Request | None = None
        self.index = 0
        self.choices: list[Request] | None = None  # the leader's: all n requests, itself first
        # With params.logprobs: per output token known, (its logprob, the top ids, their logprobs)
        self.logprobs: list[tuple[float, list[int], list[float]]] | None = None
        # With params.prompt_logprobs: the same for prompt tokens, None for the first
        self.prompt_logprobs: list[tuple[float, list[int], list[float]] | None] | None = None
        self.constraint = None  # the TokenConstraint deciding which token may come next, if any
        self.stop_text: TextStream | None = None  # its output's text, for its stop strings (made by the core scheduler)
        self.reported = False  # finished and listed for the engine to report (Scheduler.ended)
        self.kv_send: KVMove | None = None  # prefill here, then hand the K/V over to kv_send.receiver
        self.kv_receive: KVMove | None = None  # the prompt's K/V comes from kv_receive.sender
        self.kv_transfer_s: float | None = None  # how long its K/V took to move here (disaggregated)
        self.kv_transfer_bytes = 0
        self.block_names: dict[int, tuple[int, ...]] | None = None  # prompt_block_names' memo, by block size
        self.block_identities: dict[int, list] | None = None  # prompt_block_identities' memo, by block size

    def prompt_block_names(self, block_size: int) -> tuple[int, ...]:
        """The chained names (inferlab.core.blocks) of the prompt's full blocks of block_size tokens,
        computed once per block size: a router and the KV manager read the same."""
        memo = self.block_names
        if memo is None:
            memo = self.block_names = {}
        names = memo.get(block_size)
        if names is None:
            identities: list = []
            names = memo[block_size] = tuple(
                block_hashes(self.token_ids, block_size, self.num_prompt_tokens // block_size, None, identities)
            )
            if self.block_identities is None:
                self.block_identities = {}
            self.block_identities[block_size] = identities
        return names

    def prompt_block_identities(self, block_size: int) -> list:
        """The identities (inferlab.core.blocks.block_identity) of the blocks prompt_block_names
        names, made with their names: the KV manager confirms and records hits by them."""
        memo = self.block_identities
        identities = memo.get(block_size) if memo is not None else None
        if identities is None:
            if self.block_names is None or block_size not in self.block_names:
                self.prompt_block_names(block_size)
                return self.block_identities[block_size]
            # named in another process: a request travels without its identities
            identities = block_identities(self.token_ids, block_size, 0, len(self.block_names[block_size]))
            if memo is None:
                memo = self.block_identities = {}
            memo[block_size] = identities
        return identities

    def __getstate__(self) -> dict:
        # a request travels to another process (a disaggregated replica) without its view, which
        # holds this process's KV manager, and its stop-string stream, which holds its tokenizer:
        # the scheduler that queues it makes a new view, and its stream is rebuilt when first read
        # the identities, which a plain prompt's are a copy of, are made again where needed
        return {
            name: getattr(self, name)
            for name in self.__slots__
            if name not in ("view", "stop_text", "block_identities")
        }

    def __setstate__(self, state: dict) -> None:
        self.view = self.stop_text = self.block_identities = None
        for name, value in state.items():
            setattr(self, name, value)

    def __repr__(self):
        return (
            f"Request(id={self.request_id}, status={self.status.value}, tokens={len(self.token_ids)}, "
            f"computed={self.num_computed_tokens})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None


class ReadOnlyRequest:
    """What every read-only view of a request shows (a policy's RequestView, a router's
    RoutedRequest): always current, never writable."""

    __slots__ = ("_request", "_metadata")

    def __init__(self, request: Request):
        self._request = request
        self._metadata = MappingProxyType(request.metadata)

    @property
    def request_id(self) -> int:
        """Its id (what add_request returned)."""
        return self._request.request_id

    @property
    def arrival_time(self) -> float:
        return self._request.arrival_time

    @property
    def status(self) -> str:
        """'waiting', 'running' or 'finished'."""
        return self._request.status.value

    @property
    def num_prompt_tokens(self) -> int:
        return self._request.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return self._request.num_output_tokens

    @property
    def max_tokens(self) -> int:
        return self._request.params.max_tokens

    @property
    def priority(self) -> int:
        """Lower is served first (vLLM's convention); 0 unless given at submission."""
        return self._request.priority

    @property
    def metadata(self) -> MappingProxyType:
        """The free-form dict given at submission (tenant, deadline, session, ...), read-only."""
        return self._metadata


class RequestView(ReadOnlyRequest):
    """What a scheduler policy sees of a request: read-only, always current.

    num_cached_prefix_tokens asks the KV manager for a waiting request (how much of it the
    prefix cache would serve if admitted now) and reports what it served for a running one.
    """

    __slots__ = ("_kv",)

    def __init__(self, request: Request, kv: "KVCacheManager"):
        super().__init__(request)
        self._kv = kv

    def __repr__(self):
        r = self._request
        return f"RequestView(id={r.request_id}, {r.status.value}, priority={r.priority})"

    @property
    def num_computed_tokens(self) -> int:
        return self._request.num_computed_tokens

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self._request.token_ids)

    @property
    def num_cached_prefix_tokens(self) -> int:
        r = self._request
        if r.status is RequestStatus.WAITING:
            return self._kv.num_cached_prefix_tokens(r)
        return r.num_cached_tokens

    @property
    def num_preemptions(self) -> int:
        return self._request.num_preemptions
