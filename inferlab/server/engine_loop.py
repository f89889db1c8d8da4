"""The thread that owns the engine while it serves.

HTTP handlers never call the engine. They put what they want (add these prompts, abort that
stream) into the loop's inbox, a thread-safe queue; one thread takes it between steps, calls
`engine.step()` while requests are pending (waking a step that waits, such as a Ray cluster's
for its actors' reports, when something is put in the inbox), and after each step sends every followed request's
newly known tokens to its stream: one hand-over to the event loop carries the updates of all
streams (call_soon_threadsafe, at most once a step), so that the engine's per-step cost of
streaming is a pass over the requests that ran.
"""

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from inferlab.core.engine import older_objects_frozen
from inferlab.core.protocols import PrefixCacheStats, WakeableStep
from inferlab.core.request import Request, RequestStatus
from inferlab.core.sampling_params import SamplingParams

log = logging.getLogger("inferlab")

FINISHED = RequestStatus.FINISHED
IDLE_POLL_S = 0.1  # how often an idle loop looks at its shutdown deadline


@dataclass(slots=True)
class Prompt:
    """One engine request to add: its token ids and how it samples and is scheduled."""

    token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    metadata: dict | None = None


@dataclass(slots=True)
class Finish:
    """How a request ended, with the engine's figures for it. reason: "stop", "length",
    "abort" or "error" (then error says why)."""

    reason: str
    queue_s: float | None = None  # from arrival to first scheduled, on the engine's clock
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: str | None = None


@dataclass(slots=True)
class Refused:
    """The loop could not add a stream's prompts (the engine refused one); none of them runs."""

    error: Exception


ACCEPTED = "accepted"  # the first update of a stream whose prompts were all added


class RequestStream:
    """What one HTTP request receives from the loop, on the event loop's thread: first ACCEPTED
    or Refused, then (choice index, new token ids, Finish or None, their logprobs or None, the
    prompt's logprobs or None) updates in step order. A prompt with params.n choices has n
    consecutive choice indices; logprobs entries are (logprob, top ids, top logprobs), and the
    prompt's (with a None first) come once, with the choice's first update."""

    __slots__ = ("items", "ready")

    def __init__(self):
        self.items: list = []
        self.ready = asyncio.Event()

    async def get(self) -> list:
        """Every update that arrived since the last call (waits for at least one)."""
        await self.ready.wait()
        self.ready.clear()
        items, self.items = self.items, []
        return items


@dataclass(slots=True)
class EngineSnapshot:
    """The engine's gauges after the loop's latest step, read by /metrics and the queue limit."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0


class _Follow:
    """A request the loop streams: its stream, its choice index there and how many of its
    output tokens were sent."""

    __slots__ = ("request", "stream", "index", "num_sent")

    def __init__(self, request: Request, stream: RequestStream, index: int):
        self.request = request
        self.stream = stream
        self.index = index
        self.num_sent = 0


class EngineLoop:
    """Owns the engine on a thread of its own. submit() and abort() are safe from any thread;
    updates reach each stream on the event loop given to start()."""

    def __init__(self, engine, metrics=None):
        self.engine = engine
        self.metrics = metrics  # a ServerMetrics, or None
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        # what ends the engine's wait in a step, so that the inbox is read at once (None: it never waits)
        self.wake = engine.wake if isinstance(engine, WakeableStep) else None
        self.follows: dict[int, _Follow] = {}  # engine request id -> its stream
        self.stream_requests: dict[RequestStream, list[int]] = {}
        self.snapshot = self.gauges()
        self.num_unread_adds = 0  # prompts in the inbox: queued, though the scheduler has not seen them
        self.unread_lock = threading.Lock()
        self.abort_deadline: float | None = None  # set by drain(): in-flight requests end by then
        self.stopping = False
        self.outbox: list = []  # (stream, update) pairs the event loop has not taken yet
        self.outbox_lock = threading.Lock()
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None

    # -- from the event loop (or any thread) ------------------------------------------------

    def start(self, event_loop: asyncio.AbstractEventLoop) -> None:
        self.event_loop = event_loop
        self.thread = threading.Thread(target=self._run, name="inferlab-engine-loop", daemon=True)
        self.thread.start()

    def submit(self, stream: RequestStream, prompts: list[Prompt]) -> None:
        """Queues the prompts of one stream; it receives ACCEPTED or Refused, then tokens."""
        with self.unread_lock:
            self.num_unread_adds += len(prompts)
        self._put((stream, prompts))

    def abort(self, stream: RequestStream, index: int | None = None, reason: str = "abort") -> None:
        """Aborts the stream's unfinished requests (only choice `index` when given), freeing
        their KV blocks; no further updates for them. reason: how the metrics count them ("stop"
        when a stop string ended the text)."""
        self._put((stream, (index, reason)))

    def num_queued(self) -> int:
        """Requests waiting for admission: in the inbox, or in the scheduler's waiting queue."""
        return self.num_unread_adds + self.snapshot.num_waiting

    def num_in_flight(self) -> int:
        """Streams whose requests have not all ended, with prompts still in the inbox."""
        return len(self.stream_requests) + self.num_unread_adds

    def drain(self, timeout_s: float) -> None:
        """In-flight requests may run for timeout_s more; then each is aborted (its stream gets
        a final "abort")."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        self.abort_deadline = deadline if self.abort_deadline is None else min(self.abort_deadline, deadline)
        self._put(None)  # wakes an idle loop

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ends the loop: what is still in flight is aborted with a final event."""
        self.stopping = True
        self._put(None)
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout_s)

    def _put(self, item) -> None:
        """Puts item in the inbox and ends the engine's wait in a step, if it waits."""
        self.inbox.put(item)
        if self.wake is not None:
            self.wake()

    # -- on the loop's thread ---------------------------------------------------------------

    def _run(self) -> None:
        with older_objects_frozen():  # the engine's objects stay out of the collector's walks
            while not self.stopping:
                updates: list = []
                try:
                    self._iterate(updates)
                except Exception as e:  # the engine failed: every request in flight ends with why
                    log.exception("the engine loop failed; failing the %d requests in flight", len(self.follows))
                    self._abort_all(updates, Finish("error", error=f"the engine failed: {type(e).__name__}: {e}"))
                    self._take_snapshot()
                self._post(updates)
            updates = []
            self._read_inbox(updates, block=False)
            self._abort_all(updates, Finish("abort"))
            self._post(updates)

    def _iterate(self, updates: list) -> None:
        """Takes the inbox (waiting for it while the engine is idle), then runs one step."""
        engine = self.engine
        self._read_inbox(updates, block=engine.is_finished())
        if self.abort_deadline is not None and time.monotonic() >= self.abort_deadline:
            self._abort_all(updates, Finish("abort"))
        if not engine.is_finished():
            output = engine.step()
            num_generated = self._fan_out(output.finished, updates)
            self._take_snapshot()
            if self.metrics is not None:
                self.metrics.observe_step(output.num_prefill_tokens + output.num_decode_tokens, num_generated)

    def _post(self, updates: list) -> None:
        """Hands updates to the event loop. It is woken only when it has taken every earlier
        update: while it is behind, later steps' updates join the pending ones (fewer wake-ups,
        each of which costs the engine's thread a hand-over of the GIL)."""
        if not updates:
            return
        with self.outbox_lock:
            wake = not self.outbox
            self.outbox += updates
        if wake:
            try:
                self.event_loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the event loop has closed: nobody is left to read them
                pass

    def _deliver(self) -> None:
        """On the event loop: gives each stream its pending updates."""
        with self.outbox_lock:
            updates, self.outbox = self.outbox, []
        for stream, item in updates:
            stream.items.append(item)
            stream.ready.set()

    def _read_inbox(self, updates: list, block: bool) -> None:
        try:
            items = [self.inbox.get(timeout=IDLE_POLL_S) if block else self.inbox.get_nowait()]
        except queue.Empty:
            return
        try:
            while True:
                items.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        num_adds = 0
        for item in items:
            if item is None:  # a wake-up
                continue
            stream, what = item
            if isinstance(what, list):
                num_adds += len(what)
                self._add(stream, what, updates)
            else:
                self._abort(stream, *what, updates)
        self._take_snapshot()
        with self.unread_lock:  # after the snapshot counts them as waiting
            self.num_unread_adds -= num_adds

    def _add(self, stream: RequestStream, prompts: list[Prompt], updates: list) -> None:
        engine = self.engine
        if self.abort_deadline is not None or self.stopping:
            updates.append((stream, Refused(RuntimeError("the server is shutting down"))))
            return
        request_ids = []
        try:
            for prompt in prompts:
                request_ids.append(
                    engine.add_request(prompt.token_ids, prompt.params, prompt.priority, prompt.metadata)
                )
        except Exception as e:  # mostly ValueError: too large for the whole KV cache
            for request_id in request_ids:
                engine.abort(request_id)
            updates.append((stream, Refused(e)))
            return
        followed = []
        for request_id in request_ids:
            leader = engine.requests[request_id]
            for choice in leader.choices or (leader,):
                self.follows[choice.request_id] = _Follow(choice, stream, len(followed))
                followed.append(choice.request_id)
        self.stream_requests[stream] = followed
        updates.append((stream, ACCEPTED))

    def _abort(self, stream: RequestStream, index: int | None, reason: str, updates: list) -> None:
        for request_id in self.stream_requests.get(stream, ()):
            follow = self.follows.get(request_id)
            if follow is not None and (index is None or follow.index == index):
                self.engine.abort(request_id)
                self._unfollow(follow, Finish(reason), updates, send=False)

    def _abort_all(self, updates: list, finish: Finish) -> None:
        for request_id, follow in list(self.follows.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # a failed engine may not abort cleanly; the stream still gets its end
                log.exception("aborting request %d failed", request_id)
            self._unfollow(follow, finish, updates, send=True)

    def _fan_out(self, finished: list[Request], updates: list) -> int:
        """Sends the tokens each running or just-finished request gained in the step; returns
        how many there were."""
        follows = self.follows
        num_new_tokens = 0
        for requests in (self.running_requests(), finished):
            for request in requests:
                follow = follows.get(request.request_id)
                if follow is None:
                    continue
                known = len(request.token_times)  # the newest token may still be a placeholder
                done = request.status is FINISHED and known == request.num_output_tokens
                if known == follow.num_sent and not done:
                    continue
                start = request.num_prompt_tokens
                tokens = request.token_ids[start + follow.num_sent : start + known]
                logprobs = prompt_logprobs = None
                if request.logprobs is not None:
                    logprobs = request.logprobs[follow.num_sent : known]
                if follow.num_sent == 0:
                    # the first choice computed the prompt's: the others, released after it, show them too
                    prompt_logprobs = (request if request.leader is None else request.leader).prompt_logprobs
                num_new_tokens += known - follow.num_sent
                follow.num_sent = known
                if done:
                    self._unfollow(follow, self._finish(request), updates, False, tokens, logprobs, prompt_logprobs)
                else:
                    updates.append((follow.stream, (follow.index, tokens, None, logprobs, prompt_logprobs)))
        if len(follows) > len(self.engine.requests):  # the engine dropped a request without reporting it
            for follow in [f for id_, f in follows.items() if id_ not in self.engine.requests]:
                self._unfollow(follow, self._finish(follow.request), updates, send=True)
        return num_new_tokens

    @staticmethod
    def _finish(request: Request) -> Finish:
        first = request.first_scheduled_time
        return Finish(
            request.finish_reason or "abort",
            None if first is None else first - request.arrival_time,
            request.num_cached_tokens,
            request.num_preemptions,
            request.error,
        )

    def _unfollow(
        self, follow: _Follow, finish: Finish, updates: list, send: bool, tokens=None, logprobs=None, prompt=None
    ) -> None:
        """Stops following a request and sends its last update with finish: its tokens (and
        logprobs) not yet sent when send, else `tokens`, `logprobs` and `prompt` (logprobs)."""
        request = follow.request
        del self.follows[request.request_id]
        if send:
            known = len(request.token_times)
            start = request.num_prompt_tokens
            tokens = request.token_ids[start + follow.num_sent : start + known]
            if request.logprobs is not None:
                logprobs = request.logprobs[follow.num_sent : known]
            follow.num_sent = known
        updates.append((follow.stream, (follow.index, tokens or [], finish, logprobs, prompt)))
        siblings = self.stream_requests.get(follow.stream)
        if siblings is not None and not any(i in self.follows for i in siblings):
            del self.stream_requests[follow.stream]
        if self.metrics is not None:
            self.metrics.observe_finished(request, finish.reason)

    def running_requests(self) -> list[Request]:
        """The requests whose tokens a step may have advanced."""
        return self.engine.scheduler.running

    def gauges(self) -> EngineSnapshot:
        engine = self.engine
        scheduler, kv = engine.scheduler, engine.kv_manager
        hits, queried = kv.prefix_cache_stats() if isinstance(kv, PrefixCacheStats) else (0, 0)
        return EngineSnapshot(
            len(scheduler.running),
            len(scheduler.waiting),
            kv.num_free_blocks,
            kv.num_blocks,
            scheduler.num_preemptions,
            hits,
            queried,
        )

    def _take_snapshot(self) -> None:
        self.snapshot = self.gauges()


class ClusterLoop(EngineLoop):
    """The loop over a Cluster (inferlab.cluster) instead of one engine: its replicas' running
    requests and their gauges summed; streams are served from whichever replica holds each."""

    def running_requests(self) -> list[Request]:
        return self.engine.running_requests()

    def gauges(self) -> EngineSnapshot:
        return EngineSnapshot(**self.engine.gauges())
