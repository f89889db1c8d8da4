"""One virtual GPU shared by the runners of several simulated replicas (`cluster.gpus_per_replica`
below 1), as two processes share a card without MPS: CUDA time-slices their contexts.

The model, the simplest that keeps what time-slicing does to latency:
- Kernels of two contexts never run at once: the replicas' steps queue on one timeline, in the
  order the simulation launches them (the fleet steps its replicas in time order).
- A switch from one context's work to another's costs `context_switch_s` of device time.
- A context keeps the device while it has queued work, up to a timeslice (`timeslice_s`) counted
  from when it got the device: a step of another context that is ready while the holder still has
  work at the next timeslice boundary runs at that boundary (after a switch), and the holder's
  remaining work resumes after it (after another switch), with a timeslice of its own from then.
  Without a timeslice (None) steps run in launch order, each whole.

What it leaves out: a step that jumps in runs whole (it is not itself cut at a timeslice), and the
holder's steps whose ends the simulation had already given their replica keep those ends (their
replica read them, or will); the time they lost delays the work queued after them instead, so the
device's busy time is right and only the cut step reads early. Both are measured on the card with
inferlab.experiment.timeslice (docs/cluster.md, "Replicas sharing a GPU").
"""

import math


class SharedGPU:
    """The timeline of one virtual GPU that several contexts (replicas, numbered) queue steps on."""

    def __init__(self, timeslice_s: float | None, context_switch_s: float):
        self.timeslice = math.inf if timeslice_s is None else timeslice_s
        self.switch = context_switch_s
        self.free_at = 0.0  # when the work queued so far ends
        self.holder: int | None = None  # the context whose work is queued last (runs at free_at)
        self.held_since = 0.0  # when the holder got the device, for its timeslice
        self.num_switches = 0
        self.num_preemptions = 0

    def place(self, context: int, ready: float, seconds: float, not_before: float) -> float:
        """Queues a step of `seconds` of `context` that can start at `ready` and ends no earlier
        than `not_before` (an eager step's kernels run as they are launched); returns its end."""
        free, switch = self.free_at, self.switch
        if self.holder is None or self.holder == context:
            begin = max(free, ready)
            if self.holder is None or ready > free:  # the device was idle: a timeslice starts now
                self.held_since = begin
            self.holder = context
            self.free_at = max(begin + seconds, not_before)
            return self.free_at
        if ready < free and self.timeslice < math.inf:
            # the holder still has work: the first timeslice boundary at or after `ready`
            k = max(1, math.ceil((ready - self.held_since) / self.timeslice))
            boundary = self.held_since + k * self.timeslice
            if boundary < free:  # preempted there; the holder resumes after this step
                begin = boundary + switch
                end = max(begin + seconds, not_before)
                self.free_at = free + (end - begin) + 2 * switch
                self.held_since = end + switch
                self.num_switches += 2
                self.num_preemptions += 1
                return end
        begin = max(free, ready) + switch
        self.holder, self.held_since = context, begin
        self.free_at = max(begin + seconds, not_before)
        self.num_switches += 1
        return self.free_at

    def describe(self, num_contexts: int) -> dict:
        return {
            "replicas": num_contexts,
            "timeslice_s": None if self.timeslice == math.inf else self.timeslice,
            "context_switch_s": self.switch,
            "num_switches": self.num_switches,
            "num_preemptions": self.num_preemptions,
        }
