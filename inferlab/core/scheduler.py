"""The core scheduler: the mechanism that carries out a scheduler policy's decisions.

Each step it continues the running requests (decodes and unfinished prefill chunks, oldest
admitted first) within the token budget, allocating their KV blocks and preempting the policy's
victim when blocks run out (recompute preemption: the victim's blocks are freed and it waits to
be computed again). Then, unless it had to preempt, it admits waiting requests in the policy's
order while the budget, max_num_seqs and free blocks allow; the last one admitted may get only
part of its prompt (chunked prefill). After the step runs it advances the requests and finishes
them (EOS, stop ids and strings, max_tokens, max_model_len, abort): every finish goes through
`_finish`.

Faults. A request's status is the truth about it: each change (admitted, preempted, finished) is
computed first and applied to the request's fields in one assignment, then the queues follow,
each request entering its new queue before it leaves the old one. The KV manager frees a
request's blocks after the change (to_free; one it fails to free is freed again before the next
step schedules anything). So whatever raises in the middle of a call (a plugin, or any line), the
call's handler (settle) puts every request back in the one queue its status names, with its
progress consistent and its blocks accounted, and the error goes on up. A policy's exception
that one request's fields cause fails that request alone (_ask).

Under prefill/decode disaggregation a request may also leave after its first token (kv_send: it is
handed off, its blocks held in `sending` until the transfer reports them sent) or come with its
prompt's K/V computed elsewhere (kv_receive: admitted by allocating blocks for the prompt, it waits
in `receiving` while they fill, then decodes as if it had computed them). The engine drives the
transfer (inferlab.core.handoff); this module only keeps the books.
"""

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from operator import attrgetter
from typing import TypeVar

from inferlab.core.batch import ScheduledBatch
from inferlab.core.protocols import (
    BlockAligned,
    BudgetPolicy,
    FixedAdmissionOrder,
    KVCacheManager,
    ObservingPolicy,
    PreemptivePolicy,
    PureAdmissionOrder,
    ReadsMetadata,
    SchedulerPolicy,
    SchedulerState,
)
from inferlab.core.request import Request, RequestStatus, RequestView
from inferlab.core.text import TextStream

RUNNING, WAITING, FINISHED = RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.FINISHED
HANDOFF = "handoff"  # the finish_reason of a request handed to another engine after its first token
VIEW_OF = attrgetter("view")  # a request's view, in C: the waiting queue can hold thousands
REQUEST_ID = attrgetter("request_id")
NOBODY: frozenset = frozenset()
# A policy's decision that raised is made again without up to this many of the newest requests it
# was given, to find the ones whose fields caused it.
MAX_SUSPECTS = 64
T = TypeVar("T")


class PolicyError(RuntimeError):
    """A scheduler policy raised, or returned something the core cannot carry out. When the fault
    is one request's, that request fails alone with this error's message."""


class SchedulerStallError(RuntimeError):
    """Requests are pending but the scheduler policy let nothing run."""


class _CannotTell(Exception):
    """A decision that cannot be asked without the requests left out (no candidates remain)."""


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
        # BlockAligned: a step's commit of a request matters only when it filled a block (0: always asked)
        self.commit_stride = kv.block_size if isinstance(kv, BlockAligned) and kv.block_aligned else 0
        self.policy = policy
        self.policy_name = policy_name
        self.clock = clock
        self.decode = decode
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.preemptive = isinstance(policy, PreemptivePolicy)
        self.budgeted = isinstance(policy, BudgetPolicy)
        self.observing = isinstance(policy, ObservingPolicy)
        # whether a run of decode steps may skip asking admission_order where it could admit nothing
        self.pure_admission_order = isinstance(policy, PureAdmissionOrder) and bool(policy.admission_order_is_pure)
        # and whether one call tells what it would put first in each of them
        self.fixed_admission_order = (
            self.pure_admission_order
            and isinstance(policy, FixedAdmissionOrder)
            and bool(policy.admission_order_is_fixed)
        )
        self.metadata_fields = declared_metadata_fields(policy, policy_name)
        self.waiting: deque[Request] = deque()  # arrival order, preempted requests in front
        # The waiting requests' views as the policy is given them, kept while the queue does not
        # change: under overload the queue is long and most steps admit nobody.
        self._waiting_views: tuple[RequestView, ...] | None = None
        self.running: list[Request] = []  # admission order
        # Requests that left the running queue (finished or preempted) whose blocks the KV manager
        # has not freed yet: a free that raised is tried again before anything is scheduled.
        self.to_free: list[Request] = []
        # Requests that ended outside advance and resolve (a policy's fault pinned on them, or
        # finished while a call was cut short), for the engine to report.
        self.ended: list[Request] = []
        # Disaggregation: admitted requests whose prompt's K/V is arriving (by id), requests handed
        # off whose blocks are held until sent (by id), and those handed off since the engine last
        # started sends.
        self.receiving: dict[int, Request] = {}
        self.sending: dict[int, Request] = {}
        self.handed_off: list[Request] = []
        self.num_preemptions = 0
        self.num_steps = 0

    # -- requests in and out ------------------------------------------------------------------

    def check_metadata(self, metadata) -> None:
        """Raises ValueError when a field the policy declares (ReadsMetadata) has another type."""
        for key, types in self.metadata_fields.items():
            if metadata and key in metadata:
                value = metadata[key]
                if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                    allowed = " or ".join(t.__name__ for t in types)
                    raise ValueError(
                        f"metadata[{key!r}] must be {allowed} (scheduler {self.policy_name!r} reads it), "
                        f"got {_clipped(value)}"
                    )

    def add(self, request: Request, front: bool = False) -> None:
        """Queues a request: at the back, or in front (choices of a prompt whose first choice ran)."""
        view = RequestView(request, self.kv)
        # a request handed over by another engine arrives finished there ("handoff") and reported
        request.finish_reason = request.finish_time = None
        request.status, request.view, request.reported, self._waiting_views = WAITING, view, False, None
        # last: until here the request is in no queue and holds nothing
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.receiving)

    def abort(self, request: Request) -> bool:
        """Finishes the request with reason "abort" (listing it in `ended`); False if it had
        finished already."""
        if request.status is FINISHED:
            return False
        self.finish(request, "abort")
        return True

    def finish(self, request: Request, reason: str) -> None:
        """Ends a waiting or running request now with `reason` (an abort, a constraint that
        completes it), listing it in `ended`, and frees its blocks."""
        try:
            self._finish(request, reason, report=True)
            self.release()
        except BaseException:
            self.settle()
            raise

    def _finish(self, request: Request, reason: str, report: bool = False) -> None:
        """Ends a waiting, running or receiving request now (listing it in `ended` when report);
        its blocks are freed by the next release()."""
        if request.status is FINISHED:
            return
        queue = self.running if request.status is RUNNING else self.waiting
        to_free, ended = [*self.to_free, request], [*self.ended, request] if report else self.ended
        request.finish_reason, request.finish_time = reason, self.clock()  # read only once it is finished
        # One assignment on one line (no line event between its stores): all of it happens, or none.
        request.status, request.reported, request.num_computed_tokens, self.to_free, self.ended = (
            FINISHED,
            report,
            0,
            to_free,
            ended,
        )
        if request in queue:  # absent when the call that added it was cut short, or while it receives
            queue.remove(request)
        if queue is self.waiting:
            self._waiting_views = None
        self.receiving.pop(request.request_id, None)

    def release(self) -> None:
        """Has the KV manager free the blocks of the requests in to_free, oldest first. One it
        fails to free stays listed and the error goes up; since a request stays listed until its
        free returns, the KV manager may be asked to free a request it holds nothing for, which
        must then do nothing."""
        while self.to_free:
            self.kv.free(self.to_free[0])
            self.to_free = self.to_free[1:]

    def settle(self) -> None:
        """Puts the books right after a call was cut short: every request in the one queue its
        status names (running in admission order, then those admitted last; preempted ones at the
        front of the waiting queue), a running request's progress short of its tokens (its last
        one is computed again), one at its max_tokens or max_model_len finished, a waiting one
        holding no blocks; then frees what it can. A step's tokens left unresolved are the
        caller's to resolve again (resolve is re-entrant, and reports what finished). A request
        still receiving is one whose K/V has not arrived (kv_receive set), and it is in no other
        queue; one handed off (sending) keeps its blocks."""
        self.receiving = {i: r for i, r in self.receiving.items() if r.status is RUNNING and r.kv_receive is not None}
        receiving = set(self.receiving.values())
        running = dict.fromkeys(r for r in (*self.running, *self.waiting) if r.status is RUNNING and r not in receiving)
        preempted = [r for r in reversed(self.running) if r.status is WAITING]
        waiting = dict.fromkeys(r for r in (*preempted, *self.waiting) if r.status is WAITING)
        for request in dict.fromkeys((*self.running, *self.waiting)):
            if request.status is FINISHED and request not in self.to_free and request.request_id not in self.sending:
                self.to_free = [*self.to_free, request]  # cut short before its queue was left: ended since
        for request in waiting:
            request.num_computed_tokens = 0
            if self.kv.block_table(request) and request not in self.to_free:
                self.to_free = [*self.to_free, request]  # admitted, then cut short before it ran
        self.running, self.waiting, self._waiting_views = list(running), deque(waiting), None
        for request in list(self.running):
            if request.num_computed_tokens >= len(request.token_ids):  # its K/V is there, its sample was lost
                request.num_computed_tokens = len(request.token_ids) - 1
            if self._reached_length(request):  # advance was cut short before it finished it; resolve reports it
                self._finish(request, "length")
        self.release()

    # -- asking the policy --------------------------------------------------------------------

    def _ask(self, method: str, involved: Sequence[Request], call: Callable[[frozenset], T], step: "_Step") -> T:
        """call(left_out): the policy's `method` over the involved requests less those left out.
        Made once with nobody left out; when the policy raises, the fault is pinned on requests if
        it can be: the call is made again without the newest 1, 2, 4, ... involved requests (at
        most MAX_SUSPECTS) until it succeeds, then each left out is put back, oldest first, and
        blamed if the call fails with it. Blamed requests fail alone at the end of the step (their
        error a PolicyError naming the policy, the method and the request); the answer is the
        call's without them. When leaving requests out does not help, the policy's error is
        raised as a PolicyError."""
        try:
            return call(step.blamed)
        except PolicyError:
            raise  # the core's own check of what the policy returned: no request's fault
        except Exception as error:
            first = error
        suspects = sorted((r for r in involved if r not in step.blamed), key=REQUEST_ID, reverse=True)
        suspects = suspects[:MAX_SUSPECTS]
        count, answer, left_out = 1, None, None
        while suspects and left_out is None:
            count = min(count, len(suspects))
            trial = step.blamed | frozenset(suspects[:count])
            try:
                answer, left_out = call(trial), suspects[:count]
            except PolicyError:
                raise
            except Exception:
                if count == len(suspects):
                    break
                count *= 2
        if left_out is None:
            raise PolicyError(
                f"scheduler {self.policy_name!r}: {method} raised {type(first).__name__}: {first}"
            ) from first
        out = set(step.blamed) | set(left_out)
        for request in reversed(left_out):  # oldest first
            out.discard(request)
            try:
                answer = call(frozenset(out))
            except PolicyError:
                raise
            except Exception as error:
                out.add(request)
                step.blame(request, self._blame_message(method, request, error))
        return answer

    def _blame_message(self, method: str, request: Request, error: Exception) -> str:
        return (
            f"PolicyError: scheduler {self.policy_name!r} failed on request {request.request_id} (metadata "
            f"{_clipped(request.metadata)}, priority {request.priority}): its {method} raised "
            f"{type(error).__name__}: {error}; the request failed alone"
        )

    def _fail_blamed(self, step: "_Step") -> None:
        for request in step.blamed:
            step.remove(request)
            if request.status is not FINISHED:
                request.error = step.blame_messages[request]
                self._finish(request, "error", report=True)

    # -- one step -----------------------------------------------------------------------------

    def state(self, now: float, left_out: frozenset = NOBODY) -> SchedulerState:
        return SchedulerState(
            now=now,
            step=self.num_steps,
            running=tuple(r.view for r in self.running if r not in left_out)
            if left_out
            else tuple(map(VIEW_OF, self.running)),
            num_waiting=len(self.waiting),
            num_free_blocks=self.kv.num_free_blocks,
            num_blocks=self.kv.num_blocks,
            block_size=self.kv.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )

    def schedule(self) -> ScheduledBatch:
        """The next step: which requests compute how many tokens, their KV blocks allocated."""
        try:
            self.release()  # blocks a failed free left behind, before any are handed out
            step = _Step(self)
            self.num_steps += 1
            try:
                step.budget = self._token_budget(step) if self.budgeted else self.max_num_batched_tokens
                self._continue_running(step)
                if self.waiting and not step.preempted and step.budget > 0:
                    if len(self.running) < self.max_num_seqs or self.preemptive:
                        self._admit(step)
                if self.observing and step.requests:
                    self._observe(step)
            finally:
                self._fail_blamed(step)
            self.release()
        except BaseException:
            self.settle()
            raise
        return ScheduledBatch(step.requests, step.counts, list(map(self.kv.block_table, step.requests)))

    def _token_budget(self, step: "_Step") -> int:
        budget = self._ask("token_budget", self.running, lambda out: self.policy.token_budget(step.state(out)), step)
        if not isinstance(budget, int) or budget < 1:
            raise PolicyError(f"scheduler {self.policy_name!r} returned a token budget of {budget!r}; give an int >= 1")
        return budget

    def _observe(self, step: "_Step") -> None:
        scheduled = [(r, n) for r, n in zip(step.requests, step.counts)]

        def observe(out: frozenset) -> None:
            self.policy.observe(tuple((r.view, n) for r, n in scheduled if r not in out), step.state(out))

        self._ask("observe", [r for r, _ in scheduled], observe, step)

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int, step: "_Step") -> int:
        remaining = len(request.token_ids) - num_computed
        num_tokens = remaining if remaining < budget else budget
        if self.budgeted and remaining > 1:

            def chunk_size(out: frozenset) -> int:
                if request in out:
                    raise _CannotTell
                return self.policy.chunk_size(request.view, budget)

            try:
                chunk = self._ask("chunk_size", [request], chunk_size, step)
            except PolicyError as e:
                if e.__cause__ is None:
                    raise
                step.blame(request, self._blame_message("chunk_size", request, e.__cause__))
                return 0
            if not isinstance(chunk, int) or chunk < 1:
                raise PolicyError(
                    f"scheduler {self.policy_name!r} returned a chunk size of {chunk!r}; give an int >= 1"
                )
            num_tokens = min(num_tokens, chunk)
        return num_tokens

    def _victim(self, step: "_Step") -> Request | None:
        """The running request the policy preempts when blocks run out; None when every running
        request has been blamed for the policy's failures."""

        def preemption_victim(out: frozenset):
            running = tuple(r.view for r in self.running if r not in out)
            if not running:
                raise _CannotTell
            return self.policy.preemption_victim(running, step.state(out))

        while True:
            try:
                choice = self._ask("preemption_victim", self.running, preemption_victim, step)
                return self._own(choice, RUNNING, "preemption_victim")
            except PolicyError as e:
                suspects = [r for r in self.running if r not in step.blamed]
                if e.__cause__ is None or not suspects:
                    raise
                # it fails with any one of them: the newest is blamed, the choice made among the rest
                newest = max(suspects, key=REQUEST_ID)
                step.blame(newest, self._blame_message("preemption_victim", newest, e.__cause__))
                if len(suspects) == 1:
                    return None

    def _continue_running(self, step: "_Step") -> None:
        # The hot loop of every decode step: one pass over the running requests, in admission order.
        running, allocate = self.running, self.kv.allocate
        requests, counts = step.requests, step.counts
        # BlockAligned: tokens that stay inside the block holding the request's last computed one
        # need no allocate call (it would change nothing): most decode rows
        stride = self.commit_stride
        i = 0
        while i < len(running) and step.budget > 0:
            request = running[i]
            if step.blamed and request in step.blamed:
                i += 1
                continue
            if self.budgeted:
                num_tokens = self._num_new_tokens(request, request.num_computed_tokens, step.budget, step)
            else:  # _num_new_tokens without a policy to ask: what is left, up to the budget
                num_tokens = len(request.token_ids) - request.num_computed_tokens
                if num_tokens > step.budget:
                    num_tokens = step.budget
            if step.blamed and request in step.blamed:
                i += 1
                continue
            if stride:
                offset = request.num_computed_tokens % stride
                if offset and offset + num_tokens <= stride:
                    requests.append(request)
                    counts.append(num_tokens)
                    step.budget -= num_tokens
                    i += 1
                    continue
            while not allocate(request, num_tokens):
                victim = self._victim(step)
                if victim is None or request in step.blamed:
                    break
                position = running.index(victim)
                self._preempt(victim, step)
                if position < i:
                    i -= 1
                if victim is request:
                    break
            else:
                requests.append(request)
                counts.append(num_tokens)
                step.budget -= num_tokens
                i += 1
                continue
            if request in step.blamed:
                i += 1
        step.invalidate()

    def _admission_order(self, step: "_Step") -> list | tuple:
        if self._waiting_views is None:
            self._waiting_views = tuple(map(VIEW_OF, self.waiting))
        views = self._waiting_views

        def admission_order(out: frozenset):
            waiting = tuple(v for v in views if v._request not in out) if out else views
            if not waiting:
                return ()
            order = self.policy.admission_order(waiting, step.state(out))
            try:
                # a lazy order is taken whole here, so that an exception it raises is the call's
                return order if isinstance(order, (list, tuple)) else list(order)
            except TypeError:
                raise PolicyError(
                    f"scheduler {self.policy_name!r}: admission_order returned {order!r}, not the waiting "
                    f"requests' views to admit (a list, possibly empty, or another iterable)"
                ) from None

        return self._ask("admission_order", self.waiting, admission_order, step)

    def first_to_admit(self) -> Request | None:
        """The waiting request a FixedAdmissionOrder policy puts first now (None: it lists none),
        asked outside a step, which its call leaves unchanged. An error the call raises goes up
        (PolicyError where it names no waiting request): the caller leaves it to a step."""
        if self._waiting_views is None:
            self._waiting_views = tuple(map(VIEW_OF, self.waiting))
        view = next(iter(self.policy.admission_order(self._waiting_views, self.state(self.clock()))), None)
        return None if view is None else self._own(view, WAITING, "admission_order")

    def _admit(self, step: "_Step") -> None:
        order = self._admission_order(step)
        kv = self.kv
        admitted: list[Request] = []
        request = None
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
                if request in step.blamed:
                    continue
                if self._num_admitted() >= self.max_num_seqs and not self._make_room(view, step, admitted):
                    if request in step.blamed:
                        continue
                    break
                # A request whose prompt's K/V arrives from another engine takes blocks for the whole
                # prompt (its prefix-cache hits here move no data) and computes nothing this step.
                receives = request.kv_receive is not None
                while True:
                    # prompt logprobs need every prompt token's logits: computed, not taken from the cache
                    cached = kv.num_cached_prefix_tokens(request) if request.prompt_logprobs is None else 0
                    if receives:
                        num_tokens = request.num_prompt_tokens - cached
                        if kv.allocate(request, num_tokens, cached):
                            break
                    else:
                        num_tokens = self._num_new_tokens(request, cached, step.budget, step)
                        if not num_tokens or kv.allocate(request, num_tokens, cached):
                            break
                    if not self._make_room(view, step, admitted):
                        num_tokens, receives = 0, False
                        break
                if request in step.blamed:
                    continue
                if not num_tokens and not receives:
                    break
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = step.now
                request.num_cached_tokens = cached  # its view reads the KV manager's answer until it runs
                if receives:  # it waits for its K/V, holding its blocks and a sequence slot
                    receiving = {**self.receiving, request.request_id: request}
                    request.status, request.num_computed_tokens, self.receiving = RUNNING, cached, receiving  # one line
                    admitted.append(request)
                    step.invalidate()
                    continue
                request.status, request.num_computed_tokens = RUNNING, cached  # one line: all or none
                self.running.append(request)  # in its new queue before admitted takes it out of the old
                admitted.append(request)
                step.add(request, num_tokens)
        except BaseException:
            if request is not None and request.status is WAITING and request not in self.to_free:
                self.to_free = [*self.to_free, request]  # it may hold the blocks just allocated
            raise
        finally:  # also when a policy raises midway: an admitted request must not stay in the queue
            if admitted:
                self._remove_waiting(admitted)

    def _num_admitted(self) -> int:
        """Requests holding a sequence slot: running, or admitted while their K/V arrives."""
        return len(self.running) + len(self.receiving)

    def _make_room(self, view: RequestView, step: "_Step", admitted: list[Request]) -> bool:
        """Asks a preemptive policy for a running request to give way to `view`; False if it
        names none (or the policy never preempts)."""
        if not self.preemptive:
            return False
        candidates = [r for r in self.running if r not in admitted]
        if not candidates:
            return False
        request = view._request

        def preempts(out: frozenset):
            remaining = tuple(r.view for r in candidates if r not in out)
            if not remaining:
                raise _CannotTell
            return self.policy.preempts(view, remaining, step.state(out))

        try:
            choice = self._ask("preempts", candidates, preempts, step)
        except PolicyError as e:
            if e.__cause__ is None:
                raise
            # no running request's absence helps: the request asking for room is the one at fault
            step.blame(request, self._blame_message("preempts", request, e.__cause__))
            return False
        if choice is None or request in step.blamed:
            return False
        victim = self._own(choice, RUNNING, "preempts")
        if victim in admitted:
            raise PolicyError(f"scheduler {self.policy_name!r}: preempts named a request admitted this step")
        self._preempt(victim, step)
        return True

    def _preempt(self, request: Request, step: "_Step") -> None:
        step.remove(request)
        to_free, num_preemptions = [*self.to_free, request], request.num_preemptions + 1
        request.status, request.num_computed_tokens, request.num_preemptions, self.to_free = (
            WAITING,
            0,
            num_preemptions,
            to_free,
        )
        self.num_preemptions += 1
        self._waiting_views = None
        self.waiting.appendleft(request)
        self.running.remove(request)
        step.preempted = True
        self.release()

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

    def advance(
        self, batch: ScheduledBatch, sampled: list[int | None], appended: list | None = None
    ) -> list[tuple[Request, int, int]]:
        """Counts the step's tokens as computed and appends each request's new token, which may
        be a placeholder (negative) under overlap scheduling. A request reaching max_tokens or
        max_model_len finishes now, so that it is not scheduled again; it is reported by
        resolve. Returns (request, row, position) of every appended token, for resolve: the list
        `appended` when given, filled as the tokens are appended (so that a caller holding it
        can resolve what was appended before an exception)."""
        appended = [] if appended is None else appended
        # BlockAligned: a request's commit changes something only when its step filled a block
        stride = self.commit_stride
        filled = []  # the step's requests whose commit is asked, in row order
        try:
            for row, (request, num_tokens, token) in enumerate(
                zip(batch.requests, batch.num_scheduled_tokens, sampled)
            ):
                if request.status is not RUNNING:  # finished (aborted, a stop) while its step ran
                    if not stride or request.num_computed_tokens % stride < num_tokens:
                        filled.append(request)
                    continue
                computed = request.num_computed_tokens = request.num_computed_tokens + num_tokens
                if not stride or computed % stride < num_tokens:
                    filled.append(request)
                if token is None:
                    continue
                token_ids = request.token_ids
                appended.append((request, row, len(token_ids)))
                token_ids.append(token)
                length = len(token_ids)
                if length - request.num_prompt_tokens >= request.params.max_tokens or (
                    request.max_model_len is not None and length >= request.max_model_len
                ):
                    self._finish(request, "length")  # reported by resolve, once its token is known
                elif request.kv_send is not None:
                    self._hold_for_sending(request)
            self._commit(filled)
            self.release()
        except BaseException:
            self.settle()
            raise
        return appended

    def _commit(self, filled: list[Request]) -> None:
        """Tells the KV manager what each request of the step whose commit is asked computed (those
        still running or sending, as they stand after advancing); one that raises for a request
        does not keep the others from theirs, and the first error is raised after."""
        error = None
        commit, sending = self.kv.commit, self.sending
        for request in filled:
            if request.status is RUNNING or request.request_id in sending:
                try:
                    commit(request)
                except Exception as e:
                    error = error or e
        if error is not None:
            raise error

    def _hold_for_sending(self, request: Request) -> None:
        """A request to be handed off has its prompt's K/V and first token: it leaves this engine's
        steps, its blocks held until the transfer reports them sent. resolve hands it off, or
        finishes it here when that first token ends it."""
        self.sending[request.request_id] = request  # first: settle keeps the blocks of those listed
        request.finish_reason, request.finish_time = HANDOFF, self.clock()
        request.status = FINISHED
        self.running.remove(request)

    def release_sent(self, request_id: int) -> None:
        """Frees the blocks of a handed-off request, once the transfer reports them sent (or the
        send failed)."""
        request = self.sending.get(request_id)
        if request is not None:
            self.to_free = [*self.to_free, request]
            del self.sending[request_id]
            self.release()

    def received(self, request: Request) -> None:
        """A receiving request's prompt K/V has arrived: its blocks count as computed (the full ones
        enter the prefix cache) and it decodes on, as the newest running request."""
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.commit(request)
        request.kv_receive = None  # the truth that it has its K/V; preempted later, it is recomputed here
        self.running.append(request)
        del self.receiving[request.request_id]

    def resolve(self, appended: list[tuple[Request, int, int]], tokens: list[int | None]) -> list[Request]:
        """Writes the sampled tokens in place of what advance appended, records when they became
        known and applies the stop conditions. Returns the requests that finished, which are also
        listed in `ended` (for the engine). Each entry is resolved once, its time recorded last: a
        resolve cut short may be called again with the same entries and does the rest."""
        now = self.clock()
        finished = []
        try:
            for request, row, position in appended:
                token_ids = request.token_ids
                if position >= len(token_ids) or len(request.token_times) > position - request.num_prompt_tokens:
                    continue  # not appended after all (advance was cut short), or resolved already
                token = token_ids[position] = tokens[row]
                params = request.params
                stopped = (
                    (token == request.eos_token_id and not params.ignore_eos)
                    or (params.stop_token_ids and token in params.stop_token_ids)
                    or (params.stop and self._hits_stop_string(request, position))
                )
                if stopped and request.finish_reason != HANDOFF:
                    reason = "stop" if request.error is None else "error"
                    if request.status is not FINISHED:
                        self._finish(request, reason)
                    elif request.finish_reason == "length":  # the token decides, as when it was known at once
                        request.finish_reason = reason
                if request.finish_reason == HANDOFF and not request.reported:
                    if stopped:  # its first token ends it here: nothing to hand off
                        request.finish_reason = "stop" if request.error is None else "error"
                        self.release_sent(request.request_id)
                    elif request not in self.handed_off:
                        self.handed_off = [*self.handed_off, request]
                if request.status is FINISHED and not request.reported:
                    request.reported, self.ended = True, [*self.ended, request]  # one line: all or none
                    finished.append(request)
                request.token_times.append(now)
            self.release()
        except BaseException:
            self.settle()
            raise
        return finished

    @staticmethod
    def _reached_length(request: Request) -> bool:
        return request.num_output_tokens >= request.params.max_tokens or (
            request.max_model_len is not None and len(request.token_ids) >= request.max_model_len
        )

    def _hits_stop_string(self, request: Request, position: int) -> bool:
        """Whether the text of the request's tokens up to position completes a stop string: its
        text stream decodes the tokens since the last point where the text was known, however many
        tokens a stop string spans (tokens it has seen already are not pushed again). True too when
        the tokens cannot be decoded, with request.error saying why: that request fails alone."""
        stream = request.stop_text
        if stream is None:
            prompt = request.token_ids[: request.num_prompt_tokens]
            stream = request.stop_text = TextStream(self.decode, prompt, request.params.stop)
        first = request.num_prompt_tokens + stream.num_tokens
        try:
            return stream.push(request.token_ids[first : position + 1])[1]
        except Exception as e:
            request.error = f"decoding its newest tokens for the stop strings failed: {type(e).__name__}: {e}"
            return True


def declared_metadata_fields(policy, policy_name: str) -> dict[str, tuple[type, ...]]:
    """The metadata fields a ReadsMetadata policy declares, each with a tuple of types; {} for
    another policy. PolicyError for a declaration the core cannot check with."""
    if not isinstance(policy, ReadsMetadata):
        return {}
    declared = policy.metadata_fields
    fields = {}
    for key, types in declared.items() if isinstance(declared, Mapping) else [(None, None)]:
        types = types if isinstance(types, tuple) else (types,)
        if not isinstance(key, str) or not types or not all(isinstance(t, type) for t in types):
            raise PolicyError(
                f"scheduler {policy_name!r}: metadata_fields must map field names to a type or a tuple of types, "
                f"got {declared!r}"
            )
        fields[key] = types
    return fields


def _clipped(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}..."


class _Step:
    """The step being scheduled: its requests and token counts, the budget left, the policy's
    view of the queues (built on first use, again after they change), and the requests a
    policy's fault was pinned on."""

    __slots__ = ("scheduler", "now", "requests", "counts", "budget", "preempted", "_state", "blamed", "blame_messages")

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.now = scheduler.clock()
        self.requests: list[Request] = []
        self.counts: list[int] = []
        self.budget = 0
        self.preempted = False
        self._state: SchedulerState | None = None
        self.blamed: frozenset[Request] = NOBODY
        self.blame_messages: dict[Request, str] = {}

    def state(self, left_out: frozenset = NOBODY) -> SchedulerState:
        if left_out:
            return replace(self.state(), running=tuple(v for v in self.state().running if v._request not in left_out))
        if self._state is None:
            self._state = self.scheduler.state(self.now, self.blamed)
        return self._state

    def blame(self, request: Request, message: str) -> None:
        self.blamed = self.blamed | {request}
        self.blame_messages[request] = message
        self._state = None

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
