"""Limits on the server's connections that uvicorn's own options do not give: how many may be open
at once (one past the limit gets a 503 and is closed at once, before it holds a file descriptor
for long), and how long a client may take to send a request's headers and its body (past either,
a 408 and the connection is closed), so that silent, trickling or half-sent connections cannot
pile up. uvicorn's timeout_keep_alive closes idle kept-alive connections; these timers start when
a connection opens, again when the first byte of its next request arrives, and for the body when
the headers are complete."""

import asyncio
import json
from dataclasses import dataclass

from uvicorn.protocols.http.auto import AutoHTTPProtocol


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    body_timeout_s: float


def http_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response with OpenAI's error JSON, closing the connection."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


def limited_protocol(limits: ConnectionLimits) -> type:
    """uvicorn's HTTP protocol class (httptools' or h11's, whichever it picks) with the limits."""

    class LimitedHTTPProtocol(AutoHTTPProtocol):
        refused = False
        timer: asyncio.TimerHandle | None = None
        timed_cycle = None  # the request the timer runs for (None: the headers of the next one)

        def connection_made(self, transport) -> None:
            if len(self.server_state.connections) >= limits.max_connections:
                self.refused = True
                message = (
                    f"the server has {limits.max_connections} connections open, its limit "
                    f"(serve.max_connections); retry later"
                )
                transport.write(http_error(503, "Service Unavailable", message, "too_many_connections"))
                transport.close()
                return
            super().connection_made(transport)
            self._arm(limits.header_timeout_s, "headers")

        def connection_lost(self, exc) -> None:
            if self.refused:
                return
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            cycle = self.cycle
            if cycle is not self.timed_cycle:  # a request's headers are complete: its body is timed now
                self._disarm()
                self.timed_cycle = cycle
                if cycle.more_body:
                    self._arm(limits.body_timeout_s, "body")
            elif cycle is not None and not cycle.more_body and not cycle.response_complete:
                self._disarm()  # its body is complete
            elif self.timer is None and (cycle is None or cycle.response_complete):
                self._arm(limits.header_timeout_s, "headers")  # the first bytes of the next request

        def _arm(self, seconds: float, part: str) -> None:
            self._disarm()
            self.timer = asyncio.get_running_loop().call_later(seconds, self._expire, seconds, part)

        def _disarm(self) -> None:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None

        def _expire(self, seconds: float, part: str) -> None:
            self.timer = None
            transport = self.transport
            if transport is None or transport.is_closing():
                return
            cycle = self.cycle
            if cycle is None or not cycle.response_started:
                message = f"the request's {part} did not arrive within serve.{'header' if part == 'headers' else 'body'}_timeout_s={seconds:g} s"
                transport.write(http_error(408, "Request Timeout", message, "request_timeout"))
            transport.close()

    return LimitedHTTPProtocol
