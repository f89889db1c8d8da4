"""Engine fuzzing on CPU: random prompts (1..max_model_len tokens, shared prefixes), random
sampling settings, random small KV budgets and batch limits, block size 16. Every run must end
with every block free, and the tokens of each request must not depend on the budgets, the batch
it shared, the submission order or a warm prefix cache."""

import random
from collections import Counter

import pytest
from engine_books import assert_books_clean
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis_profiles import ENGINE_EXAMPLES, QUICK_ENGINE_EXAMPLES, quick_and_thorough

from inferlab import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BLOCK = 16
VOCAB = 384  # the tiny tokenizer's; id 0 is EOS


@st.composite
def workloads(draw):
    max_model_len = draw(st.integers(8, 96), label="max_model_len")
    bases = draw(
        st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_model_len), min_size=1, max_size=3),
        label="shared prefixes",
    )
    prompts, params = [], []
    for _ in range(draw(st.integers(1, 8), label="requests")):
        base = draw(st.sampled_from(bases))
        prompt = base[: draw(st.integers(0, len(base)))] + draw(st.lists(st.integers(0, VOCAB - 1), max_size=40))
        prompts.append((prompt or [draw(st.integers(1, VOCAB - 1))])[:max_model_len])
        params.append(
            SamplingParams(
                temperature=draw(st.sampled_from([0.0, 0.6, 1.0, 1.5])),
                top_k=draw(st.sampled_from([-1, 1, 5, 50])),
                top_p=draw(st.sampled_from([1.0, 0.9, 0.5])),
                min_p=draw(st.sampled_from([0.0, 0.1])),
                max_tokens=draw(st.integers(1, 24)),
                ignore_eos=draw(st.booleans()),
                seed=draw(st.none() | st.integers(0, 2**32 - 1)),
                stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
            )
        )
    return max_model_len, prompts, params


PATHS_TAKEN = (
    64,
    [list(range(1, 41)), *(list(range(50 + 20 * i, 66 + 20 * i)) for i in range(3))],
    [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 4,
)
TIGHT = {"num_kvcache_blocks": 4, "max_num_seqs": 4, "max_num_batched_tokens": 64, "enable_prefix_caching": False}
budgets = st.fixed_dictionaries(
    {
        "num_kvcache_blocks": st.integers(1, 12),
        "max_num_seqs": st.integers(1, 8),
        "max_num_batched_tokens": st.integers(4, 128),
        "enable_prefix_caching": st.booleans(),
    }
)


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint()


@pytest.mark.parametrize("examples", quick_and_thorough(QUICK_ENGINE_EXAMPLES, ENGINE_EXAMPLES))
def test_engine_fuzz(path, examples):
    seen = Counter()  # across all examples: proof that the interesting paths were taken

    @settings(max_examples=examples)
    @given(workload=workloads(), first=budgets, second=budgets, order_seed=st.randoms(use_true_random=False))
    # The paths the final check asks for, whatever the draws: a request too long for a 2-block cache
    # (an error result) and four requests that do not fit a 4-block cache together (preemption).
    @example(workload=PATHS_TAKEN, first=TIGHT | {"num_kvcache_blocks": 2}, second=TIGHT, order_seed=random.Random(0))
    def engines_agree(workload, first, second, order_seed):
        max_model_len, prompts, params = workload
        engine_a = LLM(path, device="cpu", kvcache_block_size=BLOCK, max_model_len=max_model_len, **first)
        engine_b = LLM(path, device="cpu", kvcache_block_size=BLOCK, max_model_len=max_model_len, **second)
        out_a = engine_a.generate(prompts, params, use_tqdm=False)
        assert_books_clean(engine_a)
        out_b = engine_b.generate(prompts, params, use_tqdm=False)
        assert_books_clean(engine_b)
        for i, (a, b) in enumerate(zip(out_a, out_b)):
            most_tokens = max(len(prompts[i]), min(len(prompts[i]) + params[i].max_tokens, max_model_len) - 1)
            for out, engine in ((a, engine_a), (b, engine_b)):
                assert (out["finish_reason"] == "error") == (-(-most_tokens // BLOCK) > engine.kv_manager.num_blocks)
                if out["finish_reason"] != "error":
                    assert 1 <= len(out["token_ids"]) <= params[i].max_tokens
            if "error" not in a and "error" not in b:  # same seeds (unseeded ones drawn in order), same tokens
                assert a["token_ids"] == b["token_ids"], f"request {i} differs between budgets {first} and {second}"
                seen["compared"] += 1
            seen["error"] += ("error" in a) + ("error" in b)
        seen["preempted"] += engine_a.scheduler.num_preemptions + engine_b.scheduler.num_preemptions > 0
        # again on the warm engine, in another order: requests with a seed (or greedy) repeat exactly
        order = list(range(len(prompts)))
        order_seed.shuffle(order)
        again = engine_a.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False)
        assert_books_clean(engine_a)
        for j, i in enumerate(order):
            if params[i].seed is not None or params[i].temperature == 0:
                assert again[j]["token_ids"] == out_a[i]["token_ids"], f"request {i} differs on a rerun"
        assert engine_a.stats.num_preemptions == engine_a.scheduler.num_preemptions

    engines_agree()
    # the examples preempted, rejected and compared requests
    assert seen["preempted"] > 0 and seen["error"] > 0 and seen["compared"] > 0, seen
