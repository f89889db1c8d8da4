"""Ctrl-C at every line of the engine, the core scheduler and the paged KV manager.

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

By default each line is interrupted at its first occurrence in the run (all the lines, about two
minutes); FAULT_INJECTION=all interrupts every occurrence (about an hour).
"""

import gc
import os
import signal
import sys
from collections import Counter

import pytest
from engine_books import assert_books_clean, assert_books_exact

from inferlab import LLM, SamplingParams
from inferlab.core import engine, interrupts, scheduler
from inferlab.plugins.kv_cache import paged

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TRACED = {module.__file__ for module in (engine, scheduler, paged)}
EVERY_OCCURRENCE = os.environ.get("FAULT_INJECTION") == "all"

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
    the current SIGINT handler there, once."""

    def __init__(self, point=None):
        self.point, self.seen, self.fired = point, Counter(), False
        self.held_back = False  # whether the engine held the interrupt back until its books were done
        self.lines: list[tuple[str, int, int]] = []  # (file, line, occurrence) of every event

    def __enter__(self):
        sys.settrace(self.global_trace)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        self.point = ()  # frames traced so far keep their tracer: it must not fire after the run

    def global_trace(self, frame, event, arg):
        return self.local_trace if frame.f_code.co_filename in TRACED else None

    def local_trace(self, frame, event, arg):
        if event == "line" and not self.fired:
            key = (frame.f_code.co_filename, frame.f_lineno)
            self.seen[key] += 1
            point = (*key, self.seen[key])
            if self.point is None:
                self.lines.append(point)
            elif point == self.point:
                self.fired = True
                signal.getsignal(signal.SIGINT)(signal.SIGINT, frame)
                self.held_back = interrupts.held_back()
        return self.local_trace


def points_of(lines: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    return lines if EVERY_OCCURRENCE else [p for p in lines if p[2] == 1]


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


def test_interrupt_at_every_line_of_generate(path, overlap, reference):
    outputs, survivor_tokens = reference
    llm = LLM(path, overlap_scheduling=overlap, **SETTINGS)

    def run(point):
        llm.reset_prefix_cache()
        survivor = llm.requests[llm.add_request(*SURVIVOR)]  # through the step API: must outlive the interrupt
        with Injector(point) as injector:
            try:
                result = generate(llm)
            except KeyboardInterrupt:
                result = None
        return injector, survivor, result

    injector, survivor, result = run(None)
    assert result == outputs
    drain(llm)
    points, failures = points_of(injector.lines), []
    assert len({p[:2] for p in points}) > 150  # the three files' lines that a generate runs
    for point in points:
        injector, survivor, result = run(point)
        try:
            assert injector.fired, "not reached"
            assert result is None, "no KeyboardInterrupt"
            assert gc.get_freeze_count() <= engine.FROZEN_AT_IMPORT, "objects left frozen"
            assert set(llm.requests) <= {survivor.request_id}, "the call's requests left queued"
            assert_books_exact(llm)
            assert generate(llm) == outputs, "wrong tokens after the interrupt"
            drain(llm)
            assert survivor.output_token_ids == survivor_tokens, "the survivor's tokens changed"
            assert_books_clean(llm)
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "SIGINT handler not restored"
        except Exception as e:  # a wrong check, or an engine that raises now (a lasting KeyError, say)
            failures.append(f"{label(point)}: {type(e).__name__}: {(str(e) or '?').splitlines()[0]}")
            llm = LLM(path, overlap_scheduling=overlap, **SETTINGS)  # a fresh engine for the next point
    assert not failures, f"{len(failures)} of {len(points)} points went wrong:\n" + "\n".join(failures)


def test_interrupt_at_every_line_of_a_step_loop(path, overlap, reference):
    """Requests queued with add_request outlive an interrupted step (and an abort): stepping on
    finishes each with its reference tokens. Each finished request is reported once; an
    interrupt held back to the end of a step loses no report (the next step gives it), while one
    on step()'s last lines, outside the held-back section, may lose that step's."""
    outputs, _ = reference
    llm = LLM(path, overlap_scheduling=overlap, **SETTINGS)

    def run(point):
        llm.reset_prefix_cache()
        requests = [llm.requests[llm.add_request(p, params)] for p, params in zip(PROMPTS, PARAMS)]
        interrupted = iteration = 0
        aborted, reported = False, []
        with Injector(point) as injector:
            while True:
                iteration += 1
                try:
                    if llm.is_finished():
                        break
                    if iteration >= 3 and not aborted:
                        llm.abort(requests[0].request_id)  # again if interrupted: it may not have happened
                        aborted = True
                    reported += [r.request_id for r in llm.step().finished]
                except KeyboardInterrupt:
                    interrupted += 1
        reported += [r.request_id for r in llm.step().finished]  # drain: idle, restores the handler
        return injector, requests, interrupted, reported

    injector, requests, _, reported = run(None)
    assert sorted(reported) == [r.request_id for r in requests[1:]]  # abort answers for the aborted one
    points, failures = points_of(injector.lines), []
    for point in points:
        injector, requests, interrupted, reported = run(point)
        try:
            assert injector.fired and interrupted == 1, "not reached" if not injector.fired else "no KeyboardInterrupt"
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "SIGINT handler not restored"
            dropped, kept = requests[0], requests[1:]
            assert (
                dropped.finish_reason == "abort" and dropped.output_token_ids == outputs[0][: dropped.num_output_tokens]
            )
            assert [r.output_token_ids for r in kept] == outputs[1:], "wrong tokens"
            assert len(reported) == len(set(reported)), "a request reported twice"
            if injector.held_back:
                assert sorted(reported) == [r.request_id for r in kept], "a finished request not reported"
            assert_books_clean(llm)
        except Exception as e:  # a wrong check, or an engine that raises now (a lasting KeyError, say)
            failures.append(f"{label(point)}: {type(e).__name__}: {(str(e) or '?').splitlines()[0]}")
            llm = LLM(path, overlap_scheduling=overlap, **SETTINGS)
    assert not failures, f"{len(failures)} of {len(points)} points went wrong:\n" + "\n".join(failures)
