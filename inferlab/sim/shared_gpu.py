"""One virtual GPU shared by the runners of several simulated replicas (`cluster.gpus_per_replica`
below 1), as two processes share a card without MPS: CUDA time-slices their contexts.

The timeline, as the driver time-slices contexts:
- Each context (replica) queues its steps in order; a step can start once it is launched (its
  `ready` time) and the context's step before it has ended. Kernels of two contexts never run at
  once.
- The context holding the device runs its queue for up to a timeslice (`timeslice_s`) counted from
  when it got the device, work it queues meanwhile included (under overlap scheduling a replica
  launches its next step before the one running ends). At the end of the timeslice, if another
  context has work ready, the device goes to the next such context in round-robin order; the step
  running is cut there and its remaining work resumes in its context's next timeslice. Any step is
  cut so, a prompt step as a decode step. With nobody waiting the holder keeps the device.
- A context that runs out of work yields at once: the device goes to the next context with work
  ready, or idles; work of the context that held it last starts at once, in a fresh timeslice.
- Each change of context costs `context_switch_s`, in which no context's work runs.
- A step whose kernels run as they are launched (eager: its `not_before` is its launch) ends no
  earlier than its launch; until then its context has nothing more to run.
Without a timeslice (None) a context keeps the device as long as it has work.

A step's end depends on work that other contexts queue before it ends, so it is computed when it is
asked for (`end`), from the launches placed so far, and the timeline is committed up to it: a
replica reads a step's end when it reads its tokens, and the fleet steps its replicas so that by
then every launch that could start before that end has been placed (inferlab.cluster.local:
a replica on a shared GPU steps at the end of the step whose tokens it reads next, `pending_end`,
and its launch in that step can run only after that end). The timeline is then exact for the
launches it is given. Measured on the card with inferlab.experiment.timeslice (docs/cluster.md,
"Replicas sharing a GPU").
"""

import math

# Steps that have run are dropped from a context's queue once this many have gathered (a step's end,
# once read, is kept by the step itself), so that a long simulation's queues do not grow with it.
FORGET_AFTER = 1024


class GPUStep:
    """A step queued on the shared GPU: its context, when it can start, its device time, and the
    time it ends no earlier than; `end` is set once the timeline has run it."""

    __slots__ = ("context", "index", "ready", "seconds", "not_before", "end")

    def __init__(self, context: int, index: int, ready: float, seconds: float, not_before: float):
        self.context, self.index = context, index
        self.ready, self.seconds, self.not_before = ready, seconds, not_before
        self.end: float | None = None


class Timeline:
    """Where the device is at time `now`: who holds it since when, each context's next step (its
    index), that step's work left and when the context's last step ended. Copied to look ahead."""

    __slots__ = ("now", "holder", "held_since", "next", "left", "free", "num_switches", "num_preemptions")

    def __init__(self, num_contexts: int):
        self.now = 0.0
        self.holder: int | None = None  # the context resident on the device (the last one to run)
        self.held_since = 0.0  # when its timeslice began
        self.next = [0] * num_contexts
        self.left: list[float | None] = [None] * num_contexts  # work left of the next step, once begun
        self.free = [0.0] * num_contexts
        self.num_switches = 0
        self.num_preemptions = 0

    def copy(self) -> "Timeline":
        other = Timeline.__new__(Timeline)
        other.now, other.holder, other.held_since = self.now, self.holder, self.held_since
        other.next, other.left, other.free = list(self.next), list(self.left), list(self.free)
        other.num_switches, other.num_preemptions = self.num_switches, self.num_preemptions
        return other


class SharedGPU:
    """The timeline of one virtual GPU that several contexts (replicas, numbered) queue steps on."""

    def __init__(self, timeslice_s: float | None, context_switch_s: float, num_contexts: int = 2):
        self.timeslice = math.inf if timeslice_s is None else timeslice_s
        self.switch = context_switch_s
        self.queues: list[list[GPUStep]] = [[] for _ in range(num_contexts)]
        self.dropped = [0] * num_contexts  # steps that ran and left the front of each queue
        self.timeline = Timeline(num_contexts)  # committed: no launch placed later starts before its now

    def place(self, context: int, ready: float, seconds: float, not_before: float) -> GPUStep:
        """Queues a step of `seconds` of device time of `context` that can start at `ready` and ends
        no earlier than `not_before` (an eager step's kernels run as they are launched)."""
        queue = self.queues[context]
        step = GPUStep(context, self.dropped[context] + len(queue), ready, seconds, not_before)
        queue.append(step)
        return step

    def end(self, step: GPUStep) -> float:
        """When the step ends, its context reading it now: the timeline runs up to it and keeps
        what it decided (the launches that could change it have been placed)."""
        if step.end is None:
            self._run(self.timeline, step, True)
            self._forget()
        return step.end

    def _forget(self) -> None:
        """Drops the steps that have run from the front of the queues, where enough have gathered:
        no timeline, committed or a copy of it, runs them again."""
        for context, queue in enumerate(self.queues):
            done = self.timeline.next[context] - self.dropped[context]
            if done >= FORGET_AFTER:
                del queue[:done]
                self.dropped[context] += done

    def pending_end(self, step: GPUStep) -> float:
        """When the step would end given the launches placed so far; nothing is committed."""
        if step.end is not None:
            return step.end
        return self._run(self.timeline.copy(), step, False)

    def drained(self) -> Timeline:
        """The timeline once every step placed has run (a copy): when the last ends, and the
        switches and cuts it took."""
        timeline = self.timeline.copy()
        self._run(timeline, None, False)
        return timeline

    def _available(self, timeline: Timeline, context: int) -> float:
        """When the context's next step can run (inf: it has none)."""
        queue, index = self.queues[context], timeline.next[context] - self.dropped[context]
        if index >= len(queue):
            return math.inf
        ready, free = queue[index].ready, timeline.free[context]
        return ready if ready > free else free

    def _next_ready(self, timeline: Timeline, after: int, by: float) -> int | None:
        """The first context after `after` in round-robin order with work ready by `by`."""
        n = len(self.queues)
        for k in range(1, n):
            context = (after + k) % n
            if self._available(timeline, context) <= by:
                return context
        return None

    def _switch_to(self, timeline: Timeline, context: int) -> None:
        timeline.now += self.switch
        timeline.holder, timeline.held_since = context, timeline.now
        timeline.num_switches += 1

    def _run(self, timeline: Timeline, target: GPUStep | None, commit: bool) -> float:
        """Runs the timeline until `target` ends (None: until every step placed has), and returns
        its end. With `commit` the steps that end are given their ends."""
        queues, slice_s = self.queues, self.timeslice
        n = len(queues)
        target_end = math.nan
        while True:
            if target is not None and timeline.next[target.context] > target.index:
                return target.end if commit else target_end
            holder, now = timeline.holder, timeline.now
            if holder is None or self._available(timeline, holder) > now:
                # the holder has nothing to run now: it yields to the next context with work ready,
                # or the device idles until the first work arrives (the holder's needs no switch)
                other = None if holder is None else self._next_ready(timeline, holder, now)
                if other is not None:
                    self._switch_to(timeline, other)
                    continue
                first = min(range(n), key=lambda c: (self._available(timeline, c), c != holder))
                at = self._available(timeline, first)
                if at == math.inf:
                    return math.inf  # nothing left to run
                timeline.now = at if at > now else now
                if holder is None or first == holder:
                    timeline.holder, timeline.held_since = first, timeline.now
                else:
                    self._switch_to(timeline, first)
                continue
            # the holder runs its next step: to its end, or to the end of its timeslice where
            # another context has work ready by then
            index = timeline.next[holder]
            step = queues[holder][index - self.dropped[holder]]
            left = timeline.left[holder]
            finish = now + (step.seconds if left is None else left)
            since = timeline.held_since
            if finish - since > slice_s:
                waiting = min((self._available(timeline, c) for c in range(n) if c != holder), default=math.inf)
                if waiting < finish:
                    boundary = since + slice_s * max(1, math.ceil((waiting - since) / slice_s))
                    if boundary < finish:
                        timeline.left[holder] = finish - boundary
                        timeline.now = boundary
                        timeline.num_preemptions += 1
                        self._switch_to(timeline, self._next_ready(timeline, holder, boundary))
                        continue
                # nobody waits at the ends of the timeslices it runs past: they renew
                timeline.held_since = since + slice_s * math.floor((finish - since) / slice_s)
            end = finish if finish > step.not_before else step.not_before
            timeline.now, timeline.free[holder] = finish, end
            timeline.next[holder], timeline.left[holder] = index + 1, None
            if commit:
                step.end = end
            elif step is target:
                target_end = end
