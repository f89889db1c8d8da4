"""Replicas as Ray actors (`cluster.backend=ray`): each actor holds an engine and a thread that
steps it; the driver routes, sends each request to its actor, and polls the actors for what their
steps did: tokens, finished requests (with their results), gauges for the router's views, counters,
and the KV events that tell which block hashes each replica's prefix cache holds.

Ray is an optional extra (`pip install -e ".[cluster]"`), imported only here. The actors build
their engines from the installed plugins (a registry made by hand in the driver cannot travel);
the router runs in the driver. Times come back on the driver's clock: each actor's perf_counter is
offset by what a round trip measured when it started.
"""

import queue
import threading
import time
from time import perf_counter
from types import SimpleNamespace

from inferlab.core.blocks import BlockPrompt
from inferlab.core.engine import EngineStats, LLMEngine, StepOutput, as_token_ids, outside_range
from inferlab.core.protocols import KVCacheEvents, PrefixCacheStats
from inferlab.core.request import Request, RequestStatus
from inferlab.core.routing import RoutedRequest, cached_prefix_from_names
from inferlab.core.sampling_params import SamplingParams

POLL_S = 0.01  # how long the driver waits for a report before it looks at its own inbox again
IDLE_WAIT_S = 0.05  # how long an idle actor waits for work before it looks at its stop flag
WAITING, RUNNING, FINISHED = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.FINISHED


class ReplicaActor:
    """One replica, inside a Ray actor (threaded: poll, add and abort are served while the engine's
    thread steps)."""

    def __init__(self, model_path, settings: dict):
        self.engine = engine = LLMEngine(model_path, **settings)
        self.kv_events = isinstance(engine.kv_manager, KVCacheEvents)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
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

    def clock(self) -> float:
        return perf_counter()

    def add(self, request_id: int, prompt, params: SamplingParams, priority: int, metadata, arrival_time: float) -> int:
        """Makes the request (every check the engine makes) and queues it for the engine's thread;
        returns the seed it samples with. Raises what make_request raises."""
        request = self.engine.make_request(prompt, params, priority, metadata, arrival_time)
        request.request_id = request_id  # the cluster's id (make_request's counter is this actor's own)
        self.inbox.put(("add", request))
        return request.seed

    def abort(self, request_id: int) -> None:
        self.inbox.put(("abort", request_id))

    def poll(self, timeout: float) -> dict:
        """What the engine's steps did since the previous poll (waits up to timeout for a step)."""
        with self.reported:
            if not self.report["steps"] and not self.report["finished"]:
                self.reported.wait(timeout)
            report, self.report = self.report, self._empty_report()
        engine = self.engine
        scheduler, kv = engine.scheduler, engine.kv_manager
        report["gauges"] = {
            "num_waiting": len(scheduler.waiting),
            "num_running": len(scheduler.running),
            "num_free_blocks": kv.num_free_blocks,
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

    def reset_stats(self) -> None:
        self.engine.stats = EngineStats()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def close(self) -> None:
        self.stopping = True
        self.inbox.put(None)
        self.thread.join(30)
        self.engine.close()

    # -- the engine's thread ----------------------------------------------------------------

    @staticmethod
    def _empty_report() -> dict:
        return {"steps": [], "tokens": {}, "finished": [], "kv_events": {}}

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
                    engine.queue(value)
                    self.sent[value.request_id] = 0
                elif engine.abort(value):
                    self.sent.pop(value, None)
            if engine.is_finished():
                continue
            start = perf_counter()
            output = engine.step()
            end = perf_counter()
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
            )
            self.sent[request.request_id] = known
        finished = []
        for request in output.finished:
            self.sent.pop(request.request_id, None)
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

    def __init__(self, replica_id: int, actor, info: dict, offset: float):
        self.replica_id = replica_id
        self.role = None  # roles run on the local backend (inferlab.conf.cluster.role_problems)
        self.actor = actor
        self.num_blocks = info["num_blocks"]
        self.block_size = info["block_size"]
        self.offset = offset  # driver clock - actor clock
        self.alive = True
        self.num_waiting = self.num_running = 0
        self.num_free_blocks = self.num_blocks
        self.num_queued_prompt_tokens = self.num_outstanding_tokens = 0
        self.cached: set[int] = set()  # the block hashes its prefix cache holds, as its KV events say
        self.requests: dict[int, Request] = {}  # in flight there
        self.stats = EngineStats()
        self.prefix: tuple[int, int] | None = None
        self.poll = None  # the poll in flight

    def cached_prefix_tokens(self, request: RoutedRequest) -> int:
        return cached_prefix_from_names(request, self.block_size, self.cached)


class RayFleet:
    """The actors of a Ray cluster, as the Cluster drives them."""

    virtual = False
    simulated = False

    def __init__(self, model_path, settings: dict, replicas: int, gpus_per_replica: float, ray_address, registry):
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
                self.replicas.append(RayReplica(i, actor, info, offset))
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
        self.alive_version = 0  # bumped when an actor dies
        self.outputs: dict[int, dict] = {}  # finished request id -> the result its actor made
        for replica in self.replicas:
            self._poll(replica)

    # -- requests ---------------------------------------------------------------------------

    def make_request(self, prompt, params: SamplingParams, priority: int, metadata, arrival_time: float) -> Request:
        """The driver's copy of a request: its token ids (which the router reads) and settings. The
        replica's engine checks it in full when it is queued there."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
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
        return Request(
            request_id,
            token_ids,
            params,
            arrival_time=arrival_time,
            priority=priority,
            metadata=metadata,
            eos_token_id=self.front.tokenizer.eos_token_id,
            max_model_len=config.max_model_len,
        )

    def queue(self, replica: RayReplica, request: Request) -> None:
        """Sends the request to its actor, whose engine checks it (its error raised here)."""
        prompt = request.token_ids.prompt if hasattr(request.token_ids, "prompt") else request.token_ids
        try:
            request.seed = self.ray.get(
                replica.actor.add.remote(
                    request.request_id,
                    prompt,
                    request.params,
                    request.priority,
                    request.metadata,
                    request.arrival_time - replica.offset,
                )
            )
        except self.ray.exceptions.RayActorError as e:
            self._die(replica, e)
            raise ValueError(f"replica {replica.replica_id} died: {e}") from None
        except self.ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None
        replica.requests[request.request_id] = request
        replica.num_waiting += 1

    def abort(self, replica: RayReplica, request_id: int) -> bool:
        request = replica.requests.pop(request_id, None)
        if request is None:
            return False
        request.status, request.finish_reason, request.finish_time = FINISHED, "abort", perf_counter()
        if replica.alive:
            replica.actor.abort.remote(request_id)
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

    def step(self) -> list[tuple[RayReplica, StepOutput, float, float]]:
        """What the actors reported within POLL_S: one entry per step they took."""
        polls = {replica.poll: replica for replica in self.replicas if replica.alive and replica.poll is not None}
        if not polls:
            return []
        ready, _ = self.ray.wait(list(polls), num_returns=1, timeout=POLL_S)
        if ready:  # take whatever else is ready too
            ready, _ = self.ray.wait(list(polls), num_returns=len(polls), timeout=0)
        steps = []
        for ref in ready:
            replica = polls[ref]
            replica.poll = None
            try:
                report = self.ray.get(ref)
            except self.ray.exceptions.RayActorError as e:
                finished = self._die(replica, e)
                steps.append((replica, StepOutput(finished, 0, 0, 0), perf_counter(), perf_counter()))
                continue
            steps += self._apply(replica, report)
            self._poll(replica)
        return steps

    def _poll(self, replica: RayReplica) -> None:
        replica.poll = replica.actor.poll.remote(POLL_S)

    def _apply(self, replica: RayReplica, report: dict) -> list[tuple[RayReplica, StepOutput, float, float]]:
        offset = replica.offset
        for request_id, (ids, times, first_scheduled, cached, preemptions) in report["tokens"].items():
            request = replica.requests.get(request_id)
            if request is None:
                continue
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
                continue
            request.status, request.finish_reason, request.error = FINISHED, reason, error
            request.finish_time = max(finish_time + offset, request.arrival_time)
            self.outputs[request_id] = output
            finished.append(request)
        for name, cached in report["kv_events"].items():
            (replica.cached.add if cached else replica.cached.discard)(name)
        gauges = report["gauges"]
        replica.num_waiting, replica.num_running = gauges["num_waiting"], gauges["num_running"]
        replica.num_free_blocks = gauges["num_free_blocks"]
        replica.num_queued_prompt_tokens = gauges["num_queued_prompt_tokens"]
        replica.num_outstanding_tokens = gauges["num_queued_prompt_tokens"] + gauges["num_pending_output_tokens"]
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
        why = f"replica {replica.replica_id} died: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        finished = []
        for request in replica.requests.values():
            request.status, request.finish_reason, request.error = FINISHED, "error", why
            request.finish_time = perf_counter()
            self.outputs[request.request_id] = LLMEngine.error_output(why)
            finished.append(request)
        replica.requests.clear()
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
