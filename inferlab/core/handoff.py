"""An engine's side of prefill/decode disaggregation: it starts the moves of KV blocks through the
kv_transfer plugin and applies what the plugin reports to the core scheduler's books.

On the replica that prefills a request (request.kv_send set) the scheduler hands it off after its
first token and holds its blocks; the handoff sends them and frees them once the move is reported
there. On the replica that decodes it (request.kv_receive set) the scheduler admits it by
allocating blocks for its prompt; the handoff receives into them, then the request decodes on, or,
when the move failed, it ends with an error result naming both replicas, its blocks freed.
"""

import logging
from collections.abc import Callable

from inferlab.core.protocols import KVCacheManager, KVMove, KVTransfer
from inferlab.core.request import Request
from inferlab.core.scheduler import Scheduler

log = logging.getLogger(__name__)


class KVHandoff:
    def __init__(self, transfer: KVTransfer, endpoint: int, scheduler: Scheduler, kv: KVCacheManager, stats: Callable):
        self.transfer = transfer
        self.endpoint = endpoint
        self.scheduler = scheduler
        self.kv = kv
        self.engine_stats = stats  # the engine's EngineStats, which a bench may replace
        self.receives: set[int] = set()  # the receiving requests whose receive has started (ids)

    def check(self, request: Request) -> None:
        """Raises ValueError when a request's moves do not start or end at this engine."""
        send, receive = request.kv_send, request.kv_receive
        if send is not None and receive is not None:
            raise ValueError(f"request {request.request_id} both sends and receives its K/V; give one of the two")
        if send is not None and send.sender != self.endpoint:
            raise ValueError(
                f"request {request.request_id} is to send its K/V from replica {send.sender}, not from this engine "
                f"(replica {self.endpoint})"
            )
        if receive is not None and receive.receiver != self.endpoint:
            raise ValueError(
                f"request {request.request_id} is to receive its K/V on replica {receive.receiver}, not on this "
                f"engine (replica {self.endpoint})"
            )
        move = send or receive
        if move is not None and request.params.n > 1:
            raise ValueError(
                f"request {request.request_id} asks for n={request.params.n} choices, which share its prefill on one "
                f"engine: a request whose K/V moves between replicas takes n=1"
            )
        if move is not None and (move.sender == move.receiver or move.request_id != request.request_id):
            raise ValueError(f"request {request.request_id}: {move} must move that request's K/V between two replicas")

    def start_receives(self) -> None:
        """Starts receiving into the blocks of the receiving requests admitted since the last call;
        one whose receive cannot start ends with an error (listed in the scheduler's `ended`)."""
        scheduler, bs = self.scheduler, self.kv.block_size
        self.receives &= scheduler.receiving.keys()  # those that ended since
        for request in [r for i, r in scheduler.receiving.items() if i not in self.receives]:
            move = request.kv_receive
            self.receives.add(request.request_id)
            table = self.kv.block_table(request)
            first = request.num_cached_tokens // bs
            try:
                self.transfer.receive(move, list(table[first : -(-request.num_prompt_tokens // bs)]), first)
            except Exception as e:  # a plugin's fault fails this request alone
                self._fail(request, move, f"receive raised {type(e).__name__}: {e}")
                try:  # so that the sender frees its blocks
                    self.transfer.cancel(move, self.endpoint)
                except Exception:
                    log.warning("cancelling the failed receive of request %d raised", move.request_id, exc_info=True)

    def start_sends(self) -> None:
        """Sends the blocks of the requests handed off since the last call; a send that cannot
        start frees them and turns the handoff into an error result here."""
        scheduler = self.scheduler
        while scheduler.handed_off:
            request = scheduler.handed_off[0]
            scheduler.handed_off = scheduler.handed_off[1:]
            move = request.kv_send
            try:
                self.transfer.send(move, list(self.kv.block_table(request)))
            except Exception as e:
                request.finish_reason = "error"
                request.error = self.why(move, f"send raised {type(e).__name__}: {e}")
                self.engine_stats().num_failed_kv_transfers += 1
                scheduler.release_sent(request.request_id)

    def poll(self) -> None:
        """Applies the moves that ended here: a sender frees their blocks; a receiver decodes on or
        fails the request (listed in the scheduler's `ended`)."""
        scheduler, stats = self.scheduler, self.engine_stats()
        for ended in self.transfer.poll(self.endpoint):
            request_id = ended.move.request_id
            request = scheduler.receiving.get(request_id)
            if request is not None:
                if ended.error is None:
                    request.kv_transfer_s = ended.seconds
                    request.kv_transfer_bytes = ended.num_bytes
                    try:
                        scheduler.received(request)
                    except Exception as e:  # the KV manager's commit: this request's fault alone
                        self._fail(request, ended.move, f"registering its blocks raised {type(e).__name__}: {e}")
                        continue
                    stats.kv_bytes_received += ended.num_bytes
                else:
                    self._fail(request, ended.move, ended.error)
            elif request_id in scheduler.sending:
                scheduler.release_sent(request_id)
                if ended.error is None:
                    stats.kv_bytes_sent += ended.num_bytes
                else:
                    stats.num_failed_kv_transfers += 1

    def cancel(self, request: Request) -> None:
        """Before a receiving request is aborted: the plugin stops writing into its blocks (and
        tells the sender, which frees its own)."""
        if request.request_id in self.scheduler.receiving:
            try:
                self.transfer.cancel(request.kv_receive, self.endpoint)
            except Exception:  # the abort goes on: its blocks are freed here whatever the plugin says
                log.warning("cancelling the receive of request %d raised", request.request_id, exc_info=True)

    def wait(self) -> None:
        """Nothing to compute but receives in flight: until one may have ended."""
        self.transfer.wait(self.endpoint)

    def _fail(self, request: Request, move: KVMove, why: str) -> None:
        request.error = self.why(move, why)
        self.scheduler.finish(request, "error")
        self.engine_stats().num_failed_kv_transfers += 1

    @staticmethod
    def why(move: KVMove, reason: str) -> str:
        return (
            f"the KV transfer of request {move.request_id} from replica {move.sender} to replica {move.receiver} "
            f"failed: {reason}"
        )
