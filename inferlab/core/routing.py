"""What a router reads: the request it routes and each replica it may choose, as read-only views
that the cluster keeps current (the router Protocol is inferlab.core.protocols.Router)."""

from collections.abc import Container
from typing import Protocol

from inferlab.core.request import ReadOnlyRequest


class RoutedRequest(ReadOnlyRequest):
    """A request as a router sees it, in route() (before any replica holds it) and in observe()
    (once it finished on its replica)."""

    __slots__ = ()

    def __repr__(self):
        r = self._request
        return f"RoutedRequest(id={r.request_id}, {r.num_prompt_tokens} prompt tokens, {r.status.value})"

    @property
    def finish_reason(self) -> str | None:
        """How it ended ("stop", "length", "abort", "error"); None until it has."""
        return self._request.finish_reason

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The prompt's token ids (for a prompt given by its blocks, made from their source: prefer
        prompt_block_hashes)."""
        return tuple(self._request.token_ids[: self._request.num_prompt_tokens])

    def cacheable_block_hashes(self, block_size: int) -> tuple[int, ...]:
        """The names of the blocks a prefix cache could serve: those before the prompt's last token
        (which is always computed, for its logits)."""
        return self.prompt_block_hashes(block_size)[: (self.num_prompt_tokens - 1) // block_size]

    def prompt_block_hashes(self, block_size: int) -> tuple[int, ...]:
        """The chained names (inferlab.core.blocks) of the prompt's full blocks of block_size
        tokens: two prompts share their first k names exactly when they share their first k
        blocks. Computed once per block size."""
        return self._request.prompt_block_names(block_size)


def cached_prefix_from_names(request: RoutedRequest, block_size: int, cached: Container[int]) -> int:
    """Leading prompt tokens whose blocks all have their names in cached: a replica's prefix cache
    known by the names of the blocks it holds (as its KV-cache events tell a router)."""
    hits = 0
    for name in request.cacheable_block_hashes(block_size):
        if name not in cached:
            break
        hits += 1
    return hits * block_size


class ReplicaState(Protocol):
    """What a ReplicaView reads: the cluster's record of one replica (in-process, or what its Ray
    actor reported with its latest step)."""

    replica_id: int
    role: str | None
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_blocks: int
    block_size: int
    num_queued_prompt_tokens: int
    num_outstanding_tokens: int

    def cached_prefix_tokens(self, request: "RoutedRequest") -> int:
        """Leading prompt tokens of the request its prefix cache holds now (the last one never)."""


class ReplicaView:
    """A replica as a router sees it: read-only, current as of its latest step.

    - replica_id: its index in the cluster, 0..replicas-1;
    - role: "prefill" or "decode" in a disaggregated cluster (docs/disaggregation.md), else None;
    - num_waiting, num_running: its engine's queues;
    - num_free_blocks, num_blocks, block_size: its KV cache (free counts cached blocks no request holds);
    - num_queued_prompt_tokens: tokens queued but not yet computed (whole waiting requests, what
      remains of running prefills);
    - num_outstanding_tokens: those plus the output tokens its requests may still generate (up to
      their max_tokens);
    - cached_prefix_tokens(request): how many leading tokens of request's prompt its prefix cache
      holds now (a multiple of block_size; the prompt's last token is never counted, as it is
      always computed).
    """

    __slots__ = ("_replica",)

    def __init__(self, replica: ReplicaState):
        self._replica = replica

    def __repr__(self):
        r = self._replica
        return f"ReplicaView({r.replica_id}, waiting={r.num_waiting}, running={r.num_running})"

    @property
    def replica_id(self) -> int:
        return self._replica.replica_id

    @property
    def role(self) -> str | None:
        return self._replica.role

    @property
    def num_waiting(self) -> int:
        return self._replica.num_waiting

    @property
    def num_running(self) -> int:
        return self._replica.num_running

    @property
    def num_free_blocks(self) -> int:
        return self._replica.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self._replica.num_blocks

    @property
    def block_size(self) -> int:
        return self._replica.block_size

    @property
    def num_queued_prompt_tokens(self) -> int:
        return self._replica.num_queued_prompt_tokens

    @property
    def num_outstanding_tokens(self) -> int:
        return self._replica.num_outstanding_tokens

    def cached_prefix_tokens(self, request: RoutedRequest) -> int:
        if not isinstance(request, RoutedRequest):
            raise TypeError(f"cached_prefix_tokens takes the RoutedRequest being routed, got {type(request).__name__}")
        return self._replica.cached_prefix_tokens(request)


def decode_replica_by_room(request: RoutedRequest, replicas: tuple[ReplicaView, ...]) -> ReplicaView:
    """The decode replica for a request by KV room and load, the built-in routers' pairing: of those
    whose free blocks hold its prompt and first token beyond what their queues will take, the one
    with the fewest outstanding tokens; when none has that room, the one with the most (ties: the
    lowest replica_id)."""

    def room(replica: ReplicaView) -> int:  # tokens its cache can take beyond what it has queued
        return replica.num_free_blocks * replica.block_size - replica.num_queued_prompt_tokens

    fits = [r for r in replicas if room(r) > request.num_prompt_tokens]
    if fits:
        return min(fits, key=lambda r: (r.num_outstanding_tokens, r.replica_id))
    return max(replicas, key=lambda r: (room(r), -r.replica_id))
