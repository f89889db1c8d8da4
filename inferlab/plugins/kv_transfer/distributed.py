"""The `distributed` KV transfer: engines in separate processes, on one machine or many, move a
request's blocks with torch.distributed point-to-point sends (NCCL between GPUs, gloo on CPU). One
engine per process, each an endpoint whose id is its rank; every endpoint attaches with the same
address and world_size, and endpoint 0 serves the rendezvous store there.

The receiver pulls: once it has allocated blocks it posts its receives and asks the sender, through
the store, for move k of their pair; the sender answers the asks of each receiver in order, so the
two sides' point-to-point operations pair up in the same order (NCCL matches them by order alone).
An answer is a header (whether the sender holds the blocks, how many) and the blocks; a move the
sender cannot serve (it never sent it: a replica sends before it hands the request over, so before
any ask) still sends both, marked failed, so later moves stay paired. Each pair and
direction has a thread that waits for its operations in order. An endpoint either sends or receives
over a pair, never both (a prefill replica sends, a decode replica receives)."""

import datetime
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from time import perf_counter

import torch
import torch.distributed as dist

from inferlab.core.hookspecs import hookimpl
from inferlab.core.protocols import KVBlockStore, KVMove, KVMoveEnded, OnDevice, Runner

POLL_S = 0.0005  # how long a thread sleeps between looks at a pending operation
ASK_POLL_S = 0.001  # between looks at the store for a receiver's next ask (a round trip each)


@dataclass
class DistributedTransferOptions:
    address: str = "127.0.0.1:29600"  # host:port of the rendezvous store, served by endpoint 0
    world_size: int = 2  # endpoints (processes) in all
    backend: str = "auto"  # nccl or gloo; auto: nccl for GPU runners, gloo for CPU ones
    timeout_s: float = 60.0  # a move not done this long after its receive started fails

    def __post_init__(self):
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"kv_transfer.address must be host:port, got {self.address!r}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 2:
            raise ValueError(f"kv_transfer.world_size must be a whole number >= 2, got {self.world_size!r}")
        if self.backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"kv_transfer.backend must be one of auto, nccl, gloo; got {self.backend!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"kv_transfer.timeout_s must be > 0 seconds, got {self.timeout_s!r}")


@dataclass
class Receive:
    move: KVMove
    blocks: list[int]
    header: torch.Tensor
    data: torch.Tensor | None
    works: list
    started: float
    arrived: bool = False
    error: str | None = None


@dataclass
class Send:
    move: KVMove
    blocks: list[int]
    cancelled: bool = False


@dataclass
class Channel:
    """The operations of one pair and direction, waited for in order by one thread."""

    peer: int
    queue: deque = field(default_factory=deque)
    thread: threading.Thread | None = None
    next_seq: int = 0  # the next ask: sent (receiving side) or answered (sending side)


class DistributedTransfer:
    """inferlab.core.protocols.KVTransfer over torch.distributed, one endpoint per process."""

    def __init__(self, address: str, world_size: int, backend: str, timeout_s: float):
        host, _, port = address.rpartition(":")
        self.host, self.port = host, int(port)
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.rank: int | None = None
        self.runner: KVBlockStore | None = None
        self.lock = threading.Condition()
        self.closing = threading.Event()
        self.sends: dict[int, Send] = {}  # by request id, until answered
        self.receives: dict[int, Receive] = {}  # by request id, until reported
        self.ended: list[KVMoveEnded] = []  # sends that ended, for poll
        self.send_channels: dict[int, Channel] = {}
        self.receive_channels: dict[int, Channel] = {}

    # -- set-up -------------------------------------------------------------------------------

    def attach(self, endpoint: int, runner: Runner, block_size: int) -> None:
        if self.rank is not None:
            raise ValueError(
                f"kv_transfer=distributed serves one engine a process (this one is replica {self.rank}); "
                f"engines in one process use kv_transfer=local"
            )
        if not isinstance(runner, KVBlockStore):
            raise TypeError(
                f"kv_transfer=distributed moves KV blocks between engines' caches, but replica {endpoint}'s runner "
                f"({type(runner).__name__}) cannot read or write them (KVBlockStore): use executor=real with "
                f"tensor_parallel_size=1"
            )
        if not 0 <= endpoint < self.world_size:
            raise ValueError(f"replica {endpoint} is outside kv_transfer.world_size={self.world_size}")
        self.device = runner.device if isinstance(runner, OnDevice) else torch.device("cpu")
        backend = self.backend if self.backend != "auto" else ("nccl" if self.device.type == "cuda" else "gloo")
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.store = dist.TCPStore(self.host, self.port, self.world_size, endpoint == 0, timeout=timeout)
        # the group's own operations wait longer than a move may take: the move fails first, at poll
        group_timeout = datetime.timedelta(seconds=4 * self.timeout_s + 60)
        self.group = make_group(
            backend, dist.PrefixStore("inferlab-kv", self.store), endpoint, self.world_size, group_timeout, self.host
        )
        self.nccl = backend == "nccl"
        self.rank, self.runner = endpoint, runner

    # -- the receiving side -------------------------------------------------------------------

    def receive(self, move: KVMove, blocks: list[int], first_block: int) -> None:
        self._check(move, move.receiver)
        header = torch.empty(2, dtype=torch.long, device=self.device)
        works = [self.group.recv([header], move.sender, 0)]
        data = None
        if blocks:
            data = self.runner.empty_kv_blocks(len(blocks))
            works.append(self.group.recv([data], move.sender, 0))
        entry = Receive(move, list(blocks), header, data, works, perf_counter())
        channel = self._channel(self.receive_channels, move.sender, self._await_receives)
        with self.lock:
            self.receives[move.request_id] = entry
            seq = channel.next_seq
            channel.next_seq += 1
            channel.queue.append(entry)
            self.lock.notify_all()
        self.store.set(ask_key(move.sender, self.rank, seq), f"{move.request_id} {first_block} {len(blocks)}")

    def _await_receives(self, channel: Channel) -> None:
        """The thread of one sender's moves to this endpoint: waits for each in order."""
        while True:
            entry = self._next(channel)
            if entry is None:
                return
            try:
                self._wait(entry.works[0])
                status, _ = entry.header.tolist()
                for work in entry.works[1:]:
                    self._wait(work)
                error = None if status == 1 else f"replica {entry.move.sender} no longer held the blocks"
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
            with self.lock:
                entry.error, entry.arrived = error, True

    # -- the sending side ---------------------------------------------------------------------

    def send(self, move: KVMove, blocks: list[int]) -> None:
        self._check(move, move.sender)
        self._channel(self.send_channels, move.receiver, self._answer_asks)
        with self.lock:
            self.sends[move.request_id] = Send(move, list(blocks))
            self.lock.notify_all()

    def _answer_asks(self, channel: Channel) -> None:
        """The thread of this endpoint's moves to one receiver: answers its asks in order."""
        receiver = channel.peer
        while not self.closing.is_set():
            key = ask_key(self.rank, receiver, channel.next_seq)
            if not self.store.check([key]):  # not asked yet
                time.sleep(ASK_POLL_S)
                continue
            request_id, first, num_blocks = map(int, self.store.get(key).decode().split())
            self.store.delete_key(key)
            channel.next_seq += 1
            started = perf_counter()
            with self.lock:  # the sender sent before its replica handed the request over, so before this ask
                entry = self.sends.pop(request_id, None)
            ok = entry is not None and not entry.cancelled and first + num_blocks <= len(entry.blocks)
            header = torch.tensor([1 if ok else 0, num_blocks], dtype=torch.long, device=self.device)
            works, data = [self.group.send([header], receiver, 0)], None
            if num_blocks:
                if ok:
                    data = self.runner.read_kv_blocks(entry.blocks[first : first + num_blocks])
                else:
                    data = self.runner.empty_kv_blocks(num_blocks)
                works.append(self.group.send([data], receiver, 0))
            error = None if ok else "it asked for blocks this replica does not hold"
            try:
                for work in works:
                    self._wait(work)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
            if entry is not None:
                num_bytes = data.numel() if ok and data is not None else 0
                with self.lock:
                    self.ended.append(KVMoveEnded(entry.move, error, perf_counter() - started, num_bytes))

    # -- both sides ---------------------------------------------------------------------------

    def poll(self, endpoint: int) -> list[KVMoveEnded]:
        if endpoint != self.rank:
            return []
        now = perf_counter()
        arrived = []
        with self.lock:
            out, self.ended = self.ended, []
            for request_id, entry in list(self.receives.items()):
                if entry.arrived and entry.error is None:
                    arrived.append(self.receives.pop(request_id))
                elif entry.arrived or now - entry.started > self.timeout_s:
                    # its channel's thread still waits for it, so that later moves stay paired
                    del self.receives[request_id]
                    error = entry.error or f"timed out after {self.timeout_s} s"
                    out.append(KVMoveEnded(entry.move, error, now - entry.started))
        for entry in arrived:  # into the cache on the engine's thread, ordered before its next step
            num_bytes = 0
            if entry.data is not None:
                self.runner.write_kv_blocks(entry.blocks, entry.data)
                num_bytes = entry.data.numel()
            out.append(KVMoveEnded(entry.move, None, perf_counter() - entry.started, num_bytes))
        return out

    def wait(self, endpoint: int) -> None:
        time.sleep(POLL_S)

    def cancel(self, move: KVMove, endpoint: int) -> None:
        with self.lock:
            if endpoint == move.receiver:
                self.receives.pop(move.request_id, None)  # its channel's thread still waits for it
                # Told in the sender's process (a cluster whose decode replica refused the request,
                # died, or dropped it before asking): no ask will come, so the send ends here now.
                send = self.sends.pop(move.request_id, None) if self.rank == move.sender else None
                if send is not None:
                    self.ended.append(KVMoveEnded(move, f"replica {move.receiver} cancelled the move"))
            elif move.request_id in self.sends:
                self.sends[move.request_id].cancelled = True

    def close(self) -> None:
        self.closing.set()
        with self.lock:
            self.lock.notify_all()
        for channel in (*self.send_channels.values(), *self.receive_channels.values()):
            if channel.thread is not None:
                channel.thread.join(timeout=2)
        if self.rank is not None and self.nccl:
            self.group.shutdown()  # its communicators' resources, now rather than at exit
        self.group = None

    # -- plumbing -----------------------------------------------------------------------------

    def _check(self, move: KVMove, endpoint: int) -> None:
        if self.rank is None:
            raise RuntimeError("kv_transfer=distributed: no engine is attached in this process")
        if endpoint != self.rank:
            raise ValueError(f"{move} does not start or end at this process's replica {self.rank}")

    def _channel(self, channels: dict[int, Channel], peer: int, loop) -> Channel:
        channel = channels.get(peer)
        if channel is None:
            channel = channels[peer] = Channel(peer)
            channel.thread = threading.Thread(
                target=self._run, args=(loop, channel), name=f"inferlab-kv-{self.rank}-{peer}", daemon=True
            )
            channel.thread.start()
        return channel

    def _run(self, loop, channel: Channel) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        loop(channel)

    def _next(self, channel: Channel):
        """The channel's next queued entry (None once closing)."""
        with self.lock:
            while not channel.queue and not self.closing.is_set():
                self.lock.wait(timeout=0.1)
            return channel.queue.popleft() if channel.queue else None

    def _wait(self, work) -> None:
        """Until a point-to-point operation is done: gloo's wait blocks until it is; NCCL's only
        orders the stream, so its completion is polled."""
        if not self.nccl:
            work.wait()
            return
        while not work.is_completed():
            if self.closing.is_set():
                raise RuntimeError("the transfer closed")
            time.sleep(POLL_S)
        work.wait()


def ask_key(sender: int, receiver: int, seq: int) -> str:
    return f"ask/{sender}/{receiver}/{seq}"


def make_group(backend: str, store, rank: int, size: int, timeout: datetime.timedelta, host: str):
    """A process group of the transfer's own, on its store: not torch's default group, which the
    engine's tensor parallelism or the user's program may hold."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    local = host in ("127.0.0.1", "localhost")
    device = (
        dist.ProcessGroupGloo.create_device(hostname=host) if local else dist.ProcessGroupGloo.create_default_device()
    )
    options._devices = [device]
    return dist.ProcessGroupGloo(store, rank, size, options)


@hookimpl
def register_kv_transfers(register):
    register("distributed", DistributedTransfer, options=DistributedTransferOptions)
