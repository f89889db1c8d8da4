"""The engine under stress on CPU: abort, KeyboardInterrupt, KV exhaustion (preemption),
requests larger than the whole cache, and the garbage collector's pauses."""

import gc
import random

import pytest
from engine_books import assert_books_clean, assert_books_exact

from inferlab import LLM, SamplingParams
from inferlab.core import engine
from inferlab.core.engine import RequestTooLargeError

BLOCK = 16
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_llm(path, **settings):
    return LLM(path, device="cpu", kvcache_block_size=BLOCK, max_model_len=128, **settings)


def prompts_of(lengths, seed=0, vocab=300):
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True, seed=7)


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint()


@pytest.fixture(scope="module")
def reference(path):
    """What a roomy engine generates for prompts, alone."""
    llm = make_llm(path, num_kvcache_blocks=64)

    def run(prompts, params=GREEDY):
        return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]

    return run


# -- abort ------------------------------------------------------------------------------------


def test_abort_waiting_request_frees_it_and_others_finish(path, reference):
    llm = make_llm(path, num_kvcache_blocks=16, max_num_seqs=1)
    kept, dropped = prompts_of([40, 30])
    kept_id, dropped_id = llm.add_request(kept, GREEDY), llm.add_request(dropped, GREEDY)
    kept_seq, dropped_seq = llm.requests[kept_id], llm.requests[dropped_id]
    llm.step()
    assert dropped_seq.status.name == "WAITING"
    assert llm.abort(dropped_id)
    assert dropped_seq.finish_reason == "abort" and not llm.kv_manager.block_table(dropped_seq)
    assert_books_exact(llm)
    while not llm.is_finished():
        llm.step()
    assert kept_seq.output_token_ids == reference([kept])[0]
    assert_books_clean(llm)
    assert not llm.abort(dropped_id) and not llm.abort(kept_id) and not llm.abort(10**9)
    assert llm.stats.num_aborted_requests == 1


@pytest.mark.parametrize("phase", ["mid-prefill", "decoding"])
def test_abort_running_request_frees_all_its_blocks(path, reference, phase):
    llm = make_llm(path, num_kvcache_blocks=16, max_num_batched_tokens=BLOCK)
    prompt, other = prompts_of([70, 20], seed=1)
    request_id = llm.add_request(prompt, GREEDY)
    seq = llm.requests[request_id]
    llm.step()
    if phase == "mid-prefill":
        assert 0 < seq.num_computed_tokens < seq.num_prompt_tokens
    else:
        while seq.num_output_tokens < 3:
            llm.step()
    assert llm.kv_manager.block_table(seq) and llm.kv_manager.num_free_blocks < llm.kv_manager.num_blocks
    assert llm.abort(request_id)
    assert seq.finish_reason == "abort" and llm.kv_manager.block_table(seq) == []
    assert llm.step().finished == [seq]  # a step loop sees every request end, an aborted one too
    assert_books_clean(llm)
    # the engine serves the same prompts as before, the aborted one included (its cached prefix too)
    assert [o["token_ids"] for o in llm.generate([prompt, other], GREEDY, use_tqdm=False)] == reference([prompt, other])
    assert_books_clean(llm)


# -- KeyboardInterrupt ------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["forward", "advance"])
@pytest.mark.parametrize("after_steps", [0, 2, 9])
def test_interrupted_generate_leaves_engine_usable(path, reference, monkeypatch, where, after_steps):
    llm = make_llm(path, num_kvcache_blocks=10, max_num_seqs=3, max_num_batched_tokens=48)
    prompts = prompts_of([9, 50, 33, 17, 60], seed=2)
    survivor = prompts_of([25], seed=3)[0]
    survivor_id = llm.add_request(survivor, SEEDED)  # queued through the step API: must outlive the interrupt
    survivor_seq = llm.requests[survivor_id]
    target = llm.runner if where == "forward" else llm.scheduler
    method = "launch" if where == "forward" else "advance"
    real, calls = getattr(target, method), []

    def interrupted(*args):
        calls.append(1)
        if where == "forward" and len(calls) > after_steps:
            raise KeyboardInterrupt
        result = real(*args)
        if len(calls) > after_steps:
            raise KeyboardInterrupt  # the step's state advanced, then Ctrl-C before the engine saw it
        return result

    monkeypatch.setattr(target, method, interrupted)
    # the short one finishes in the first step, so an interrupt there catches it finished but unreported
    params = [SamplingParams(temperature=0, max_tokens=1), GREEDY, GREEDY, GREEDY, GREEDY]
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    assert set(llm.requests) <= {survivor_id} and llm.stats.num_aborted_requests > 0
    assert_books_exact(llm)
    assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == reference(prompts, params)
    while not llm.is_finished():
        llm.step()
    assert survivor_seq.output_token_ids == reference([survivor], SEEDED)[0]
    assert_books_clean(llm)


# -- KV exhaustion: preemption ----------------------------------------------------------------


def test_exhausted_cache_preempts_counts_and_matches_a_roomy_cache(path, reference):
    # 8 blocks of 16 tokens; each request grows to 30 + 23 = 53 tokens (4 blocks): at most two fit
    llm = make_llm(path, num_kvcache_blocks=8, max_num_seqs=6)
    prompts = prompts_of([30] * 6, seed=4)
    for params in (
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, max_tokens=24, ignore_eos=True, seed=11),
    ):
        before = llm.scheduler.num_preemptions
        outputs = llm.generate(prompts, params, use_tqdm=False)
        preemptions = llm.scheduler.num_preemptions - before
        assert preemptions > 0
        assert sum(o["num_preemptions"] for o in outputs) == preemptions
        assert llm.stats.num_preemptions == llm.scheduler.num_preemptions
        assert [o["token_ids"] for o in outputs] == reference(prompts, params)  # recompute changes nothing
        assert all(o["finish_reason"] == "length" for o in outputs)
        assert_books_clean(llm)


# -- requests larger than the whole cache -----------------------------------------------------


def test_request_larger_than_the_cache_fails_alone(path, reference):
    llm = make_llm(path, num_kvcache_blocks=4)  # 64 tokens in all
    small, large, exact = prompts_of([10, 60, 60], seed=5)
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),  # 60 + 6 - 1 = 65 tokens of K/V
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
    ]  # 64: fits exactly
    outputs = llm.generate([small, large, exact], params, use_tqdm=False)
    error = outputs[1]
    assert error["finish_reason"] == "error" and error["token_ids"] == [] and error["text"] == ""
    assert "5 KV blocks" in error["error"] and "cache has 4" in error["error"] and "65" in error["error"]
    assert [o["finish_reason"] for o in outputs] == ["length", "error", "length"]
    assert outputs[0]["token_ids"] == reference([small], params[0])[0]
    assert outputs[2]["token_ids"] == reference([exact], params[2])[0] and len(outputs[2]["token_ids"]) == 5
    assert "error" not in outputs[0] and llm.stats.num_failed_requests == 1
    assert_books_clean(llm)

    with pytest.raises(RequestTooLargeError, match="prompt 1: the request needs up to 5 KV blocks"):
        llm.generate([small, large], params[:2], use_tqdm=False, raise_on_error=True)
    with pytest.raises(RequestTooLargeError, match="whole cache has 4"):
        llm.add_request(large, params[1])
    assert_books_clean(llm)  # nothing was queued


@pytest.mark.parametrize(
    "bad, message",
    [
        ([], "prompt 1: the prompt is empty"),
        ([5, 10**6], "prompt 1: token ids \\[1000000\\] are outside the vocabulary"),
        (list(range(1, 130)), "prompt 1: the prompt has 129 tokens, more than max_model_len=128"),
    ],
)
def test_other_bad_inputs_still_raise_and_queue_nothing(path, bad, message):
    llm = make_llm(path, num_kvcache_blocks=4)
    large = prompts_of([60])[0]
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3], bad, large], SamplingParams(max_tokens=20), use_tqdm=False)
    assert_books_clean(llm)
    with pytest.raises(ValueError, match=r"temperature must be a number in \[0, 2\*\*126\]"):
        SamplingParams(temperature=-1)


def test_seeds_do_not_depend_on_which_requests_fit(path):
    """Unseeded requests draw their seeds in submission order, rejected ones included, so a
    smaller cache changes no other request's tokens."""
    prompts = prompts_of([10, 60, 20], seed=6)
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)  # no seed
    small_cache = make_llm(path, num_kvcache_blocks=4).generate(prompts, params, use_tqdm=False)
    roomy_cache = make_llm(path, num_kvcache_blocks=16).generate(prompts, params, use_tqdm=False)
    assert small_cache[1]["finish_reason"] == "error" and roomy_cache[1]["finish_reason"] == "length"
    assert [small_cache[i]["token_ids"] for i in (0, 2)] == [roomy_cache[i]["token_ids"] for i in (0, 2)]


# -- garbage collection -----------------------------------------------------------------------


def tracked_ids() -> set[int]:
    """ids of the objects in the collector's generations (frozen ones are in none)."""
    return {id(o) for o in gc.get_objects()}


def test_generate_freezes_what_exists_before_it_and_unfreezes_after(path, reference, monkeypatch):
    """A full collection inside generate walks only what the call creates: older objects are frozen from its first step (checking the prompts) to its last (building the
    outputs), and are collectable again when it returns or raises."""
    llm = make_llm(path, num_kvcache_blocks=16)
    older = [[]]  # a tracked container made before the call
    seen = {}

    def recording(owner, name):
        real = getattr(owner, name)

        def wrapper(*args):
            if name not in seen:
                newer = [[]]
                ids = tracked_ids()
                seen[name] = (gc.get_freeze_count() > 0, id(older) in ids, id(newer) in ids)
            return real(*args)

        monkeypatch.setattr(owner, name, wrapper)

    for owner, name in ((llm, "make_request"), (llm.runner, "launch"), (llm, "output")):
        recording(owner, name)
    prompts = prompts_of([9, 30], seed=4)
    assert gc.get_freeze_count() <= engine.FROZEN_AT_IMPORT
    assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == reference(prompts)
    # older frozen, the call's own objects not
    assert seen == {name: (True, False, True) for name in ("make_request", "launch", "output")}
    assert gc.get_freeze_count() <= engine.FROZEN_AT_IMPORT and id(older) in tracked_ids()

    def failing_launch(batch):
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.runner, "launch", failing_launch)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert gc.get_freeze_count() <= engine.FROZEN_AT_IMPORT
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    assert gc.get_freeze_count() <= engine.FROZEN_AT_IMPORT


def test_generate_leaves_a_callers_freeze_alone(path, reference, monkeypatch):
    llm = make_llm(path, num_kvcache_blocks=16)
    older, made_during = [[]], []
    real_launch = llm.runner.launch

    def launch(batch):
        made_during.append([])
        return real_launch(batch)

    monkeypatch.setattr(llm.runner, "launch", launch)
    gc.freeze()
    try:
        prompts = prompts_of([12], seed=5)
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == reference(prompts)
        ids = tracked_ids()
        assert id(older) not in ids  # the caller's freeze still holds
        assert id(made_during[0]) in ids  # and the call froze nothing of its own
    finally:
        gc.unfreeze()


def test_what_the_interpreter_keeps_frozen_is_not_a_callers_freeze(monkeypatch):
    """Python 3.12 starts with 375 tuples frozen; the engine's freeze must still happen there."""
    startup = [(i,) for i in range(5)]  # stands for the interpreter's frozen tuples
    gc.freeze()
    try:
        monkeypatch.setattr(engine, "FROZEN_AT_IMPORT", gc.get_freeze_count())
        newer = [[]]
        with engine.older_objects_frozen():
            assert id(newer) not in tracked_ids()
        assert id(newer) in tracked_ids()
    finally:
        gc.unfreeze()
    assert id(startup) in tracked_ids()


def test_refreeze_freezes_what_survives_a_middle_collection_and_unfreezes_all_after():
    """A simulated run's long-lived objects leave the collector's walks after the next collection
    of the middle generation; nothing stays frozen, and no callback stays, after the block."""
    callbacks = list(gc.callbacks)
    with engine.older_objects_frozen(refreeze=True):
        survivor = [[]]
        assert id(survivor) in tracked_ids()
        gc.collect(1)
        assert id(survivor) not in tracked_ids()
        later = [[]]
        gc.collect(0)  # a young collection freezes nothing
        assert id(later) in tracked_ids()
    assert id(survivor) in tracked_ids() and id(later) in tracked_ids()
    assert gc.callbacks == callbacks and gc.get_freeze_count() == engine.FROZEN_AT_IMPORT


def test_rarer_young_collections_restores_the_thresholds_even_on_error():
    before = gc.get_threshold()
    with pytest.raises(RuntimeError):
        with engine.rarer_young_collections(50_000):
            assert gc.get_threshold() == (50_000, *before[1:])
            raise RuntimeError("inside")
    assert gc.get_threshold() == before


# -- one request's failure stays its own ------------------------------------------------------


def test_settings_that_could_not_be_served_are_refused_where_they_are_made(path, reference):
    """The issue's wedge: top_k=2**63 passed validation, then every later step overflowed."""
    llm = make_llm(path, num_kvcache_blocks=16)
    with pytest.raises(ValueError, match=r"top_k must be -1 \(disabled\) or an integer in \[1, 2\*\*31 - 1\]"):
        llm.add_request("bye", SamplingParams(top_k=2**63))
    largest = SamplingParams(temperature=1.0, top_k=2**31 - 1, max_tokens=2**63 - 1, seed=2**32 - 1)
    llm.add_request([5, 6, 7], largest)  # the largest allowed values run
    llm.step()
    llm.abort(0)
    prompts = prompts_of([9, 20], seed=12)
    assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == reference(prompts)
    assert_books_clean(llm)


def test_a_request_whose_tokens_cannot_be_decoded_fails_alone(path, reference, monkeypatch):
    """Decoding can fail for one request (a tokenizer that rejects some ids): checking its stop
    strings or building its text then ends that request with an error result, while the others
    run on and the engine keeps serving."""
    llm = make_llm(path, num_kvcache_blocks=16)
    same, other = prompts_of([12, 15], seed=13)
    tokens = reference([same, other])
    poison = next(t for t in tokens[0][2:] if t not in tokens[1])  # in the first prompt's output only
    real_decode = llm.tokenizer.decode

    def decode(ids, *args, **kwargs):
        if poison in ids:
            raise ValueError(f"cannot decode id {poison}")
        return real_decode(ids, *args, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "decode", decode)
    monkeypatch.setattr(llm.scheduler, "decode", decode)
    with_stop = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["never seen"])
    outputs = llm.generate([same, same, other], [with_stop, GREEDY, GREEDY], use_tqdm=False)
    cut = tokens[0].index(poison) + 1
    assert outputs[0]["finish_reason"] == "error" and outputs[0]["token_ids"] == tokens[0][:cut]
    assert (
        outputs[0]["error"]
        == f"decoding its newest tokens for the stop strings failed: ValueError: cannot decode id {poison}"
    )
    assert outputs[1]["finish_reason"] == "error" and outputs[1]["token_ids"] == tokens[0]
    assert outputs[1]["error"] == f"decoding its output tokens failed: ValueError: cannot decode id {poison}"
    assert (
        outputs[2]["finish_reason"] == "length" and outputs[2]["token_ids"] == tokens[1] and "error" not in outputs[2]
    )
    assert llm.stats.num_failed_requests == 2
    assert_books_clean(llm)
    monkeypatch.undo()
    assert [o["token_ids"] for o in llm.generate([same, other], GREEDY, use_tqdm=False)] == tokens


def test_a_prompt_the_tokenizer_rejects_names_the_prompt_and_queues_nothing(path, monkeypatch):
    llm = make_llm(path, num_kvcache_blocks=16)

    def encode(text, *args, **kwargs):
        raise RuntimeError("tokenizer panicked")

    monkeypatch.setattr(llm.tokenizer, "encode", encode)
    with pytest.raises(
        ValueError, match="prompt 1: the tokenizer could not encode the prompt: RuntimeError: tokenizer panicked"
    ):
        llm.generate([[1, 2, 3], "boom"], GREEDY, use_tqdm=False)
    assert llm.next_request_id == 0  # nothing drawn, nothing queued
    assert_books_clean(llm)


# -- close ------------------------------------------------------------------------------------


def test_a_closed_engine_refuses_calls_and_a_second_one_serves(path, reference):
    prompts = prompts_of([5, 9])
    with make_llm(path, num_kvcache_blocks=64) as llm:
        llm.add_request(prompts[0], GREEDY)  # unfinished at close: dropped with the engine
        llm.step()
        with pytest.raises(TypeError, match=r"output\(\) takes a finished Request .*, got int"):
            llm.output(0)
        request = llm.requests[0]
    assert llm.runner.kv_cache is None and llm.runner.model is None  # its memory is handed back
    calls = (
        lambda: llm.generate(prompts, GREEDY, use_tqdm=False),
        llm.step,
        lambda: llm.add_request([1]),
        llm.is_finished,
        lambda: llm.output(request),
    )
    for call in calls:
        with pytest.raises(engine.EngineClosedError, match="closed engine"):
            call()
    llm.close()  # twice is harmless
    with make_llm(path, num_kvcache_blocks=64) as second:
        assert [o["token_ids"] for o in second.generate(prompts, GREEDY, use_tqdm=False)] == reference(prompts)
