"""Tensor parallelism over processes. Rank 0, the engine's own process, runs a TensorParallelRunner;
ranks 1..N-1 are spawned worker processes, each with its own ModelRunner. Every step rank 0 sends
the step's host inputs (StepInputs) to each worker over a pipe, all ranks run the forward pass
(their collectives meet in torch.distributed: nccl on CUDA, gloo on CPU), rank 0 samples and
broadcasts its samples (the next step's placeholder tokens stand for them), then waits for every
worker's acknowledgement while watching that each one is alive. A worker that dies or raises
becomes, within seconds, a TensorParallelError naming the rank and why, and every worker is shut
down; so does one that stays silent through a step for longer than the engine's
tp_step_timeout_s (stopped, or stuck), which a watch thread finds and stops. A Ctrl-C during a
step takes effect when every rank has finished it (their collectives must meet), so the engine
stays usable; a second Ctrl-C before then stops at once and shuts the workers down, even while
rank 0 waits inside a collective with a stopped worker (InterruptWatch). No shared
memory is used, and the rendezvous port is picked free by the OS, so any number of engines can
run at once in one process."""

import datetime
import gc
import logging
import multiprocessing as mp
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from time import perf_counter

import torch
import torch.distributed as dist

from inferlab.core.batch import ScheduledBatch, StepInputs
from inferlab.core.checkpoint import Checkpoint
from inferlab.core.config import EngineConfig
from inferlab.core.cuda_graphs import GraphLimits
from inferlab.core.interrupts import DEFERRED
from inferlab.core.model_runner import ModelRunner, StepHandle, resolve_device, sleep_until
from inferlab.core.parallel import TPGroup
from inferlab.core.plugins import PluginEntry, PluginFailure, PluginRegistry

log = logging.getLogger("inferlab")

# Bounds a rank that is alive but stuck in start-up (loading weights may take minutes) and the
# collectives' own wait; in a step the watch thread bounds it by tp_step_timeout_s. A dead rank is seen at once.
TIMEOUT = datetime.timedelta(minutes=5)
FAILURE_GRACE_S = 3.0  # after a failure, how long rank 0 waits for the other ranks to report theirs
FAILURE_SETTLE_S = 0.3  # once one rank has failed, how long to wait for the reports it triggers
SHUTDOWN_GRACE_S = 5.0  # how long workers get to exit on request before they are terminated
ABORT_GRACE_S = 10.0  # how long rank 0 waits for its communicator's abort before leaving it behind
WORKER_KINDS = ("model", "attention", "sampler")  # the plugins a worker's ModelRunner builds
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
STOP = b""  # rank 0 -> worker: exit; worker -> rank 0: the step is done


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or failed; the engine's workers have been shut down."""


def make_group(backend: str, store: dist.Store, rank: int, size: int) -> dist.Backend:
    """This rank's process group, built directly on the engine's own store: not torch's default
    group, which exists once per process and would allow one engine per process."""
    name = f"inferlab-tp-{store.port}" if isinstance(store, dist.TCPStore) else "inferlab-tp"
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = TIMEOUT
        options.global_ranks_in_group = list(range(size))
        options.group_name = name
        # On a failed collective torch's default takes the whole process down, and rank 0 is the
        # user's program: only abort the communicator (unless the user chose otherwise).
        chosen = os.environ.get(NCCL_ERROR_HANDLING)
        os.environ[NCCL_ERROR_HANDLING] = chosen or "2"  # 2: CleanUpOnly, read when the group is built
        try:
            return dist.ProcessGroupNCCL(store, rank, size, options)
        finally:
            if chosen is None:
                del os.environ[NCCL_ERROR_HANDLING]
    options = dist.ProcessGroupGloo._Options()
    options._timeout = TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # all ranks share this host
    options._threads = 2
    options.global_ranks_in_group = list(range(size))
    options.group_name = name
    return dist.ProcessGroupGloo(store, rank, size, options)


def process_state(pid: int) -> str:
    """The kernel's one-letter state of a process (T: stopped), or "" where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def describe_exit(process: mp.Process) -> str:
    process.join(1.0)  # its sentinel fired: reap it to read the exit code
    code = process.exitcode
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code} without saying why"


class Workers:
    """Rank 0's handles on ranks 1..N-1: starts them, sends each step, collects acknowledgements,
    says which rank failed and why, and shuts them down (on close, on failure, when garbage
    collected and at interpreter exit)."""

    def __init__(
        self, config: EngineConfig, hf_config, model_path: str, registry: PluginRegistry, backend: str, store_port: int
    ):
        size = config.tensor_parallel_size
        entries, failures = shippable_plugins(registry)
        context = mp.get_context("spawn")  # a fresh interpreter per rank: CUDA cannot be forked
        self.processes: list[mp.Process] = []
        self.conns: list[Connection] = []
        self.watch_stops: list[Connection] = []  # wakes the NCCL watchdog when closing
        self.groups: list = []  # rank 0's process group, released after the workers stop
        self.cuda_graphs: list = []  # rank 0's CUDA graphs, destroyed before its group is aborted
        self.failures: dict[int, str] = {}  # rank -> what happened to it, once known
        self.raised: dict[int, str] = {}  # rank -> "Type: message" of the exception it reported
        self.busy_since: list[float | None] = [None]  # when the step under way began (read by the hang watch)
        self._finalizer = weakref.finalize(
            self, shutdown_workers, self.processes, self.conns, self.watch_stops, self.groups, self.cuda_graphs
        )
        try:
            for rank in range(1, size):
                ours, theirs = context.Pipe(duplex=True)
                process = context.Process(
                    target=worker_main,
                    name=f"inferlab-tp-rank{rank}",
                    args=(rank, size, backend, store_port, theirs, config, hf_config, model_path, entries, failures),
                )
                self.conns.append(ours)
                process.start()
                self.processes.append(process)
                theirs.close()
        except BaseException:
            self.close(grace=0.0)
            raise
        self.pids = [p.pid for p in self.processes]

    def send(self, step: StepInputs) -> None:
        payload = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(payload)

    def receive(self, expected: str, timeout: float = TIMEOUT.total_seconds()) -> list:
        """The `expected` message of every worker, in rank order; raises TensorParallelError as soon
        as one dies, reports an error or stays silent past the timeout."""
        pending = set(range(1, len(self.conns) + 1))
        replies: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while pending:
            handles = {}
            for rank in pending:
                handles[self.conns[rank - 1]] = handles[self.processes[rank - 1].sentinel] = rank
            ready = wait(list(handles), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                for rank in pending:
                    self.failures.setdefault(rank, self.describe_silence(rank, f"sent no {expected!r}", timeout))
                raise TensorParallelError(self.failures[min(pending)])
            for rank in {handles[h] for h in ready}:
                kind, value = self._read(rank)  # a dead worker's pipe reads as EOF, after anything it sent
                if kind != expected:
                    raise TensorParallelError(
                        self.failures.get(rank, f"rank {rank} sent {kind!r}, expected {expected!r}")
                    )
                replies[rank] = value
                pending.discard(rank)
        return [replies[rank] for rank in range(1, len(self.conns) + 1)]

    def _read(self, rank: int) -> tuple[str, object]:
        """One message from a worker; a reported error or a death is recorded in self.failures."""
        conn, process = self.conns[rank - 1], self.processes[rank - 1]
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            self.failures.setdefault(rank, f"rank {rank} (pid {process.pid}) {describe_exit(process)}")
            return "died", None
        if data == STOP:
            return "ack", None
        kind, value = pickle.loads(data)
        if kind == "error":
            summary, trace = value
            self.raised[rank] = summary
            self.failures[rank] = (
                f"rank {rank} (pid {process.pid}) raised {summary}\n--- rank {rank} traceback ---\n{trace}"
            )
        return kind, value

    def describe_silence(self, rank: int, what: str, seconds: float) -> str:
        pid = self.processes[rank - 1].pid
        state = "it is stopped (SIGSTOP?)" if process_state(pid) in ("T", "t") else "it is alive but stuck"
        return f"rank {rank} (pid {pid}) {what} within {seconds:g} s: {state}"

    def start_interrupt_watch(self) -> "InterruptWatch":
        return InterruptWatch(self.processes, self.failures, self.busy_since, self.watch_stops)

    def start_hang_watch(self, timeout: float) -> None:
        """A thread that, once a step has run `timeout` seconds, records which ranks are silent and
        kills them: rank 0, blocked in a collective with them, then fails at once and reports them.
        It holds no reference to self, which the garbage collector must be able to finalize."""
        stop_reader, stop_writer = mp.Pipe(duplex=False)
        self.watch_stops.append(stop_writer)
        threading.Thread(
            target=watch_for_hangs,
            name="inferlab-tp-hang-watch",
            daemon=True,
            args=(self.processes, self.conns, self.failures, self.busy_since, timeout, stop_reader),
        ).start()

    def collect_failures(self, grace: float) -> dict[int, str]:
        """Every failure known within `grace` seconds: each worker's own report, or how it died.
        Stops once all have failed, or FAILURE_SETTLE_S after the first failure (for those it causes)."""
        deadline = time.monotonic() + grace
        settled = False
        while True:
            for rank, conn in enumerate(self.conns, 1):
                while rank not in self.failures and conn.poll():
                    self._read(rank)
            if self.failures and not settled:
                deadline, settled = min(deadline, time.monotonic() + FAILURE_SETTLE_S), True
            healthy = [rank for rank in range(1, len(self.conns) + 1) if rank not in self.failures]
            remaining = deadline - time.monotonic()
            if not healthy or remaining <= 0:
                return dict(sorted(self.failures.items()))
            wait([self.conns[rank - 1] for rank in healthy], timeout=remaining)

    def fail(self, error: BaseException) -> BaseException:
        """Shuts the workers down after `error` interrupted rank 0, and returns what to raise: the
        workers' failures when a rank failed, else rank 0's own error."""
        grace = FAILURE_GRACE_S if isinstance(error, Exception) else 0.0  # Ctrl-C: no waiting
        failures = self.collect_failures(grace)
        self.close(grace=0.0)
        own = f"{type(error).__name__}: {error}"
        if not failures or (len(self.raised) == len(failures) and set(self.raised.values()) == {own}):
            return error  # rank 0's own error, or one every rank hit alike (a bad setting, say)
        return TensorParallelError(
            "tensor-parallel " + "; ".join(failures.values()).rstrip() + "\n(the engine's workers are shut down)"
        )

    def check_alive(self) -> None:
        dead = wait([p.sentinel for p in self.processes], timeout=0)
        if dead:
            raise TensorParallelError(f"{len(dead)} tensor-parallel worker(s) died")

    def start_watchdog(self, group) -> None:
        """On CUDA: aborts the NCCL communicator as soon as a worker dies (see watch_for_deaths)."""
        stop_reader, stop_writer = mp.Pipe(duplex=False)
        self.watch_stops.append(stop_writer)
        threading.Thread(
            target=watch_for_deaths,
            name="inferlab-tp-watchdog",
            daemon=True,
            args=([p.sentinel for p in self.processes], stop_reader, group),
        ).start()

    def close(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        """Stops the workers (asks, then terminates, then kills); safe to call twice."""
        found = self._finalizer.detach()
        if found:
            _, function, args, _ = found
            function(*args, grace=grace)


def shutdown_workers(
    processes: list[mp.Process],
    conns: list[Connection],
    watch_stops: list[Connection],
    groups: list,
    cuda_graphs: list,
    grace: float = SHUTDOWN_GRACE_S,
) -> None:
    for stop in watch_stops:  # the deaths that follow are expected
        stop.close()
    for conn in conns:
        try:
            conn.send_bytes(STOP)
        except (OSError, ValueError):
            pass  # already gone
    deadline = time.monotonic() + grace
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()  # SIGTERM also ends a rank blocked inside a collective
    for process in processes:
        process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()
    for graphs in cuda_graphs:  # NCCL's abort waits until no graph holds the communicator's collectives
        graphs.release()
    cuda_graphs.clear()
    for group in groups:  # its peers are gone: abort rather than finalize (which would wait for them)
        abort_group(group)


def abort_group(group) -> None:
    """Aborts rank 0's communicator in a thread and waits at most ABORT_GRACE_S: an abort that
    cannot finish (a CUDA graph that captured its collectives still alive) must not hang the
    user's program; it is logged and left behind."""

    def abort():
        try:
            group.abort()
        except RuntimeError as e:
            log.warning("releasing the tensor-parallel group failed: %s", e)

    thread = threading.Thread(target=abort, name="inferlab-tp-abort", daemon=True)
    thread.start()
    thread.join(ABORT_GRACE_S)
    if thread.is_alive():
        log.warning("the tensor-parallel group's abort did not finish within %g s; leaving it behind", ABORT_GRACE_S)


def watch_for_hangs(
    processes: list[mp.Process],
    conns: list[Connection],
    failures: dict[int, str],
    busy_since: list[float | None],
    timeout: float,
    stop: Connection,
) -> None:
    """Wakes a few times per timeout; a step under way for longer than `timeout` has ranks that
    never answered: those stopped (SIGSTOP) if any are, else every one without an acknowledgement
    waiting in its pipe. Each is named in `failures` and killed."""
    while not wait([stop], timeout=min(1.0, timeout / 4)):
        since = busy_since[0]
        if since is None or time.monotonic() - since < timeout:
            continue
        states = {rank: process_state(process.pid) for rank, process in enumerate(processes, 1)}
        try:
            silent = [rank for rank, conn in enumerate(conns, 1) if states[rank] not in ("", "Z") and not conn.poll()]
        except (OSError, ValueError):
            return  # the workers are being shut down
        stopped = [rank for rank in silent if states[rank] in ("T", "t")]
        for rank in stopped or silent:
            pid = processes[rank - 1].pid
            how = "it is stopped (SIGSTOP?)" if rank in stopped else "it is alive but stuck"
            failures.setdefault(
                rank, f"rank {rank} (pid {pid}) did not finish a step within tp_step_timeout_s={timeout:g} s: {how}"
            )
            log.warning("tensor-parallel %s; killing it", failures[rank])
            processes[rank - 1].kill()
        busy_since[0] = None  # once per step
    stop.close()


class InterruptWatch:
    """A second Ctrl-C during a step that stops at once, also while rank 0's main thread waits
    inside a collective (a worker stopped with SIGSTOP, say), where Python runs no signal handler
    until the collective returns. While a step runs in the main thread, the interpreter's C-level
    handler also writes each signal's number to a pipe (signal.set_wakeup_fd) that a thread reads;
    at the second SIGINT of one step it kills the workers, so that the collective fails now and
    the Ctrl-C is raised. The wakeup fd in place before is put back after each step, and gets the
    bytes meanwhile."""

    def __init__(self, processes, failures: dict[int, str], busy_since: list[float | None], stops: list):
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        stop_reader, stop_writer = mp.Pipe(duplex=False)
        stops.append(stop_writer)  # closed when the workers shut down: the thread then ends
        self.previous: list[int] = [-1]  # the wakeup fd a step's watch replaced
        threading.Thread(
            target=watch_for_interrupts,
            name="inferlab-tp-interrupt-watch",
            daemon=True,
            args=(self.read_fd, self.write_fd, stop_reader, processes, failures, busy_since, self.previous),
        ).start()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous[0] = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)

    def __exit__(self, *exc):
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self.previous[0])
            self.previous[0] = -1


def watch_for_interrupts(
    read_fd: int, write_fd: int, stop: Connection, processes, failures, busy_since, previous
) -> None:
    counted_step, count = None, 0
    while True:
        ready, _, _ = select.select([read_fd, stop], [], [])
        if stop in ready:
            os.close(read_fd)
            os.close(write_fd)
            return
        data = os.read(read_fd, 512)
        if previous[0] != -1:
            try:
                os.write(previous[0], data)
            except OSError:
                pass
        step = busy_since[0]
        if step is None:
            continue
        if step != counted_step:
            counted_step, count = step, 0
        count += data.count(signal.SIGINT)
        if count >= 2:
            for rank, process in enumerate(processes, 1):
                failures.setdefault(
                    rank, f"rank {rank} (pid {process.pid}) was stopped by a second Ctrl-C during a step"
                )
                process.kill()
            counted_step, count = None, 0


def watch_for_deaths(sentinels: list[int], stop: Connection, group) -> None:
    """On CUDA rank 0 waits for a step on the GPU, where a collective with a dead peer spins until
    the NCCL timeout: abort the communicator as soon as a worker dies, so the step fails now."""
    ready = wait([*sentinels, stop])
    if stop in ready:
        return
    log.warning("a tensor-parallel worker died: aborting the NCCL communicator")
    try:
        group.abort()
    except RuntimeError as e:
        log.warning("aborting the NCCL communicator failed: %s", e)


class TensorParallelRunner:
    """Rank 0's runner: holds rank 0's ModelRunner (model_runner) and drives ranks 1..N-1 in
    worker processes. The engine uses it as it uses a ModelRunner (launch, and the settings it
    copies from rank 0's); close() (or the engine's) stops the workers. After a failure or close()
    it refuses to run steps: its ranks may be out of step."""

    clock = staticmethod(perf_counter)
    wait_until = staticmethod(sleep_until)

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, registry: PluginRegistry):
        self.checkpoint = checkpoint
        hf_config, model_path = checkpoint.hf_config, checkpoint.path
        size = config.tensor_parallel_size
        check_heads_divide(hf_config, size)
        device = resolve_device(config.device)
        if device.type == "cuda":
            if device.index is not None:
                raise ValueError(
                    f"device {config.device!r} names one GPU, but tensor parallelism puts rank r on "
                    f"cuda:r; give device='cuda' or 'auto'"
                )
            if torch.cuda.device_count() < size:
                raise ValueError(
                    f"tensor_parallel_size={size} needs {size} GPUs, but {torch.cuda.device_count()} are visible"
                )
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.step_timeout = config.tp_step_timeout_s
        # port 0: the OS picks a free one, so engines started side by side never collide
        self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        self.closed_because: str | None = None
        self.workers = Workers(config, hf_config, model_path, registry, backend, self.store.port)
        try:
            self.workers.receive("started")
            self.group = self._join_group(backend, size)
            self.workers.groups.append(self.group)
            # every rank builds its runner (and runs its warm-up) by itself, in step with the others
            self.model_runner = ModelRunner(config, checkpoint, registry, TPGroup(0, size, self.group))
            # what the engine and the bench read of a runner: rank 0's
            runner = self.model_runner
            self.device, self.dtype, self.kv_cache_dtype = runner.device, runner.dtype, runner.kv_cache_dtype
            self.runs_ahead = runner.runs_ahead
            self.block_size, self.num_kv_blocks = runner.block_size, runner.num_kv_blocks
            self.backend, self.decode_graphs = runner.backend, runner.decode_graphs
            self.prefill_graphs = runner.prefill_graphs
            for graphs in (self.decode_graphs, self.prefill_graphs):
                if graphs is not None:
                    self.workers.cuda_graphs.append(graphs)
            counts = self.workers.receive("ready")
            if any(count != self.num_kv_blocks for count in counts):  # the ranks agreed on a minimum
                raise RuntimeError(f"the ranks hold different numbers of KV blocks: {[self.num_kv_blocks, *counts]}")
        except BaseException as e:
            self._fail(e, "its start-up failed")
        if backend == "nccl":
            self.workers.start_watchdog(self.group)
        self.workers.start_hang_watch(self.step_timeout)
        self.interrupt_watch = self.workers.start_interrupt_watch()
        log.info("tensor parallelism: %d ranks over %s, workers %s", size, backend, self.workers.pids)

    def _join_group(self, backend: str, size: int):
        """Builds rank 0's group in a thread while watching the workers: the rendezvous would wait out
        the whole timeout for a worker that died before joining."""
        box = {}

        def build():
            try:
                box["group"] = make_group(backend, self.store, 0, size)
            except BaseException as e:  # handed to the main thread
                box["error"] = e

        thread = threading.Thread(target=build, name="inferlab-tp-rendezvous", daemon=True)
        thread.start()
        handles = [*self.workers.conns, *(p.sentinel for p in self.workers.processes)]
        deadline = time.monotonic() + TIMEOUT.total_seconds()
        while thread.is_alive():
            if wait(handles, timeout=0.05):  # a worker failed; if it had joined, rank 0 joins at once
                thread.join(1.0)
                if thread.is_alive():
                    raise TensorParallelError("a worker failed before the ranks joined their group")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"the ranks did not join their group within {TIMEOUT}")
        if "error" in box:
            raise box["error"]
        return box["group"]

    def graph_limits(self) -> GraphLimits:
        return self.model_runner.graph_limits()

    @property
    def sampler(self):
        """Rank 0's sampler, which draws every rank's tokens (SamplesLogits)."""
        return self.model_runner.sampler

    def launch(self, batch: ScheduledBatch) -> "TensorParallelStep":
        """Sends the step to the workers, launches rank 0's part and waits for theirs to be launched.
        A Ctrl-C meanwhile is held back until every rank is done with the step (deferred): rank 0
        leaving its collectives halfway would leave the workers waiting in theirs."""
        if self.closed_because:
            raise TensorParallelError(f"this tensor-parallel engine is shut down: {self.closed_because}")
        busy_since = self.workers.busy_since
        with DEFERRED, self.interrupt_watch:
            try:
                busy_since[0] = time.monotonic()
                step = self.model_runner.prepare_inputs(batch)
                self.workers.send(step)
                handle = self.model_runner.launch(batch, step=step)
                self.workers.receive("ack", self.step_timeout)
                busy_since[0] = None
            except BaseException as e:  # a second Ctrl-C included: the ranks are out of step now
                busy_since[0] = None
                self._fail(e, f"a step raised {type(e).__name__}")
        return TensorParallelStep(handle, self)

    def _fail(self, error: BaseException, why: str):
        """Shuts the workers down and raises what explains `error` best (see Workers.fail)."""
        explained = self.workers.fail(error)
        self.closed_because = why if explained is error else str(explained).split("\n", 1)[0]
        if explained is error:
            raise error
        raise explained from (None if isinstance(error, TensorParallelError) else error)

    def close(self) -> None:
        """Stops and joins the workers and frees rank 0's own share of the model and KV cache; the
        engine cannot run steps afterwards."""
        self.closed_because = self.closed_because or "it was closed"
        self.workers.close()
        model_runner = getattr(self, "model_runner", None)  # absent when start-up failed before it
        if model_runner is not None:
            model_runner.close()


def check_heads_divide(hf_config, size: int) -> None:
    """The usual mistake, caught before any process starts: ranks must split the attention heads
    evenly, and the KV heads too unless each rank keeps a replica of one."""
    heads = getattr(hf_config, "num_attention_heads", None)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads and heads % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {heads} attention heads; "
            f"use one of {[n for n in range(1, heads + 1) if heads % n == 0]}"
        )
    if kv_heads and kv_heads % size and size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={size} and the model's {kv_heads} KV heads must divide one another "
            f"(with fewer KV heads than ranks, each rank keeps a replica of one)"
        )


class TensorParallelStep:
    """A step launched on every rank. tokens() also makes sure every worker outlived it: on CUDA a
    dead worker's collectives are aborted rather than failed, so its death shows only here."""

    def __init__(self, handle: StepHandle, runner: TensorParallelRunner):
        self.handle, self.runner = handle, runner

    def placeholders(self) -> list[int | None]:
        return self.handle.placeholders()

    def logprobs(self):
        """Rank 0's logprobs of the step (StepHandle.logprobs)."""
        return self.handle.logprobs()

    def tokens(self) -> list[int | None]:
        """Rank 0's samples. Every rank has launched the step already, so a Ctrl-C while waiting
        for them leaves the ranks in step: the engine stays usable."""
        busy_since = self.runner.workers.busy_since
        try:
            busy_since[0] = time.monotonic()
            with self.runner.interrupt_watch:
                tokens = self.handle.tokens()
            self.runner.workers.check_alive()
            busy_since[0] = None
        except KeyboardInterrupt:
            busy_since[0] = None
            raise
        except BaseException as e:
            busy_since[0] = None
            self.runner._fail(e, f"reading a step's samples raised {type(e).__name__}")
        return tokens


def shippable_plugins(registry: PluginRegistry) -> tuple[list[PluginEntry], list[PluginFailure]]:
    """The registry's model, attention and sampler plugins, for the workers to build their runner
    from (factories travel by reference); those that cannot travel become load failures there."""
    entries, failures = [], []
    for kind in WORKER_KINDS:
        for name, entry in registry.entries[kind].items():
            try:
                pickle.dumps(entry)
            except (pickle.PicklingError, AttributeError, TypeError) as e:
                failures.append(
                    PluginFailure(
                        entry.plugin,
                        entry.distribution,
                        f"{kind} {name!r} cannot be sent to tensor-parallel workers: its factory "
                        f"must be importable by name, not local ({e})",
                    )
                )
                continue
            entries.append(entry)
    return entries, failures


def worker_registry(entries: list[PluginEntry], failures: list[PluginFailure]) -> PluginRegistry:
    registry = PluginRegistry(load_entry_points=False)
    for entry in entries:
        registry.entries[entry.kind][entry.name] = entry
    registry.failures.extend(failures)
    return registry


def exit_with_parent() -> None:
    """Ends this worker when rank 0's process dies, whatever this worker is blocked in."""
    parent = mp.parent_process()

    def watch():
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="inferlab-tp-parent-watch", daemon=True).start()


def worker_main(
    rank: int,
    size: int,
    backend: str,
    store_port: int,
    conn: Connection,
    config: EngineConfig,
    hf_config,
    model_path: str,
    entries: list[PluginEntry],
    failures: list[PluginFailure],
) -> None:
    """A worker's life: join the group, build the runner, then run every step rank 0 sends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops the workers
    exit_with_parent()
    try:
        conn.send_bytes(pickle.dumps(("started", os.getpid())))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:  # ranks share the host's cores
            torch.set_num_threads(max(1, torch.get_num_threads() // size))
        store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False, timeout=TIMEOUT)
        group = make_group(backend, store, rank, size)
        checkpoint = Checkpoint(model_path, hf_config, tokenizer=None)
        runner = ModelRunner(config, checkpoint, worker_registry(entries, failures), TPGroup(rank, size, group))
        conn.send_bytes(pickle.dumps(("ready", runner.num_kv_blocks)))
        # This process lives for one engine: its start-up objects are frozen for good, so a full
        # garbage collection in the step loop (a pause every rank would wait for) walks only what
        # came after
        gc.collect()
        gc.freeze()
        while (payload := conn.recv_bytes()) != STOP:
            runner.follow(pickle.loads(payload))
            conn.send_bytes(STOP)
    except EOFError:
        pass  # rank 0 closed its end: nothing left to do
    except BaseException as e:
        try:
            conn.send_bytes(pickle.dumps(("error", (f"{type(e).__name__}: {e}", traceback.format_exc()))))
        except OSError:
            pass
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: the group's peers may be gone already
