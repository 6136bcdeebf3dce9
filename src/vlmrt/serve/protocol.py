"""The HTTP/1.1 connection: uvicorn's h11 protocol with a deadline for each request's head, and JSON answers to
requests it cannot parse (docs/server.md, "Limits").

uvicorn bounds a request's head (h11: at most HEAD_MAX_BYTES of request line and headers, else a 400) and the idle
time between keep-alive requests, but not how long a head may take to arrive: a client that sends one header byte
every few seconds (slowloris) would hold its connection, and with --max-connections of them nobody else is served.
Here every connection gets HEAD_TIMEOUT_S from its start, and from the end of each answer, to send the next
request's whole head; past it, a 408 if part of a head came (else nothing: an idle connection) and the connection is
closed. (The body's deadline is the app's: app.read_body. h11's size limit holds only for a head that arrives in
pieces; access.HeadSize holds it for one that arrives whole.)
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import HEAD_MAX_BYTES, HEAD_TIMEOUT_S


def _raw_response(status: int, reason: str, code: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class Protocol(H11Protocol):
    head_timeout_s = HEAD_TIMEOUT_S  # set per server by serve.command (a subclass with its own value)
    _head_timer = None
    _head_started = False  # bytes of the awaited head have come

    def _arm(self) -> None:
        self._disarm()
        self._head_started = False
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._head_timer is not None and data:
            self._head_started = True
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if not self._waiting_for_head():
            self._disarm()  # this request's head is in; its body has the app's deadline

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._waiting_for_head():
            self._arm()

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._waiting_for_head():
            return
        if self._head_started:
            self.transport.write(_raw_response(408, "Request Timeout", "request_timeout",
                                               f"the request head did not arrive within {self.head_timeout_s:g} s"))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse (or whose head is over HEAD_MAX_BYTES), as JSON."""
        self.transport.write(_raw_response(400, "Bad Request", "invalid_http",
                                           f"invalid HTTP request (malformed, or its head is over {HEAD_MAX_BYTES} "
                                           "bytes)"))
        self.transport.close()
