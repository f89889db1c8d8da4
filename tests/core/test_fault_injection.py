"""Ctrl-C at every line of the engine, the core scheduler and the paged KV manager, and an
exception at every line of the engine and the core scheduler.

sys.settrace follows a clean run and lists every line event in those three files; then, for each
point, the same run is repeated and a SIGINT is delivered at that line: the handler installed
for SIGINT at that moment is called there, which is what a Ctrl-C does (Python runs the handler
between two lines of the main thread, and the default handler raises KeyboardInterrupt). After
each point the engine must be as good as new: the interrupted generate raised KeyboardInterrupt
and left none of its requests queued, the KV books match the pending requests (no block leaked,
no reference count off), the garbage collector's freeze and the SIGINT handler are back as they
were, the same prompts give the reference tokens again, and a request queued through
add_request before the interrupt (or, in the step loop, every request) still gets its reference
tokens.

An exception raised at a line (InjectedFault, a BaseException so that no handler of the engine's
takes it for a plugin's error) must leave the same: the call raises it, every request is in one
queue as its status says, every KV block is held by a pending request or listed to be freed
(Scheduler.to_free), and the engine serves on with the same tokens.

By default each line is interrupted at its first occurrence in the run (all the lines, about two
minutes), and every third of those lines raises an exception; FAULT_INJECTION=lines also runs the
`slow` variant, which raises at each line's first occurrence; FAULT_INJECTION=all does every
occurrence of every line (about an hour).
"""

import gc
import os
import signal
import sys
from collections import Counter

import pytest
from engine_books import assert_books_clean, assert_books_exact, assert_kv_books

from inferlab import LLM, SamplingParams
from inferlab.core import engine, interrupts, scheduler
from inferlab.core.request import RequestStatus
from inferlab.plugins.kv_cache import paged

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TRACED = {module.__file__ for module in (engine, scheduler, paged)}
BOOKKEEPING = {module.__file__ for module in (engine, scheduler)}  # exceptions: the core's own lines
EVERY_OCCURRENCE = os.environ.get("FAULT_INJECTION") == "all"
EVERY_LINE = os.environ.get("FAULT_INJECTION") in ("lines", "all")
# Garbage-collector settings around a call, not the engine's books: their cleanup lines (gc.unfreeze)
# cannot raise, and an exception injected there would only skip them.
GC_BLOCKS = {"older_objects_frozen", "rarer_young_collections"}
SAMPLE_EVERY = 3  # the default run raises exceptions at every third line (the slow variant at all)


class InjectedFault(BaseException):
    """Raised at the chosen line."""


SHARED = [(7 * j) % 300 + 3 for j in range(20)]  # a prefix the prompts share: prefix-cache hits
PROMPTS = [SHARED + [5, 9, 11], SHARED[:17] + [40, 41], [8, 9, 10, 11, 12, 13, 14] * 5, [200, 201, 202]]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, max_tokens=7, ignore_eos=True, seed=3),
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=["zz"]),  # stop strings are checked
    SamplingParams(temperature=0.7, top_k=20, max_tokens=1, seed=5),  # finishes in its first step
]
SURVIVOR = ([17, 18, 19, 20, 21, 22], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=11))
# A small cache (preemption), small batches and chunked prefill: every path of the scheduler runs.
SETTINGS = dict(
    device="cpu",
    kvcache_block_size=16,
    num_kvcache_blocks=7,
    max_num_seqs=3,
    max_num_batched_tokens=24,
    max_model_len=64,
)


class Injector:
    """Counts line events in the traced files; at the chosen (file, line, occurrence) it calls
    the current SIGINT handler there, once (fault "sigint"), or raises InjectedFault (fault
    "exception")."""

    def __init__(self, point=None, fault="sigint"):
        self.point, self.seen, self.fired, self.fault = point, Counter(), False, fault
        self.traced = TRACED if fault == "sigint" else BOOKKEEPING
        self.function = None  # where it fired
        self.held_back = False  # whether the engine held the interrupt back until its books were done
        self.lines: list[tuple[str, int, int]] = []  # (file, line, occurrence) of every event

    def __enter__(self):
        sys.settrace(self.global_trace)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        self.point = ()  # frames traced so far keep their tracer: it must not fire after the run

    def global_trace(self, frame, event, arg):
        return self.local_trace if frame.f_code.co_filename in self.traced else None

    def local_trace(self, frame, event, arg):
        if event == "line" and not self.fired and not (self.fault == "exception" and frame.f_code.co_name in GC_BLOCKS):
            key = (frame.f_code.co_filename, frame.f_lineno)
            self.seen[key] += 1
            point = (*key, self.seen[key])
            if self.point is None:
                self.lines.append(point)
            elif point == self.point:
                self.fired, self.function = True, frame.f_code.co_name
                if self.fault == "exception":
                    raise InjectedFault(label(point))
                signal.getsignal(signal.SIGINT)(signal.SIGINT, frame)
                self.held_back = interrupts.held_back()
        return self.local_trace


def points_of(lines: list[tuple[str, int, int]], sample: int = 1) -> list[tuple[str, int, int]]:
    points = lines if EVERY_OCCURRENCE else [p for p in lines if p[2] == 1]
    return points if EVERY_OCCURRENCE else points[::sample]


def assert_blocks_accounted(llm) -> None:
    """The KV books match the pending requests and those whose blocks wait to be freed."""
    assert_kv_books(llm.kv_manager, dict.fromkeys([*llm.requests.values(), *llm.scheduler.to_free]))


def assert_queues_match_statuses(llm) -> None:
    """Each pending request is in the one queue its status names, once."""
    scheduler = llm.scheduler
    queued = [*scheduler.running, *scheduler.waiting]
    assert len(queued) == len(set(map(id, queued))), "a request queued twice"
    assert all(r.status is RequestStatus.RUNNING for r in scheduler.running), "a request running by mistake"
    assert all(r.status is RequestStatus.WAITING for r in scheduler.waiting), "a request waiting by mistake"
    for request in llm.requests.values():
        assert request.is_finished or any(r is request for r in queued), f"request {request.request_id} in no queue"


def label(point) -> str:
    file, line, occurrence = point
    return f"{os.path.basename(file)}:{line} (occurrence {occurrence})"


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint()


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "overlap"])
def overlap(request):
    return request.param


@pytest.fixture(scope="module")
def reference(path, overlap):
    llm = LLM(path, overlap_scheduling=overlap, **SETTINGS)
    outputs = [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    survivor = llm.generate([SURVIVOR[0]], SURVIVOR[1], use_tqdm=False)[0]["token_ids"]
    return outputs, survivor


def generate(llm):
    return [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def drain(llm):
    while not llm.is_finished():
        llm.step()
    llm.step()  # idle: puts the SIGINT handler back


def check_generate(path, overlap, reference, fault, sample=1):
    outputs, survivor_tokens = reference
    raised = KeyboardInterrupt if fault == "sigint" else InjectedFault
    llm = LLM(path, overlap_scheduling=overlap, **SETTINGS)

    def run(point):
        llm.reset_prefix_cache()
        survivor = llm.requests[llm.add_request(*SURVIVOR)]  # through the step API: must outlive the interrupt
        with Injector(point, fault) as injector:
            try:
                result = generate(llm)
            except raised:
                result = None
        return injector, survivor, result

    injector, survivor, result = run(None)
    assert result == outputs
    drain(llm)
    points, failures = points_of(injector.lines, sample), []
    assert len({p[:2] for p in points}) > 150 // sample // (1 if fault == "sigint" else 2)  # the lines a generate runs
    for point in points:
        injector, survivor, result = run(point)
        try:
            assert injector.fired, "not reached"
            assert result is None, f"no {raised.__name__}"
            assert gc.get_freeze_count() <= engine.FROZEN_AT_IMPORT, "objects left frozen"
            assert set(llm.requests) <= {survivor.request_id}, "the call's requests left queued"
            assert_queues_match_statuses(llm)
            assert_blocks_accounted(llm)
            if fault == "sigint":
                assert_books_exact(llm)
            assert generate(llm) == outputs, "wrong tokens after the fault"
            drain(llm)
            assert survivor.output_token_ids == survivor_tokens, "the survivor's tokens changed"
            assert_books_clean(llm)
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "SIGINT handler not restored"
        except Exception as e:  # a wrong check, or an engine that raises now (a lasting KeyError, say)
            failures.append(f"{label(point)}: {type(e).__name__}: {(str(e) or '?').splitlines()[0]}")
            llm = LLM(path, overlap_scheduling=overlap, **SETTINGS)  # a fresh engine for the next point
    assert not failures, f"{len(failures)} of {len(points)} points went wrong:\n" + "\n".join(failures)


def check_step_loop(path, overlap, reference, fault, sample=1):
    """Requests queued with add_request outlive an interrupted step (and an abort): stepping on
    finishes each with its reference tokens. Each finished request is reported once, an aborted
    one too; an interrupt held back to the end of a step loses no report (the next step gives it),
    while a fault on step()'s last lines, outside the held-back section, may lose that step's."""
    outputs, _ = reference
    raised = KeyboardInterrupt if fault == "sigint" else InjectedFault
    llm = LLM(path, overlap_scheduling=overlap, **SETTINGS)

    def run(point):
        llm.reset_prefix_cache()
        requests = [llm.requests[llm.add_request(p, params)] for p, params in zip(PROMPTS, PARAMS)]
        interrupted = iteration = 0
        aborted, reported = False, []
        with Injector(point, fault) as injector:
            while True:
                iteration += 1
                try:
                    if llm.is_finished():
                        break
                    if iteration >= 3 and not aborted:
                        llm.abort(requests[0].request_id)  # again if interrupted: it may not have happened
                        aborted = True
                    reported += [r.request_id for r in llm.step().finished]
                except raised:
                    interrupted += 1
        reported += [r.request_id for r in llm.step().finished]  # drain: idle, restores the handler
        return injector, requests, interrupted, reported

    injector, requests, _, reported = run(None)
    assert sorted(reported) == [r.request_id for r in requests]  # the aborted one too, as "abort"
    points, failures = points_of(injector.lines, sample), []
    for point in points:
        injector, requests, interrupted, reported = run(point)
        try:
            assert injector.fired and interrupted == 1, "not reached" if not injector.fired else f"no {raised.__name__}"
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "SIGINT handler not restored"
            dropped, kept = requests[0], requests[1:]
            assert (
                dropped.finish_reason == "abort" and dropped.output_token_ids == outputs[0][: dropped.num_output_tokens]
            )
            assert [r.output_token_ids for r in kept] == outputs[1:], "wrong tokens"
            assert len(reported) == len(set(reported)), "a request reported twice"
            if injector.held_back or (fault == "exception" and injector.function != "step"):
                assert sorted(reported) == [r.request_id for r in requests], "a finished request not reported"
            assert_books_clean(llm)
        except Exception as e:  # a wrong check, or an engine that raises now (a lasting KeyError, say)
            failures.append(f"{label(point)}: {type(e).__name__}: {(str(e) or '?').splitlines()[0]}")
            llm = LLM(path, overlap_scheduling=overlap, **SETTINGS)
    assert not failures, f"{len(failures)} of {len(points)} points went wrong:\n" + "\n".join(failures)


def test_interrupt_at_every_line_of_generate(path, overlap, reference):
    check_generate(path, overlap, reference, "sigint")


def test_interrupt_at_every_line_of_a_step_loop(path, overlap, reference):
    check_step_loop(path, overlap, reference, "sigint")


def test_exception_at_lines_of_generate(path, overlap, reference):
    check_generate(path, overlap, reference, "exception", SAMPLE_EVERY)


def test_exception_at_lines_of_a_step_loop(path, overlap, reference):
    check_step_loop(path, overlap, reference, "exception", SAMPLE_EVERY)


@pytest.mark.slow
@pytest.mark.skipif(not EVERY_LINE, reason="FAULT_INJECTION=lines (or all) raises at every line")
def test_exception_at_every_line_of_generate(path, overlap, reference):
    check_generate(path, overlap, reference, "exception")


@pytest.mark.slow
@pytest.mark.skipif(not EVERY_LINE, reason="FAULT_INJECTION=lines (or all) raises at every line")
def test_exception_at_every_line_of_a_step_loop(path, overlap, reference):
    check_step_loop(path, overlap, reference, "exception")
