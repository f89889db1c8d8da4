"""The HTTP bench's client for streamed completions: HTTP/1.1 over asyncio streams, kept-alive
connections, and server-sent events handed over as they arrive with the time they arrived.

A bench over HTTP is only as good as its client's timing, and at hundreds of concurrent streams
httpx's per-chunk work (its connection pool, h11, line decoding) made the client the bottleneck,
and its figures the client's, not the server's (BENCHMARKS.md, "Serving over HTTP"). This client does what the bench needs
and no more: one POST a stream, a status line, headers, and a chunked, sized or close-delimited
body cut into events.
"""

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator
from time import perf_counter
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024  # a response's status line and headers; more is not a server we know


class HTTPProtocolError(Exception):
    """The server's response is not HTTP/1.1 as the client reads it."""


class Response:
    """A response whose status and headers have been read; its body comes through events() (a
    200 stream) or text() (anything else)."""

    def __init__(self, client: "SSEClient", connection, status: int, headers: dict[str, str]):
        self.client = client
        self.connection = connection  # (reader, writer)
        self.status = status
        self.headers = headers
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self.remaining = int(length) if length is not None and not self.chunked else None
        self.reusable = headers.get("connection", "").lower() != "close" and (self.chunked or length is not None)

    async def _pieces(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive; afterwards the connection goes back to the pool when
        the body ended where HTTP says it ends."""
        reader = self.connection[0]
        if self.chunked:
            while True:
                line = await reader.readuntil(b"\r\n")
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise HTTPProtocolError(f"bad chunk size line {line[:40]!r}") from None
                if size == 0:
                    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the end
                        pass
                    break
                data = await reader.readexactly(size + 2)
                yield data[:-2]
        elif self.remaining is not None:
            while self.remaining > 0:
                data = await reader.read(min(self.remaining, 1 << 16))
                if not data:
                    raise asyncio.IncompleteReadError(b"", self.remaining)
                self.remaining -= len(data)
                yield data
        else:  # delimited by the server closing the connection
            while data := await reader.read(1 << 16):
                yield data
        self.client._release(self)

    async def events(self) -> AsyncIterator[tuple[float, bytes]]:
        """(arrival time on perf_counter, the data of one event) for each server-sent event, in order;
        an event with several data lines gets them joined by newlines, as the SSE format says."""
        buffer = b""
        async for piece in self._pieces():
            now = perf_counter()
            buffer += piece
            if b"\r" in buffer:  # CRLF line ends; a CR that ends a piece waits for the LF after it
                buffer = buffer.replace(b"\r\n", b"\n")
            if b"\n\n" not in buffer:
                continue
            *complete, buffer = buffer.split(b"\n\n")
            for event in complete:
                data = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
                if data:
                    yield now, b"\n".join(data)

    async def text(self) -> str:
        return b"".join([piece async for piece in self._pieces()]).decode(errors="replace")

    def close(self) -> None:
        """Drops the connection unless the body was read to its end (then it is pooled already)."""
        if self.connection is not None:
            self.connection[1].close()
            self.connection = None


class SSEClient:
    """Streams POSTs to one server (http:// or https://, with a path prefix if the URL has one);
    idle connections are kept for the next request."""

    def __init__(self, url: str, headers: dict[str, str] | None = None):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"an http:// or https:// URL with a host is needed, got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        default_port = self.port == (443 if parts.scheme == "https" else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if default_port else f"{host}:{self.port}"
        self.extra_headers = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.idle: list = []

    async def _connect(self):
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=MAX_HEADER_BYTES)
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each request is one write anyway
        return reader, writer

    def _release(self, response: Response) -> None:
        connection, response.connection = response.connection, None
        if response.reusable and connection is not None and not connection[0].at_eof():
            self.idle.append(connection)
        elif connection is not None:
            connection[1].close()

    async def post(self, path: str, body: bytes) -> Response:
        """Sends a JSON body and reads the response's status and headers. A kept-alive connection
        the server has closed meanwhile is replaced by a new one, once."""
        request = (
            f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host_header}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n{self.extra_headers}\r\n"
        ).encode() + body
        while self.idle:
            connection = self.idle.pop()
            try:
                return await self._send(connection, request)
            except (OSError, asyncio.IncompleteReadError):  # closed while idle: try the next one
                connection[1].close()
        return await self._send(await self._connect(), request)

    async def _send(self, connection, request: bytes) -> Response:
        reader, writer = connection
        writer.write(request)
        await writer.drain()
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            writer.close()
            raise HTTPProtocolError(f"a response head over {MAX_HEADER_BYTES} bytes") from None
        except BaseException:
            writer.close()
            raise
        status_line, *lines = head.decode("latin-1").split("\r\n")
        version, _, rest = status_line.partition(" ")
        if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
            writer.close()
            raise HTTPProtocolError(f"not an HTTP/1.1 response: {status_line[:80]!r}")
        headers = {}
        for line in lines:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        return Response(self, connection, int(rest[:3]), headers)

    async def aclose(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()
