"""Replicas in this process: each an LLMEngine, stepped by the cluster's own loop (no threads).

On the host's clock the busy replica that stepped least recently steps next, so replicas take
turns. On virtual clocks (a simulated fleet) each replica's clock is its own and the one whose
next step starts earliest steps next: a heap of (start time, replica), in which only replicas with
work have an entry. A step is one event at its start; a replica on a GPU shared with others
(simulated) steps at the end of the step whose tokens it reads next, where that is later
(inferlab.sim.shared_gpu), and what reaches it between its clock and then waits for the step.

Disaggregated (roles), a replica can have work it cannot do yet: a prefill replica whose blocks are
held by sends that no decode replica has taken yet. A step of it that did nothing (no tokens, its
clock unmoved) parks it until another replica has stepped, so that the others run meanwhile.
"""

import heapq
import math
from time import perf_counter

from inferlab.core.engine import EngineStats, LLMEngine, StepOutput
from inferlab.core.protocols import (
    CachedPrefixLookup,
    KVMove,
    KVTransfer,
    PrefixCacheStats,
    SharedDevice,
    SimulatedDevice,
    VirtualTime,
)
from inferlab.core.request import Request
from inferlab.core.routing import ReplicaView, RoutedRequest
from inferlab.core.sampling_params import SamplingParams


class LocalReplicaView(ReplicaView):
    """An in-process replica as a router sees it: its replica_id and queue lengths are kept in the
    view (LocalReplica.refresh writes them whenever they may have changed), so that a router that
    reads every replica at every arrival makes no call for them."""

    __slots__ = ("replica_id", "num_waiting", "num_running")

    def __init__(self, replica: "LocalReplica"):
        object.__setattr__(self, "_replica", replica)
        object.__setattr__(self, "replica_id", replica.replica_id)
        object.__setattr__(self, "num_waiting", 0)
        object.__setattr__(self, "num_running", 0)

    def __setattr__(self, name, value):
        raise AttributeError(f"a ReplicaView is read-only: {name!r} cannot be set")


SET_WAITING = LocalReplicaView.num_waiting.__set__  # the replica's own writes
SET_RUNNING = LocalReplicaView.num_running.__set__


class LocalReplica:
    """One in-process replica and what its ReplicaView reads (inferlab.core.routing.ReplicaState)."""

    def __init__(self, replica_id: int, engine: LLMEngine, role: str | None = None):
        self.replica_id = replica_id
        self.role = role  # "prefill" or "decode" in a disaggregated cluster
        self.engine = engine
        self.scheduler = engine.scheduler  # its queues, which a router reads at every arrival
        kv = engine.kv_manager
        self.num_blocks = kv.num_blocks
        self.block_size = kv.block_size
        self.version = 0  # bumped whenever its queues change, for the sums below
        # Its queues' lengths, kept here (refresh) where a router reads them at every arrival
        self.num_waiting = self.num_running = 0
        self._sums: tuple[int, int, int] | None = None  # (version, queued prompt tokens, outstanding tokens)
        self.fleet_probes: list = []  # the fleet's list of replicas asked about the request being routed
        self.alive = True  # an in-process replica fails only with the process
        # A decode replica's requests still being prefilled elsewhere (by id): its load to come
        self.incoming: dict[int, Request] = {}
        self.heap_version = 0  # the entry of the fleet's heap that is current for it
        self.scheduled = False  # whether it has a current entry
        self.view = LocalReplicaView(self)  # what a router is given of it
        # The replicas on its GPU (itself among them) when it shares one with others (simulated)
        self.sharing: list[LocalReplica] = []
        # Requests that reached it while its next step, begun on its clock, waits on the shared
        # GPU: its engine takes them after that step, as an engine takes what arrives mid-step
        self.inbox: list[Request] = []

    def refresh(self) -> None:
        """After it acted (the fleet calls this wherever its queues may have changed)."""
        self.version += 1
        scheduler, view = self.scheduler, self.view
        self.num_waiting = len(scheduler.waiting) + len(self.inbox)
        self.num_running = len(scheduler.running)
        SET_WAITING(view, self.num_waiting)
        SET_RUNNING(view, self.num_running)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def num_free_blocks(self) -> int:
        return self.engine.kv_manager.num_free_blocks

    def _queue_sums(self) -> tuple[int, int]:
        if self._sums is None or self._sums[0] != self.version:
            scheduler = self.engine.scheduler
            queued = sum(len(r.token_ids) - r.num_computed_tokens for r in scheduler.waiting)
            queued += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in scheduler.running)
            outputs = sum(r.params.max_tokens - r.num_output_tokens for r in scheduler.waiting)
            outputs += sum(r.params.max_tokens - r.num_output_tokens for r in scheduler.running)
            if self.incoming:
                queued += sum(r.num_prompt_tokens for r in self.incoming.values())
                outputs += sum(r.params.max_tokens for r in self.incoming.values())
            if self.inbox:
                queued += sum(r.num_prompt_tokens for r in self.inbox)
                outputs += sum(r.params.max_tokens for r in self.inbox)
            self._sums = (self.version, queued, queued + outputs)
        return self._sums[1], self._sums[2]

    @property
    def num_queued_prompt_tokens(self) -> int:
        return self._queue_sums()[0]

    @property
    def num_outstanding_tokens(self) -> int:
        return self._queue_sums()[1]

    def cached_prefix_tokens(self, request: RoutedRequest) -> int:
        kv = self.engine.kv_manager
        if isinstance(kv, CachedPrefixLookup):  # the prompt's names are computed once for every replica
            return kv.cached_prefix_blocks(request.cacheable_block_hashes(self.block_size)) * self.block_size
        # Otherwise the question the core scheduler asks at admission; the manager's memo of the
        # request is dropped (free) if another replica gets it (LocalFleet.forget_probes).
        self.fleet_probes.append(self)
        return kv.num_cached_prefix_tokens(request._request)

    def busy(self) -> bool:
        return not self.engine.is_finished()


class LocalFleet:
    """The replicas of a local cluster and the order in which they step."""

    def __init__(
        self,
        engines: list[LLMEngine],
        roles: list[str] | None = None,
        transfer: KVTransfer | None = None,
        gpus_per_replica: float = 1.0,
    ):
        roles = roles or [None] * len(engines)
        self.transfer = transfer  # the kv_transfer plugin of the replicas (roles), which the cluster closes
        self.replicas = [LocalReplica(i, engine, role) for i, (engine, role) in enumerate(zip(engines, roles))]
        self.parked: list[LocalReplica] = []  # busy replicas whose last step did nothing (see the module's docstring)
        self.probed: list[LocalReplica] = []  # asked about the request being routed, through its KV manager
        for replica in self.replicas:
            replica.fleet_probes = self.probed
        self.alive_version = 0  # in-process replicas never die alone
        self.engines = engines
        self.front = engines[0]  # makes every request (one id counter, one seed stream) and decodes outputs
        runners = [engine.runner for engine in engines]
        self.virtual = all(isinstance(r, VirtualTime) and r.virtual_time for r in runners)
        self.simulated = all(isinstance(r, SimulatedDevice) for r in runners)
        # whether the replicas may run decode steps at once (LLMEngine.run_decodes); False: one at a time
        self.decode_runs = self.virtual and all(engine.decode_runs for engine in engines)
        # Simulated replicas with a fraction of a GPU each: floor(1 / fraction) consecutive ones
        # share one virtual GPU, whose timeline a run of one replica's decode steps cannot see past.
        per_gpu = math.floor(1 / gpus_per_replica + 1e-9) if 0 < gpus_per_replica < 1 else 1
        if per_gpu > 1 and len(runners) > 1 and all(isinstance(r, SharedDevice) for r in runners):
            for first in range(0, len(runners), per_gpu):
                group = self.replicas[first : first + per_gpu]
                if len(group) > 1:
                    group[0].engine.runner.share_device([replica.engine.runner for replica in group])
                    for replica in group:
                        replica.sharing = group
            self.decode_runs = False
        self.heap: list[tuple[float, int, int]] = []  # (when it steps next, replica_id, heap_version)
        self.now = max(engine.clock() for engine in engines) if self.virtual else 0.0

    def ready_at(self, replica: LocalReplica) -> float:
        """When the replica steps next: its clock (virtual), or when it last acted (host clock). On
        a shared GPU, no earlier than the end of the step whose tokens it reads next: that end
        waits for the steps the others launch before it, and the step's own launch can run only
        after it, so nothing earlier depends on it."""
        if not self.virtual:
            return perf_counter()
        clock = replica.engine.clock()
        if replica.sharing:
            end = replica.engine.runner.pending_end()
            return end if end > clock else clock
        return clock

    def schedule(self, replica: LocalReplica) -> None:
        """Records when the replica steps next, after it acted (stepped, queued or aborted a
        request): on virtual clocks at its clock, which queueing moves too; on the host's clock it
        keeps its place in line until it steps."""
        replica.refresh()
        if not replica.busy():
            replica.heap_version += 1  # its entry, if any, is stale
            replica.scheduled = False
        elif self.virtual or not replica.scheduled:
            replica.heap_version += 1
            replica.scheduled = True
            heapq.heappush(self.heap, (self.ready_at(replica), replica.replica_id, replica.heap_version))

    def next_step_time(self) -> float:
        """When the next replica step starts (inf when none has work)."""
        heap = self.heap
        while heap and heap[0][2] != self.replicas[heap[0][1]].heap_version:
            heapq.heappop(heap)  # stale: the replica acted since
        if not heap and self.parked:  # nothing else can run: the parked ones try again
            self.unpark()
            return self.next_step_time()
        return heap[0][0] if heap else float("inf")

    def unpark(self) -> None:
        parked, self.parked = self.parked, []
        for replica in parked:
            self.schedule(replica)

    def queue(self, replica: LocalReplica, request: Request, at: float | None = None) -> None:
        """Queues the request on the replica at `at` (its arrival, or when its prefill replica
        handed it over): on virtual clocks an idle replica's clock catches up with it."""
        engine = replica.engine
        at = request.arrival_time if at is None else at
        if self.virtual and engine.clock() < at:
            if replica.sharing and replica.busy():  # its step begun before `at` has not run yet
                replica.inbox.append(request)
                self.schedule(replica)
                return
            engine.wait_until(at)
        engine.queue(request)
        if replica in self.parked:
            self.parked.remove(replica)
        self.schedule(replica)

    def expect(self, replica: LocalReplica, request: Request) -> None:
        """The request, routed to the replica as its decode replica, counts in its load from now."""
        replica.incoming[request.request_id] = request
        replica.version += 1

    def unexpect(self, replica: LocalReplica, request: Request) -> None:
        """It no longer does: it reached the replica, or ended on its prefill replica."""
        if replica.incoming.pop(request.request_id, None) is not None:
            replica.version += 1

    def cancel_move(self, move: KVMove) -> None:
        """The move's receiver will never take its blocks: told at the receiver, the transfer tells
        the sender, which frees them."""
        self.transfer.cancel(move, move.receiver)

    def forget_probes(self, request: Request, chosen: LocalReplica | None) -> None:
        """Drops what the KV managers asked about `request` keep of it, but on the chosen replica."""
        for replica in self.probed:
            if replica is not chosen:
                replica.engine.kv_manager.free(request)
        self.probed.clear()

    def make_request(self, prompt, params: SamplingParams, priority: int, metadata, arrival_time: float) -> Request:
        return self.front.make_request(prompt, params, priority, metadata, arrival_time)

    def clock(self) -> float:
        return self.front.clock()

    def wake(self) -> None:
        """Nothing to wake: a local step never waits for anything but its own replicas' work."""

    def wait_until(self, t: float) -> None:
        if self.virtual:
            self.now = max(self.now, t)
        else:
            self.front.wait_until(t)

    def step(self, until: float | None = None) -> list[tuple[LocalReplica, StepOutput, StepOutput, list]]:
        """Steps the replica next in order: its steps as runs [(replica, the first step's output,
        each later step's output, [(start, end) on its clock of each step])], a step alone being a
        run of one; empty when none has work. With `until` (virtual clocks: nothing reaches the
        replicas before it), the replica runs at once the decode steps before it that nothing can
        change, one run; and where replicas move no K/V to each other (no roles), it goes on with
        every step of its own that starts before `until`, one at a time or in runs: no other
        replica's step before then can change it. On the host's clock `until` changes nothing: a
        step here never waits for an arrival."""
        if self.next_step_time() == float("inf"):
            return []
        _, replica_id, _ = heapq.heappop(self.heap)
        replica = self.replicas[replica_id]
        replica.scheduled = False
        engine = replica.engine
        if until is None or not self.decode_runs:
            return self._step_once(replica)
        runs: list[tuple[LocalReplica, StepOutput, StepOutput, list]] = []
        while True:
            num = len(engine.scheduler.running)  # each step's batch (some may finish in the last)
            spans = engine.run_decodes(until)
            if spans:
                output = StepOutput([], 0, num, num)  # each step's: no prefill, one token a request
                finished = engine.take_finished()  # the first step read their last tokens
                runs.append((replica, StepOutput(finished, 0, num, num) if finished else output, output, spans))
            else:
                start = engine.clock()
                output = engine.step()
                end = engine.clock()
                runs.append((replica, output, output, [(start, end)]))
                if not (output.num_requests or output.finished or end > start):  # did nothing
                    break
            if self.transfer is not None or engine.clock() >= until or engine.is_finished():
                break
        self.now = max(self.now, runs[-1][3][-1][1])
        if len(runs) == 1 and not spans:  # one step alone: as stepping one at a time leaves it
            output = runs[0][1]
            start, end = runs[0][3][0]
            if not (output.num_requests or output.finished or end > start or not replica.busy()):
                replica.refresh()
                self.parked.append(replica)
                return runs
        self.acted(replica)
        return runs

    def _step_once(self, replica: LocalReplica) -> list[tuple[LocalReplica, StepOutput, StepOutput, list]]:
        engine = replica.engine
        start = engine.clock()
        output = engine.step()
        end = engine.clock()
        if replica.inbox:  # what reached it during the step, for the next
            inbox, replica.inbox = replica.inbox, []
            for request in inbox:
                engine.queue(request)
        if self.virtual:
            self.now = max(self.now, end)
        if output.num_requests or output.finished or end > start or not replica.busy():
            self.acted(replica)
        else:
            replica.refresh()
            self.parked.append(replica)
        return [(replica, output, output, [(start, end)])]

    def acted(self, replica: LocalReplica) -> None:
        """After a replica's step (or run of decode steps) did something: the parked replicas try
        again, it steps next at its clock (the others on its GPU, whose steps its launch may delay,
        at theirs), and an idle prefill replica frees the blocks of sends that ended."""
        self.unpark()
        self.schedule(replica)
        for other in replica.sharing:
            if other is not replica and other.scheduled:
                self.schedule(other)
        if self.transfer is None:
            return  # no K/V moves between replicas: none holds sends
        for other in self.replicas:
            if other.engine.scheduler.sending and not other.scheduled and other not in self.parked:
                other.engine.poll_kv_transfer()

    def earliest_handoff(self) -> float:
        """No prefill replica hands a request over before this time: the earliest clock of those
        with work (a handoff comes at the end of one of their steps), inf when none has any."""
        return min((r.engine.clock() for r in self.replicas if r.role == "prefill" and r.busy()), default=float("inf"))

    def output(self, request: Request) -> dict:
        return self.front.output(request)

    def abort(self, replica: LocalReplica, request_id: int) -> bool:
        for request in replica.inbox:
            if request.request_id == request_id:  # its engine aborts it as it does one it holds
                replica.inbox.remove(request)
                replica.engine.queue(request)
                break
        aborted = replica.engine.abort(request_id)
        self.schedule(replica)
        return aborted

    def idle(self) -> bool:
        return self.next_step_time() == float("inf")

    def warm_up(self, prompt, params: SamplingParams) -> None:
        for engine in self.engines:
            engine.generate([prompt], params, use_tqdm=False)
        for replica in self.replicas:
            replica.refresh()
        if self.virtual:
            self.now = max(self.now, *(engine.clock() for engine in self.engines))

    def on_front(self, read):
        """read(engine) on the first replica's engine (what records read of an engine: its plugins,
        device, cache)."""
        return read(self.front)

    def running_requests(self) -> list[Request]:
        return [request for engine in self.engines for request in engine.scheduler.running]

    def replica_stats(self) -> list[EngineStats]:
        return [engine.stats for engine in self.engines]

    def reset_stats(self) -> None:
        for engine in self.engines:
            engine.stats = EngineStats()

    def prefix_cache_stats(self) -> tuple[int, int] | None:
        managers = [engine.kv_manager for engine in self.engines]
        if not all(isinstance(kv, PrefixCacheStats) for kv in managers):
            return None
        counts = [kv.prefix_cache_stats() for kv in managers]
        return sum(hits for hits, _ in counts), sum(queried for _, queried in counts)

    def reset_prefix_cache(self) -> None:
        for engine in self.engines:
            engine.reset_prefix_cache()

    def reseed(self, seed: int) -> None:
        for engine in self.engines:
            engine.runner.reseed(seed)  # simulated: Cluster.reseed asks only then

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
