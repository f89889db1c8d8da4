"""The OpenAI-compatible server, in-process on a free loopback port, through the official openai
client (sync and async, streamed and whole) and plain HTTP: completions and chat, concurrent
streams against a non-streamed greedy reference, disconnects freeing KV blocks, auth, every
error status, stop strings, priority and metadata reaching the policy, a short load test, and
the latency bench over bench.url."""

import asyncio
import concurrent.futures
import json
import os
import re
import threading
import time
import types

import httpx
import openai
import pytest

from inferlab import LLM, SamplingParams
from inferlab.conf import ServeConfig, compose, engine_arguments
from inferlab.core.hookspecs import hookimpl
from inferlab.core.plugins import PluginRegistry
from inferlab.server import InferenceServer

KEY = "test-key"
SETTINGS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=512, max_num_seqs=64)
PROMPTS = [f"Request {i}: the quick brown fox" + " jumps" * (i % 5) for i in range(32)]


@pytest.fixture(scope="module")
def server(one_torch_thread):
    engine = LLM(**SETTINGS)
    with engine, InferenceServer(engine, ServeConfig(port=0, api_key=KEY, log_level="warning")) as server:
        yield server


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of a separate engine of the same model: prompt -> max_tokens -> token ids."""
    engine = LLM(**SETTINGS)
    made = {}

    def greedy(prompts: list[str], max_tokens: int) -> list[list[int]]:
        missing = [p for p in prompts if (p, max_tokens) not in made]
        if missing:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            for prompt, out in zip(missing, engine.generate(missing, params, use_tqdm=False)):
                made[prompt, max_tokens] = out["token_ids"]
        return [made[p, max_tokens] for p in prompts]

    yield greedy
    engine.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def metrics(server) -> dict[str, float]:
    """The server's series by name, with their labels less model_name and engine (which every
    series carries): 'inferlab:request_success_total{finished_reason="abort"}'."""
    text = httpx.get(f"{server.url}/metrics").text
    series = {}
    for name, labels, value in re.findall(r"^([a-z_:]+)(?:\{([^}]*)\})? ([0-9.e+-]+)$", text, re.MULTILINE):
        kept = [label for label in labels.split(",") if label and not label.startswith(("model_name=", "engine="))]
        series[name + (f"{{{','.join(kept)}}}" if kept else "")] = float(value)
    return series


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def all_blocks_free(server) -> bool:
    m = metrics(server)
    return m["inferlab:kv_cache_usage_perc"] == 0 and m["inferlab:num_requests_running"] == 0


# -- completions and chat ------------------------------------------------------------------------


def test_completion_whole_and_streamed_match_the_greedy_reference(server, client, reference):
    tokenizer = server.model.tokenizer
    expected_ids = reference([PROMPTS[0]], 12)[0]
    expected = tokenizer.decode(expected_ids, skip_special_tokens=True)
    whole = client.completions.create(
        model=server.model.name,
        prompt=PROMPTS[0],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = whole.choices[0]
    assert (choice.text, choice.finish_reason, choice.token_ids) == (expected, "length", expected_ids)
    prompt_tokens = len(tokenizer.encode(PROMPTS[0]))
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 12)
    assert whole.usage.total_tokens == prompt_tokens + 12

    chunks = list(
        client.completions.create(
            model=server.model.name,
            prompt=PROMPTS[0],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_prompt_as_token_ids_and_several_prompts(server, client, reference):
    ids = server.model.tokenizer.encode(PROMPTS[1])
    out = client.completions.create(
        model=server.model.name, prompt=[ids, ids[:5]], max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == server.model.tokenizer.decode(reference([PROMPTS[1]], 6)[0], skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(ids) + 5 and out.usage.completion_tokens == 12


def test_chat_whole_and_streamed(server, client):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": ", world"}]},
    ]
    whole = client.chat.completions.create(model=server.model.name, messages=messages, max_tokens=8, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    template = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello, world<|im_end|>\n<|im_start|>assistant\n"
    assert whole.usage.prompt_tokens == len(server.model.tokenizer.encode(template))
    stream = client.chat.completions.create(
        model=server.model.name, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_async_client_streams_chat_and_completions(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        async with client:
            whole = await client.completions.create(
                model=server.model.name, prompt="Hello", max_tokens=5, temperature=0
            )
            stream = await client.completions.create(
                model=server.model.name, prompt="Hello", max_tokens=5, temperature=0, stream=True
            )
            streamed = "".join([c.choices[0].text async for c in stream])
            chat = await client.chat.completions.create(
                model=server.model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
            )
            finishes = [c.choices[0].finish_reason async for c in chat]
        return whole.choices[0].text, streamed, finishes

    whole, streamed, finishes = asyncio.run(run())
    assert whole == streamed and finishes[-1] in ("stop", "length")


def test_32_concurrent_streams_each_get_exactly_their_tokens(server, reference):
    """Nothing lost, nothing mixed: each stream's token ids and text equal its own greedy run."""
    lengths = [8 + (i * 7) % 25 for i in range(len(PROMPTS))]
    tokenizer = server.model.tokenizer

    async def run():
        return await asyncio.gather(*(stream_ids(server, p, n) for p, n in zip(PROMPTS, lengths)))

    results = asyncio.run(run())
    for prompt, max_tokens, (ids, text, finish) in zip(PROMPTS, lengths, results):
        expected = reference([prompt], max_tokens)[0]
        assert len(ids) == max_tokens and finish == "length"
        assert ids == expected, prompt
        assert text == tokenizer.decode(expected, skip_special_tokens=True)
    wait_until(lambda: all_blocks_free(server))


def test_stop_string_across_chunks_ends_the_text_before_it(server, client, reference):
    tokenizer = server.model.tokenizer
    ids = reference([PROMPTS[2]], 24)[0]
    pieces = [tokenizer.decode([t], skip_special_tokens=True) for t in ids]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    # A stop string made of the end of one token's text and the start of a later one's.
    boundary = next(
        i for i in range(8, 20) if pieces[i] and pieces[i + 1] and "\ufffd" not in pieces[i] + pieces[i + 1]
    )
    start = len(tokenizer.decode(ids[: boundary + 1], skip_special_tokens=True)) - 1
    stop = full[start : start + 1 + len(pieces[boundary + 1])]
    expected = full[: full.find(stop)]
    stream = client.completions.create(
        model=server.model.name,
        prompt=PROMPTS[2],
        max_tokens=24,
        temperature=0,
        stream=True,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    chunks = [c.choices[0] for c in stream]
    assert "".join(c.text for c in chunks) == expected
    assert chunks[-1].finish_reason == "stop"
    whole = client.completions.create(
        model=server.model.name,
        prompt=PROMPTS[2],
        max_tokens=24,
        temperature=0,
        stop=stop,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"


async def stream_ids(server, prompt, max_tokens: int) -> tuple[list[int], str, str]:
    """(token ids, text, finish reason) of one greedy streamed completion with ignore_eos."""
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    async with client:
        stream = await client.completions.create(
            model=server.model.name,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        ids, text, finish = [], "", None
        async for chunk in stream:
            ids += chunk.choices[0].token_ids
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    return ids, text, finish


def test_overlap_scheduling_streams_only_tokens_already_known(reference):
    """Under overlap scheduling a step's newest token is a placeholder until the next step reads it
    back: streams carry only real tokens, and each request's last one once it is known."""
    engine = LLM(**SETTINGS, overlap_scheduling=True)
    lengths = [1, 2, 5, 9, 17, 30]
    with engine, InferenceServer(engine, ServeConfig(port=0, api_key=KEY, log_level="warning")) as server:

        async def run():
            return await asyncio.gather(*(stream_ids(server, p, n) for p, n in zip(PROMPTS, lengths)))

        results = asyncio.run(run())
        wait_until(lambda: all_blocks_free(server))
    for prompt, max_tokens, (ids, text, finish) in zip(PROMPTS, lengths, results):
        assert ids == reference([prompt], max_tokens)[0] and finish == "length"
        assert text == server.model.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.gpu
def test_gpu_concurrent_streams_get_every_token_once():
    """On CUDA (overlap scheduling, CUDA graphs): 64 concurrent streams each receive exactly their
    max_tokens real tokens, and their text is the decode of those tokens."""
    engine = LLM()
    lengths = [16 + (i * 37) % 200 for i in range(64)]
    with engine, InferenceServer(engine, ServeConfig(port=0, api_key=KEY, log_level="warning")) as server:

        async def run():
            return await asyncio.gather(*(stream_ids(server, f"GPU {i}", n) for i, n in enumerate(lengths)))

        results = asyncio.run(run())
        wait_until(lambda: all_blocks_free(server))
    for max_tokens, (ids, text, finish) in zip(lengths, results):
        assert len(ids) == max_tokens and min(ids) >= 0 and finish == "length"
        assert text == server.model.tokenizer.decode(ids, skip_special_tokens=True)


def test_an_engine_failure_ends_the_streams_in_flight_with_an_error_and_serving_goes_on(server, client, monkeypatch):
    engine = server.engine_loop.engine
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    stream = client.completions.create(
        model=server.model.name, prompt="Hi", max_tokens=50, stream=True, extra_body={"ignore_eos": True}
    )
    with pytest.raises(openai.APIError, match="injected failure"):
        for _ in stream:
            pass
    monkeypatch.undo()
    wait_until(lambda: all_blocks_free(server))
    assert client.completions.create(model=server.model.name, prompt="Hi", max_tokens=3).usage.completion_tokens


# -- disconnects ---------------------------------------------------------------------------------


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server, client):
    aborted = metrics(server).get('inferlab:request_success_total{finished_reason="abort"}', 0)
    stream = client.completions.create(
        model=server.model.name, prompt=PROMPTS[3], max_tokens=3000, stream=True, extra_body={"ignore_eos": True}
    )
    for _, _ in zip(range(5), stream):
        pass
    assert metrics(server)["inferlab:kv_cache_usage_perc"] > 0
    stream.close()
    wait_until(lambda: all_blocks_free(server), timeout_s=5)
    assert metrics(server)['inferlab:request_success_total{finished_reason="abort"}'] == aborted + 1


def test_a_client_that_gives_up_on_a_whole_response_frees_its_blocks(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": PROMPTS[4], "max_tokens": 3000, "ignore_eos": True},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=0.5,
        )
    wait_until(lambda: all_blocks_free(server), timeout_s=5)


# -- auth and errors -----------------------------------------------------------------------------


def post(server, path: str, body, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (bytes, str)):
        return httpx.post(f"{server.url}{path}", content=body, headers=headers)
    return httpx.post(f"{server.url}{path}", json=body, headers=headers)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


def test_a_bearer_token_is_required_when_a_key_is_set(server):
    assert_openai_error(post(server, "/v1/completions", {"prompt": "x"}, key=None), 401)
    assert_openai_error(post(server, "/v1/completions", {"prompt": "x"}, key="wrong"), 401)
    assert_openai_error(httpx.get(f"{server.url}/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}  # health and metrics stay open
    assert httpx.get(f"{server.url}/metrics").status_code == 200


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", b"{not json", None),
        ("/v1/completions", b"[1, 2]", None),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "x", "metadata": [1]}, "metadata"),
        ("/v1/completions", {"prompt": [1] * 5000}, "prompt"),
        ("/v1/completions", {"prompt": [1] * 4000, "max_tokens": 200}, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "top_k": 0}, "top_k"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
        ("/v1/chat/completions", {"prompt": "x"}, "messages"),
        # each of these used to reach the tokenizer, json or the sampler and answer 500 or garbage
        ("/v1/completions", b'{"prompt": "\\ud800 lone"}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"]}', "prompt"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages.0.content"),
        pytest.param("/v1/completions", b'{"max_tokens": 1' + b"0" * 5000 + b"}", None, id="5001-digit-integer"),
        pytest.param("/v1/completions", b"[" * 100_000 + b"]" * 100_000, None, id="100000-deep-nesting"),
        ("/v1/completions", {"prompt": "x", "temperature": 3.5e38}, "temperature"),
    ],
)
def test_bad_requests_get_400_with_openai_error_json(server, client, path, body, param):
    message = assert_openai_error(post(server, path, body), 400, param)
    assert "Traceback" not in message
    # and the server keeps serving the others
    assert client.completions.create(model=server.model.name, prompt="ok", max_tokens=2).choices[0].finish_reason


def test_a_message_without_content_is_empty_text_as_with_null(server):
    bodies = [{"role": "user"}, {"role": "user", "content": None}]
    answers = [
        post(
            server,
            "/v1/chat/completions",
            {"messages": [body], "max_tokens": 3, "temperature": 0, "return_token_ids": True},
        )
        for body in bodies
    ]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    assert answers[0].json()["choices"][0]["token_ids"] == answers[1].json()["choices"][0]["token_ids"]


def test_a_top_p_below_float32s_range_keeps_the_top_token(server, reference):
    # 1e-46 is 0 in float32: the filter then kept nothing, and every draw was the last token
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "ignore_eos": True, "top_p": 1e-46, "return_token_ids": True}
    answer = post(server, "/v1/completions", body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["token_ids"] == reference([PROMPTS[0]], 6)[0]


def test_a_long_prompt_is_tokenized_off_the_event_loop(server, monkeypatch):
    """While one request's long prompt tokenizes, health checks and other requests are answered."""
    tokenizer = server.model.tokenizer
    started, release = threading.Event(), threading.Event()
    encode = tokenizer.encode

    def slow_encode(text, *args, **kwargs):
        if len(text) >= 80_000:
            started.set()
            release.wait(30)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # short enough that its length alone does not prove it past the context: it is tokenized
        long = pool.submit(post, server, "/v1/completions", {"prompt": "ab " * 30_000, "max_tokens": 1})
        assert started.wait(30)
        try:
            assert httpx.get(f"{server.url}/health", timeout=5).json() == {"status": "ok"}
            short = post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 2})
            assert short.status_code == 200 and not long.done()
        finally:
            release.set()
        assert_openai_error(long.result(timeout=60), 400, "prompt")  # 60,000 tokens: past the context


def test_the_openai_client_raises_bad_request_for_400(server, client):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=server.model.name, messages=[{"role": "user", "content": "x"}], top_p=2)


def test_unknown_paths_get_openai_error_json(server):
    assert_openai_error(httpx.get(f"{server.url}/v1/nothing"), 404)


def test_model_card_reports_the_context_and_vocabulary(client, server):
    card = client.models.list().data[0]
    assert card.id == server.model.name
    assert (card.max_model_len, card.vocab_size) == (4096, 384)
    assert card.plugins["scheduler"] == "fcfs"


# -- the queue limit and the scheduler policy ----------------------------------------------------


@pytest.fixture(scope="module")
def policy_server(one_torch_thread):
    """One sequence at a time, a policy that orders by priority then metadata["rank"] and records
    what it sees, and a queue of at most 3."""
    seen = []

    class RankPolicy:
        def admission_order(self, waiting, state):
            seen.extend((v.priority, dict(v.metadata)) for v in waiting)
            return sorted(waiting, key=lambda v: (v.priority, v.metadata.get("rank", 0), v.arrival_time))

        def preemption_victim(self, running, state):
            return running[-1]

    plugin = types.ModuleType("rank_policy")
    plugin.register_schedulers = hookimpl(lambda register: register("rank", RankPolicy))
    registry = PluginRegistry()
    registry.register(plugin)
    engine = LLM(registry=registry, scheduler="rank", **{**SETTINGS, "max_num_seqs": 1})
    config = ServeConfig(port=0, max_queued_requests=3, log_level="warning")
    with engine, InferenceServer(engine, config) as server:
        server.policy_seen = seen
        yield server


def test_priority_and_metadata_reach_the_policy_and_the_queue_limit_answers_429(policy_server):
    server = policy_server

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            order = []

            async def complete(name, priority, metadata):
                body = {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True, "priority": priority}
                response = await http.post("/v1/completions", json={**body, "metadata": metadata})
                assert response.status_code == 200, response.text
                order.append(name)

            blocker = {"prompt": [1, 2, 3], "max_tokens": 3000, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=blocker) as stream:
                lines = stream.aiter_lines()
                await anext(lines)  # it runs, holding the only sequence slot
                tasks = [
                    asyncio.ensure_future(complete(name, priority, {"rank": rank, "tenant": name}))
                    for name, priority, rank in [("late", 2, 0), ("second", 1, 5), ("first", 1, 1)]
                ]
                while metrics(server)["inferlab:num_requests_waiting"] < 3:
                    await asyncio.sleep(0.02)
                refused = await http.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
                assert_openai_error(refused, 429)
                assert refused.headers["retry-after"] == "1"  # in seconds: the openai SDK waits that long
                # more prompts in one request than may ever wait: no retry could succeed
                never = await http.post("/v1/completions", json={"prompt": [[1]] * 4, "max_tokens": 1})
                assert "serve.max_queued_requests=3" in assert_openai_error(never, 400, "prompt")
            await asyncio.gather(*tasks)  # the blocker's disconnect aborted it
            return order

    assert asyncio.run(run()) == ["first", "second", "late"]
    assert (1, {"rank": 1, "tenant": "first"}) in server.policy_seen
    assert (2, {"rank": 0, "tenant": "late"}) in server.policy_seen


# -- load ------------------------------------------------------------------------------------------


def test_short_load_test_has_no_errors(server):
    num_requests, concurrency = 96, 16

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        errors, tokens = [], 0
        gate = asyncio.Semaphore(concurrency)

        async def one(i):
            nonlocal tokens
            async with gate:
                try:
                    stream = await client.completions.create(
                        model=server.model.name,
                        prompt=PROMPTS[i % len(PROMPTS)],
                        max_tokens=8,
                        stream=True,
                        extra_body={"ignore_eos": True, "return_token_ids": True},
                    )
                    received = sum([len(c.choices[0].token_ids) async for c in stream])
                    tokens += received
                except openai.OpenAIError as e:
                    errors.append(e)

        async with client:
            start = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(num_requests)))
            return time.perf_counter() - start, errors, tokens

    elapsed, errors, tokens = asyncio.run(run())
    print(
        f"\nload test: {num_requests} streamed requests, {concurrency} at a time, in {elapsed:.2f} s: "
        f"{num_requests / elapsed:.1f} requests/s, {tokens / elapsed:.0f} tokens/s, {len(errors)} errors"
    )
    assert errors == [] and tokens == num_requests * 8


# -- the latency bench over HTTP and the job's config -------------------------------------------


def test_bench_url_sends_the_workload_and_writes_result_json(server, tmp_path, monkeypatch):
    from inferlab.experiment.bench import run_bench
    from inferlab.experiment.workload import build_workload

    monkeypatch.setenv("INFERLAB_API_KEY", KEY)
    overrides = [
        "job=bench",
        f"bench.url={server.url}",
        "bench.num_seqs=12",
        "bench.min_len=4",
        "bench.max_len=40",
        "bench.min_output_len=2",
        "bench.max_output_len=12",
        "bench.arrival=poisson",
        "bench.request_rate=40",
        "bench.slo_ttft_s=5",
    ]
    cfg = compose(overrides)
    result = run_bench(cfg, str(tmp_path))
    on_disk = json.loads((tmp_path / "result.json").read_text())
    workload = build_workload(cfg.bench, 384, 4096)
    assert on_disk["num_errors"] == 0 and on_disk["num_requests"] == 12
    assert on_disk["num_output_tokens"] == sum(r.output_len for r in workload.requests)
    assert on_disk["workload"] == workload.summary()
    assert on_disk["ttft_s"]["p50"] > 0 and on_disk["slo_attainment"] == 1.0
    assert on_disk["choices"]["scheduler"] == "fcfs" and on_disk["server"]["url"] == server.url
    assert result["num_output_tokens"] == on_disk["num_output_tokens"]
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 12 and all(json.loads(line)["finish_reason"] == "length" for line in lines)


def test_bench_url_without_a_server_says_so(tmp_path):
    from inferlab.conf.bench import BenchConfigError
    from inferlab.experiment.bench import run_bench

    cfg = compose(
        ["job=bench", "bench.url=http://127.0.0.1:9", "bench.num_seqs=2", "bench.min_len=4", "bench.max_len=8"]
    )
    with pytest.raises(BenchConfigError, match="no inferlab server answers"):
        run_bench(cfg, str(tmp_path))
    assert "error" in json.loads((tmp_path / "result.json").read_text())


def test_job_serve_composes_the_engine_from_the_same_groups():
    cfg = compose(["job=serve", "serve.port=0", "serve.api_key=k", "scheduler=lpm", "engine.max_num_seqs=8"])
    assert cfg.serve.host == "127.0.0.1" and cfg.serve.port == 0 and cfg.serve.api_key == "k"
    _, settings = engine_arguments(cfg)
    assert settings["scheduler"] == "lpm" and settings["max_num_seqs"] == 8


def test_the_api_key_may_come_from_the_environment_and_max_tokens_defaults_to_what_fits(monkeypatch):
    monkeypatch.setenv("INFERLAB_API_KEY", "from-env")
    engine = LLM(**{**SETTINGS, "num_kvcache_blocks": 8})  # 128 tokens of KV, far below max_model_len
    with engine, InferenceServer(engine, ServeConfig(port=0, log_level="warning")) as server:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        headers = {"Authorization": "Bearer from-env"}
        assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 200
        body = {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60).json()
        assert reply["choices"][0]["finish_reason"] == "length"
        assert reply["usage"]["total_tokens"] == 8 * 16 + 1  # the last token is sampled, never cached
    assert server.engine_loop.thread is not None and not server.engine_loop.thread.is_alive()
    assert os.environ["INFERLAB_API_KEY"] == "from-env"


def test_connections_to_the_listening_socket_send_without_nagle_delays():
    """asyncio turns Nagle's algorithm off on the connections it accepts only where the listening
    socket's protocol is TCP by number: with it on, a stream's first chunk after the headers waited
    for the client's delayed ACK (about 40 ms)."""
    import socket

    from inferlab.server.server import listening_socket

    async def accepted_nodelay() -> int:
        sock = listening_socket("127.0.0.1", 0)
        seen = asyncio.get_running_loop().create_future()

        def on_connect(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0
    with listening_socket("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"cannot listen on 127\.0\.0\.1:{port} \(serve\.host, serve\.port\)"):
            listening_socket("127.0.0.1", port)


def test_the_server_loads_what_the_first_streamed_response_would_at_start_up():
    """anyio's asyncio backend is loaded while the server starts, not by its first streamed
    response (on the CPU that request's first chunk took twice as long). A fresh process: this
    one may have loaded it already."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from inferlab import LLM\n"
        "from inferlab.conf import ServeConfig\n"
        "from inferlab.server import InferenceServer\n"
        "engine = LLM(kvcache_block_size=16, num_kvcache_blocks=8, enforce_eager=True)\n"
        "before = 'anyio._backends._asyncio' in sys.modules\n"
        "with engine, InferenceServer(engine, ServeConfig(port=0, log_level='warning')):\n"
        "    print(before, 'anyio._backends._asyncio' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == ["False", "True"]


def test_updates_of_several_steps_reach_a_stream_as_one_chunk_per_choice(server):
    """When the event loop falls behind the engine, the updates of several steps arrive together:
    each choice then costs one detokenization and one chunk for all of them (so the loop catches
    up), and its text is the decode of all its tokens, as per-step chunks would have joined to."""
    from inferlab.server.app import Generation
    from inferlab.server.engine_loop import ACCEPTED, Finish, Prompt

    tokenizer = server.model.tokenizer
    prompt = tokenizer.encode("The quick brown fox")
    output = tokenizer.encode(" jumps over the lazy dog. Once upon a time, a small engine")

    class Loop:  # the engine loop's part: the test hands the steps' updates over itself
        metrics = None

        def submit(self, stream, prompts):
            stream.items.append(ACCEPTED)
            stream.ready.set()

        def abort(self, stream, index=None):
            raise AssertionError("nothing is aborted")

    async def run():
        params = SamplingParams(max_tokens=len(output), ignore_eos=True)
        generation = Generation(Loop(), [Prompt(prompt, params), Prompt(prompt, params)], tokenizer)
        await generation.start()
        generation.stream.items += [
            (1, output[:1], None, None, None),
            (0, output[:2], None, None, None),
            (0, output[2:5], None, None, None),
            (1, output[1:], Finish("length"), None, None),
            (0, output[5:], Finish("length"), None, None),
        ]
        generation.stream.ready.set()
        return [deltas async for deltas in generation]

    [deltas] = asyncio.run(run())
    assert [(d.index, d.token_ids, d.finish.reason) for d in deltas] == [(1, output, "length"), (0, output, "length")]
    assert deltas[0].text == deltas[1].text == tokenizer.decode(output, skip_special_tokens=True)


def test_the_server_sets_its_gil_switch_interval_while_it_serves_and_refuses_a_bad_one():
    import sys

    engine = LLM(**{**SETTINGS, "num_kvcache_blocks": 8})
    before = sys.getswitchinterval()
    with engine:
        with InferenceServer(engine, ServeConfig(port=0, log_level="warning", gil_switch_interval_s=0.002)):
            assert sys.getswitchinterval() == pytest.approx(0.002)
        assert sys.getswitchinterval() == before
        with InferenceServer(engine, ServeConfig(port=0, log_level="warning", gil_switch_interval_s=None)):
            assert sys.getswitchinterval() == before
        for bad in (0, -0.001, "1ms", True):
            with pytest.raises(ValueError, match=r"serve\.gil_switch_interval_s must be a positive number of seconds"):
                InferenceServer(engine, ServeConfig(port=0, gil_switch_interval_s=bad))
