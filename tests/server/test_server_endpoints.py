"""The serving surface vLLM users bring besides completions: /tokenize and /detokenize with
vLLM's bodies, /v1/models/{id}, /version, FastAPI's /openapi.json and /docs, HEAD on /health and
/metrics, an unknown model answered 404 model_not_found (the openai SDK's NotFoundError), Allow on
405, and fields the server does not implement refused instead of ignored."""

import httpx
import openai
import pytest

import inferlab
from inferlab import LLM
from inferlab.conf import ServeConfig
from inferlab.server import InferenceServer

KEY = "test-key"
NAME = "acme/tiny-chat"  # a slash, as in Hugging Face names: /v1/models/{id} must take it
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(one_torch_thread):
    engine = LLM(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64)
    config = ServeConfig(port=0, api_key=KEY, model_name=NAME, log_level="warning")
    with engine, InferenceServer(engine, config) as server:
        yield server


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# -- tokenize and detokenize ---------------------------------------------------------------------


def test_tokenize_a_prompt_as_vllm_answers(server):
    tokenizer = server.model.tokenizer
    text = "Hello, world"
    answer = httpx.post(f"{server.url}/tokenize", json={"model": NAME, "prompt": text})
    assert answer.status_code == 200, answer.text
    ids = tokenizer.encode(text)
    assert answer.json() == {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}
    strs = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(ids) and len(strs["token_strs"]) == strs["count"]
    bare = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)


def test_tokenize_messages_gives_the_prompt_a_chat_request_has(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    answer = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1)
    assert answer["count"] == len(answer["tokens"]) == chat.usage.prompt_tokens
    template = server.model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert answer["tokens"] == server.model.tokenizer.encode(template, add_special_tokens=False)
    continued = [*messages, {"role": "assistant", "content": "Hello"}]
    body = {"messages": continued, "add_generation_prompt": False, "continue_final_message": True}
    open_turn = httpx.post(f"{server.url}/tokenize", json=body).json()["tokens"]
    assert server.model.tokenizer.decode(open_turn).endswith("Hello")  # the last message left open


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "continue_final_message"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}, "chat_template"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_tokenize_refuses_bad_bodies_naming_the_field(server, body, param):
    assert openai_error(httpx.post(f"{server.url}/tokenize", json=body), 400)["param"] == param


def test_detokenize_turns_token_ids_back_into_text(server):
    tokenizer = server.model.tokenizer
    ids = tokenizer.encode("The quick brown fox")
    answer = httpx.post(f"{server.url}/detokenize", json={"model": NAME, "tokens": ids})
    assert answer.status_code == 200 and answer.json() == {"prompt": "The quick brown fox"}
    special = [tokenizer.convert_tokens_to_ids("<|im_start|>"), *ids]  # kept, as vLLM keeps them
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": special}).json()["prompt"].startswith("<|im_start|>")
    error = openai_error(httpx.post(f"{server.url}/detokenize", json={"tokens": [1, 384, -1]}), 400)
    assert error["param"] == "tokens" and "[384, -1]" in error["message"]
    assert openai_error(httpx.post(f"{server.url}/detokenize", json={"tokens": "abc"}), 400)["param"] == "tokens"


def test_tokenize_and_detokenize_refuse_another_model_with_404(server):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        error = openai_error(httpx.post(f"{server.url}{path}", json={**body, "model": "gpt-4"}), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"


# -- models, version, docs -----------------------------------------------------------------------


def test_models_retrieve_gives_the_card_and_404_for_another_model(server, client):
    card = client.models.retrieve(NAME)  # the SDK sends acme%2Ftiny-chat
    assert card.id == NAME and card.max_model_len == 4096 and card.plugins["scheduler"] == "fcfs"
    assert card.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("gpt-4")
    assert raised.value.code == "model_not_found"
    assert httpx.get(f"{server.url}/v1/models/{NAME}").status_code == 401  # under /v1: the key is required


def test_an_unknown_model_in_a_generation_request_is_404_model_not_found(server, client):
    with pytest.raises(openai.NotFoundError, match="does not exist") as raised:
        client.completions.create(model="another-model", prompt="x", max_tokens=2)
    assert raised.value.code == "model_not_found" and raised.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="another-model", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError):  # streamed too: refused before the stream starts
        client.completions.create(model="another-model", prompt="x", max_tokens=2, stream=True)


def test_version(server):
    assert httpx.get(f"{server.url}/version").json() == {"version": inferlab.__version__}


def test_the_openapi_schema_describes_every_endpoint_and_its_request_body(server):
    document = httpx.get(f"{server.url}/openapi.json").json()
    paths, schemas = document["paths"], document["components"]["schemas"]
    expected = {
        "/v1/completions": "CompletionBody",
        "/v1/chat/completions": "ChatBody",
        "/tokenize": "TokenizeBody",
        "/detokenize": "DetokenizeBody",
    }
    for path, name in expected.items():
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
    assert {"prompt", "max_tokens", "stream", "priority"} <= set(schemas["CompletionBody"]["properties"])
    assert "ChatMessage" in schemas  # what ChatBody refers to is there too
    refs = {v for v in _values(document) if isinstance(v, str) and v.startswith("#/components/schemas/")}
    assert {ref.rsplit("/", 1)[1] for ref in refs} <= set(schemas)
    for path in ("/health", "/metrics", "/version", "/v1/models", "/v1/models/{model_id}"):
        assert "get" in paths[path]
    docs = httpx.get(f"{server.url}/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def _values(node):
    if isinstance(node, dict):
        for value in node.values():
            yield from _values(value)
    elif isinstance(node, list):
        for value in node:
            yield from _values(value)
    else:
        yield node


# -- methods and headers -------------------------------------------------------------------------


def test_head_on_health_and_metrics(server):
    for path in ("/health", "/metrics"):
        head = httpx.head(f"{server.url}{path}")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-type"] == httpx.get(f"{server.url}{path}").headers["content-type"]


@pytest.mark.parametrize(
    "method, path, allow",
    [
        ("GET", "/v1/completions", "POST"),
        ("PUT", "/v1/chat/completions", "POST"),
        ("POST", "/health", "GET, HEAD"),
        ("DELETE", "/metrics", "GET, HEAD"),
        ("POST", "/v1/models", "GET"),
        ("GET", "/tokenize", "POST"),
    ],
)
def test_405_names_the_allowed_methods(server, method, path, allow):
    answer = httpx.request(method, f"{server.url}{path}")
    openai_error(answer, 405)
    assert answer.headers["allow"] == allow


# -- fields the server cannot honour -------------------------------------------------------------


@pytest.mark.parametrize(
    "path, field, value",
    [
        ("/v1/completions", "use_beam_search", True),
        ("/v1/completions", "skip_special_tokens", False),
        ("/v1/completions", "include_stop_str_in_output", True),
        ("/v1/completions", "add_special_tokens", False),
        ("/v1/completions", "truncate_prompt_tokens", 4),
        ("/v1/completions", "allowed_token_ids", [1, 2]),
        ("/v1/chat/completions", "add_generation_prompt", False),
        ("/v1/chat/completions", "continue_final_message", True),
        ("/v1/chat/completions", "chat_template_kwargs", {"enable_thinking": False}),
        ("/v1/chat/completions", "chat_template", "{{ messages }}"),
        ("/v1/chat/completions", "tool_choice", "required"),
        ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ],
)
def test_fields_the_server_does_not_implement_are_refused_not_ignored(server, path, field, value):
    body = {"max_tokens": 2, field: value}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    error = openai_error(httpx.post(f"{server.url}{path}", json=body, headers=AUTH), 400)
    assert error["param"] == field and error["code"] == "unsupported"


def test_fields_at_the_values_that_ask_for_nothing_are_served(server):
    body = {"prompt": "x", "max_tokens": 2, "logprobs": None, "use_beam_search": False, "skip_special_tokens": True}
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH).status_code == 200
    chat = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2,
        "add_generation_prompt": True,
        "tool_choice": "none",
        "chat_template_kwargs": {},
    }
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=AUTH).status_code == 200


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(server, client):
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    sent = 0
    for c in chunks[:-1]:
        sent += len(getattr(c.choices[0], "token_ids", None) or [])
        assert c.usage.completion_tokens == sent and c.usage.total_tokens == c.usage.prompt_tokens + sent
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
