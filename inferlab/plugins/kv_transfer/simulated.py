"""The `simulated` KV transfer: no data moves; a move takes the time a link would, on the
endpoints' clocks (virtual under the simulated executor). A move starts once both sides have
posted it and the sender's outgoing and the receiver's incoming link are free, and takes
latency_s + bytes / bandwidth_bytes_per_s, its bytes the blocks received times a block's size
(each runner's KVBlockBytes). Links carry one move at a time each way, so moves queue behind one
another. The presets' figures and their sources: docs/disaggregation.md."""

from dataclasses import dataclass

from inferlab.core.hookspecs import hookimpl
from inferlab.core.protocols import KVBlockBytes, KVMove, KVMoveEnded, Runner

# (bytes/s one way, seconds a move's fixed cost) of one GPU's link
LINKS = {
    "nvlink": (450e9, 3e-6),  # H100/H200 SXM NVLink 4: 900 GB/s both ways together
    "infiniband": (50e9, 3e-6),  # 400 Gb/s NDR InfiniBand (ConnectX-7), one NIC per GPU
}


@dataclass
class SimulatedTransferOptions:
    link: str = "nvlink"  # a preset of LINKS: nvlink (in one node) or infiniband (across nodes)
    bandwidth_bytes_per_s: float | None = None  # None: the link's
    latency_s: float | None = None  # None: the link's
    timeout_s: float = 60.0  # a move longer than this (queueing for the link included) fails

    def __post_init__(self):
        if self.link not in LINKS:
            raise ValueError(f"kv_transfer.link must be one of {sorted(LINKS)}, got {self.link!r}")
        if self.bandwidth_bytes_per_s is not None and not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"kv_transfer.bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s!r}")
        if self.latency_s is not None and not self.latency_s >= 0:
            raise ValueError(f"kv_transfer.latency_s must be >= 0 seconds, got {self.latency_s!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"kv_transfer.timeout_s must be > 0 seconds, got {self.timeout_s!r}")


@dataclass
class SimulatedMove:
    move: KVMove
    sent_at: float | None = None  # the sender's clock when it sent
    received_at: float | None = None  # the receiver's clock when it posted the receive
    num_blocks: int = 0
    ended: KVMoveEnded | None = None
    ends_at: float | None = None  # when it ends (or fails), once both sides posted it
    waiting: tuple[int, ...] = ()  # the endpoints it has not been reported at yet


class SimulatedTransfer:
    """inferlab.core.protocols.KVTransfer whose moves take modeled time."""

    def __init__(self, link: str, bandwidth_bytes_per_s: float | None, latency_s: float | None, timeout_s: float):
        default_bandwidth, default_latency = LINKS[link]
        self.bandwidth = bandwidth_bytes_per_s or default_bandwidth
        self.latency = default_latency if latency_s is None else latency_s
        self.timeout_s = timeout_s
        self.runners: dict[int, Runner] = {}
        self.block_bytes: dict[int, int] = {}
        self.moves: dict[int, SimulatedMove] = {}  # by request id, until reported at both endpoints
        self.link_free_at: dict[tuple[int, str], float] = {}  # (endpoint, "out" or "in") -> when it is free

    def attach(self, endpoint: int, runner: Runner, block_size: int) -> None:
        if not isinstance(runner, KVBlockBytes):
            raise TypeError(
                f"kv_transfer=simulated prices a move by its bytes, but replica {endpoint}'s runner "
                f"({type(runner).__name__}) does not say a KV block's size (KVBlockBytes)"
            )
        if endpoint in self.runners:
            raise ValueError(f"replica {endpoint} is attached to this KV transfer already")
        self.runners[endpoint] = runner
        self.block_bytes[endpoint] = runner.kv_block_bytes

    def seconds(self, num_bytes: int) -> float:
        """What moving num_bytes takes on an idle link."""
        return self.latency + num_bytes / self.bandwidth

    def _entry(self, move: KVMove) -> SimulatedMove:
        for endpoint in (move.sender, move.receiver):
            if endpoint not in self.runners:
                raise ValueError(f"{move} names replica {endpoint}, which is not attached to this KV transfer")
        entry = self.moves.get(move.request_id)
        if entry is None:
            entry = self.moves[move.request_id] = SimulatedMove(move, waiting=(move.sender, move.receiver))
        return entry

    def send(self, move: KVMove, blocks: list[int]) -> None:
        entry = self._entry(move)
        entry.sent_at = self.runners[move.sender].clock()
        if entry.received_at is not None:
            self._start(entry)

    def receive(self, move: KVMove, blocks: list[int], first_block: int) -> None:
        entry = self._entry(move)
        entry.received_at = self.runners[move.receiver].clock()
        entry.num_blocks = len(blocks)
        if entry.sent_at is not None:
            self._start(entry)

    def _start(self, entry: SimulatedMove) -> None:
        move = entry.move
        out, into = (move.sender, "out"), (move.receiver, "in")
        posted = max(entry.sent_at, entry.received_at)
        start = max(posted, self.link_free_at.get(out, 0.0), self.link_free_at.get(into, 0.0))
        num_bytes = entry.num_blocks * self.block_bytes[move.receiver]
        busy_until = start + num_bytes / self.bandwidth if num_bytes else start
        self.link_free_at[out] = self.link_free_at[into] = busy_until
        ends_at = busy_until + self.latency
        if ends_at - posted > self.timeout_s:
            entry.ends_at = posted + self.timeout_s
            entry.ended = KVMoveEnded(
                move, f"timed out after {self.timeout_s} s (the link would take {ends_at - posted:.3g} s)"
            )
        else:
            entry.ends_at = ends_at
            entry.ended = KVMoveEnded(move, seconds=ends_at - posted, num_bytes=num_bytes)

    def poll(self, endpoint: int) -> list[KVMoveEnded]:
        now = self.runners[endpoint].clock() if endpoint in self.runners else 0.0
        out = []
        for request_id, entry in list(self.moves.items()):
            if endpoint in entry.waiting and entry.ends_at is not None and now >= entry.ends_at:
                out.append(entry.ended)
                entry.waiting = tuple(e for e in entry.waiting if e != endpoint)
                if not entry.waiting:
                    del self.moves[request_id]
        return out

    def wait(self, endpoint: int) -> None:
        ends = [e.ends_at for e in self.moves.values() if endpoint in e.waiting and e.ends_at is not None]
        if ends:
            self.runners[endpoint].wait_until(min(ends))

    def cancel(self, move: KVMove, endpoint: int) -> None:
        entry = self.moves.get(move.request_id)
        if entry is None:
            return
        entry.waiting = tuple(e for e in entry.waiting if e != endpoint)
        if endpoint == move.receiver and entry.ended is None:  # never started: the sender frees at once
            entry.ended = KVMoveEnded(move, f"replica {endpoint} gave the request up before its K/V arrived")
            entry.ends_at = 0.0
        if not entry.waiting:
            del self.moves[move.request_id]

    def close(self) -> None:
        self.moves.clear()


@hookimpl
def register_kv_transfers(register):
    register("simulated", SimulatedTransfer, options=SimulatedTransferOptions)
