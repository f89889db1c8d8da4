"""The default sampler's filters, its per-request reproducibility, and stop handling end to end."""

import pytest
import torch

from inferlab import LLM, SamplingParams
from inferlab.core.batch import SamplingTensors
from inferlab.plugins.samplers.default_sampler import (
    DefaultSampler,
    filter_logits,
    inverse_transform_reference,
    row_uniform,
)


def tensors(n, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0, seeds=None, steps=None, vocab=8):
    top_k = top_k if top_k is not None else vocab
    as_list = lambda v: v if isinstance(v, list) else [v] * n  # noqa: E731
    t, k, p, m = as_list(temperature), as_list(top_k), as_list(top_p), as_list(min_p)
    return SamplingTensors(
        temperatures=torch.tensor(t, dtype=torch.float32),
        top_k=torch.tensor(k),
        top_p=torch.tensor(p),
        min_p=torch.tensor(m),
        seeds=torch.tensor(seeds if seeds is not None else list(range(n))),
        steps=torch.tensor(steps if steps is not None else [0] * n),
        all_greedy=all(x == 0 for x in t),
        any_top_k=any(x < vocab for x in k),
        any_top_p=any(x < 1 for x in p),
        any_min_p=any(x > 0 for x in m),
    )


PROBS = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
LOGITS = PROBS.log()


def kept(**kw):
    return torch.isfinite(filter_logits(LOGITS.clone(), tensors(1, vocab=4, **kw)))[0].nonzero().flatten().tolist()


def test_top_k_mask():
    assert kept(top_k=1) == [1]
    assert kept(top_k=2) == [1, 3]
    assert kept(top_k=3) == [1, 2, 3]


def test_top_p_mask_keeps_smallest_set_reaching_p():
    assert kept(top_p=0.5) == [1]
    assert kept(top_p=0.7) == [1, 3]
    assert kept(top_p=0.8) == [1, 3]
    assert kept(top_p=0.81) == [1, 2, 3]
    assert kept(top_p=1e-6) == [1]  # the top token always stays


def test_top_k_then_top_p():
    assert kept(top_k=2, top_p=0.99) == [1, 3]


def test_min_p_mask():
    assert kept(min_p=0.2) == [1, 2, 3]  # threshold 0.1
    assert kept(min_p=0.5) == [1, 3]  # threshold 0.25
    assert kept(min_p=1.0) == [1]


def test_greedy_rows_take_argmax_and_mix_with_sampled_rows():
    logits = torch.randn(6, 50)
    out = DefaultSampler()(logits, tensors(6, temperature=[0, 1, 0, 1, 0, 1], vocab=50))
    assert out[0::2].tolist() == logits[0::2].argmax(-1).tolist()


def test_a_rows_token_ignores_the_rest_of_its_batch():
    """What lets the runner replay the sampler from CUDA graphs (supports_cuda_graphs): rows
    sampled beside padding rows of other logits and stale settings get the tokens they get alone."""
    from inferlab.core.cuda_graphs import sampling_graph_kind

    assert DefaultSampler.supports_cuda_graphs
    torch.manual_seed(0)
    logits = torch.randn(7, 50)
    for temperature in ([0, 0, 0], [0.7, 0, 1.3]):
        alone = tensors(3, temperature=temperature, seeds=[5, 6, 7], steps=[10, 11, 12], vocab=50)
        padded = tensors(
            7, temperature=temperature + [0.5] * 4, seeds=[5, 6, 7, 1, 2, 3, 4], steps=[10, 11, 12] + [3] * 4, vocab=50
        )
        padded.all_greedy = alone.all_greedy  # the graph is chosen by the real rows' flags
        assert torch.equal(DefaultSampler()(logits[:3], alone), DefaultSampler()(logits, padded)[:3])
        assert sampling_graph_kind(alone) == ("greedy" if alone.all_greedy else "sampled")
    assert sampling_graph_kind(tensors(2, top_k=5, vocab=50)) is None  # filtered: eager


def test_top_k_1_is_greedy_at_any_temperature():
    logits = torch.randn(5, 100)
    out = DefaultSampler()(logits, tensors(5, temperature=2.0, top_k=1, vocab=100))
    assert out.tolist() == logits.argmax(-1).tolist()


def test_samples_follow_the_distribution():
    """Many independent draws (different steps) land in proportion to softmax(logits / T)."""
    n = 20000
    logits = LOGITS.expand(n, 4) * 2  # T=2 below undoes the scaling
    out = DefaultSampler()(logits, tensors(n, temperature=2.0, seeds=[7] * n, steps=list(range(n)), vocab=4))
    freq = torch.bincount(out, minlength=4).float() / n
    assert torch.allclose(freq, PROBS[0], atol=0.015), freq


def test_uniform_depends_only_on_seed_and_step():
    u = row_uniform(torch.tensor([1, 2, 1, 1]), torch.tensor([5, 5, 5, 6]))
    assert u[0] == u[2] and u[0] != u[1] and u[0] != u[3]
    many = row_uniform(torch.full((20000,), 3), torch.arange(20000))
    assert 0 <= many.min() and many.max() < 1 and abs(many.mean().item() - 0.5) < 0.01
    assert torch.equal(many * (1 << 24), (many * (1 << 24)).round())  # 24 bits: exact in float32
    assert row_uniform(torch.tensor([1]), torch.tensor([5])) == u[0]  # whatever else is in the batch


def test_inverse_transform_picks_the_token_whose_share_holds_the_uniform():
    """With four tokens of known shares, the drawn token is the one whose interval of the
    cumulative distribution holds u, for every uniform the hash gives these steps."""
    n = 2000
    logits = LOGITS.expand(n, 4)
    seeds, steps = torch.full((n,), 11), torch.arange(n)
    out = inverse_transform_reference(logits, torch.ones(n), seeds, steps)
    bounds = PROBS[0].double().cumsum(0)
    want = torch.searchsorted(bounds, row_uniform(seeds, steps)[:, None], right=True).squeeze(1)
    assert torch.equal(out, want)


def test_seeded_request_reproducible_whatever_the_batch(checkpoint):
    llm = LLM(checkpoint("gqa2-tied"), kvcache_block_size=16, num_kvcache_blocks=64)
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], seeded, use_tqdm=False)[0]
    others = SamplingParams(temperature=0.8, max_tokens=5, top_p=0.9, ignore_eos=True)
    crowded = llm.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4]], [others, seeded, others], use_tqdm=False)[1]
    assert alone["token_ids"] == crowded["token_ids"]
    different = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True), use_tqdm=False
    )[0]
    assert different["token_ids"] != alone["token_ids"]


def test_engine_seed_makes_unseeded_runs_reproducible(checkpoint):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = [
        LLM(checkpoint("gqa2-tied"), kvcache_block_size=16, num_kvcache_blocks=64, seed=3).generate(
            [[5, 6, 7], [8, 9]], params, use_tqdm=False
        )
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


@pytest.fixture(scope="module")
def greedy_llm(checkpoint):
    return LLM(checkpoint("gqa4-untied"), kvcache_block_size=16, num_kvcache_blocks=64)


def test_stop_string_cuts_text_before_it(greedy_llm):
    prompt = "Hello, world! How are"
    full = greedy_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[
        0
    ]
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), "the test needs a visible stop string"
    cut = greedy_llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop, "never-there"]),
        use_tqdm=False,
    )[0]
    assert cut["text"] == text[: text.find(stop)]
    assert cut["finish_reason"] == "stop"
    assert len(cut["token_ids"]) < len(full["token_ids"])
    assert full["token_ids"][: len(cut["token_ids"])] == cut["token_ids"]


def test_stop_token_ids_end_generation(greedy_llm):
    full = greedy_llm.generate(
        [[4, 5, 6]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0]
    stop_at = full["token_ids"][3]
    first = full["token_ids"].index(stop_at)
    out = greedy_llm.generate(
        [[4, 5, 6]],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )[0]
    assert out["token_ids"] == full["token_ids"][: first + 1] and out["finish_reason"] == "stop"


def test_temperature_zero_is_greedy_and_allowed(greedy_llm):
    assert SamplingParams(temperature=0).greedy
    a = greedy_llm.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=8, seed=1), use_tqdm=False)[0]
    b = greedy_llm.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=8, seed=2), use_tqdm=False)[0]
    assert a == b and a["token_ids"]


@pytest.mark.parametrize("temperature", [1e-39, 1e-20, 9.9e-6])
def test_temperatures_below_the_threshold_are_greedy(greedy_llm, temperature):
    """Dividing logits by 1e-39 overflows float32 and picked the last vocabulary id every time;
    below 1e-5 (vLLM's _SAMPLING_EPS) a request samples greedily instead."""
    params = SamplingParams(temperature=temperature, max_tokens=10, seed=1, ignore_eos=True)
    assert params.greedy and params.temperature == temperature  # kept as given
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[3, 4], [7, 8, 9, 10]]
    got = greedy_llm.generate(prompts, [params, SamplingParams(temperature=1.0, seed=4, max_tokens=4)], use_tqdm=False)
    assert got[0]["token_ids"] == greedy_llm.generate([prompts[0]], greedy, use_tqdm=False)[0]["token_ids"]
    assert not SamplingParams(temperature=1e-5).greedy


def test_each_seed_has_its_own_tokens_and_unusable_seeds_are_refused(greedy_llm):
    """Seeds used to fold to 32 bits (-1, 0, 2**64 and 2**32 + 1 gave the same tokens): now every
    seed in [0, 2**32) is honoured whole and the rest are refused where they are given."""
    seeds = [0, 1, 2**31, 2**32 - 1]
    params = [SamplingParams(temperature=1.5, max_tokens=24, seed=seed, ignore_eos=True) for seed in seeds]
    outputs = greedy_llm.generate([[3, 4, 5]] * len(seeds), params, use_tqdm=False)
    tokens = [tuple(o["token_ids"]) for o in outputs]
    assert len(set(tokens)) == len(seeds)
    assert greedy_llm.generate([[3, 4, 5]], params[-1], use_tqdm=False)[0]["token_ids"] == list(tokens[-1])
    for seed in (-1, 2**32, 2**32 + 1, 2**64):
        with pytest.raises(ValueError, match=r"seed must be None or an integer in \[0, 2\*\*32 - 1\]"):
            SamplingParams(seed=seed)
