"""The gateway's own short answers (404, 413, 429, 502, 504 ...) as RFC 9457 problem details:
no stack traces, ever."""

from __future__ import annotations

import asyncio
import json
import time
from email.utils import formatdate
from http import HTTPStatus
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
PROBLEM_JSON: Final = "application/problem+json"
_LEGACY_JSON: Final = "application/json"


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def error_body(status: int, message: str, legacy: bool = False) -> tuple[bytes, str]:
    """The body of one of the gateway's own answers and its content type: RFC 9457 problem
    details, as its 429s; ``legacy`` (``server.error_body: legacy``) the JSON of old."""
    if legacy:
        fields = {"status": status, "error": _TITLES.get(status, "error"), "message": message}
        return json.dumps(fields).encode(), _LEGACY_JSON
    problem = {"type": "about:blank", "title": _phrase(status), "status": status, "detail": message}
    return json.dumps(problem).encode(), PROBLEM_JSON


def error_response(
    status: int,
    message: str,
    *,
    close: bool = False,
    headers: dict[str, str] | None = None,
    legacy: bool = False,
) -> web.Response:
    body, content_type = error_body(status, message, legacy)
    response = web.Response(
        status=status,
        body=body,
        content_type=content_type,
        headers={"Server": SERVER, **(headers or {})},
    )
    if close:
        response.force_close()
    return response


def error_bytes(status: int, message: str, legacy: bool = False) -> bytes:
    """A whole HTTP/1.1 answer in bytes that closes the connection, for where no aiohttp
    response can be (the request line's version refused, a connection over the cap)."""
    body, content_type = error_body(status, message, legacy)
    return (
        b"HTTP/1.1 %d %s\r\nServer: %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
        b"Date: %s\r\nConnection: close\r\n\r\n%s"
        % (
            status,
            _phrase(status).encode(),
            SERVER.encode(),
            content_type.encode(),
            len(body),
            formatdate(time.time(), usegmt=True).encode("ascii"),
            body,
        )
    )


def version_not_supported(legacy: bool = False) -> bytes:
    """A whole 505 in HTTP/1.1 (aiohttp would answer in the request's own 0.9 or 2.0)."""
    return error_bytes(505, "only HTTP/1.0 and HTTP/1.1 are served", legacy)


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
    response.content_type = PROBLEM_JSON
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
        self.send(request.transport)

    def send(self, transport: asyncio.Transport | None) -> None:
        """Write the bytes, once, unless the connection is gone (the request loop's way, with
        no aiohttp request to prepare with)."""
        data = self._data
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
