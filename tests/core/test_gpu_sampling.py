"""On a CUDA GPU with CUDA graphs: penalties, logit_bias, min_tokens, logprobs and constraints in
decode batches whose model replays from graphs. A batch whose rows adjust their logits samples
eagerly (the sampling graphs know no adjustments): its tokens must equal those of an engine whose
sampling never replays (its runner handed another sampler instance, as test_gpu.py's sampling
graph test does), over the same decode graphs; plain batches still replay the sampling graphs,
and draw beside penalized rows what they draw alone; the penalties change the tokens.

Run: python -m pytest -m gpu -rP tests/core/test_gpu_sampling.py"""

from collections import Counter

import pytest
import torch
from logit_compare import ENGINE, SHAPE

from inferlab import LLM, SamplingParams
from inferlab.core.cuda_graphs import sampling_graph_kind
from inferlab.core.sampling_params import StructuredOutputs
from inferlab.tiny_model import make_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("gpu-qwen3-sampling")), seed=0, **SHAPE)


PROMPTS = [[(7 * i + j) % 380 for j in range(n)] for i, n in enumerate([5, 40, 300, 17, 64, 9])]
LENGTHS = [30, 12, 45, 3, 20, 25]


def cases() -> dict[str, list[SamplingParams]]:
    penalized = dict(presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.3)
    return {
        "greedy-penalized": [
            SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, **penalized) for m in LENGTHS
        ],
        "sampled-penalized-seeded": [
            SamplingParams(temperature=0.9, seed=300 + i, max_tokens=m, ignore_eos=True, **penalized)
            for i, m in enumerate(LENGTHS)
        ],
        "bias-and-min-tokens": [
            SamplingParams(
                temperature=0.7, seed=i, max_tokens=m, logit_bias={17: 4.0, 99: -100.0}, min_tokens=min(m, 5)
            )
            for i, m in enumerate(LENGTHS)
        ],
        # half the rows plain: they share batches with penalized ones
        "mixed": [
            SamplingParams(temperature=0.8, seed=400 + i, max_tokens=m, ignore_eos=True, **(penalized if i % 2 else {}))
            for i, m in enumerate(LENGTHS)
        ],
        "logprobs": [
            SamplingParams(temperature=0.8, seed=500 + i, max_tokens=m, ignore_eos=True, logprobs=5, prompt_logprobs=2)
            for i, m in enumerate(LENGTHS)
        ],
        "regex": [
            SamplingParams(
                temperature=1.0, seed=600 + i, max_tokens=m, structured_outputs=StructuredOutputs(regex="[a-z ]{1,40}")
            )
            for i, m in enumerate(LENGTHS)
        ],
    }


def generate_all(llm) -> dict:
    return {case: llm.generate(PROMPTS, params, use_tqdm=False) for case, params in cases().items()}


def test_adjusted_batches_draw_what_eager_sampling_draws(qwen3_path):
    from inferlab.plugins.samplers.default_sampler import DefaultSampler

    pytest.importorskip("xgrammar")
    replays = Counter()
    plain_params = [
        SamplingParams(temperature=0.8, seed=400 + i, max_tokens=m, ignore_eos=True) for i, m in enumerate(LENGTHS)
    ]
    greedy_params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in LENGTHS]
    with LLM(qwen3_path, attention="triton", **ENGINE) as llm:
        graphs = llm.runner.sampling_graphs
        assert graphs is not None and llm.runner.decode_graphs is not None
        replay = graphs.run

        def counted(hidden, params):
            replayed = replay(hidden, params)
            replays[sampling_graph_kind(params) if replayed else "eager"] += 1
            return replayed

        graphs.run = counted
        with_graphs = generate_all(llm)
        plain = llm.generate(PROMPTS, plain_params, use_tqdm=False)
        greedy = llm.generate(PROMPTS, greedy_params, use_tqdm=False)
    with LLM(qwen3_path, attention="triton", **ENGINE) as llm:
        assert llm.runner.decode_graphs is not None
        llm.runner.sampler = DefaultSampler()  # the captured sampler is not this one: sampling runs eagerly
        llm.runner.sampling_graphs.run = lambda hidden, params: pytest.fail("a replaced sampler was replayed")
        eager = generate_all(llm)
    print(dict(replays))
    for case in with_graphs:
        got = [o["token_ids"] for o in with_graphs[case]]
        expected = [o["token_ids"] for o in eager[case]]
        assert got == expected, f"{case}: sampling in the graph engine drew other tokens than eager sampling"
    # the plain rows of the mixed batches drew what they draw without penalized neighbours
    for i in range(0, len(PROMPTS), 2):
        assert with_graphs["mixed"][i]["token_ids"] == plain[i]["token_ids"]
    penalized = [o["token_ids"] for o in with_graphs["greedy-penalized"]]
    assert penalized != [o["token_ids"] for o in greedy], "the penalties changed the greedy tokens"
    for out, reference in zip(with_graphs["logprobs"], eager["logprobs"]):
        for got, expected in zip(
            out["logprobs"] + out["prompt_logprobs"][1:], reference["logprobs"] + reference["prompt_logprobs"][1:]
        ):
            assert list(got) == list(expected)
            assert list(got.values()) == pytest.approx(list(expected.values()), abs=1e-4)
    for out in with_graphs["bias-and-min-tokens"]:
        assert 99 not in out["token_ids"] and len(out["token_ids"]) >= 3
    assert replays["eager"] > 0, "adjusted batches sample eagerly"
    assert replays["sampled"] > 0 and replays["greedy"] > 0, "plain batches still replay the sampling graphs"
