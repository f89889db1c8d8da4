"""The HTTP bench's client (inferlab.experiment.sse_client) against scripted servers: chunked,
sized and close-delimited bodies, events split anywhere, kept-alive connections and their loss,
error statuses, broken responses, and what send_request records of each."""

import asyncio
import json

import pytest

from inferlab.experiment.http_client import send_request
from inferlab.experiment.sse_client import HTTPProtocolError, SSEClient
from inferlab.experiment.workload import WorkloadRequest


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def event(token_ids, finish=None) -> bytes:
    choice = {"index": 0, "text": "x", "token_ids": token_ids, "finish_reason": finish}
    if finish:
        choice["stats"] = {"queue_s": 0.001, "num_cached_tokens": 16, "num_preemptions": 0}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


class ScriptedServer:
    """Answers each request on a connection with the next scripted response (bytes, then
    whether to close the connection after it); records the requests and counts connections."""

    def __init__(self, responses: list[tuple[bytes, bool]]):
        self.responses = list(responses)
        self.requests: list[bytes] = []
        self.connections = 0

    async def handle(self, reader, writer):
        self.connections += 1
        try:
            while self.responses:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(
                    next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
                )
                self.requests.append(head + await reader.readexactly(length))
                response, close = self.responses.pop(0)
                for i in range(0, len(response), 7):  # in small pieces: the client must join them
                    writer.write(response[i : i + 7])
                    await writer.drain()
                if close:
                    break
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc):
        self.server.close()


async def read_events(client: SSEClient, body: bytes = b"{}") -> tuple[int, list[bytes]]:
    response = await client.post("/v1/completions", body)
    events = [data async for _, data in response.events()]
    response.close()
    return response.status, events


def test_events_split_anywhere_arrive_whole_and_the_connection_is_kept():
    # the last event ends in CRLFs alone, as a server that writes CRLF line ends sends them
    body = event([1, 2]) + b"data: line one\r\ndata: line two\r\n\r\n" + event([3], "length") + b"data: [DONE]\r\n\r\n"
    pieces = [body[i : i + 5] for i in range(0, len(body), 5)]  # chunk boundaries inside events and CRLFs

    async def run():
        script = ScriptedServer([(STREAM_HEAD + chunked(*pieces), False)] * 2)
        async with script as url:
            client = SSEClient(url + "/prefix/", {"Authorization": "Bearer k"})
            first = await read_events(client, b'{"a": 1}')
            second = await read_events(client)
            await client.aclose()
        return script, first, second

    script, first, second = asyncio.run(run())
    expected = [event([1, 2])[6:-2], b"line one\nline two", event([3], "length")[6:-2], b"[DONE]"]
    assert first == second == (200, expected)
    assert script.connections == 1, "the second request reuses the first one's connection"
    head = script.requests[0].decode()
    assert head.startswith("POST /prefix/v1/completions HTTP/1.1\r\n")
    assert "Host: 127.0.0.1:" in head and "Authorization: Bearer k\r\n" in head and head.endswith('{"a": 1}')


def test_sized_and_close_delimited_bodies_and_a_connection_closed_while_idle():
    sized = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(event([7])), event([7]))
    until_close = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + event([8]) + event([9], "stop")

    async def run():
        # the first connection answers once and closes while idle, which the client notices on
        # its next request and answers with a new connection
        script = ScriptedServer([(sized, True), (until_close, True)])
        async with script as url:
            client = SSEClient(url)
            results = [await read_events(client), await read_events(client)]
            await client.aclose()
        return script, results

    script, results = asyncio.run(run())
    assert results == [(200, [event([7])[6:-2]]), (200, [event([8])[6:-2], event([9], "stop")[6:-2]])]
    assert script.connections == 2


def test_send_request_records_tokens_errors_and_cut_streams():
    error_body = json.dumps({"error": {"message": "model 'x' is not served here"}}).encode()
    refused = b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(error_body), error_body)
    good = STREAM_HEAD + chunked(event([1, 2]), event([3], "length"), b"data: [DONE]\n\n")
    cut = STREAM_HEAD + b"40\r\n" + event([4])[:20]  # the server goes away mid-chunk
    request = WorkloadRequest(0, 0.0, [1, 2, 3], 3)

    async def run():
        script = ScriptedServer([(refused, False), (good, False), (cut, True)])
        async with script as url:
            client = SSEClient(url)
            records = [await send_request(client, {"prompt": [1]}, request, 0.0)]
            records += [await send_request(client, {"prompt": [1]}, request, 0.0) for _ in range(2)]
            await client.aclose()
        assert script.connections == 1, "a stream read to its end leaves its connection for the next request"
        return records

    (refused_record, refused_error), (record, error), (cut_record, cut_error) = asyncio.run(run())
    assert refused_error.startswith("HTTP 400: ") and "not served here" in refused_error
    assert refused_record.finish_reason == "error" and refused_record.num_output_tokens == 0
    assert error is None and record.finish_reason == "length" and record.num_output_tokens == 3
    assert record.token_times_s[0] == record.token_times_s[1] <= record.token_times_s[2]
    assert record.num_cached_tokens == 16 and record.first_scheduled_s is not None
    assert cut_error.startswith("IncompleteReadError") and cut_record.finish_reason == "error"


def test_a_response_that_is_not_http_and_a_url_that_is_not_http_are_refused():
    async def run():
        async with ScriptedServer([(b"SSH-2.0-OpenSSH_9.6\r\n\r\n", True)]) as url:
            client = SSEClient(url)
            with pytest.raises(HTTPProtocolError, match="not an HTTP/1.1 response: 'SSH-2.0"):
                await client.post("/v1/completions", b"{}")

    asyncio.run(run())
    for bad in ("ftp://host/", "http://", "127.0.0.1:8000"):
        with pytest.raises(ValueError, match="an http:// or https:// URL with a host is needed"):
            SSEClient(bad)
    assert SSEClient("https://example.org/api").host_header == "example.org"
    assert SSEClient("http://[::1]:8000").host_header == "[::1]:8000"
