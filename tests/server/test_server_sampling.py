"""The server's sampling features through the official openai client against a live server:
logprobs (completions and chat, whole and streamed) equal to the library's, echo with prompt
logprobs as lm-eval's loglikelihood requests send it, n choices indexed and streamed
interleaved, penalties and logit_bias, structured outputs (response_format, vLLM's guided_*
fields), and the 400s for what is out of range or unsupported."""

import json
import re

import httpx
import openai
import pytest

from inferlab import LLM, SamplingParams
from inferlab.conf import ServeConfig
from inferlab.server import InferenceServer

SETTINGS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64, max_num_seqs=32)
PROMPT = "The quick brown fox jumps over the lazy dog. Prefix caching lets two prompts"


@pytest.fixture(scope="module")
def server(one_torch_thread):
    engine = LLM(**SETTINGS)
    with engine, InferenceServer(engine, ServeConfig(port=0, log_level="warning", max_n=8)) as server:
        yield server


@pytest.fixture(scope="module")
def library():
    """A second engine of the same model, for reference outputs."""
    with LLM(**SETTINGS) as engine:
        yield engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_completion_logprobs_whole_and_streamed_equal_the_librarys(server, client, library):
    expected = library.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3), use_tqdm=False
    )[0]
    decode = server.model.tokenizer.decode
    whole = client.completions.create(
        model=server.model.name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    logprobs = whole.choices[0].logprobs
    assert logprobs.tokens == [decode([t]) for t in expected["token_ids"]]
    assert logprobs.token_logprobs == pytest.approx([e[t] for t, e in zip(expected["token_ids"], expected["logprobs"])])
    for top, entry in zip(logprobs.top_logprobs, expected["logprobs"]):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(max(entry.values()))
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets

    chunks = list(
        client.completions.create(
            model=server.model.name,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            logprobs=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    streamed = [
        lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(logprobs.token_logprobs)


def test_chat_logprobs_in_openais_shape(server, client):
    messages = [{"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(
        model=server.model.name, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = whole.choices[0].logprobs.content
    assert 1 <= len(content) <= 5
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())
    chunks = client.chat.completions.create(
        model=server.model.name,
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    streamed = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content])


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(server, client, library):
    """lm-eval's loglikelihood request: token id prompts, max_tokens 1, logprobs 1, echo, greedy."""
    tokenizer = server.model.tokenizer
    contexts = [tokenizer.encode("Question: what is the capital of France? Answer:"), tokenizer.encode("One two")]
    continuations = [tokenizer.encode(" Paris"), tokenizer.encode(" three")]
    prompts = [c + x for c, x in zip(contexts, continuations)]
    response = client.completions.create(
        model=server.model.name, prompt=prompts, max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    assert [c.index for c in response.choices] == [0, 1]
    for prompt, context, choice in zip(prompts, contexts, response.choices):
        expected = library.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False
        )[0]["prompt_logprobs"]
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(prompt) + 1 and logprobs.token_logprobs[0] is None
        assert logprobs.top_logprobs[0] is None
        assert logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(
            [expected[p][prompt[p]] for p in range(1, len(prompt))], abs=1e-4
        )
        assert choice.text.startswith(tokenizer.decode(prompt))
        # what lm-eval sums: the continuation's logprobs, and whether each is the greedy token
        continuation = logprobs.token_logprobs[len(context) : len(prompt)]
        assert all(isinstance(v, float) and v < 0 for v in continuation)


def test_n_choices_are_indexed_and_streamed_interleaved(server, client):
    whole = client.completions.create(
        model=server.model.name, prompt=[PROMPT, "Hello"], n=3, max_tokens=4, temperature=1.0, seed=5
    )
    assert [c.index for c in whole.choices] == list(range(6))
    encode = server.model.tokenizer.encode
    assert whole.usage.prompt_tokens == len(encode(PROMPT)) + len(encode("Hello")), "a prompt counts once"
    assert 6 <= whole.usage.completion_tokens <= 24
    chunks = list(
        client.completions.create(
            model=server.model.name,
            prompt=PROMPT,
            n=3,
            max_tokens=6,
            temperature=1.0,
            seed=5,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    )
    order = [c.choices[0].index for c in chunks if c.choices]
    assert set(order) == {0, 1, 2}
    first_finish = min(i for i, c in enumerate(chunks) if c.choices and c.choices[0].finish_reason)
    assert len({c.choices[0].index for c in chunks[:first_finish] if c.choices}) > 1, "choices interleave"
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    whole = client.completions.create(
        model=server.model.name,
        prompt=PROMPT,
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    assert texts == [c.text for c in whole.choices], "the same seed draws the same choices streamed or whole"


def test_best_of_returns_the_completions_of_highest_mean_logprob(server, client):
    only = client.completions.create(model=server.model.name, prompt=PROMPT, max_tokens=5, best_of=4, seed=9)
    assert [c.index for c in only.choices] == [0] and only.choices[0].logprobs is None
    assert only.usage.completion_tokens >= 4, "every generated completion counts"
    best = client.completions.create(
        model=server.model.name, prompt=PROMPT, max_tokens=5, best_of=4, n=2, seed=9, logprobs=1
    )
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in best.choices]
    assert [c.index for c in best.choices] == [0, 1] and means[0] >= means[1]
    assert best.choices[0].text == only.choices[0].text, "the same seed draws the same four; the best is the same"
    everyone = client.completions.create(model=server.model.name, prompt=PROMPT, max_tokens=5, n=4, seed=9, logprobs=1)
    all_means = sorted(
        (sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in everyone.choices), reverse=True
    )
    assert means == pytest.approx(all_means[:2])


def test_n_shares_the_prefill_through_the_prefix_cache(server, client):
    before = prefix_hits(server)
    long_prompt = " ".join(["Numbers: zero one two three four five six seven eight nine ten."] * 4)
    client.completions.create(model=server.model.name, prompt=long_prompt, n=4, max_tokens=2, temperature=1.0)
    num_tokens = len(server.model.tokenizer.encode(long_prompt))
    full_blocks = (num_tokens - 1) // 16 * 16
    assert prefix_hits(server) - before >= 3 * full_blocks


def prefix_hits(server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(r"^[a-z_:]*prefix_cache_hit[a-z_]*total(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, "the server exports its prefix cache hits"
    return float(match.group(1))


def test_penalties_and_logit_bias_reach_the_sampler(server, client):
    favoured = 42
    out = client.completions.create(
        model=server.model.name,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logit_bias={str(favoured): 100},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert out.choices[0].token_ids == [favoured] * 4
    out = client.completions.create(
        model=server.model.name,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logit_bias={str(favoured): 100},
        presence_penalty=2.0,
        frequency_penalty=2.0,
        extra_body={"return_token_ids": True, "ignore_eos": True, "repetition_penalty": 1.5, "min_tokens": 2},
    )
    assert out.choices[0].token_ids == [favoured] * 4, "a +100 bias outweighs the penalties"
    chat = client.chat.completions.create(
        model=server.model.name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        presence_penalty=1.0,
        frequency_penalty=-0.5,
        seed=3,
    )
    assert chat.choices[0].finish_reason in ("stop", "length")


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


@pytest.mark.parametrize(
    "fields, check",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
            lambda text: isinstance(json.loads(text)["answer"], int),
        ),
        ({"response_format": {"type": "json_object"}}, lambda text: isinstance(json.loads(text), dict)),
        ({"extra_body": {"guided_regex": "[0-9]{3}"}}, lambda text: re.fullmatch("[0-9]{3}", text)),
        ({"extra_body": {"guided_choice": ["red", "green"]}}, lambda text: text in ("red", "green")),
        ({"extra_body": {"guided_json": SCHEMA}}, lambda text: "answer" in json.loads(text)),
        ({"extra_body": {"structured_outputs": {"regex": "x+y"}}}, lambda text: re.fullmatch("x+y", text)),
        ({"extra_body": {"guided_grammar": 'root ::= "a" | "b"'}}, lambda text: text in ("a", "b")),
    ],
    ids=["json_schema", "json_object", "guided_regex", "guided_choice", "guided_json", "structured_outputs", "grammar"],
)
def test_structured_outputs_over_chat(server, client, fields, check):
    pytest.importorskip("xgrammar")
    out = client.chat.completions.create(
        model=server.model.name,
        messages=[{"role": "user", "content": "Answer."}],
        max_tokens=80,
        temperature=0.7,
        seed=1,
        **fields,
    )
    choice = out.choices[0]
    if choice.finish_reason == "stop":  # the grammar ended it
        assert check(choice.message.content), choice.message.content


def test_a_grammar_that_cannot_finish_ends_with_length(server, client):
    pytest.importorskip("xgrammar")
    word = "abababababababababab"
    out = client.completions.create(
        model=server.model.name, prompt="x", max_tokens=2, extra_body={"guided_choice": [word]}
    )
    assert out.choices[0].finish_reason == "length" and word.startswith(out.choices[0].text)


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"logprobs": 21}, "logprobs", "logprobs must be in \\[0, 20\\]"),
        ({"n": 9}, "n", "n must be in \\[1, 8\\] \\(serve.max_n\\)"),
        ({"n": 8, "max_tokens": 200}, "n", "n: 8 choices .* KV cache"),
        ({"presence_penalty": -2.5}, "presence_penalty", "presence_penalty must be in \\[-2, 2\\]"),
        ({"frequency_penalty": 3}, "frequency_penalty", "frequency_penalty must be in"),
        ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be a number > 0"),
        ({"logit_bias": {"100000": 1}}, "logit_bias", "outside the vocabulary"),
        ({"logit_bias": {"5": 200}}, "logit_bias", "must be in \\[-100, 100\\]"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens", "min_tokens must be at most max_tokens"),
        ({"guided_regex": "[0-9]", "guided_choice": ["a"]}, "guided_choice", "give one structured output"),
        ({"response_format": {"type": "xml"}}, "response_format", "type must be"),
        ({"best_of": 2, "n": 3}, "best_of", "best_of \\(2\\) must be at least n \\(3\\)"),
        ({"best_of": 3, "stream": True}, "best_of", "best_of cannot be used with stream"),
        ({"best_of": 9}, "best_of", "best_of must be in \\[1, 8\\]"),
    ],
)
def test_out_of_range_sampling_fields_are_400s_naming_the_field(server, body, param, message):
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and re.search(message, error["message"]), error


def test_a_schema_the_grammar_library_rejects_is_a_400_naming_the_problem(server):
    pytest.importorskip("xgrammar")
    response = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "guided_regex": "(unclosed"}
    )
    assert response.status_code == 400
    assert "structured_outputs.regex: the grammar library rejects it" in response.json()["error"]["message"]
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 21, "logprobs": True},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"


def test_tools_are_refused_saying_so(server):
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tools" and "tool calling is not supported" in error["message"]


def test_echo_streamed_sends_each_choices_prompt_first(server, client):
    tokenizer = server.model.tokenizer
    whole = client.completions.create(
        model=server.model.name, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=0, n=2
    )
    chunks = list(
        client.completions.create(
            model=server.model.name, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=0, n=2, stream=True
        )
    )
    prompt = tokenizer.decode(tokenizer.encode(PROMPT))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].text.startswith(prompt)
        assert "".join(c.text for c in mine) == whole.choices[index].text
        streamed = [v for c in mine if c.logprobs for v in c.logprobs.token_logprobs]
        assert streamed[0] is None and streamed == pytest.approx(whole.choices[index].logprobs.token_logprobs)
