"""The `local` KV transfer: engines in one process (on one GPU or several, or the CPU) hand a
request's blocks over by copying them from the sender's cache into the receiver's, as soon as both
sides have posted the move. On CUDA the copy is queued on the device and timed with events: a move
ends when its copy has run. Each runner must offer KVBlockStore (the real executor does; tensor
parallelism does not)."""

from dataclasses import dataclass, field
from time import perf_counter

import torch

from inferlab.core.hookspecs import hookimpl
from inferlab.core.protocols import KVBlockStore, KVMove, KVMoveEnded, OnDevice, Runner


def gpu_index(device: torch.device) -> int | None:
    """The CUDA device's index ("cuda" alone meaning the current one), None for another device."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


@dataclass
class LocalMove:
    move: KVMove
    sent: list[int] | None = None  # the sender's blocks, once sent
    received: tuple[list[int], int] | None = None  # the receiver's blocks and the first block they take
    ends: list | None = None  # (start, end) CUDA events of the copy, or None once it ran
    ended: KVMoveEnded | None = None
    waiting: set[int] = field(default_factory=set)  # endpoints it has not been reported at yet


class LocalTransfer:
    """inferlab.core.protocols.KVTransfer between the engines of this process."""

    def __init__(self):
        self.runners: dict[int, KVBlockStore] = {}
        self.moves: dict[int, LocalMove] = {}  # by request id, until reported at both endpoints

    def attach(self, endpoint: int, runner: Runner, block_size: int) -> None:
        if not isinstance(runner, KVBlockStore):
            raise TypeError(
                f"kv_transfer=local copies KV blocks between engines' caches, but replica {endpoint}'s runner "
                f"({type(runner).__name__}) cannot read or write them (KVBlockStore): use executor=real with "
                f"tensor_parallel_size=1, or kv_transfer=simulated for a simulated executor"
            )
        if endpoint in self.runners:
            raise ValueError(f"replica {endpoint} is attached to this KV transfer already")
        self.runners[endpoint] = runner

    def _entry(self, move: KVMove) -> LocalMove:
        for endpoint in (move.sender, move.receiver):
            if endpoint not in self.runners:
                raise ValueError(f"{move} names replica {endpoint}, which is not attached to this KV transfer")
        entry = self.moves.get(move.request_id)
        if entry is None:
            entry = self.moves[move.request_id] = LocalMove(move, waiting={move.sender, move.receiver})
        return entry

    def send(self, move: KVMove, blocks: list[int]) -> None:
        entry = self._entry(move)
        entry.sent = list(blocks)
        if entry.received is not None:
            self._copy(entry)

    def receive(self, move: KVMove, blocks: list[int], first_block: int) -> None:
        entry = self._entry(move)
        entry.received = (list(blocks), first_block)
        if entry.sent is not None:
            self._copy(entry)

    def _copy(self, entry: LocalMove) -> None:
        move, (blocks, first) = entry.move, entry.received
        source = entry.sent[first : first + len(blocks)]
        if len(source) < len(blocks):
            entry.ended = KVMoveEnded(
                move,
                f"the receiver asked for {len(blocks)} blocks from block {first}, the sender holds {len(entry.sent)}",
            )
            return
        sender, receiver = self.runners[move.sender], self.runners[move.receiver]
        if not blocks:
            entry.ended = KVMoveEnded(move)
            return
        started = perf_counter()
        data = sender.read_kv_blocks(source)
        on_one_gpu = (
            data.is_cuda and isinstance(receiver, OnDevice) and gpu_index(receiver.device) == gpu_index(data.device)
        )
        if on_one_gpu:  # timed on the device, ended when the copy has run there
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            receiver.write_kv_blocks(blocks, data)
            end.record()
            entry.ends = [start, end]
            entry.ended = KVMoveEnded(move, num_bytes=data.numel())
            return
        receiver.write_kv_blocks(blocks, data)
        if data.is_cuda:
            torch.cuda.synchronize(data.device)
        entry.ended = KVMoveEnded(move, seconds=perf_counter() - started, num_bytes=data.numel())

    def _finished(self, entry: LocalMove) -> KVMoveEnded | None:
        """The move's end once its copy has run (None while it runs)."""
        if entry.ends is not None:
            start, end = entry.ends
            if not end.query():
                return None
            entry.ended = KVMoveEnded(
                entry.move, seconds=start.elapsed_time(end) / 1000, num_bytes=entry.ended.num_bytes
            )
            entry.ends = None
        return entry.ended

    def poll(self, endpoint: int) -> list[KVMoveEnded]:
        out = []
        for request_id, entry in list(self.moves.items()):
            if endpoint in entry.waiting and entry.ended is not None and self._finished(entry) is not None:
                out.append(entry.ended)
                entry.waiting.discard(endpoint)
                if not entry.waiting:
                    del self.moves[request_id]
        return out

    def wait(self, endpoint: int) -> None:
        for entry in self.moves.values():
            if endpoint in entry.waiting and entry.ends is not None:
                entry.ends[1].synchronize()
                return

    def cancel(self, move: KVMove, endpoint: int) -> None:
        entry = self.moves.get(move.request_id)
        if entry is None:
            return
        entry.waiting.discard(endpoint)
        if endpoint == move.receiver and entry.ended is None:
            # the sender frees its blocks when it next polls
            entry.ended = KVMoveEnded(move, f"replica {endpoint} gave the request up before its K/V arrived")
        if not entry.waiting:
            del self.moves[move.request_id]

    def close(self) -> None:
        self.moves.clear()
        self.runners.clear()


@hookimpl
def register_kv_transfers(register):
    register("local", LocalTransfer)
