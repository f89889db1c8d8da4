"""Replicas as Ray actors (`cluster.backend=ray`): each actor holds an engine and a thread that
steps it; the driver routes, sends each request to its actor, and polls the actors for what their
steps did: tokens, finished requests (with their results), gauges for the router's views, counters,
and the KV events that tell which block hashes each replica's prefix cache holds.

Ray is an optional extra (`pip install -e ".[cluster]"`), imported only here. The actors build
their engines from the installed plugins (a registry made by hand in the driver cannot travel);
the router runs in the driver. Times come back on the driver's clock: each actor's perf_counter is
offset by what a round trip measured when it started.

The driver never waits on an actor to queue a request: it draws the request's seed itself (one
stream from the engine seed, as the local cluster's front engine draws them) and sends it without
waiting for an answer; an actor whose engine refuses it reports the refusal with its next poll,
and the driver fails that request then. Ray runs a threaded actor's calls in no set order, so the
driver numbers what it sends each actor (add, take, abort) and the actor hands them to its engine
in that order.

Disaggregated (roles), every actor joins one torch.distributed group through kv_transfer=distributed,
its rank its replica id, at a rendezvous address the driver chooses. A prefill actor reports each
request it hands off (the request itself, pickled), the driver queues it on its decode actor as the
local cluster does, and the K/V moves from actor to actor through the group.
"""

import pickle
import queue
import random
import socket
import threading
import time
from time import perf_counter
from types import SimpleNamespace

from inferlab.core.blocks import BlockPrompt
from inferlab.core.engine import (
    EngineStats,
    LLMEngine,
    StepOutput,
    as_token_ids,
    check_request_arguments,
    draw_seed,
    outside_range,
)
from inferlab.core.handoff import KVHandoff
from inferlab.core.protocols import KVCacheEvents, KVMove, PrefixCacheStats
from inferlab.core.request import Request, RequestStatus
from inferlab.core.routing import ReplicaView, RoutedRequest, cached_prefix_from_names
from inferlab.core.sampling_params import SamplingParams
from inferlab.core.scheduler import HANDOFF

POLL_S = 0.01  # how long a step waits for a report (unless woken) before its caller looks at its own inbox
IDLE_WAIT_S = 0.05  # how long an idle actor waits for work before it looks at its stop flag
WAITING, RUNNING, FINISHED = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.FINISHED


class ReplicaActor:
    """One replica, inside a Ray actor (threaded: poll, add and abort are served while the engine's
    thread steps)."""

    def __init__(self, model_path, settings: dict):
        self.engine = engine = LLMEngine(model_path, **settings)
        self.transfer = None  # the kv_transfer plugin, once connect ran (roles)
        self.kv_events = isinstance(engine.kv_manager, KVCacheEvents)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.order = threading.Lock()
        self.next_message = 0  # the number of the driver's next message for the engine's thread
        self.early: dict[int, tuple | None] = {}  # messages that came before an earlier-numbered one
        self.report = self._empty_report()
        self.reported = threading.Condition()
        self.sent: dict[int, int] = {}  # request id -> output tokens already reported
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="inferlab-replica", daemon=True)
        self.thread.start()

    def info(self) -> dict:
        import ray

        engine = self.engine
        kv = engine.kv_manager
        checkpoint = engine.runner.checkpoint
        return {
            "config": engine.config,
            "hf_config": engine.hf_config,
            "tokenizer": checkpoint.tokenizer,
            "model_path": engine.model_path,
            "num_blocks": kv.num_blocks,
            "block_size": kv.block_size,
            "node": ray.get_runtime_context().get_node_id(),
        }

    def free_address(self) -> str:
        """host:port on this actor's machine where the KV transfer's rendezvous store can listen."""
        import ray

        return f"{ray.util.get_node_ip_address()}:{free_port()}"

    def connect(self, kv_transfer: str, options: dict, endpoint: int) -> None:
        """Makes the engine replica `endpoint` of the KV transfer (kv_transfer=distributed: joins
        its process group, which returns once every replica has joined)."""
        from inferlab.core.plugins import get_registry

        self.transfer = get_registry().create("kv_transfer", kv_transfer, options=options)
        self.engine.connect_kv_transfer(self.transfer, endpoint)

    def cancel_move(self, move: KVMove) -> None:
        """The move's receiver will never take the blocks (it refused the request, died or aborted
        it): this sender frees them."""
        self.transfer.cancel(move, move.receiver)

    def clock(self) -> float:
        return perf_counter()

    def add(
        self,
        number: int,
        request_id: int,
        prompt,
        params: SamplingParams,
        priority: int,
        metadata,
        arrival_time: float,
        kv_send: KVMove | None,
        seed: int,
    ) -> None:
        """Makes the request (every check the engine makes), with the seed the driver drew, and
        queues it for the engine's thread as the driver's message `number`. A request the engine
        refuses is reported refused (with what make_request raised) in the next poll."""
        try:
            request = self.engine.make_request(prompt, params, priority, metadata, arrival_time)
            request.request_id = request_id  # the cluster's id (make_request's counter is this actor's own)
            request.seed = seed
            request.kv_send = kv_send
            if kv_send is not None:
                self.engine.handoff.check(request)
        except Exception as e:
            self._refuse(request_id, e)
            self._deliver(number, None)
            return
        self._deliver(number, ("add", request))

    def take(self, number: int, request: Request) -> None:
        """Queues a request another replica prefilled and handed off (its kv_receive set), its K/V
        to come through the transfer, as the driver's message `number`. Raises
        RequestTooLargeError if this cache could never hold it."""
        try:
            self.engine.handoff.check(request)
            self.engine.check_fits_cache(request.num_prompt_tokens, request.params)
        except BaseException:
            self._deliver(number, None)
            raise
        self._deliver(number, ("add", request))

    def abort(self, number: int, request_id: int) -> None:
        self._deliver(number, ("abort", request_id))

    def _deliver(self, number: int, message: tuple | None) -> None:
        """Passes the driver's messages to the engine's thread in the order the driver numbered them."""
        with self.order:
            self.early[number] = message
            while self.next_message in self.early:
                message = self.early.pop(self.next_message)
                self.next_message += 1
                if message is not None:
                    self.inbox.put(message)

    def _refuse(self, request_id: int, error: Exception) -> None:
        with self.reported:
            self.report["refused"].append((request_id, str(error), perf_counter()))
            self.reported.notify_all()

    def poll(self, timeout: float) -> dict:
        """What the engine's steps did since the previous poll (waits up to timeout for a step)."""
        with self.reported:
            if not (self.report["steps"] or self.report["finished"] or self.report["refused"]):
                self.reported.wait(timeout)
            report, self.report = self.report, self._empty_report()
        engine = self.engine
        scheduler, kv = engine.scheduler, engine.kv_manager
        report["gauges"] = {
            "num_waiting": len(scheduler.waiting),
            "num_running": len(scheduler.running),
            "num_free_blocks": kv.num_free_blocks,
            "num_preemptions": scheduler.num_preemptions,
            "num_queued_prompt_tokens": sum(len(r.token_ids) - r.num_computed_tokens for r in scheduler.waiting)
            + sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in scheduler.running),
            "num_pending_output_tokens": sum(
                r.params.max_tokens - r.num_output_tokens for r in (*scheduler.waiting, *scheduler.running)
            ),
        }
        report["stats"] = engine.stats
        report["prefix"] = kv.prefix_cache_stats() if isinstance(kv, PrefixCacheStats) else None
        return report

    def call(self, read):
        """read(engine): what the records read of an engine, read where it runs."""
        return read(self.engine)

    def warm_up(self, prompt, params: SamplingParams) -> None:
        self.engine.generate([prompt], params, use_tqdm=False)

    def stats(self) -> EngineStats:
        return self.engine.stats

    def reset_stats(self) -> None:
        self.engine.stats = EngineStats()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def close(self) -> None:
        self.stopping = True
        self.inbox.put(None)
        self.thread.join(30)
        self.engine.close()
        if self.transfer is not None:
            self.transfer.close()

    # -- the engine's thread ----------------------------------------------------------------

    @staticmethod
    def _empty_report() -> dict:
        return {"steps": [], "tokens": {}, "finished": [], "refused": [], "kv_events": {}}

    def _loop(self) -> None:
        engine = self.engine
        while not self.stopping:
            try:
                items = [self.inbox.get(timeout=IDLE_WAIT_S) if engine.is_finished() else self.inbox.get_nowait()]
            except queue.Empty:
                items = []
            try:
                while True:
                    items.append(self.inbox.get_nowait())
            except queue.Empty:
                pass
            for item in items:
                if item is None:
                    continue
                what, value = item
                if what == "add":
                    try:
                        engine.queue(value)
                    except Exception as e:  # the request alone fails, not the engine's thread
                        self._refuse(value.request_id, e)
                        continue
                    self.sent[value.request_id] = len(value.token_times)  # a handed-off one's first token is known
                elif engine.abort(value):
                    self.sent.pop(value, None)
            if engine.is_finished():
                if engine.scheduler.sending:  # an idle prefill replica frees the blocks of sends that ended
                    engine.poll_kv_transfer()
                continue
            start = perf_counter()
            output = engine.step()
            end = perf_counter()
            if output.num_requests or output.finished or engine.handoff is None:  # not a step that only waited for K/V
                self._report(output, start, end)

    def _report(self, output: StepOutput, start: float, end: float) -> None:
        engine = self.engine
        tokens = {}
        for request in (*engine.scheduler.running, *output.finished):
            sent = self.sent.get(request.request_id)
            known = len(request.token_times)
            if sent is None or (known == sent and request.status is not FINISHED):
                continue
            first = request.num_prompt_tokens + sent
            tokens[request.request_id] = (
                request.token_ids[first : request.num_prompt_tokens + known],
                request.token_times[sent:],
                request.first_scheduled_time,
                request.num_cached_tokens,
                request.num_preemptions,
                request.kv_transfer_s,
                request.kv_transfer_bytes,
            )
            self.sent[request.request_id] = known
        finished = []
        for request in output.finished:
            self.sent.pop(request.request_id, None)
            if request.finish_reason == HANDOFF:  # the request itself, as it is now, for its decode replica
                finished.append((request.request_id, HANDOFF, None, request.finish_time, pickle.dumps(request)))
                continue
            finished.append(
                (request.request_id, request.finish_reason, request.error, request.finish_time, engine.output(request))
            )
        events = engine.kv_manager.take_kv_events() if self.kv_events else {}
        step = (start, end, output.num_prefill_tokens, output.num_decode_tokens, output.num_requests)
        with self.reported:
            report = self.report
            report["steps"].append(step)
            for request_id, (ids, times, *rest) in tokens.items():
                earlier = report["tokens"].get(request_id)
                report["tokens"][request_id] = (
                    (earlier[0] + ids, earlier[1] + times, *rest) if earlier else (ids, times, *rest)
                )
            report["finished"] += finished
            report["kv_events"].update(events)
            self.reported.notify_all()


class RayReplica:
    """The driver's record of one actor (inferlab.core.routing.ReplicaState): the gauges and cached
    block hashes it last reported, and the requests it holds."""

    def __init__(self, replica_id: int, actor, info: dict, offset: float, role: str | None = None):
        self.replica_id = replica_id
        self.view = ReplicaView(self)  # what a router is given of it
        self.role = role  # "prefill" or "decode" in a disaggregated cluster
        self.actor = actor
        self.num_blocks = info["num_blocks"]
        self.block_size = info["block_size"]
        self.offset = offset  # driver clock - actor clock
        self.alive = True
        self.num_waiting = self.num_running = 0
        self.num_free_blocks = self.num_blocks
        self.num_preemptions = 0  # as its latest poll said
        self.reported_queued_tokens = self.reported_outstanding_tokens = 0  # as its latest poll said
        # A decode replica's requests still being prefilled elsewhere (by id): its load to come
        self.incoming: dict[int, Request] = {}
        self.cached: set[int] = set()  # the block hashes its prefix cache holds, as its KV events say
        self.requests: dict[int, Request] = {}  # in flight there
        self.stats = EngineStats()
        self.prefix: tuple[int, int] | None = None
        self.poll = None  # the poll in flight: a concurrent.futures.Future of its report
        self.num_messages = 0  # add, take and abort calls sent to its actor: the next one's number

    @property
    def num_queued_prompt_tokens(self) -> int:
        return self.reported_queued_tokens + sum(r.num_prompt_tokens for r in self.incoming.values())

    @property
    def num_outstanding_tokens(self) -> int:
        incoming = sum(r.num_prompt_tokens + r.params.max_tokens for r in self.incoming.values())
        return self.reported_outstanding_tokens + incoming

    def cached_prefix_tokens(self, request: RoutedRequest) -> int:
        return cached_prefix_from_names(request, self.block_size, self.cached)


class RayFleet:
    """The actors of a Ray cluster, as the Cluster drives them."""

    virtual = False
    simulated = False

    def __init__(
        self,
        model_path,
        settings: dict,
        replicas: int,
        gpus_per_replica: float,
        ray_address,
        registry,
        roles: list[str] | None = None,
        kv_transfer: tuple[str, dict] | None = None,
    ):
        """roles: each replica's, when prefill is split from decode; kv_transfer: the plugin's name
        and options every actor builds its own from (distributed: an address of None has the driver
        choose one; world_size is the number of replicas)."""
        try:
            import ray
        except ImportError:
            raise ImportError(
                'cluster.backend=ray needs Ray: pip install -e ".[cluster]" (or pip install ray)'
            ) from None
        self.ray = ray
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
        self.actors = []
        self.kv_address = None  # the KV transfer's rendezvous address (roles)
        try:
            gpus = ray.cluster_resources().get("GPU", 0)
            if replicas * gpus_per_replica > gpus:  # the actors would wait for GPUs forever
                raise ValueError(
                    f"cluster.gpus_per_replica={gpus_per_replica} asks for {replicas * gpus_per_replica:g} GPUs for "
                    f"{replicas} replicas, but the Ray cluster has {gpus:g}; lower it (0.5: two replicas a GPU; 0 for "
                    "replicas on CPUs)"
                )
            # num_cpus=0: an actor's engine threads are its own business, and Ray would otherwise hold
            # actors back on a machine with fewer CPUs than replicas
            remote = ray.remote(ReplicaActor).options(num_gpus=gpus_per_replica, num_cpus=0, max_concurrency=8)
            self.actors = [remote.remote(model_path, dict(settings)) for _ in range(replicas)]
            infos = ray.get([actor.info.remote() for actor in self.actors])
            self.replicas = []
            node = ray.get_runtime_context().get_node_id()
            for i, (actor, info) in enumerate(zip(self.actors, infos)):
                offset = 0.0  # perf_counter is one clock for every process of a machine
                if info["node"] != node:  # another machine's: estimated from a round trip
                    before = perf_counter()
                    actor_clock = ray.get(actor.clock.remote())
                    offset = (before + perf_counter()) / 2 - actor_clock
                self.replicas.append(RayReplica(i, actor, info, offset, roles[i] if roles else None))
            if roles is not None:
                self._connect(infos, node, *kv_transfer)
        except BaseException:
            self._shutdown()
            raise
        front = infos[0]
        self.front = SimpleNamespace(
            config=front["config"],
            hf_config=front["hf_config"],
            tokenizer=front["tokenizer"],
            model_path=front["model_path"],
        )
        self.next_request_id = 0
        # every request's seed, drawn here as one engine draws them (the actors' own streams would
        # make a request's seed depend on where it was routed, and reading it back cost a round trip)
        self.seed_rng = random.Random(self.front.config.seed)
        self.alive_version = 0  # bumped when an actor dies
        self.outputs: dict[int, dict] = {}  # finished request id -> the result its actor made
        # handed off by their prefill actor, not yet queued on their decode one: id -> (the actor's
        # request, that actor's clock offset)
        self.handed: dict[int, tuple[Request, float]] = {}
        # requests that ended outside a poll (their actor found dead when queueing), for step to report
        self.orphans: list[tuple[RayReplica, list[Request]]] = []
        # replicas whose poll came back (put by Ray's thread as it does), and None for each wake()
        self.reports: queue.SimpleQueue = queue.SimpleQueue()
        for replica in self.replicas:
            self._poll(replica)

    def _connect(self, infos: list[dict], node: str, name: str, options: dict) -> None:
        """Joins every actor to the KV transfer, at once: each actor's join returns only when all
        have joined."""
        options = dict(options)
        if options.get("address") is None:
            if all(info["node"] == node for info in infos):  # one machine: the loopback
                options["address"] = f"127.0.0.1:{free_port()}"
            else:  # endpoint 0 serves the rendezvous store on its machine
                options["address"] = self.ray.get(self.actors[0].free_address.remote())
        self.kv_address = options["address"]
        timeout = options.get("timeout_s", 60.0) + 60
        self.ray.get([actor.connect.remote(name, options, i) for i, actor in enumerate(self.actors)], timeout=timeout)

    # -- requests ---------------------------------------------------------------------------

    def make_request(self, prompt, params: SamplingParams, priority: int, metadata, arrival_time: float) -> Request:
        """The driver's copy of a request: its token ids (which the router reads) and settings. The
        replica's engine checks it in full when it is queued there."""
        check_request_arguments(params, priority, metadata, arrival_time)
        config, vocab = self.front.config, self.front.hf_config.vocab_size
        if isinstance(prompt, str):
            token_ids = self.front.tokenizer.encode(prompt)
        elif isinstance(prompt, BlockPrompt):
            token_ids = prompt
        else:
            token_ids = as_token_ids(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if not isinstance(token_ids, BlockPrompt) and outside_range(token_ids, vocab):
            raise ValueError(f"token ids are outside the vocabulary: ids must be in [0, {vocab})")
        if len(token_ids) > config.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len={config.max_model_len}")
        request_id = self.next_request_id
        self.next_request_id += 1
        seed = draw_seed(params, self.seed_rng)
        return Request(
            request_id,
            token_ids,
            params,
            arrival_time=arrival_time,
            priority=priority,
            metadata=metadata,
            eos_token_id=self.front.tokenizer.eos_token_id,
            max_model_len=config.max_model_len,
            seed=seed,
        )

    def queue(self, replica: RayReplica, request: Request, at: float | None = None) -> None:
        """Sends the request to its actor without waiting: what its engine refuses comes back with
        the actor's next poll and fails the request then; a dead actor fails it at that poll too.
        One with kv_receive set goes as its prefill actor handed it off, its times moved to this
        actor's clock, and waits for the actor's checks (their error raised here)."""
        prompt = request.token_ids.prompt if hasattr(request.token_ids, "prompt") else request.token_ids
        try:
            if request.kv_receive is not None:
                moved, offset = self.handed.pop(request.request_id)
                shift = offset - replica.offset
                moved.arrival_time += shift
                moved.token_times = [t + shift for t in moved.token_times]
                if moved.first_scheduled_time is not None:
                    moved.first_scheduled_time += shift
                moved.kv_send, moved.kv_receive, moved.finish_reason, moved.finish_time = (
                    None,
                    request.kv_receive,
                    None,
                    None,
                )
                self.ray.get(self._send(replica, replica.actor.take, moved))
                request.status, request.finish_reason, request.finish_time = WAITING, None, None
            else:
                self._send(
                    replica,
                    replica.actor.add,
                    request.request_id,
                    prompt,
                    request.params,
                    request.priority,
                    request.metadata,
                    request.arrival_time - replica.offset,
                    request.kv_send,
                    request.seed,
                )
        except self.ray.exceptions.RayActorError as e:
            self.orphans.append((replica, self._die(replica, e)))
            raise ValueError(died(replica, e)) from None
        except self.ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None
        replica.requests[request.request_id] = request
        replica.num_waiting += 1

    def _send(self, replica: RayReplica, method, *args):
        """Calls the actor's method with the next number of the messages it passes to its engine in
        order; one that could not be sent (its arguments would not pickle) gives its number back."""
        number = replica.num_messages
        replica.num_messages += 1
        try:
            return method.remote(number, *args)
        except BaseException:
            replica.num_messages = number  # the actor must not wait for a message never sent
            raise

    def expect(self, replica: RayReplica, request: Request) -> None:
        """The request, routed to the replica as its decode replica, counts in its load from now."""
        replica.incoming[request.request_id] = request

    def unexpect(self, replica: RayReplica, request: Request) -> None:
        """It no longer does: it reached the replica, or ended on its prefill replica."""
        replica.incoming.pop(request.request_id, None)

    def cancel_move(self, move: KVMove) -> None:
        """The move's receiver will never take its blocks: its sender frees them."""
        sender = self.replicas[move.sender]
        self.handed.pop(move.request_id, None)
        if sender.alive:
            sender.actor.cancel_move.remote(move)

    def abort(self, replica: RayReplica, request_id: int) -> bool:
        request = replica.requests.pop(request_id, None)
        if request is None:
            return False
        request.status, request.finish_reason, request.finish_time = FINISHED, "abort", perf_counter()
        if replica.alive:
            self._send(replica, replica.actor.abort, request_id)
        if request.kv_receive is not None:  # its decode replica may never have asked for the blocks
            self.cancel_move(request.kv_receive)
        return True

    # -- the loop -----------------------------------------------------------------------------

    def forget_probes(self, request: Request, chosen: RayReplica | None) -> None:
        """Nothing to forget: the driver's answers asked no actor."""

    def clock(self) -> float:
        return perf_counter()

    def wait_until(self, t: float) -> None:
        remaining = t - perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def next_step_time(self) -> float:
        return float("inf")

    def idle(self) -> bool:
        return not any(replica.requests for replica in self.replicas)

    def step(self, until: float | None = None) -> list[tuple[RayReplica, StepOutput, StepOutput, list]]:
        """What the actors reported within POLL_S, or by `until` if sooner (the caller's next
        arrival, to be routed on time), or before wake() (a request the caller was just given), as
        LocalFleet.step gives its runs: a run of one for each step they took."""
        return [(replica, output, output, [(start, end)]) for replica, output, start, end in self._steps(until)]

    def _steps(self, until: float | None) -> list[tuple[RayReplica, StepOutput, float, float]]:
        now = perf_counter()
        steps = [(replica, StepOutput(ended, 0, 0, 0), now, now) for replica, ended in self.orphans if ended]
        self.orphans = []
        if not any(replica.alive and replica.poll is not None for replica in self.replicas):
            return steps
        timeout = POLL_S if until is None else min(POLL_S, until - perf_counter())
        ready = []
        try:  # the first report (or a wake), then whatever else is ready too
            ready.append(self.reports.get(timeout=timeout) if timeout > 0 else self.reports.get_nowait())
            while True:
                ready.append(self.reports.get_nowait())
        except queue.Empty:
            pass
        for replica in ready:
            if replica is None or not replica.alive or replica.poll is None:  # a wake, or found dead meanwhile
                continue
            poll, replica.poll = replica.poll, None
            try:
                report = poll.result()
            except self.ray.exceptions.RayActorError as e:
                finished = self._die(replica, e)
                steps.append((replica, StepOutput(finished, 0, 0, 0), perf_counter(), perf_counter()))
                continue
            steps += self._apply(replica, report)
            self._poll(replica)
        return steps

    def wake(self) -> None:
        """Ends a step's wait for reports now, or the next step's if none is waiting (any thread)."""
        self.reports.put(None)

    def _poll(self, replica: RayReplica) -> None:
        """Asks the actor for its next report; Ray's thread queues the replica in self.reports when
        it comes, so that a step waits for reports and wakes alike (ray.wait waits for Ray objects
        alone)."""
        poll = replica.poll = replica.actor.poll.remote(POLL_S).future()
        poll.add_done_callback(lambda _, replica=replica: self.reports.put(replica))

    def _apply(self, replica: RayReplica, report: dict) -> list[tuple[RayReplica, StepOutput, float, float]]:
        offset = replica.offset
        for request_id, (ids, times, first_scheduled, cached, preemptions, *moved) in report["tokens"].items():
            request = replica.requests.get(request_id)
            if request is None:
                continue
            if request.kv_receive is not None and ids:  # decoding here: its K/V arrived
                request.kv_receive = None
                request.kv_transfer_s, request.kv_transfer_bytes = moved
            request.status = RUNNING
            request.token_ids += ids
            # another machine's clock, estimated, must not put a request's events before its arrival
            arrival = request.arrival_time
            request.token_times += [max(t + offset, arrival) for t in times]
            if first_scheduled is not None:
                request.first_scheduled_time = max(first_scheduled + offset, arrival)
            request.num_cached_tokens, request.num_preemptions = cached, preemptions
        finished = []
        for request_id, reason, error, finish_time, output in report["finished"]:
            request = replica.requests.pop(request_id, None)
            if request is None:
                if reason == HANDOFF:  # aborted here meanwhile: no decode replica will ask for its blocks
                    replica.actor.cancel_move.remote(pickle.loads(output).kv_send)
                continue
            request.status, request.finish_reason, request.error = FINISHED, reason, error
            request.finish_time = max(finish_time + offset, request.arrival_time)
            if reason == HANDOFF:
                self.handed[request_id] = (pickle.loads(output), offset)
            else:
                self.outputs[request_id] = output
            finished.append(request)
        for request_id, why, refused_time in report["refused"]:
            request = replica.requests.pop(request_id, None)
            if request is None:  # aborted meanwhile
                continue
            move = request.kv_receive
            if move is None:
                why = f"replica {replica.replica_id} refused the request: {why}"
            else:  # a handed-off one: its prefill replica holds its blocks still
                why = KVHandoff.why(move, f"decode replica {replica.replica_id} refused the request: {why}")
                request.kv_receive = None
                self.cancel_move(move)
            request.status, request.finish_reason, request.error = FINISHED, "error", why
            request.finish_time = max(refused_time + offset, request.arrival_time)
            self.outputs[request_id] = LLMEngine.error_output(why)
            finished.append(request)
        for name, cached in report["kv_events"].items():
            (replica.cached.add if cached else replica.cached.discard)(name)
        gauges = report["gauges"]
        replica.num_waiting, replica.num_running = gauges["num_waiting"], gauges["num_running"]
        replica.num_free_blocks, replica.num_preemptions = gauges["num_free_blocks"], gauges["num_preemptions"]
        replica.reported_queued_tokens = gauges["num_queued_prompt_tokens"]
        replica.reported_outstanding_tokens = gauges["num_queued_prompt_tokens"] + gauges["num_pending_output_tokens"]
        replica.stats, replica.prefix = report["stats"], report["prefix"]
        steps = report["steps"] or [(perf_counter() - offset,) * 2 + (0, 0, 0)]
        out = []
        for i, (start, end, prefill, decode, num_requests) in enumerate(steps):
            last = i == len(steps) - 1
            out.append(
                (
                    replica,
                    StepOutput(finished if last else [], prefill, decode, num_requests),
                    start + offset,
                    end + offset,
                )
            )
        return out

    def _die(self, replica: RayReplica, error: Exception) -> list[Request]:
        """A dead actor: its requests end with an error naming it, and the router no longer sees it."""
        replica.alive = False
        self.alive_version += 1
        why = died(replica, error)
        finished = []
        for request in replica.requests.values():
            move = request.kv_receive
            message = why if move is None else KVHandoff.why(move, why)  # its K/V was still on the way
            request.status, request.finish_reason, request.error = FINISHED, "error", message
            request.finish_time = perf_counter()
            self.outputs[request.request_id] = LLMEngine.error_output(message)
            finished.append(request)
            if move is not None:
                self.cancel_move(move)
        replica.requests.clear()
        replica.incoming.clear()
        return finished

    def output(self, request: Request) -> dict:
        output = self.outputs.pop(request.request_id, None)
        return output if output is not None else LLMEngine.error_output(request.error or "no result")

    # -- figures and lifetime -----------------------------------------------------------------

    def _live(self):
        return [replica for replica in self.replicas if replica.alive]

    def on_front(self, read):
        return self.ray.get(self._live()[0].actor.call.remote(read))

    def warm_up(self, prompt, params: SamplingParams) -> None:
        self.ray.get([replica.actor.warm_up.remote(prompt, params) for replica in self._live()])

    def running_requests(self) -> list[Request]:
        return [r for replica in self.replicas for r in replica.requests.values() if r.status is RUNNING]

    def replica_stats(self) -> list[EngineStats]:
        """Each replica's counters, asked of the actors alive (an idle prefill actor counts its
        sends when they end, after its last step), as last reported for the dead."""
        for replica in self._live():
            try:
                replica.stats = self.ray.get(replica.actor.stats.remote())
            except self.ray.exceptions.RayActorError:
                pass  # found dead at its next poll
        return [replica.stats for replica in self.replicas]

    def reset_stats(self) -> None:
        self.ray.get([replica.actor.reset_stats.remote() for replica in self._live()])
        for replica in self.replicas:
            replica.stats = EngineStats()

    def prefix_cache_stats(self) -> tuple[int, int] | None:
        counts = [replica.prefix for replica in self.replicas if replica.alive]
        if any(c is None for c in counts):
            return None
        return sum(hits for hits, _ in counts), sum(queried for _, queried in counts)

    def reset_prefix_cache(self) -> None:
        self.ray.get([replica.actor.reset_prefix_cache.remote() for replica in self._live()])

    def close(self) -> None:
        self._shutdown()

    def _shutdown(self) -> None:
        ray = self.ray
        for actor in self.actors:
            try:
                ray.get(actor.close.remote(), timeout=30)
            except Exception:  # a dead or hung actor: killed below
                pass
            ray.kill(actor)
        self.actors = []
        if self.started_ray:
            ray.shutdown()


def died(replica: RayReplica, error: Exception) -> str:
    """Why a replica's requests failed: it died, and the first line of what Ray said."""
    return (
        f"replica {replica.replica_id} died: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    )


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
