"""Cluster: N engine replicas behind a router plugin, with an engine's surface (add_request, step,
abort, is_finished, clock, wait_until, requests, output, generate, close), so that the experiment
driver and the server drive a cluster as they drive one engine. docs/cluster.md tells the design.

A request is made (tokenized and checked) when it is added, with an id unique in the cluster, and
routed when its arrival comes: on the host's clock at the next step, on virtual clocks in time
order among the replicas' steps. The router gets read-only views (inferlab.core.routing); a choice
it cannot make (it raised, or returned something it was not offered) fails that request alone with
a PolicyError naming the router.

Disaggregated (prefill_replicas and decode_replicas, docs/disaggregation.md), the router picks a
prefill and a decode replica for each request; the prefill replica hands it off after its first
token, and the cluster queues it on the decode replica, its K/V moving through the kv_transfer
plugin the cluster built for its replicas (on Ray, each actor builds its own: kv_transfer=distributed).
"""

import heapq
import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields
from itertools import count
from time import perf_counter
from typing import Any

from tqdm.auto import tqdm

from inferlab.conf.cluster import ClusterConfig, validate_cluster
from inferlab.core.config import EngineConfig
from inferlab.core.engine import (
    EngineClosedError,
    EngineStats,
    LLMEngine,
    RequestTooLargeError,
    StepOutput,
    as_prompt_list,
    per_prompt,
)
from inferlab.core.handoff import KVHandoff
from inferlab.core.plugins import ENGINE_KINDS, PluginRegistry, get_registry, validated_options
from inferlab.core.protocols import ClusterState, KVMove, ObservingRouter, PairRouter
from inferlab.core.request import Request, RequestStatus
from inferlab.core.routing import ReplicaView, RoutedRequest
from inferlab.core.sampling_params import SamplingParams
from inferlab.core.scheduler import PolicyError

FINISHED = RequestStatus.FINISHED


@dataclass(slots=True)
class ClusterStepOutput(StepOutput):
    """A cluster step: the engine's StepOutput summed over the replicas that stepped, and each of
    their steps (replica_steps)."""

    # (replica_id, the first step's output, each later step's output, [(start, end) of each step]):
    # a run of a replica's decode steps kept as one entry, made into one a step only when asked
    runs: list[tuple[int, StepOutput, StepOutput, list[tuple[float, float]]]]

    @property
    def replica_steps(self) -> list[tuple[int, float, float, StepOutput]]:
        """Each step of each replica that stepped: (replica_id, start, end on its clock, its StepOutput)."""
        return [
            (replica_id, start, end, first if i == 0 else rest)
            for replica_id, first, rest, spans in self.runs
            for i, (start, end) in enumerate(spans)
        ]


class Cluster:
    """Cluster(model_path, replicas=N, router="round_robin", router_options={}, backend="local",
    gpus_per_replica=1.0, ray_address=None, **engine settings): N engines, each built with the
    engine settings (as LLM takes them), behind the router. With executor="simulated" the replicas
    run on virtual clocks, one event at a time in time order; gpus_per_replica below 1 puts
    floor(1 / gpus_per_replica) consecutive ones on one virtual GPU, which time-slices them
    (inferlab.sim.shared_gpu).

    prefill_replicas=P, decode_replicas=D (instead of replicas) split prefill from decode: replicas
    0..P-1 prefill, P..P+D-1 decode, the K/V moving through kv_transfer ("auto": distributed on
    Ray, simulated for a simulated executor, else local) with kv_transfer_options."""

    def __init__(
        self,
        model_path: str | None = None,
        /,
        *,
        replicas: int = 1,
        router: str = "round_robin",
        router_options: Mapping[str, Any] | None = None,
        backend: str = "local",
        gpus_per_replica: float = 1.0,
        ray_address: str | None = None,
        prefill_replicas: int | None = None,
        decode_replicas: int | None = None,
        kv_transfer: str = "auto",
        kv_transfer_options: Mapping[str, Any] | None = None,
        registry: PluginRegistry | None = None,
        **settings,
    ):
        self.lock = threading.RLock()
        self.closed = False
        self.fleet = None
        self.transfer = None
        validate_cluster(
            ClusterConfig(
                replicas,
                backend,
                gpus_per_replica,
                ray_address,
                prefill_replicas=prefill_replicas,
                decode_replicas=decode_replicas,
            )
        )
        self.roles: list[str] | None = None  # each replica's, when prefill is split from decode
        if prefill_replicas is not None:
            replicas = prefill_replicas + decode_replicas
            self.roles = ["prefill"] * prefill_replicas + ["decode"] * decode_replicas
        self.registry = registry or get_registry()
        # Everything that can be refused is refused before a replica is built.
        config = EngineConfig.from_kwargs(model_path, dict(settings))
        for kind in ENGINE_KINDS:
            name = getattr(config, kind)
            if name != "auto":
                validated_options(self.registry.get(kind, name), getattr(config, f"{kind}_options"))
        self.router_name = router
        self.router_options = validated_options(self.registry.get("router", router), router_options or {})
        self.router = self.registry.create("router", router, options=self.router_options)
        self.observing = isinstance(self.router, ObservingRouter)
        self.pairs = isinstance(self.router, PairRouter)
        if self.roles is not None:
            if kv_transfer == "auto":
                if backend == "ray":
                    kv_transfer = "distributed"
                else:
                    kv_transfer = "simulated" if config.executor == "simulated" else "local"
            if backend == "ray" and kv_transfer != "distributed":
                raise ValueError(
                    f"prefill/decode roles on cluster.backend=ray move K/V between processes: kv_transfer=distributed "
                    f"(or auto), got {kv_transfer!r}"
                )
            if backend == "ray" and 0 < gpus_per_replica < 1:
                raise ValueError(
                    f"prefill/decode roles on cluster.backend=ray move K/V over NCCL, which takes a GPU per replica: "
                    f"cluster.gpus_per_replica={gpus_per_replica} shares one; use 1 (or 0 for replicas on CPUs), or "
                    f"cluster.backend=local with kv_transfer=local for replicas sharing a GPU"
                )
            given = dict(kv_transfer_options or {})
            entry = self.registry.get("kv_transfer", kv_transfer)
            address = None  # on Ray the driver chooses the rendezvous address, unless one is given
            if backend == "ray":
                given["world_size"] = replicas  # every replica an endpoint
                if given.get("address") != next(f.default for f in fields(entry.options) if f.name == "address"):
                    address = given.get("address")
            self.kv_transfer_name = kv_transfer
            self.kv_transfer_options = validated_options(entry, given)
        self.backend = backend
        if backend == "ray":
            from inferlab.cluster.ray_backend import RayFleet  # Ray is an optional extra

            transfer = None
            if self.roles is not None:
                transfer = (self.kv_transfer_name, {**self.kv_transfer_options, "address": address})
            self.fleet = RayFleet(
                model_path, settings, replicas, gpus_per_replica, ray_address, self.registry, self.roles, transfer
            )
            if self.roles is not None:  # what the records show: the address the actors met at
                self.kv_transfer_options["address"] = self.fleet.kv_address
        else:
            from inferlab.cluster.local import LocalFleet

            engines: list[LLMEngine] = []
            try:
                for _ in range(replicas):
                    engines.append(LLMEngine(model_path, registry=self.registry, **settings))
                if self.roles is not None:
                    self.transfer = self.registry.create(
                        "kv_transfer", self.kv_transfer_name, options=self.kv_transfer_options
                    )
                    for replica_id, engine in enumerate(engines):
                        engine.connect_kv_transfer(self.transfer, replica_id)
            except BaseException:
                for engine in engines:
                    engine.close()
                if self.transfer is not None:
                    self.transfer.close()
                raise
            self.fleet = LocalFleet(engines, self.roles, self.transfer, gpus_per_replica)
        front = self.fleet.front
        self.config, self.hf_config, self.tokenizer, self.model_path = (
            front.config,
            front.hf_config,
            front.tokenizer,
            front.model_path,
        )
        self.simulated = self.fleet.simulated  # its replicas' runners are simulations (SimulatedDevice)
        self.views = [replica.view for replica in self.fleet.replicas]
        self.offered: tuple[ReplicaView, ...] = ()  # the views of the replicas alive, as of offered_version
        self.offered_version = -1
        self.offered_index: tuple = ((), {})  # (a tuple of offered views, their ids -> them), for _choose
        self.requests: dict[int, Request] = {}  # pending, by id
        self.routed: dict[int, RoutedRequest] = {}  # routed and pending: what observe is given
        self.placement: dict[int, int] = {}  # request id -> the replica it was routed to
        self.arrivals: list[tuple[float, int, Request]] = []  # added, not yet routed: a heap by arrival
        # handed off by their prefill replica, not yet queued on their decode one: a heap by the time
        # of the handoff (virtual clocks: queued when that time comes among the replicas' steps)
        self.handoffs: list[tuple[float, int, Request]] = []
        self.arrival_order = count()
        self.unreported: list[Request] = []  # finished outside a replica's step (routing failed, aborted unrouted)
        self.num_routed = 0
        self.num_failed_routes = 0
        self.num_unrouted_aborts = 0
        self.route_seconds = 0.0  # the host's time in the router's route(), the views it read included

    # -- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        prompt,
        params: SamplingParams | None = None,
        priority: int = 0,
        metadata: Mapping[str, Any] | None = None,
        arrival_time: float | None = None,
    ) -> int:
        """Adds one request; returns its id in the cluster. On the host's clock it is routed now; on
        virtual clocks when its arrival comes among the replicas' steps. Raises as LLM's
        add_request does for a prompt the replicas would refuse."""
        self.refuse_closed("add_request")
        if params is not None and params.n > 1:
            raise ValueError(
                f"a cluster serves one choice a request (n=1), got n={params.n}: add n requests (a router may "
                "send them to different replicas), or use one engine"
            )
        with self.lock:
            if arrival_time is None:
                arrival_time = self.clock()
            request = self.fleet.make_request(prompt, params or SamplingParams(), priority, metadata, arrival_time)
            self.requests[request.request_id] = request
            if self.fleet.virtual:
                heapq.heappush(self.arrivals, (request.arrival_time, next(self.arrival_order), request))
                return request.request_id
            try:
                self._route(request)
            except BaseException:
                self.requests.pop(request.request_id, None)
                raise
            return request.request_id

    def _route(self, request: Request) -> None:
        """Asks the router for a replica and queues the request there, or fails it when the router
        could not choose. What the chosen replica raises in refusing it is raised."""
        if self.offered_version != self.fleet.alive_version:  # a replica died since: offer it no more
            self.offered = tuple(view for view, replica in zip(self.views, self.fleet.replicas) if replica.alive)
            self.offered_version = self.fleet.alive_version
        offered = self.offered
        routed = RoutedRequest(request)
        now = request.arrival_time if self.fleet.virtual else self.clock()
        if not offered:
            self._fail(request, "no replica is alive: every replica of the cluster died", now)
            return
        state = ClusterState(now=now, num_routed=self.num_routed, num_replicas=len(self.views))
        choice, decoder, error = None, None, None
        started = perf_counter()
        try:
            if self.roles is None:
                choice = self._choose(self.router.route(routed, offered, state), offered, "route")
            else:
                choice, decoder = self._choose_pair(routed, offered, state)
        except PolicyError as e:
            error = e
        except Exception as e:
            error = PolicyError(f"router {self.router_name!r}: route raised {type(e).__name__}: {e}")
        finally:
            self.route_seconds += perf_counter() - started
            self.fleet.forget_probes(request, None if choice is None else choice._replica)
        self.num_routed += 1
        if error is not None:
            self._fail(request, f"{type(error).__name__}: {error}", now)
            return
        if decoder is not None:
            request.kv_send = KVMove(request.request_id, choice.replica_id, decoder.replica_id)
            self.fleet.expect(decoder._replica, request)
        replica = choice._replica
        try:
            self.fleet.queue(replica, request)
        except (ValueError, TypeError) as e:
            kind = next(k for k in (RequestTooLargeError, ValueError, TypeError) if isinstance(e, k))
            raise kind(f"replica {replica.replica_id} refused the request: {e}") from e
        self.placement[request.request_id] = replica.replica_id
        self.routed[request.request_id] = routed

    def _choose(self, answer, offered: tuple[ReplicaView, ...], method: str) -> ReplicaView:
        """The offered view the router answered, or a PolicyError naming the router."""
        index = self.offered_index
        if index[0] is not offered:  # by identity: a view at most once, and no answer's __eq__ asked
            index = self.offered_index = (offered, {id(view): view for view in offered})
        choice = index[1].get(id(answer))
        if choice is None or choice is not answer:
            raise PolicyError(
                f"router {self.router_name!r}: {method} returned {answer!r}, which is not one of the replicas "
                f"offered (replica_ids {[view.replica_id for view in offered]})"
            )
        return choice

    def _choose_pair(self, routed: RoutedRequest, offered, state: ClusterState) -> tuple[ReplicaView, ReplicaView]:
        """A prefill and a decode replica for the request: the router's route_pair (PairRouter), or
        its route over the prefill replicas, then over the decode ones."""
        prefill = tuple(view for view in offered if view.role == "prefill")
        decode = tuple(view for view in offered if view.role == "decode")
        if not prefill or not decode:
            raise PolicyError(f"no {'prefill' if not prefill else 'decode'} replica is alive")
        if not self.pairs:
            return (
                self._choose(self.router.route(routed, prefill, state), prefill, "route"),
                self._choose(self.router.route(routed, decode, state), decode, "route"),
            )
        answer = self.router.route_pair(routed, prefill, decode, state)
        if not (isinstance(answer, tuple) and len(answer) == 2):
            raise PolicyError(
                f"router {self.router_name!r}: route_pair returned {answer!r}, not a (prefill replica, decode "
                f"replica) pair"
            )
        return self._choose(answer[0], prefill, "route_pair"), self._choose(answer[1], decode, "route_pair")

    def _hand_over(self, request: Request, at: float) -> None:
        """Queues a request its prefill replica handed off on its decode replica, at `at` (the
        end of the prefill replica's step, on its clock); one the decode replica refuses fails."""
        move = request.kv_send
        request.kv_send, request.kv_receive = None, move
        self.fleet.unexpect(self.fleet.replicas[move.receiver], request)
        try:
            self.fleet.queue(self.fleet.replicas[move.receiver], request, at)
        except (ValueError, TypeError) as e:
            self.fleet.cancel_move(move)  # the sender frees its blocks
            request.status, request.kv_receive = FINISHED, None
            self._fail(request, KVHandoff.why(move, f"decode replica {move.receiver} refused the request: {e}"), at)
            return
        self.placement[request.request_id] = move.receiver

    def _fail(self, request: Request, why: str, now: float) -> None:
        request.status = FINISHED
        request.finish_reason = "error"
        request.error = why
        request.finish_time = now
        self.num_failed_routes += 1
        self.unreported.append(request)

    def abort(self, request_id: int) -> bool:
        """Stops a request, routed or not; True if it was still pending."""
        self.refuse_closed("abort")
        with self.lock:
            request = self.requests.pop(request_id, None)
            if request is None:
                return False
            replica_id = self.placement.get(request_id)
            if replica_id is None:  # not routed yet
                self.arrivals = [entry for entry in self.arrivals if entry[2] is not request]
                heapq.heapify(self.arrivals)
                request.status, request.finish_reason, request.finish_time = FINISHED, "abort", self.clock()
                self.unreported.append(request)  # the next step reports it, as a replica reports its aborts
                self.num_unrouted_aborts += 1
                return True
            replica = self.fleet.replicas[replica_id]
            if any(entry[2] is request for entry in self.handoffs):  # between its two replicas
                self.handoffs = [entry for entry in self.handoffs if entry[2] is not request]
                heapq.heapify(self.handoffs)
                move = request.kv_send
                self.fleet.unexpect(self.fleet.replicas[move.receiver], request)
                self.fleet.cancel_move(move)  # its prefill replica frees the blocks
                request.status, request.finish_reason, request.finish_time = FINISHED, "abort", self.clock()
                self.unreported.append(request)  # the next step reports it
                self._observe(request, replica_id)
                return True
            if request.kv_send is not None:  # on its prefill replica still
                self.fleet.unexpect(self.fleet.replicas[request.kv_send.receiver], request)
            aborted = self.fleet.abort(replica, request_id)
            self._observe(request, replica_id)
            return aborted

    def _observe(self, request: Request, replica_id: int) -> None:
        routed = self.routed.pop(request.request_id, None)
        if self.observing and routed is not None:
            state = ClusterState(now=self.clock(), num_routed=self.num_routed, num_replicas=len(self.views))
            self.router.observe(routed, self.views[replica_id], state)

    def replica_of(self, request_id: int) -> int | None:
        """The replica_id a request was routed to (None if it never was)."""
        return self.placement.get(request_id)

    # -- the loop -----------------------------------------------------------------------------

    def clock(self) -> float:
        """The cluster's time: the host's, or on virtual clocks the time of the next event (an
        arrival to route or a replica's step), or of the latest one when none is pending."""
        fleet = self.fleet
        if not fleet.virtual:
            return fleet.clock()
        next_event = min(
            self.arrivals[0][0] if self.arrivals else float("inf"),
            self.handoffs[0][0] if self.handoffs else float("inf"),
            fleet.next_step_time(),
        )
        return next_event if next_event != float("inf") else fleet.now

    def wait_until(self, t: float) -> None:
        """Returns once clock() reads t: the host sleeps; virtual time moves there at once (while
        nothing is pending)."""
        self.fleet.wait_until(t)

    def wake(self) -> None:
        """inferlab.core.protocols.WakeableStep: ends a step's wait for the replicas' reports (on
        Ray) now, or the next step's if none waits, so that a request the caller has just been
        given is added and routed without waiting it out. Safe from any thread: it takes no lock."""
        self.fleet.wake()

    def is_finished(self) -> bool:
        self.refuse_closed("is_finished")
        return not self.arrivals and not self.handoffs and not self.unreported and self.fleet.idle()

    def step(self, until: float | None = None) -> StepOutput:
        """Routes the requests that have arrived, then one replica steps (the next in order; on Ray,
        whichever replicas reported). Returns the requests finished since the previous step.

        until: the caller's promise that it adds no request arriving before that time (a driver
        that knows its workload). On virtual clocks the replica then runs at once the decode steps
        that start before it and before the next arrival it was given, where nothing can change
        them (LLMEngine.run_decodes): the same steps, without their work per request. On the
        host's clock a fleet that waits for its replicas (Ray) waits no later than it, so that the
        caller adds that arrival on time."""
        self.refuse_closed("step")
        with self.lock:
            fleet = self.fleet
            while True:  # arrivals and handoffs, in time order, before any step that starts later
                next_step = fleet.next_step_time()
                arrival = self.arrivals[0][0] if self.arrivals else float("inf")
                handoff = self.handoffs[0][0] if self.handoffs else float("inf")
                if min(arrival, handoff) > next_step or not (self.arrivals or self.handoffs):
                    break
                if handoff < arrival:
                    self._hand_over(heapq.heappop(self.handoffs)[2], handoff)
                    continue
                request = heapq.heappop(self.arrivals)[2]
                try:
                    self._route(request)
                except (ValueError, TypeError) as e:  # a replica whose cache is smaller than the first's
                    self._fail(request, str(e), request.arrival_time)
            horizon = until  # the host's clock: how long a fleet may wait for its replicas' reports
            if until is not None and fleet.virtual:
                horizon = min(until, self.arrivals[0][0]) if self.arrivals else until
                if self.roles is not None:  # a handoff reaches a decode replica like an arrival
                    handoff = self.handoffs[0][0] if self.handoffs else horizon
                    horizon = min(horizon, handoff, fleet.earliest_handoff())
            finished, self.unreported = self.unreported, []
            for request in finished:
                self.requests.pop(request.request_id, None)
            runs: list[tuple[int, StepOutput, StepOutput, list[tuple[float, float]]]] = []
            num_prefill = num_decode = num_requests = 0
            for replica, step, rest, spans in fleet.step(horizon):
                later = len(spans) - 1  # a run's steps after its first, each alike
                num_prefill += step.num_prefill_tokens + later * rest.num_prefill_tokens
                num_decode += step.num_decode_tokens + later * rest.num_decode_tokens
                num_requests += step.num_requests + later * rest.num_requests
                runs.append((replica.replica_id, step, rest, spans))
                if not step.finished:  # most runs: nothing more to do (only a run's first step reports)
                    continue
                end = spans[0][1]
                if replica.role == "prefill":
                    handed = [r for r in step.finished if r.finish_reason == "handoff"]
                    if handed:
                        step.finished = [r for r in step.finished if r.finish_reason != "handoff"]
                        for request in handed:
                            if fleet.virtual:
                                heapq.heappush(self.handoffs, (end, next(self.arrival_order), request))
                            else:
                                self._hand_over(request, end)
                    for request in step.finished:  # ended there (its first token stopped it, or it failed)
                        if request.kv_send is not None:
                            self.fleet.unexpect(self.fleet.replicas[request.kv_send.receiver], request)
                for request in step.finished:
                    self.requests.pop(request.request_id, None)
                    self._observe(request, replica.replica_id)
                    # Request and view refer to each other: without the link a finished request is
                    # freed at once instead of by the collector (a third of a simulated fleet's memory)
                    request.view = None
                finished += step.finished
            return ClusterStepOutput(finished, num_prefill, num_decode, num_requests, runs)

    def output(self, request: Request) -> dict:
        """A finished request's result, as LLM.output gives it."""
        return self.fleet.output(request)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        raise_on_error: bool = False,
        priority: int | list[int] = 0,
        metadata=None,
    ) -> list[dict]:
        """LLM.generate over the cluster: every prompt routed, outputs in input order."""
        self.refuse_closed("generate")
        with self.lock:
            prompts = as_prompt_list(prompts)
            params = per_prompt("sampling params", sampling_params or SamplingParams(), SamplingParams, prompts)
            priorities = per_prompt("priorities", priority, int, prompts)
            metadatas = per_prompt("metadata", metadata, (Mapping, type(None)), prompts)
            results: list[int | str] = []
            for i, args in enumerate(zip(prompts, params, priorities, metadatas)):
                try:
                    results.append(self.add_request(*args))
                except RequestTooLargeError as e:
                    if raise_on_error:
                        raise
                    results.append(str(e))
                except (ValueError, TypeError) as e:
                    for request_id in results:
                        if isinstance(request_id, int):
                            self.abort(request_id)
                    raise type(e)(f"prompt {i}: {e}") from None
            mine = {r for r in results if isinstance(r, int)}
            outputs: dict[int, dict] = {}
            others: list[Request] = []
            bar = tqdm(total=len(mine), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
            try:
                while mine - outputs.keys() and not self.is_finished():
                    for request in self.step().finished:
                        if request.request_id in mine:
                            outputs[request.request_id] = self.output(request)
                            bar.update(1)
                        else:
                            others.append(request)
            finally:
                self.unreported[:0] = others
                bar.close()
            return [outputs[r] if isinstance(r, int) else LLMEngine.error_output(r) for r in results]

    def warm_up(self, prompt, params: SamplingParams) -> None:
        """One generate on every replica, outside the router and the cluster's requests (a
        benchmark's warm-up: each replica compiles and captures what it runs)."""
        self.refuse_closed("warm_up")
        with self.lock:
            self.fleet.warm_up(prompt, params)

    def running_requests(self) -> list[Request]:
        """The requests running on the replicas (a server streams their new tokens after each step)."""
        return self.fleet.running_requests()

    def gauges(self) -> dict:
        """The replicas' queues and KV caches summed (a server's /metrics): num_running, num_waiting
        (requests not yet routed included), num_free_blocks, num_blocks, num_preemptions,
        prefix_hit_tokens, prefix_queried_tokens."""
        replicas = [r for r in self.fleet.replicas if r.alive]
        hits, queried = self.fleet.prefix_cache_stats() or (0, 0)
        return {
            "num_running": sum(r.num_running for r in replicas),
            "num_waiting": sum(r.num_waiting for r in replicas) + len(self.arrivals),
            "num_free_blocks": sum(r.num_free_blocks for r in replicas),
            "num_blocks": sum(r.num_blocks for r in replicas),
            # as last reported (the server reads this after every step: asking each actor would delay its inbox)
            "num_preemptions": sum(r.num_preemptions for r in self.fleet.replicas),
            "prefix_hit_tokens": hits,
            "prefix_queried_tokens": queried,
        }

    # -- figures and lifetime -----------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        """The replicas' counters summed (the seconds are replica-seconds), plus the requests whose
        routing failed or that were aborted before routing. Assigning a fresh EngineStats resets every replica's."""
        total = EngineStats()
        for stats in self.fleet.replica_stats():
            for f in fields(EngineStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(stats, f.name))
        total.num_failed_requests += self.num_failed_routes
        total.num_aborted_requests += self.num_unrouted_aborts
        return total

    @stats.setter
    def stats(self, value: EngineStats) -> None:
        if value != EngineStats():
            raise ValueError("a cluster's stats can only be reset (assign EngineStats())")
        self.fleet.reset_stats()
        self.num_failed_routes = self.num_unrouted_aborts = 0

    def prefix_cache_stats(self) -> tuple[int, int] | None:
        """(tokens served from the replicas' prefix caches, tokens looked up), or None when their KV
        managers do not count them."""
        return self.fleet.prefix_cache_stats()

    def reset_prefix_cache(self) -> None:
        self.refuse_closed("reset_prefix_cache")
        with self.lock:
            self.fleet.reset_prefix_cache()

    def reseed(self, seed: int) -> None:
        """Restarts each simulated replica's step-time noise from seed (a bench's repeat draws from
        its own), as LLM's runner.reseed does for one engine; nothing for real replicas."""
        if self.simulated:
            self.fleet.reseed(seed)

    def refuse_closed(self, call: str) -> None:
        if self.closed:
            raise EngineClosedError(f"{call}() on a closed cluster: close() shut its replicas down; build a new one")

    def close(self) -> None:
        """Shuts every replica down (and Ray, if the cluster started it); safe to call twice."""
        if self.closed:
            return
        with self.lock:
            self.closed = True
            if self.fleet is not None:
                self.fleet.close()
            if self.transfer is not None:
                self.transfer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
