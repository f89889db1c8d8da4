"""One engine, several callers: other threads wait their turn (so every caller gets its own right
tokens), and a call from inside a call in the same thread (a signal handler, a callback) is
refused with EngineBusyError, leaving the outer call's tokens intact."""

import os
import signal
import threading

import pytest
from engine_books import assert_books_clean

from inferlab import LLM, SamplingParams
from inferlab.core.engine import EngineBusyError

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SETTINGS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=24, max_num_seqs=4, max_model_len=96)


def prompts_for(caller: int) -> list[list[int]]:
    return [[(caller * 31 + i * 7 + j) % 300 + 3 for j in range(5 + 9 * i + caller)] for i in range(3)]


def params_for(caller: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=30, max_tokens=8, ignore_eos=True, seed=caller),
        SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True, seed=100 + caller),
    ]


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint()


@pytest.fixture(scope="module")
def reference(path):
    llm = LLM(path, **SETTINGS)
    return {c: [o["token_ids"] for o in llm.generate(prompts_for(c), params_for(c), use_tqdm=False)] for c in range(6)}


def test_generate_from_many_threads_is_serialized(path, reference):
    """Six threads call generate on one engine at once, three rounds each, while a seventh drives
    requests of its own through add_request and step: every caller gets its reference tokens."""
    llm = LLM(path, **SETTINGS)
    results, errors = {c: [] for c in range(6)}, []
    stepped = {}
    start = threading.Barrier(7)

    def caller(c):
        try:
            start.wait()
            for _ in range(3):
                results[c].append([o["token_ids"] for o in llm.generate(prompts_for(c), params_for(c), use_tqdm=False)])
        except BaseException as e:  # reported below, not lost in the thread
            errors.append(e)

    def stepper():
        try:
            start.wait()
            ids = [llm.add_request(p, params) for p, params in zip(prompts_for(5), params_for(5))]
            requests = {}
            while len(requests) < len(ids):
                for request in llm.step().finished:
                    requests[request.request_id] = request
            stepped["tokens"] = [requests[i].output_token_ids for i in ids]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(c,)) for c in range(6)] + [threading.Thread(target=stepper)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    for c in range(6):
        assert results[c] == [reference[c]] * 3, f"caller {c} got wrong tokens"
    assert stepped["tokens"] == reference[5]
    assert_books_clean(llm)


def test_generate_from_a_signal_handler_is_refused(path, reference, monkeypatch):
    """A handler that runs during generate and calls generate (or step, add_request, abort) on the
    same engine gets EngineBusyError. If the handler swallows it, the outer call returns its right
    tokens; if it lets it through, the outer call raises it and the engine stays usable."""
    llm = LLM(path, **SETTINGS)
    caught = []

    def handler(signum, frame):
        for call in (
            lambda: llm.generate(prompts_for(1), params_for(1), use_tqdm=False),
            llm.step,
            lambda: llm.add_request([1, 2, 3]),
            lambda: llm.abort(0),
            llm.reset_prefix_cache,
        ):
            with pytest.raises(EngineBusyError, match="inside another call in the same thread"):
                call()
        caught.append(signum)

    real_launch, launches = llm.runner.launch, []

    def launch(batch):
        launches.append(1)
        if len(launches) == 3:
            os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs here, in the middle of the step
        return real_launch(batch)

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        monkeypatch.setattr(llm.runner, "launch", launch)
        outputs = llm.generate(prompts_for(0), params_for(0), use_tqdm=False)
        assert caught == [signal.SIGUSR1]
        assert [o["token_ids"] for o in outputs] == reference[0]
        assert_books_clean(llm)

        def raising_handler(signum, frame):
            llm.generate(prompts_for(1), params_for(1), use_tqdm=False)

        signal.signal(signal.SIGUSR1, raising_handler)
        launches.clear()
        with pytest.raises(EngineBusyError):
            llm.generate(prompts_for(0), params_for(0), use_tqdm=False)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    monkeypatch.undo()
    assert_books_clean(llm)
    assert [o["token_ids"] for o in llm.generate(prompts_for(0), params_for(0), use_tqdm=False)] == reference[0]


def test_a_policy_calling_back_into_the_engine_is_refused(path, monkeypatch):
    """A scheduler policy that calls the engine from inside a step (a callback) is refused too."""
    llm = LLM(path, **SETTINGS)
    real_order = llm.scheduler.policy.admission_order

    def admission_order(waiting, state):
        with pytest.raises(EngineBusyError):
            llm.add_request([4, 5, 6])
        return real_order(waiting, state)

    monkeypatch.setattr(llm.scheduler.policy, "admission_order", admission_order)
    outputs = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(outputs[0]["token_ids"]) == 3
    assert_books_clean(llm)
