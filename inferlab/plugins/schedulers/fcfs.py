"""First come, first served, with recompute preemption and chunked prefill.

Each step serves running sequences first, oldest first (decodes and unfinished prefill chunks),
then admits waiting ones in arrival order while the token budget, the sequence limit and the KV
blocks allow; the last one admitted may get only part of its prompt. When blocks run out the
newest running sequence is preempted: its blocks are freed and it waits at the front of the queue
to be recomputed (its cached prefix blocks usually survive).
"""

from collections import deque

from inferlab.core.batch import ScheduledBatch
from inferlab.core.hookspecs import hookimpl
from inferlab.core.sequence import Sequence, SequenceStatus


class FCFSScheduler:
    def __init__(self, config, kv_cache, **options):
        if options:
            raise TypeError(f"the fcfs scheduler takes no options, got {sorted(options)}")
        self.kv = kv_cache
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def order_waiting(self) -> None:
        """Hook for subclasses that admit in another order; FCFS keeps arrival order."""

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        seqs, counts = [], []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            while not self.kv.allocate(seq, num_tokens):
                victim = self.running.pop()  # the newest; never one already scheduled this step
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                seqs.append(seq)
                counts.append(num_tokens)
                budget -= num_tokens
                i += 1
        if not preempted:  # admitting while preempting would only thrash
            self.order_waiting()
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                num_tokens = min(seq.num_tokens - self.kv.num_cached_prefix_tokens(seq), budget)
                if not self.kv.allocate(seq, num_tokens):
                    break
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                seqs.append(seq)
                counts.append(num_tokens)
                budget -= num_tokens
        return ScheduledBatch(seqs, counts)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def postprocess(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        finished = []
        for seq, num_tokens, token in zip(batch.seqs, batch.num_scheduled_tokens, sampled):
            if seq.is_finished:  # ended (stop string, abort) while its step was in flight
                continue
            seq.num_computed_tokens += num_tokens
            self.kv.commit(seq)
            if token is None:
                continue
            seq.append_token(token)
            reason = seq.check_stop()
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == SequenceStatus.FINISHED:
            return
        queue = self.running if seq.status == SequenceStatus.RUNNING else self.waiting
        queue.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, seq_id: int) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.seq_id == seq_id:
                self.finish(seq, "abort")
                return seq
        return None


@hookimpl
def register_schedulers(register):
    register("fcfs", FCFSScheduler)
