"""The server under hostile clients, in process on a free loopback port: one request's fields that
make the scheduler policy fail fail that request alone; bodies over serve.max_body_bytes get 413
before they are read; prompts too long for the context are refused before they are tokenized;
large bodies are parsed off the event loop; silent, trickling and half-sent connections are
closed after serve.header_timeout_s / body_timeout_s; past serve.max_connections a connection gets
503; and shutdown takes serve.shutdown_timeout_s whatever the clients do, answering 503 on
connections already open meanwhile. Slow clients are real sockets that trickle bytes."""

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from deadline_policy import Deadlines

from inferlab import LLM
from inferlab.conf import ServeConfig
from inferlab.core.hookspecs import hookimpl
from inferlab.core.plugins import PluginRegistry
from inferlab.server import InferenceServer, app

SETTINGS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=256, max_model_len=256)


class Plugin:
    @staticmethod
    @hookimpl
    def register_schedulers(register):
        register("deadlines", Deadlines)


@pytest.fixture(scope="module")
def engine(one_torch_thread):
    registry = PluginRegistry()
    registry.register(Plugin, "deadlines_plugin")
    with LLM(registry=registry, scheduler="deadlines", max_num_seqs=8, **SETTINGS) as llm:
        yield llm


def serving(engine, **settings) -> InferenceServer:
    return InferenceServer(engine, ServeConfig(port=0, log_level="warning", **settings))


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or 10 s pass)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


async def stream_until_done(http: httpx.AsyncClient, body: dict) -> list[dict]:
    events = []
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_a_request_whose_metadata_breaks_the_policy_fails_alone_and_the_streams_go_on(engine):
    """Eight streams run (every sequence slot); a ninth request's deadline is a string, and the
    preemptive policy's comparison raises for it: it gets a 400 naming the policy and the
    request, and the eight finish (all nine used to end with 'the engine failed')."""
    with serving(engine) as server:

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                body = {"prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True}
                streams = [
                    asyncio.ensure_future(stream_until_done(http, {**body, "metadata": {"deadline": float(i)}}))
                    for i in range(8)
                ]
                while engine.scheduler.num_steps < 3 or len(engine.scheduler.running) < 8:
                    await asyncio.sleep(0.01)
                bad = await http.post("/v1/completions", json={**body, "metadata": {"deadline": "soon"}})
                return bad, await asyncio.gather(*streams)

        bad, streams = asyncio.run(run())
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert error["code"] == "policy_error" and error["message"].startswith("PolicyError: scheduler 'deadlines'")
    assert "failed on request" in error["message"] and "'soon'" in error["message"]
    for events in streams:
        assert [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1] == "length"
    assert engine.is_finished()


def test_metadata_a_policy_declares_is_a_400_when_its_type_is_wrong(one_torch_thread, monkeypatch):
    class Declared(Deadlines):
        metadata_fields = {"deadline": (int, float)}

    class DeclaredPlugin:
        @staticmethod
        @hookimpl
        def register_schedulers(register):
            register("declared", Declared)

    registry = PluginRegistry()
    registry.register(DeclaredPlugin, "declared_plugin")
    with LLM(registry=registry, scheduler="declared", **SETTINGS) as llm, serving(llm) as server:
        response = httpx.post(
            f"{server.url}/v1/completions", json={"prompt": [5], "max_tokens": 2, "metadata": {"deadline": "soon"}}
        )
    assert response.status_code == 400
    assert (
        "metadata['deadline'] must be int or float (scheduler 'declared' reads it)"
        in response.json()["error"]["message"]
    )


def test_a_body_over_max_body_bytes_gets_413_before_it_is_read(engine):
    with serving(engine, max_body_bytes=10_000) as server:
        assert server.max_body_bytes == 10_000
        with connect(server) as sock:  # 6 MB announced, nothing sent: answered at once
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 6000000\r\n\r\n")
            started = time.monotonic()
            response = read_all(sock)
        assert time.monotonic() - started < 2 and status_of(response) == 413
        assert b"serve.max_body_bytes=10000" in response and b'"code":"body_too_large"' in response
        with connect(server) as sock:  # chunked, no length given: refused once past the limit
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            sock.sendall(b"2710\r\n" + b"x" * 10_000 + b"\r\n" + b"10\r\n" + b"x" * 16 + b"\r\n")
            assert status_of(read_all(sock)) == 413
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5], "max_tokens": 1})
        assert ok.status_code == 200


def test_the_default_body_limit_is_sized_from_max_model_len(engine):
    with serving(engine) as server:
        assert server.max_body_bytes == 64 * 256 + 65536


def test_a_prompt_longer_than_the_context_is_refused_before_it_is_tokenized(engine, monkeypatch):
    with serving(engine) as server:
        tokenizer = server.model.tokenizer
        assert server.model.max_token_chars == max(
            len(t) for t in tokenizer.convert_ids_to_tokens(range(len(tokenizer)))
        )
        encoded = []
        real = tokenizer.encode
        monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **k: encoded.append(len(text)) or real(text, *a, **k))
        text = "x" * (2 * 256 * server.model.max_token_chars)
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": text, "max_tokens": 1}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
        assert encoded == []  # it was never tokenized
        chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
        if getattr(tokenizer, "chat_template", None):
            response = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30)
            assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
            assert encoded == []


def test_a_large_body_is_parsed_off_the_event_loop(engine, monkeypatch):
    threads = []
    real = app.parse_body
    monkeypatch.setattr(app, "parse_body", lambda raw, cls: threads.append(threading.get_ident()) or real(raw, cls))
    with serving(engine, max_body_bytes=10**6) as server:
        small = {"prompt": [5], "max_tokens": 1}
        large = {**small, "metadata": {"note": "x" * 100_000}}
        for body in (small, large):
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
        assert threads[0] == server.thread.ident  # the event loop's thread
        assert threads[1] != server.thread.ident


@pytest.mark.parametrize("part", ["silent", "headers", "body"])
def test_slow_clients_get_408_and_their_connection_closed(engine, part):
    """A connection that sends nothing, headers a byte at a time, or a body a byte at a time (a
    slowloris) is answered 408 and closed once its timeout passes; it used to stay open."""
    with serving(engine, header_timeout_s=0.5, body_timeout_s=0.5) as server:
        with connect(server) as sock:
            started = time.monotonic()
            if part == "headers":
                sock.sendall(b"GET /health HTTP/1.1\r\n")
            elif part == "body":
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            sock.settimeout(0.15)
            response = b""
            while time.monotonic() - started < 5:
                try:
                    if part != "silent":
                        sock.sendall(b"X" if part == "headers" else b" ")  # a byte every 0.15 s
                except OSError:
                    break
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    break
                if not chunk:
                    break
                response += chunk
            elapsed = time.monotonic() - started
        assert 0.4 < elapsed < 3, elapsed
        assert status_of(response) == 408 and b"request_timeout" in response
        assert (b"header_timeout_s=0.5" if part != "body" else b"body_timeout_s=0.5") in response
        assert httpx.get(f"{server.url}/health").status_code == 200  # serving on


def test_connections_past_the_limit_get_503_and_normal_requests_come_back(engine):
    with serving(engine, max_connections=4, header_timeout_s=1.0) as server:
        idle = [connect(server) for _ in range(4)]
        time.sleep(0.1)
        with connect(server) as refused:
            response = read_all(refused)
        assert status_of(response) == 503 and b"serve.max_connections" in response
        for sock in idle:
            assert read_all(sock).startswith(b"HTTP/1.1 408")  # their header timeout frees the slots
            sock.close()
        assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.fixture(scope="module")
def long_engine(one_torch_thread):
    """Room for a stream that outlasts the shutdown's drain."""
    with LLM(**{**SETTINGS, "max_model_len": 4096}) as llm:
        yield llm


def test_shutdown_answers_503_on_an_idle_kept_alive_connection_and_ends_in_time(long_engine):
    """During the drain (a stream in flight), a request on a connection kept alive from before
    gets 503 (it used to find the connection closed); a client half way through sending a body
    does not hold the shutdown past serve.shutdown_timeout_s (it used to add 10 s more)."""
    engine = long_engine
    server = serving(engine, shutdown_timeout_s=2.0, body_timeout_s=60.0).start()
    events: list = []
    stream = threading.Thread(
        target=lambda: events.extend(
            asyncio.run(
                stream_until_done(
                    httpx.AsyncClient(base_url=server.url, timeout=60),
                    {"prompt": [5, 6], "max_tokens": 4000, "ignore_eos": True},
                )
            )
        )
    )
    with httpx.Client(base_url=server.url, timeout=10) as kept_alive:
        assert kept_alive.get("/health").status_code == 200
        stream.start()
        while not engine.scheduler.running:
            time.sleep(0.01)
        half_sent = connect(server)
        half_sent.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        started = time.monotonic()
        server.begin_shutdown()
        response = kept_alive.get("/health")
        assert response.status_code == 503 and response.json() == {"status": "shutting down"}
        server.thread.join(30)
        elapsed = time.monotonic() - started
        half_sent.close()
    stream.join(30)
    assert not server.thread.is_alive() and elapsed < 2.0 + 1.0, elapsed
    assert [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1] == "abort"


def test_a_second_signal_stops_at_once(long_engine):
    engine = long_engine
    server = serving(engine, shutdown_timeout_s=30.0).start()
    done = threading.Thread(
        target=lambda: httpx.post(
            f"{server.url}/v1/completions", json={"prompt": [5], "max_tokens": 4000, "ignore_eos": True}, timeout=60
        )
    )
    done.start()
    while not engine.scheduler.running:
        time.sleep(0.01)
    started = time.monotonic()
    assert server.begin_shutdown() is False
    assert server.begin_shutdown() is True  # what uvicorn's handler does on the second signal
    server.uvicorn.should_exit = server.uvicorn.force_exit = True
    server.thread.join(30)
    done.join(30)
    assert time.monotonic() - started < 5


def test_serve_settings_are_checked(engine):
    for name, value in [
        ("header_timeout_s", 0),
        ("body_timeout_s", -1.0),
        ("max_connections", 0),
        ("max_body_bytes", 0),
    ]:
        with pytest.raises(ValueError, match=f"serve.{name} must be a positive"):
            InferenceServer(engine, ServeConfig(port=0, **{name: value}))
