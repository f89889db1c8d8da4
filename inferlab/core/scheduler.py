"""The core scheduler: the mechanism that carries out a scheduler policy's decisions.

Each step it continues the running requests (decodes and unfinished prefill chunks, oldest
admitted first) within the token budget, allocating their KV blocks and preempting the policy's
victim when blocks run out (recompute preemption: the victim's blocks are freed and it waits to
be computed again). Then, unless it had to preempt, it admits waiting requests in the policy's
order while the budget, max_num_seqs and free blocks allow; the last one admitted may get only
part of its prompt (chunked prefill). After the step runs it advances the requests and finishes
them (EOS, stop ids and strings, max_tokens, max_model_len, abort): every finish goes through
`finish`.
"""

from collections import deque
from collections.abc import Callable
from operator import attrgetter

from inferlab.core.batch import ScheduledBatch
from inferlab.core.protocols import (
    BudgetPolicy,
    KVCacheManager,
    ObservingPolicy,
    PreemptivePolicy,
    SchedulerPolicy,
    SchedulerState,
)
from inferlab.core.request import Request, RequestStatus, RequestView

RUNNING, WAITING, FINISHED = RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.FINISHED
VIEW_OF = attrgetter("view")  # a request's view, in C: the waiting queue can hold thousands


class PolicyError(RuntimeError):
    """A scheduler policy returned something the core cannot carry out."""


class SchedulerStallError(RuntimeError):
    """Requests are pending but the scheduler policy let nothing run."""


class Scheduler:
    def __init__(
        self,
        config,
        kv: KVCacheManager,
        policy: SchedulerPolicy,
        *,
        policy_name: str,
        clock: Callable[[], float],
        decode: Callable[[list[int]], str],
    ):
        """clock: the engine's time in seconds; decode: token ids to text, for stop strings."""
        self.kv = kv
        self.policy = policy
        self.policy_name = policy_name
        self.clock = clock
        self.decode = decode
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.preemptive = isinstance(policy, PreemptivePolicy)
        self.budgeted = isinstance(policy, BudgetPolicy)
        self.observing = isinstance(policy, ObservingPolicy)
        self.waiting: deque[Request] = deque()  # arrival order, preempted requests in front
        # The waiting requests' views as the policy is given them, kept while the queue does not
        # change: under overload the queue is long and most steps admit nobody.
        self._waiting_views: tuple[RequestView, ...] | None = None
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0
        self.num_steps = 0

    # -- requests in and out ------------------------------------------------------------------

    def add(self, request: Request, front: bool = False) -> None:
        """Queues a request: at the back, or in front (choices of a prompt whose first choice ran)."""
        request.status = WAITING
        request.view = RequestView(request, self.kv)
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)
        self._waiting_views = None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Ends a waiting or running request now and frees what it holds."""
        if request.status is FINISHED:
            return
        if request.status is RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
            self._waiting_views = None
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = FINISHED
        request.finish_reason = reason
        request.finish_time = self.clock()

    def abort(self, request: Request) -> bool:
        """Finishes the request with reason "abort"; False if it had finished already."""
        if request.status is FINISHED:
            return False
        self.finish(request, "abort")
        return True

    # -- one step -----------------------------------------------------------------------------

    def state(self, now: float) -> SchedulerState:
        return SchedulerState(
            now=now,
            step=self.num_steps,
            running=tuple(r.view for r in self.running),
            num_waiting=len(self.waiting),
            num_free_blocks=self.kv.num_free_blocks,
            num_blocks=self.kv.num_blocks,
            block_size=self.kv.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )

    def schedule(self) -> ScheduledBatch:
        """The next step: which requests compute how many tokens, their KV blocks allocated."""
        step = _Step(self)
        self.num_steps += 1
        budget = self.max_num_batched_tokens
        if self.budgeted:
            budget = self.policy.token_budget(step.state())
            if not isinstance(budget, int) or budget < 1:
                raise PolicyError(
                    f"scheduler {self.policy_name!r} returned a token budget of {budget!r}; give an int >= 1"
                )
        step.budget = budget
        self._continue_running(step)
        if self.waiting and not step.preempted and step.budget > 0:
            if len(self.running) < self.max_num_seqs or self.preemptive:
                self._admit(step)
        if self.observing and step.requests:
            self.policy.observe(tuple((r.view, n) for r, n in zip(step.requests, step.counts)), step.state())
        kv = self.kv
        return ScheduledBatch(step.requests, step.counts, [kv.block_table(r) for r in step.requests])

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        remaining = len(request.token_ids) - num_computed
        num_tokens = remaining if remaining < budget else budget
        if self.budgeted and remaining > 1:
            chunk = self.policy.chunk_size(request.view, budget)
            if not isinstance(chunk, int) or chunk < 1:
                raise PolicyError(
                    f"scheduler {self.policy_name!r} returned a chunk size of {chunk!r}; give an int >= 1"
                )
            num_tokens = min(num_tokens, chunk)
        return num_tokens

    def _continue_running(self, step: "_Step") -> None:
        # The hot loop of every decode step: one pass over the running requests, in admission order.
        running, allocate, num_new_tokens = self.running, self.kv.allocate, self._num_new_tokens
        requests, counts = step.requests, step.counts
        i = 0
        while i < len(running) and step.budget > 0:
            request = running[i]
            num_tokens = num_new_tokens(request, request.num_computed_tokens, step.budget)
            while not allocate(request, num_tokens):
                victim = self._own(
                    self.policy.preemption_victim(tuple(r.view for r in running), step.state()),
                    RUNNING,
                    "preemption_victim",
                )
                if running.index(victim) < i:
                    i -= 1
                self._preempt(victim, step)
                if victim is request:
                    break
            else:
                requests.append(request)
                counts.append(num_tokens)
                step.budget -= num_tokens
                i += 1
        step.invalidate()

    def _admit(self, step: "_Step") -> None:
        if self._waiting_views is None:
            self._waiting_views = tuple(map(VIEW_OF, self.waiting))
        order = self.policy.admission_order(self._waiting_views, step.state())
        try:
            order = iter(order)
        except TypeError:
            raise PolicyError(
                f"scheduler {self.policy_name!r}: admission_order returned {order!r}, not the waiting "
                f"requests' views to admit (a list, possibly empty, or another iterable)"
            ) from None
        kv = self.kv
        admitted: list[Request] = []
        try:
            for view in order:
                if step.budget <= 0:
                    break
                if isinstance(view, RequestView) and view._request.status is RUNNING and view._request in admitted:
                    raise PolicyError(
                        f"scheduler {self.policy_name!r}: admission_order listed request "
                        f"{view.request_id} twice; each waiting request may appear once"
                    )
                request = self._own(view, WAITING, "admission_order")
                if len(self.running) >= self.max_num_seqs and not self._make_room(view, step, admitted):
                    break
                while True:
                    # prompt logprobs need every prompt token's logits: computed, not taken from the cache
                    cached = kv.num_cached_prefix_tokens(request) if request.prompt_logprobs is None else 0
                    num_tokens = self._num_new_tokens(request, cached, step.budget)
                    if kv.allocate(request, num_tokens, cached):
                        break
                    if not self._make_room(view, step, admitted):
                        num_tokens = 0
                        break
                if not num_tokens:
                    break
                request.status = RUNNING
                request.num_computed_tokens = request.num_cached_tokens = cached
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = step.now
                self.running.append(request)
                admitted.append(request)
                step.add(request, num_tokens)
        finally:  # also when a policy raises midway: an admitted request must not stay in the queue
            if admitted:
                self._remove_waiting(admitted)

    def _make_room(self, view: RequestView, step: "_Step", admitted: list[Request]) -> bool:
        """Asks a preemptive policy for a running request to give way to `view`; False if it
        names none (or the policy never preempts)."""
        if not self.preemptive:
            return False
        candidates = tuple(r.view for r in self.running if r not in admitted)
        if not candidates:
            return False
        choice = self.policy.preempts(view, candidates, step.state())
        if choice is None:
            return False
        victim = self._own(choice, RUNNING, "preempts")
        if victim in admitted:
            raise PolicyError(f"scheduler {self.policy_name!r}: preempts named a request admitted this step")
        self._preempt(victim, step)
        return True

    def _preempt(self, request: Request, step: "_Step") -> None:
        step.remove(request)
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._waiting_views = None
        step.preempted = True

    def _remove_waiting(self, admitted: list[Request]) -> None:
        self._waiting_views = None
        waiting = self.waiting
        if all(waiting[i] is r for i, r in enumerate(admitted)):  # admitted in queue order: FCFS
            for _ in admitted:
                waiting.popleft()
        else:
            taken = set(map(id, admitted))
            self.waiting = deque(r for r in waiting if id(r) not in taken)

    def _own(self, view, status: RequestStatus, method: str) -> Request:
        """The request behind a view a policy returned, checked to be one it was offered."""
        request = view._request if isinstance(view, RequestView) else None
        if request is None or request.status is not status or request.view is not view or view._kv is not self.kv:
            raise PolicyError(
                f"scheduler {self.policy_name!r}: {method} returned {view!r}, which is not one of the "
                f"{status.value} requests it was given"
            )
        return request

    # -- after the step -----------------------------------------------------------------------

    def advance(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[tuple[Request, int, int]]:
        """Counts the step's tokens as computed and appends each request's new token, which may
        be a placeholder (negative) under overlap scheduling. A request reaching max_tokens or
        max_model_len finishes now, so that it is not scheduled again; it is reported by
        resolve. Returns (request, row, position) of every appended token, for resolve."""
        appended = []
        commit = self.kv.commit
        for row, (request, num_tokens, token) in enumerate(zip(batch.requests, batch.num_scheduled_tokens, sampled)):
            if request.status is not RUNNING:  # finished (aborted, a stop) while its step ran
                continue
            request.num_computed_tokens += num_tokens
            commit(request)
            if token is None:
                continue
            token_ids = request.token_ids
            appended.append((request, row, len(token_ids)))
            token_ids.append(token)
            if len(token_ids) - request.num_prompt_tokens >= request.params.max_tokens or (
                request.max_model_len is not None and len(token_ids) >= request.max_model_len
            ):
                self.finish(request, "length")
        return appended

    def resolve(self, appended: list[tuple[Request, int, int]], tokens: list[int | None]) -> list[Request]:
        """Writes the sampled tokens in place of what advance appended, records when they became
        known and applies the stop conditions. Returns the requests that finished."""
        now = self.clock()
        finished = []
        for request, row, position in appended:
            token = tokens[row]
            request.token_ids[position] = token
            request.token_times.append(now)
            params = request.params
            stops = (token == request.eos_token_id and not params.ignore_eos) or (
                params.stop_token_ids and token in params.stop_token_ids
            )
            if request.status is FINISHED:
                if request.finish_reason == "length":
                    if stops:
                        request.finish_reason = "stop"  # the token decides, as when it was known at once
                    finished.append(request)
            elif stops or (params.stop and self._hits_stop_string(request)):
                self.finish(request, "stop" if request.error is None else "error")
                finished.append(request)
        return finished

    def _hits_stop_string(self, request: Request) -> bool:
        """Whether the newest tokens complete a stop string; True too when they cannot be decoded,
        with request.error saying why: that request fails alone, the others go on."""
        # A stop string of m characters spans at most m tokens; a few more cover merges at the edge.
        stop = request.params.stop
        longest = max(len(s) for s in stop)
        try:
            tail = self.decode(
                request.token_ids[max(request.num_prompt_tokens, len(request.token_ids) - longest - 4) :]
            )
        except Exception as e:
            request.error = f"decoding its newest tokens for the stop strings failed: {type(e).__name__}: {e}"
            return True
        return any(s in tail for s in stop)


class _Step:
    """The step being scheduled: its requests and token counts, the budget left, and the policy's
    view of the queues (built on first use, again after they change)."""

    __slots__ = ("scheduler", "now", "requests", "counts", "budget", "preempted", "_state")

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.now = scheduler.clock()
        self.requests: list[Request] = []
        self.counts: list[int] = []
        self.budget = 0
        self.preempted = False
        self._state: SchedulerState | None = None

    def state(self) -> SchedulerState:
        if self._state is None:
            self._state = self.scheduler.state(self.now)
        return self._state

    def add(self, request: Request, num_tokens: int) -> None:
        self.requests.append(request)
        self.counts.append(num_tokens)
        self.budget -= num_tokens
        self._state = None  # running and free blocks changed

    def invalidate(self) -> None:
        """The queues or free blocks changed: the policy's view is built again when next asked."""
        self._state = None

    def remove(self, request: Request) -> None:
        """Takes a preempted request out of the step, if it was in it."""
        self._state = None
        for i, r in enumerate(self.requests):
            if r is request:
                del self.requests[i]
                self.budget += self.counts.pop(i)
                return
