"""The engine's sampling features beyond plain sampling, through the library API on the CPU:
logprobs and prompt logprobs against transformers' log-softmax (chunked prefill, prefix-cache
hits, overlap scheduling), logprobs_mode, n choices sharing one prefill, penalties against a
per-row reference, logit_bias, min_tokens, structured outputs and a user's own TokenConstraint,
and the refusals for samplers that lack a capability."""

import json
import re

import pytest
import torch

from inferlab import LLM, SamplingParams
from inferlab.core.batch import LogitsAdjustments
from inferlab.core.plugins import PluginRegistry
from inferlab.core.sampling_params import StructuredOutputs
from inferlab.plugins.samplers.default_sampler import DefaultSampler, adjusted_logits

SETTINGS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=128, max_num_seqs=16)
TOLERANCE = 2e-4  # float32 logits of two implementations of the same model


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("gqa2-tied")


@pytest.fixture(scope="module")
def hf_log_softmax(path):
    """token ids -> transformers' float32 log-softmax [len, vocab] at every position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def run(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)

    return run


def prompt_ids(length: int, offset: int = 0) -> list[int]:
    return [(7 * i + 3 + offset) % 300 + 10 for i in range(length)]


def check_against_reference(out: dict, prompt: list[int], reference: torch.Tensor, k: int, prompt_k: int | None):
    """out's logprobs (and prompt_logprobs) equal reference's log-softmax, its top ids included."""
    tokens = out["token_ids"]
    assert len(out["logprobs"]) == len(tokens)
    for i, (token, entry) in enumerate(zip(tokens, out["logprobs"])):
        row = reference[len(prompt) - 1 + i]
        assert token == int(row.argmax()), "greedy must take the argmax"
        assert entry[token] == pytest.approx(float(row[token]), abs=TOLERANCE)
        top = row.topk(k)
        assert list(entry)[1:] == [t for t in top.indices.tolist() if t != token][: len(entry) - 1]
        for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[token_id] == pytest.approx(value, abs=TOLERANCE)
    if prompt_k is None:
        assert "prompt_logprobs" not in out
        return
    scored = out["prompt_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None
    for p in range(1, len(prompt)):
        row = reference[p - 1]
        assert scored[p][prompt[p]] == pytest.approx(float(row[prompt[p]]), abs=TOLERANCE), f"prompt token {p}"
        assert set(row.topk(prompt_k).indices.tolist()) <= set(scored[p])


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(max_num_batched_tokens=16, overlap_scheduling=True),  # chunked prefill, placeholders
        dict(enable_prefix_caching=False),
    ],
    ids=["plain", "chunked-overlapped", "no-prefix-cache"],
)
def test_greedy_logprobs_equal_transformers_log_softmax(path, hf_log_softmax, settings, one_torch_thread):
    prompts = [prompt_ids(45), prompt_ids(20, 1)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=4, prompt_logprobs=3)
    with LLM(path, **{**SETTINGS, **settings}) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        reference = hf_log_softmax(prompt + out["token_ids"])
        check_against_reference(out, prompt, reference, 4, 3)


def test_logprobs_under_prefix_cache_hits_are_recomputed_for_the_prompt(path, hf_log_softmax, one_torch_thread):
    """A prompt whose blocks are cached: output logprobs come from the cached context, prompt
    logprobs from computing the prompt again (the cache is skipped for them)."""
    prompt = prompt_ids(50, 2)
    with LLM(path, **SETTINGS) as llm:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        hits_before = llm.kv_manager.prefix_cache_stats()[0]
        cached = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=2), use_tqdm=False)[0]
        assert llm.kv_manager.prefix_cache_stats()[0] - hits_before == 48, "the second request hits 3 blocks"
        hits_before = llm.kv_manager.prefix_cache_stats()[0]
        echoed = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=2, prompt_logprobs=2), use_tqdm=False
        )[0]
        assert llm.kv_manager.prefix_cache_stats()[0] == hits_before, "prompt logprobs compute the whole prompt"
    reference = hf_log_softmax(prompt + cached["token_ids"])
    check_against_reference(cached, prompt, reference, 2, None)
    check_against_reference(echoed, prompt, reference, 2, 2)


def test_logprobs_mode_processed_is_the_sampled_distribution_and_raw_the_models(path, hf_log_softmax):
    prompt = prompt_ids(30, 3)
    params = SamplingParams(temperature=0.5, top_k=3, max_tokens=4, ignore_eos=True, seed=11, logprobs=5)
    with LLM(path, **SETTINGS) as llm:
        processed = llm.generate([prompt], params, use_tqdm=False)[0]
    with LLM(path, **SETTINGS, logprobs_mode="raw_logprobs") as llm:
        raw = llm.generate([prompt], params, use_tqdm=False)[0]
    assert processed["token_ids"] == raw["token_ids"], "the mode changes what is reported, not what is drawn"
    reference = hf_log_softmax(prompt + raw["token_ids"])
    for i, (token, p_entry, r_entry) in enumerate(zip(raw["token_ids"], processed["logprobs"], raw["logprobs"])):
        row = reference[len(prompt) - 1 + i]
        assert r_entry[token] == pytest.approx(float(row[token]), abs=TOLERANCE)
        top3 = row.topk(3).indices
        expected = (row[top3] / 0.5).log_softmax(-1)  # the softmax of logits / T over the top 3
        assert token in top3.tolist()
        assert p_entry[token] == pytest.approx(float(expected[top3.tolist().index(token)]), abs=TOLERANCE)
        excluded = [v for t, v in p_entry.items() if t not in top3.tolist()]
        assert excluded and all(v == float("-inf") for v in excluded), "tokens top_k excludes have no mass"


def test_n_choices_share_one_prefill_and_draw_as_seeds_seed_plus_i(path, one_torch_thread):
    prompt = prompt_ids(40, 4)  # two full blocks of 16, and 8 tokens
    with LLM(path, **SETTINGS) as llm:
        out = llm.generate(
            [prompt], SamplingParams(temperature=1.0, n=4, seed=7, max_tokens=5, ignore_eos=True), use_tqdm=False
        )[0]
        assert llm.kv_manager.prefix_cache_stats()[0] == 3 * 32, "choices 1-3 take the first's two full blocks"
        assert llm.stats.num_prefill_tokens == 40 + 3 * 8, "one prefill, and each other choice its last partial block"
        alone = [
            llm.generate([prompt], SamplingParams(temperature=1.0, seed=7 + i, max_tokens=5, ignore_eos=True))[0]
            for i in range(4)
        ]
    assert [c["token_ids"] for c in out["choices"]] == [a["token_ids"] for a in alone]
    assert out["token_ids"] == out["choices"][0]["token_ids"]
    assert len({tuple(c["token_ids"]) for c in out["choices"]}) > 1


def test_n_choices_can_be_aborted_while_held_back(path):
    with LLM(path, **SETTINGS) as llm:
        leader = llm.add_request(prompt_ids(40), SamplingParams(temperature=1.0, n=3, max_tokens=4))
        assert llm.abort(leader + 2), "a choice waiting for the first choice's prefill"
        finished = []
        while not llm.is_finished():
            finished += llm.step().finished
        reasons = sorted((r.index, r.finish_reason) for r in finished)
        assert reasons == [(0, "length"), (1, "length"), (2, "abort")] or reasons == [(0, "length"), (1, "length")]


def reference_adjusted(logits, seqs, vocab):
    """vLLM's definitions, one row at a time: repetition over prompt and output, then frequency
    and presence over the output, then logit_bias; EOS and stop ids banned before min_tokens."""
    out = logits.clone()
    for row, (prompt, output, p, eos) in enumerate(seqs):
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=vocab).float()
        seen = counts > 0
        seen[prompt] = True
        r = out[row]
        r = torch.where(seen, torch.where(r > 0, r / p.repetition_penalty, r * p.repetition_penalty), r)
        r = r - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        for token, bias in (p.logit_bias or {}).items():
            r[token] += bias
        if len(output) < p.min_tokens:
            r[list(p.stop_token_ids) + [eos]] = float("-inf")
        out[row] = r
    return out


def test_penalties_bias_and_min_tokens_match_the_per_row_reference():
    vocab = 50
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=generator) * 3
    seqs = [
        ([1, 2, 3], [4, 4, 5], SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2), 0),
        ([6], [7], SamplingParams(repetition_penalty=0.8, logit_bias={9: 5.0, 1: -100.0}), 0),
        ([8, 8], [], SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=[11]), 2),
        ([3], [3, 3, 3], SamplingParams(frequency_penalty=-1.0), 0),
    ]
    rows = [0, 1, 2, 3]
    output_tokens = torch.tensor([r * vocab + t for r, (_, out, _, _) in enumerate(seqs) for t in out])
    prompt_tokens = torch.tensor([r * vocab + t for r, (pr, _, _, _) in enumerate(seqs) for t in pr])
    bias = [(r * vocab + t, b) for r, (_, _, p, _) in enumerate(seqs) for t, b in (p.logit_bias or {}).items()]
    adjustments = LogitsAdjustments(
        rows=torch.tensor(rows),
        presence=torch.tensor([p.presence_penalty for _, _, p, _ in seqs]),
        frequency=torch.tensor([p.frequency_penalty for _, _, p, _ in seqs]),
        repetition=torch.tensor([p.repetition_penalty for _, _, p, _ in seqs]),
        output_tokens=output_tokens,
        prompt_tokens=prompt_tokens,
        bias_index=torch.tensor([i for i, _ in bias]),
        bias=torch.tensor([b for _, b in bias]),
        banned=torch.tensor([2 * vocab + 11, 2 * vocab + 2]),
    )
    got = adjusted_logits(logits, adjustments)
    torch.testing.assert_close(got, reference_adjusted(logits, seqs, vocab))


def test_logit_bias_and_min_tokens_steer_the_engine(path):
    with LLM(path, **SETTINGS) as llm:
        prompt = prompt_ids(12)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logit_bias={42: 100.0}))[0]
        assert out["token_ids"] == [42] * 5
        # 42 is the stop token and favoured, but cannot end the output before min_tokens
        params = SamplingParams(temperature=0, max_tokens=8, logit_bias={42: 100.0}, stop_token_ids=[42], min_tokens=3)
        out = llm.generate([prompt], params)[0]
        assert len(out["token_ids"]) == 4 and 42 not in out["token_ids"][:3] and out["token_ids"][3] == 42
        assert out["finish_reason"] == "stop"


def test_penalties_with_logprobs_report_the_penalized_distribution(path, hf_log_softmax):
    prompt = prompt_ids(20, 5)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0, presence_penalty=2.0)
    with LLM(path, **SETTINGS) as llm:
        out = llm.generate([prompt], params)[0]
    tokens = out["token_ids"]
    reference = hf_log_softmax(prompt + tokens)
    for i, token in enumerate(tokens):
        raw = reference[len(prompt) - 1 + i].clone()
        raw[list(set(tokens[:i]))] -= 2.0
        expected = raw.log_softmax(-1)
        assert token == int(expected.argmax()), "the penalized argmax"
        assert out["logprobs"][i][token] == pytest.approx(float(expected[token]), abs=TOLERANCE)


@pytest.mark.parametrize(
    "spec, check",
    [
        (StructuredOutputs(regex="[ab]{4}c"), lambda text: re.fullmatch("[ab]{4}c", text)),
        (StructuredOutputs(choice=["yes", "no way"]), lambda text: text in ("yes", "no way")),
        (
            StructuredOutputs(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
            lambda text: isinstance(json.loads(text)["n"], int),
        ),
        (StructuredOutputs(grammar='root ::= "x" [0-9] "y"'), lambda text: re.fullmatch("x[0-9]y", text)),
    ],
    ids=["regex", "choice", "json", "grammar"],
)
def test_structured_outputs_follow_their_grammar(path, spec, check):
    pytest.importorskip("xgrammar")
    with LLM(path, **SETTINGS) as llm:
        outs = llm.generate(
            [prompt_ids(10, s) for s in range(3)],
            SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_outputs=spec, n=2),
        )
        for out in outs:
            for choice in out["choices"]:
                assert choice["finish_reason"] == "stop", choice
                assert choice["token_ids"][-1] == llm.eos_token_id, "the grammar ends with EOS"
                text = llm.tokenizer.decode(choice["token_ids"][:-1])
                assert check(text), text


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length_and_a_valid_prefix(path):
    pytest.importorskip("xgrammar")
    word = "abababababababababab"
    with LLM(path, **SETTINGS) as llm:
        out = llm.generate(
            [prompt_ids(8)], SamplingParams(max_tokens=3, structured_outputs=StructuredOutputs(choice=[word]))
        )
    assert out[0]["finish_reason"] == "length" and word.startswith(out[0]["text"]) and out[0]["text"]


def test_a_schema_the_library_rejects_is_a_value_error_naming_it(path):
    pytest.importorskip("xgrammar")
    with LLM(path, **SETTINGS) as llm, pytest.raises(ValueError, match="structured_outputs.regex: the grammar library"):
        llm.generate([prompt_ids(8)], SamplingParams(structured_outputs=StructuredOutputs(regex="(unclosed")))


class EvenTokens:
    """A user's own TokenConstraint: even token ids only, three of them."""

    def __init__(self):
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0x55555555  # bits 0, 2, 4, ...: even ids

    def accept_token(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return token_id % 2 == 0

    def is_terminated(self) -> bool:
        return len(self.accepted) == 3


def test_a_users_constraint_plugs_in_as_a_token_constraint(path):
    made = []

    def factory():
        made.append(EvenTokens())
        return made[-1]

    with LLM(path, **SETTINGS, overlap_scheduling=True) as llm:
        outs = llm.generate(
            [prompt_ids(9, s) for s in range(4)], SamplingParams(temperature=1.0, max_tokens=10, constraint=factory)
        )
    assert len(made) == 4
    for out, constraint in zip(outs, made):
        assert out["finish_reason"] == "stop" and len(out["token_ids"]) == 3
        assert all(t % 2 == 0 for t in out["token_ids"]) and constraint.accepted == out["token_ids"]


class CallOnlySampler:
    """A third-party sampler with no optional capability."""

    def __init__(self, config):
        self.inner = DefaultSampler(config)

    def __call__(self, logits, params):
        return self.inner(logits, params)


def test_a_sampler_without_a_capability_refuses_requests_that_need_it(path, plugin_module):
    registry = PluginRegistry()
    registry.register(
        plugin_module("call_only", register_samplers=lambda register: register("call_only", CallOnlySampler))
    )
    with LLM(path, **SETTINGS, sampler="call_only", registry=registry) as llm:
        assert llm.generate([prompt_ids(5)], SamplingParams(max_tokens=2))[0]["token_ids"]
        for params, lacking in (
            (SamplingParams(logprobs=1), "LogprobsSampler"),
            (SamplingParams(presence_penalty=0.5), "LogitsProcessingSampler"),
            (SamplingParams(structured_outputs=StructuredOutputs(regex="a")), "LogitsProcessingSampler"),
        ):
            with pytest.raises(ValueError, match=f"sampler 'call_only' does not support .*{lacking}"):
                llm.generate([prompt_ids(5)], params)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(logprobs=21), "logprobs must be None or an integer in \\[0, 20\\]"),
        (dict(prompt_logprobs=-1), "prompt_logprobs must be"),
        (dict(n=0), "n must be an integer in \\[1,"),
        (dict(presence_penalty=2.5), "presence_penalty must be in \\[-2, 2\\]"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty must be in \\[-2, 2\\]"),
        (dict(repetition_penalty=0), "repetition_penalty must be a number > 0"),
        (dict(logit_bias={3: 101}), "logit_bias\\[3\\] must be in \\[-100, 100\\]"),
        (dict(logit_bias={-1: 1}), "logit_bias keys must be token ids"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens must be at most max_tokens"),
        (dict(structured_outputs={"regex": "a"}), "structured_outputs must be a StructuredOutputs"),
        (dict(constraint=3), "constraint must be a callable"),
    ],
)
def test_sampling_params_refuse_out_of_range_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**settings)


def test_structured_outputs_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputs()


def test_logit_bias_ids_outside_the_vocabulary_are_refused(path):
    with LLM(path, **SETTINGS) as llm, pytest.raises(ValueError, match="logit_bias: token ids \\[999\\] are outside"):
        llm.generate([prompt_ids(5)], SamplingParams(logit_bias={999: 1.0}))


def test_every_choice_reports_the_prompt_logprobs_its_first_choice_computed(path):
    prompt = prompt_ids(40, 6)
    with LLM(path, **SETTINGS) as llm:
        out = llm.generate([prompt], SamplingParams(n=3, max_tokens=2, prompt_logprobs=1, seed=2), use_tqdm=False)[0]
        assert llm.kv_manager.prefix_cache_stats()[0] == 2 * 32, "the other choices still hit the cache"
    scored = [c["prompt_logprobs"] for c in out["choices"]]
    assert len(scored[0]) == 40 and scored[0] == scored[1] == scored[2]


def test_the_simulated_executor_runs_n_choices_and_refuses_logprobs():
    with LLM(executor="simulated", executor_options={"profile": "h200-qwen3-0.6b-triton"}) as llm:
        out = llm.generate([[1] * 600], SamplingParams(n=3, max_tokens=4), use_tqdm=False)[0]
        assert [len(c["token_ids"]) for c in out["choices"]] == [4, 4, 4]
        hits = llm.kv_manager.prefix_cache_stats()[0]
        assert hits == 2 * (599 // llm.kv_manager.block_size) * llm.kv_manager.block_size
        with pytest.raises(ValueError, match="executor 'simulated' computes no logits"):
            llm.generate([[1] * 10], SamplingParams(logprobs=1))


class Faulty(EvenTokens):
    """A constraint that raises after its first token, in fill_bitmask or in accept_token."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def fill_bitmask(self, bitmask, row):
        if self.where == "fill" and self.accepted:
            raise RuntimeError("broken mask")
        super().fill_bitmask(bitmask, row)

    def accept_token(self, token_id):
        if self.where == "accept" and self.accepted:
            raise RuntimeError("broken accept")
        return super().accept_token(token_id)


@pytest.mark.parametrize("where", ["fill", "accept"])
def test_a_constraint_that_raises_fails_its_own_request_alone(path, where):
    with LLM(path, **SETTINGS) as llm:
        outs = llm.generate(
            [prompt_ids(9), prompt_ids(9, 1)],
            [
                SamplingParams(max_tokens=8, constraint=lambda: Faulty(where)),
                SamplingParams(max_tokens=8, ignore_eos=True),
            ],
            use_tqdm=False,
        )
    assert outs[0]["finish_reason"] == "error" and "broken" in outs[0]["error"]
    assert outs[1]["finish_reason"] == "length" and len(outs[1]["token_ids"]) == 8


def test_prompt_logprobs_of_a_long_chunk_are_computed_a_few_rows_at_a_time(path, hf_log_softmax, monkeypatch):
    import inferlab.core.model_runner as model_runner

    monkeypatch.setattr(model_runner, "PROMPT_LOGITS_ROWS", 7)
    prompt = prompt_ids(45, 8)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=3)
    with LLM(path, **SETTINGS) as llm:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
    check_against_reference(out, prompt, hf_log_softmax(prompt + out["token_ids"]), 2, 3)


@pytest.mark.parametrize("overlap", [False, True])
def test_penalties_count_every_generated_token_step_after_step(path, overlap):
    """A frequency penalty large enough that greedy decoding never repeats a token while others
    are left: the penalized counts follow the output as it grows (placeholders included)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)
    with LLM(path, **SETTINGS, overlap_scheduling=overlap) as llm:
        outs = llm.generate([prompt_ids(20, s) for s in range(3)], params, use_tqdm=False)
        unpenalized = llm.generate(
            [prompt_ids(20, s) for s in range(3)],
            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
            use_tqdm=False,
        )
    assert any(len(set(o["token_ids"])) < 40 for o in unpenalized), "without penalties greedy repeats itself"
    for out in outs:
        assert len(set(out["token_ids"])) == 40, out["token_ids"]
