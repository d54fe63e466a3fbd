"""The gateway's own short JSON answers (404, 413, 502, 504 ...): no stack traces, ever."""

from __future__ import annotations

import json
import time
from email.utils import formatdate
from typing import Final

from aiohttp import web
from multidict import CIMultiDict

SERVER: Final = "gateway"
# The header line in answers relayed from an upstream, in place of the upstream's own.
SERVER_LINE: Final = b"Server: " + SERVER.encode() + b"\r\n"

_TITLES = {
    400: "bad_request",
    403: "forbidden",
    404: "no_route",
    408: "request_timeout",
    405: "method_not_allowed",
    413: "payload_too_large",
    417: "expectation_failed",
    429: "too_many_requests",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
    505: "http_version_not_supported",
}


def error_response(
    status: int, message: str, *, close: bool = False, headers: dict[str, str] | None = None
) -> web.Response:
    body = json.dumps(
        {"status": status, "error": _TITLES.get(status, "error"), "message": message}
    ).encode()
    response = web.Response(
        status=status,
        body=body,
        content_type="application/json",
        headers={"Server": SERVER, **(headers or {})},
    )
    if close:
        response.force_close()
    return response


def version_not_supported() -> bytes:
    """A whole 505 in HTTP/1.1 (aiohttp would answer in the request's own 0.9 or 2.0)."""
    body = json.dumps(
        {
            "status": 505,
            "error": _TITLES[505],
            "message": "only HTTP/1.0 and HTTP/1.1 are served",
        }
    ).encode()
    return (
        b"HTTP/1.1 505 HTTP Version Not Supported\r\nServer: %s\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\nDate: %s\r\n"
        b"Connection: close\r\n\r\n%s"
        % (
            SERVER.encode(),
            len(body),
            formatdate(time.time(), usegmt=True).encode("ascii"),
            body,
        )
    )


_PROBLEM_TITLES = {403: "Forbidden", 429: "Too Many Requests", 503: "Service Unavailable"}


def rate_limited_response(
    status: int,
    limit: str,
    detail: str,
    retry_after_s: float,
    headers: list[tuple[str, str]],
    *,
    close: bool = False,
) -> web.Response:
    """RFC 9457 problem details naming the limit, with Retry-After and rate-limit headers."""
    body = json.dumps(
        {
            "type": "about:blank",
            "title": _PROBLEM_TITLES.get(status, "Rate Limited"),
            "status": status,
            "detail": detail,
            "limit": limit,
            "retry_after_s": round(retry_after_s, 3),
        }
    ).encode()
    response = web.Response(status=status, body=body, headers=CIMultiDict(headers))
    response.headers["Server"] = SERVER
    response.content_type = "application/problem+json"
    if close:
        response.force_close()
    return response


class PreparedResponse:
    """A response the gateway serialised itself; aiohttp only finishes the exchange.

    aiohttp's request loop needs ``prepare``, ``write_eof``, ``keep_alive`` and ``status`` from
    what a handler returns; this gives it those, writing bytes built in one go.
    """

    __slots__ = ("_data", "keep_alive", "status")

    def __init__(self, status: int, data: bytes, keep_alive: bool) -> None:
        self.status = status
        self.keep_alive = keep_alive
        self._data: bytes | None = data

    async def prepare(self, request: web.BaseRequest) -> None:
        data = self._data
        transport = request.transport
        if data is not None and transport is not None and not transport.is_closing():
            self._data = None
            transport.write(data)

    async def write_eof(self, data: bytes = b"") -> None:
        return None


class HttpDate:
    """The ``Date`` header value, formatted once per second."""

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def now(self) -> bytes:
        second = int(time.time())
        if second != self._second:
            self._second = second
            self._value = formatdate(second, usegmt=True).encode("ascii")
        return self._value
