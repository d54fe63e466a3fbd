"""Malformed and request-smuggling requests over raw sockets: refused, and never forwarded.

Each corpus entry is sent on its own connection to a real gateway in front of a real upstream
that counts every request head it parses. A refused request must get the listed status, the
gateway must close the connection (a desynchronised connection must not be reused), the upstream
must see nothing, and a normal request right after must still be served.

The rule for ``Transfer-Encoding`` is "exactly ``chunked`` or 400". Two things that look like
variants are accepted on purpose, because every RFC 9112 parser reads them the same way and the
gateway re-frames the upstream request anyway: the coding name in another case (RFC 9112 section
7: transfer-coding names are case-insensitive) and optional whitespace (SP/HTAB) around the value
(RFC 9110 section 5.5: OWS is not part of the field value; aiohttp's parser takes leading SP/HTAB
and a trailing SP, and refuses a trailing HTAB, which is also safe). Any other whitespace (VT, FF,
inside the token, before the colon) is refused. Those accepted look-alikes are checked in
``test_tolerated_request_reaches_upstream_reframed``: the upstream sees exactly one request, with
the body the gateway read and framing the gateway wrote.

An absolute-form target whose authority differs from ``Host`` is refused (400): RFC 9112 section
3.2.2 tells a server to route by the target's authority, the gateway routes by ``Host`` and the
upstream sees only ``Host``, so accepting it would let one request be routed (and rate-limited)
under one name by a front proxy and another here. ``Host`` itself must be a valid
``uri-host [":" port]`` (RFC 9112 section 3.2: a server MUST answer 400 to an invalid ``Host``):
the gateway routes on it and the upstream reads it, so both must read one name.

A request line with two spaces is tolerated: the gateway writes the upstream request line itself,
so the upstream only ever sees single spaces.

A body that goes bad after streaming began cannot be refused before the upstream has the head;
there the upstream must see the body cut off, never a clean end it would take as a whole request.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import RawTestServer

from gateway.clock import FakeClock
from gateway.edge import forwarding
from gateway.edge.forwarding import BadRequest, check_request
from tests.support.gateways import GatewayFactory, RunningGateway
from tests.support.policies import policy_for
from tests.support.waiting import wait_until

MAX_HEADER_SIZE = 8190  # the policy default ``server.max_header_size``
MAX_HEADERS = 100  # the policy default ``server.max_headers``
MAX_BODY = 1024 * 1024  # set below as ``server.max_body_size: 1m``
SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: h\r\n\r\n"

pytestmark = pytest.mark.reliability


@dataclass(frozen=True, slots=True)
class Hostile:
    """One hostile request: the exact bytes, and the statuses that are a correct refusal.

    ``half_close`` ends the client's side after sending (a message cut short); then the gateway
    may have nothing left to answer to, so 0 (no response) is allowed too.
    """

    name: str
    data: bytes
    statuses: frozenset[int] = frozenset({400})
    half_close: bool = False


def _post(headers: bytes, body: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    return b"POST /target " + version + b"\r\nHost: h\r\n" + headers + b"\r\n" + body


def _chunked(body: bytes) -> bytes:
    return _post(b"Transfer-Encoding: chunked\r\n", body)


def _get_with(headers: bytes) -> bytes:
    return b"GET /target HTTP/1.1\r\nHost: h\r\n" + headers + b"\r\n"


def _line(request_line: bytes) -> bytes:
    return request_line + b"\r\nHost: h\r\n\r\n"


# CL.TE / TE.CL payload: a front-end reading one framing and a back-end the other would
# disagree on where the first request ends and see ``/smuggled`` as a second request.
_CL_TE_BODY = b"0\r\n\r\n" + SMUGGLED
_CL_TE_LEN = b"%d" % len(_CL_TE_BODY)

HOSTILE: tuple[Hostile, ...] = (
    # --- Content-Length: duplicated, listed, or not plain decimal digits ---
    Hostile("cl-duplicate-same", _post(b"Content-Length: 5\r\nContent-Length: 5\r\n", b"hello")),
    Hostile(
        "cl-duplicate-different", _post(b"Content-Length: 5\r\nContent-Length: 6\r\n", b"hello!")
    ),
    Hostile("cl-list-same", _post(b"Content-Length: 5, 5\r\n", b"hello")),
    Hostile("cl-list-different", _post(b"Content-Length: 5, 6\r\n", b"hello!")),
    Hostile("cl-plus-sign", _post(b"Content-Length: +5\r\n", b"hello")),
    Hostile("cl-hex", _post(b"Content-Length: 0x5\r\n", b"hello")),
    Hostile("cl-negative", _post(b"Content-Length: -5\r\n", b"hello")),
    Hostile("cl-space-inside", _post(b"Content-Length: 1 0\r\n", b"0123456789")),
    Hostile("cl-underscore", _post(b"Content-Length: 1_0\r\n", b"0123456789")),
    Hostile("cl-decimal-point", _post(b"Content-Length: 5.0\r\n", b"hello")),
    Hostile("cl-non-ascii-digit", _post(b"Content-Length: \xd9\xa5\r\n", b"hello")),
    Hostile("cl-empty", _post(b"Content-Length: \r\n", b"hello")),
    Hostile("cl-vertical-tab", _post(b"Content-Length: \x0b5\r\n", b"hello")),
    Hostile("cl-overflows-64-bit", _post(b"Content-Length: 99999999999999999999999\r\n", b"x")),
    Hostile(
        # The whole body is sent: after its answer aiohttp reads and drops an announced body
        # (for up to 10 s, like nginx's lingering close) so the client reads the 413, not a reset.
        "cl-over-max-body",
        _post(b"Content-Length: %d\r\n" % (2 * MAX_BODY), b"x" * (2 * MAX_BODY)),
        statuses=frozenset({413}),
    ),
    # --- Content-Length together with Transfer-Encoding, both orders ---
    Hostile(
        "cl-then-te",
        _post(
            b"Content-Length: " + _CL_TE_LEN + b"\r\nTransfer-Encoding: chunked\r\n", _CL_TE_BODY
        ),
    ),
    Hostile(
        "te-then-cl",
        _post(
            b"Transfer-Encoding: chunked\r\nContent-Length: " + _CL_TE_LEN + b"\r\n", _CL_TE_BODY
        ),
    ),
    Hostile(
        "cl-zero-and-te",
        _post(b"Content-Length: 0\r\nTransfer-Encoding: chunked\r\n", _CL_TE_BODY),
    ),
    Hostile(
        "cl-and-te-identity",
        _post(b"Content-Length: 5\r\nTransfer-Encoding: identity\r\n", b"hello"),
    ),
    Hostile(
        # A refusal closes the connection: requests pipelined behind it are never read.
        "requests-pipelined-behind-refusal",
        _post(b"Content-Length: 5\r\nContent-Length: 6\r\n", b"hello!")
        + SMUGGLED
        + b"GET /smuggled-2 HTTP/1.1\r\nHost: h\r\n\r\n",
    ),
    # --- Transfer-Encoding other than exactly ``chunked`` ---
    Hostile("te-chunked-chunked", _post(b"Transfer-Encoding: chunked, chunked\r\n", _CL_TE_BODY)),
    Hostile("te-gzip-chunked", _post(b"Transfer-Encoding: gzip, chunked\r\n", _CL_TE_BODY)),
    Hostile("te-chunked-gzip", _post(b"Transfer-Encoding: chunked, gzip\r\n", _CL_TE_BODY)),
    Hostile("te-chunked-semicolon", _post(b"Transfer-Encoding: chunked;x\r\n", _CL_TE_BODY)),
    Hostile("te-chunked-parameter", _post(b"Transfer-Encoding: chunked; q=1\r\n", _CL_TE_BODY)),
    Hostile("te-xchunked", _post(b"Transfer-Encoding: xchunked\r\n", _CL_TE_BODY)),
    Hostile("te-chunkedx", _post(b"Transfer-Encoding: chunkedx\r\n", _CL_TE_BODY)),
    Hostile("te-space-inside-token", _post(b"Transfer-Encoding: chun ked\r\n", _CL_TE_BODY)),
    Hostile("te-quoted", _post(b'Transfer-Encoding: "chunked"\r\n', _CL_TE_BODY)),
    Hostile("te-identity", _post(b"Transfer-Encoding: identity\r\n", b"")),
    Hostile("te-empty", _post(b"Transfer-Encoding: \r\n", _CL_TE_BODY)),
    Hostile("te-vertical-tab", _post(b"Transfer-Encoding:\x0bchunked\r\n", _CL_TE_BODY)),
    Hostile("te-form-feed", _post(b"Transfer-Encoding:\x0cchunked\r\n", _CL_TE_BODY)),
    Hostile("te-trailing-form-feed", _post(b"Transfer-Encoding: chunked\x0c\r\n", _CL_TE_BODY)),
    Hostile(
        "te-two-headers",
        _post(b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", _CL_TE_BODY),
    ),
    Hostile(
        "te-two-headers-identity-first",
        _post(b"Transfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\n", _CL_TE_BODY),
    ),
    Hostile("te-leading-comma", _post(b"Transfer-Encoding: ,chunked\r\n", _CL_TE_BODY)),
    Hostile("te-trailing-comma", _post(b"Transfer-Encoding: chunked,\r\n", _CL_TE_BODY)),
    Hostile("te-identity-chunked", _post(b"Transfer-Encoding: identity, chunked\r\n", _CL_TE_BODY)),
    Hostile(
        "te-deflate-chunked-no-space", _post(b"Transfer-Encoding: deflate,chunked\r\n", _CL_TE_BODY)
    ),
    Hostile(
        "te-gzip-chunked-on-get",
        b"GET /target HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
        + _CL_TE_BODY,
    ),
    Hostile(
        "te-empty-then-chunked",
        _post(b"Transfer-Encoding: \r\nTransfer-Encoding: chunked\r\n", _CL_TE_BODY),
    ),
    Hostile(
        "te-on-http-1.0",
        _post(b"Transfer-Encoding: chunked\r\n", _CL_TE_BODY, version=b"HTTP/1.0"),
    ),
    Hostile(
        "te-on-http-1.0-keep-alive",
        _post(
            b"Connection: keep-alive\r\nTransfer-Encoding: chunked\r\n",
            _CL_TE_BODY,
            version=b"HTTP/1.0",
        ),
    ),
    Hostile(
        "cl-and-te-on-http-1.0",
        _post(
            b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", b"hello", version=b"HTTP/1.0"
        ),
    ),
    # --- header syntax: names, folding, control characters ---
    Hostile("cl-space-before-colon", _post(b"Content-Length : 5\r\n", b"hello")),
    Hostile("te-space-before-colon", _post(b"Transfer-Encoding : chunked\r\n", _CL_TE_BODY)),
    Hostile("te-tab-before-colon", _post(b"Transfer-Encoding\t: chunked\r\n", _CL_TE_BODY)),
    Hostile("obs-fold-space", _get_with(b"X-Folded: a\r\n b\r\n")),
    Hostile("obs-fold-tab", _get_with(b"X-Folded: a\r\n\tb\r\n")),
    Hostile("obs-fold-te", _post(b"Transfer-Encoding:\r\n chunked\r\n", _CL_TE_BODY)),
    Hostile(
        "obs-fold-first-header",
        b"GET /target HTTP/1.1\r\n X-Folded: a\r\nHost: h\r\n\r\n",
    ),
    Hostile("bare-cr-in-value", _get_with(b"X-A: a\rTransfer-Encoding: chunked\r\n")),
    Hostile("bare-lf-in-value", _get_with(b"X-A: a\nTransfer-Encoding: chunked\r\n")),
    Hostile("bare-lf-line-endings", b"GET /target HTTP/1.1\nHost: h\n\n"),
    Hostile("bare-cr-line-endings", b"GET /target HTTP/1.1\rHost: h\r\r"),
    Hostile("nul-in-value", _get_with(b"X-A: a\x00b\r\n")),
    Hostile("nul-in-name", _get_with(b"X-\x00A: b\r\n")),
    Hostile("nul-in-target", _line(b"GET /tar\x00get HTTP/1.1")),
    Hostile("ctl-soh-in-value", _get_with(b"X-A: a\x01b\r\n")),
    Hostile("del-in-value", _get_with(b"X-A: a\x7fb\r\n")),
    Hostile("empty-header-name", _get_with(b": empty-name\r\n")),
    Hostile("header-without-colon", _get_with(b"X-No-Colon value\r\n")),
    Hostile("header-name-separator", _get_with(b"X(A): b\r\n")),
    Hostile("header-name-non-ascii", _get_with(b"X-\xc3\xa9: b\r\n")),
    # --- chunked body framing ---
    Hostile("chunk-size-negative", _chunked(b"-1\r\nx\r\n0\r\n\r\n")),
    Hostile("chunk-size-0x-prefix", _chunked(b"0x10\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n")),
    Hostile("chunk-size-non-hex", _chunked(b"g\r\nx\r\n0\r\n\r\n")),
    Hostile("chunk-size-empty", _chunked(b"\r\nhello\r\n0\r\n\r\n")),
    Hostile("chunk-size-overflows-64-bit", _chunked(b"1ffffffffffffffff\r\nx\r\n0\r\n\r\n")),
    Hostile("chunk-size-space-inside", _chunked(b"1 0\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n")),
    Hostile("chunk-ext-nul", _chunked(b"5;a\x00b\r\nhello\r\n0\r\n\r\n")),
    Hostile("chunk-ext-bare-lf", _chunked(b"5;a\nb\r\nhello\r\n0\r\n\r\n")),
    Hostile("chunk-ext-bare-cr", _chunked(b"5;a\rb\r\nhello\r\n0\r\n\r\n")),
    Hostile("chunk-ext-unterminated-quote", _chunked(b'5;a="b\r\nhello\r\n0\r\n\r\n')),
    Hostile("chunk-data-longer-than-size", _chunked(b"5\r\nhelloXX\r\n0\r\n\r\n")),
    Hostile("chunk-data-bare-lf-after", _chunked(b"5\r\nhello\n0\r\n\r\n")),
    Hostile(
        "chunk-last-then-request-line",
        _chunked(b"5\r\nhello\r\n0\r\n" + SMUGGLED),
    ),
    Hostile(
        "trailer-content-length",
        _chunked(b"5\r\nhello\r\n0\r\nContent-Length: 99\r\n\r\n"),
    ),
    Hostile(
        "trailer-transfer-encoding",
        _chunked(b"5\r\nhello\r\n0\r\nTransfer-Encoding: gzip\r\n\r\n"),
    ),
    Hostile(
        "chunk-missing-final-crlf",
        _chunked(b"5\r\nhello\r\n0\r\n"),
        statuses=frozenset({0, 400}),
        half_close=True,
    ),
    Hostile(
        "chunk-body-cut-short",
        _chunked(b"a\r\nhello"),
        statuses=frozenset({0, 400}),
        half_close=True,
    ),
    Hostile(
        "cl-body-cut-short",
        _post(b"Content-Length: 10\r\n", b"hello"),
        statuses=frozenset({0, 400}),
        half_close=True,
    ),
    # --- size limits ---
    Hostile(
        "request-line-too-long",
        _line(b"GET /" + b"a" * (MAX_HEADER_SIZE + 10) + b" HTTP/1.1"),
        statuses=frozenset({400, 414}),
    ),
    Hostile(
        "header-value-too-long",
        _get_with(b"X-Long: " + b"a" * (MAX_HEADER_SIZE + 10) + b"\r\n"),
        statuses=frozenset({400, 431}),
    ),
    Hostile(
        "header-name-too-long",
        _get_with(b"X-" + b"a" * (MAX_HEADER_SIZE + 10) + b": b\r\n"),
        statuses=frozenset({400, 431}),
    ),
    Hostile(
        "too-many-headers",
        _get_with(b"".join(b"X-H%d: v\r\n" % i for i in range(MAX_HEADERS + 5))),
        statuses=frozenset({400, 431}),
    ),
    # --- Host ---
    Hostile("host-duplicate-different", _line(b"GET /target HTTP/1.1\r\nHost: other")),
    Hostile("host-duplicate-same", _line(b"GET /target HTTP/1.1\r\nHost: h")),
    Hostile("host-missing-http-1.1", b"GET /target HTTP/1.1\r\nX-A: b\r\n\r\n"),
    Hostile("host-comma-list", b"GET /target HTTP/1.1\r\nHost: h, other\r\n\r\n"),
    Hostile("host-space-inside", b"GET /target HTTP/1.1\r\nHost: h other\r\n\r\n"),
    Hostile("host-with-path", b"GET /target HTTP/1.1\r\nHost: h/other\r\n\r\n"),
    Hostile("host-with-userinfo", b"GET /target HTTP/1.1\r\nHost: user@h\r\n\r\n"),
    Hostile("host-empty", b"GET /target HTTP/1.1\r\nHost:\r\n\r\n"),
    Hostile("absolute-uri-other-host", _line(b"GET http://other/target HTTP/1.1")),
    Hostile("absolute-uri-userinfo", _line(b"GET http://user@h/target HTTP/1.1")),
    # --- request line ---
    Hostile("method-with-separator", _line(b"G(T /target HTTP/1.1")),
    Hostile("method-with-nul", _line(b"GE\x00T /target HTTP/1.1")),
    Hostile("method-lowercase-unknown", _line(b"get /target HTTP/1.1")),
    Hostile("method-empty", _line(b" /target HTTP/1.1")),
    Hostile("connect-method", _line(b"CONNECT h:443 HTTP/1.1"), statuses=frozenset({400, 405})),
    Hostile("http2-preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", statuses=frozenset({400, 505})),
    Hostile("version-lowercase", _line(b"GET /target http/1.1")),
    Hostile("version-garbage", _line(b"GET /target HTTP/1.x")),
    Hostile("version-two-digit-minor", _line(b"GET /target HTTP/1.10")),
    Hostile(
        "version-unknown-major", _line(b"GET /target HTTP/9.1"), statuses=frozenset({400, 505})
    ),
    Hostile("version-missing-http-0.9", b"GET /target\r\n\r\n", statuses=frozenset({400, 505})),
    Hostile("version-http-0.9", _line(b"GET /target HTTP/0.9"), statuses=frozenset({505})),
    Hostile("version-http-2.0", _line(b"GET /target HTTP/2.0"), statuses=frozenset({505})),
    Hostile("request-line-trailing-space", _line(b"GET /target HTTP/1.1 ")),
    Hostile("request-line-tab-separator", _line(b"GET\t/target HTTP/1.1")),
    Hostile("target-with-space", _line(b"GET /tar get HTTP/1.1")),
    Hostile("target-not-origin-form", _line(b"GET target HTTP/1.1")),
    Hostile(
        "expect-100-continue-and-more",
        _post(b"Content-Length: 5\r\nExpect: 100-continue, foo\r\n", b"hello"),
        statuses=frozenset({417}),
    ),
    Hostile(
        "expect-unknown",
        _post(b"Content-Length: 5\r\nExpect: 200-ok\r\n", b"hello"),
        statuses=frozenset({417}),
    ),
)


@dataclass(slots=True)
class SeenRequest:
    """What the upstream parsed; ``outcome`` says whether its body then arrived whole."""

    method: str
    raw_path: str
    raw_headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    outcome: str = "pending"  # then "complete", or "aborted" if the body never finished


@dataclass(slots=True)
class CountingUpstream:
    """A real aiohttp upstream that records every request head it parses, body or not."""

    port: int = 0
    seen: list[SeenRequest] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self) -> list[tuple[str, str]]:
        return [(r.method, r.raw_path) for r in self.seen]


@pytest.fixture
async def counting_upstream() -> AsyncIterator[CountingUpstream]:
    upstream = CountingUpstream()

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        # Recorded on arrival of the head: a request whose body is then cut off still counts.
        seen = SeenRequest(request.method, request.raw_path, list(request.raw_headers))
        upstream.seen.append(seen)
        try:
            seen.body = await request.read()
        except BaseException:
            # The gateway cut the connection mid-body: a reset, or aiohttp cancels this handler.
            seen.outcome = "aborted"
            raise
        seen.outcome = "complete"
        return web.Response(text=f"upstream saw {request.method} {request.raw_path}")

    server = RawTestServer(handle, host="127.0.0.1", auto_decompress=False)
    await server.start_server()
    assert server.port is not None
    upstream.port = server.port
    yield upstream
    await server.close()


@dataclass(frozen=True, slots=True)
class RawReply:
    data: bytes
    closed_by_server: bool


async def _read_until_closed(reader: asyncio.StreamReader, wait_s: float) -> RawReply:
    chunks: list[bytes] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while (remaining := deadline - loop.time()) > 0:
        try:
            chunk = await asyncio.wait_for(reader.read(65536), remaining)
        except TimeoutError:
            break
        except ConnectionResetError:
            return RawReply(b"".join(chunks), True)
        if not chunk:
            return RawReply(b"".join(chunks), True)
        chunks.append(chunk)
    return RawReply(b"".join(chunks), False)


async def send_raw(port: int, data: bytes, *, half_close: bool, wait_s: float = 5.0) -> RawReply:
    """Send ``data`` and read until the gateway closes the connection or ``wait_s`` passes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        if half_close:
            writer.write_eof()
        await writer.drain()
        return await _read_until_closed(reader, wait_s)
    finally:
        writer.close()


_STATUS_LINE_RE = re.compile(rb"HTTP/\d\.\d (\d{3}) ")


def status_of(response: bytes) -> int:
    """Status of the first response (0 if none); aiohttp answers a bad request in its version."""
    match = _STATUS_LINE_RE.match(response)
    return int(match.group(1)) if match else 0


def response_count(response: bytes) -> int:
    """Status lines anywhere (a pipelined answer can follow a body with no CRLF before it)."""
    return len(_STATUS_LINE_RE.findall(response))


async def _gateway_idle(gw: RunningGateway) -> None:
    """Wait (bounded) until the gateway has let go of every client connection."""
    server = gw.gateway.server
    await wait_until(lambda: server.open_connections == 0, "the gateway to close its connections")


async def _assert_serves_normal_request(gw: RunningGateway) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.get(gw.url + "/healthy", timeout=aiohttp.ClientTimeout(total=5)) as resp,
    ):
        assert resp.status == 200
        assert await resp.text() == "upstream saw GET /healthy"


def _start_policy(upstream: CountingUpstream, extra: str = "") -> str:
    return policy_for(upstream.url, server="  max_body_size: 1m\n", extra=extra)


def test_corpus_is_large_and_names_are_unique() -> None:
    names = [case.name for case in HOSTILE]
    assert len(names) >= 60
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("case", HOSTILE, ids=[case.name for case in HOSTILE])
async def test_hostile_request_is_refused_and_never_forwarded(
    case: Hostile, counting_upstream: CountingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(_start_policy(counting_upstream))
    reply = await send_raw(gw.port, case.data, half_close=case.half_close)
    assert status_of(reply.data) in case.statuses, reply.data[:300]
    assert reply.closed_by_server, "the gateway kept a connection open after a refused request"
    # One answer at most: nothing parsed from the bytes after the refusal was answered.
    assert response_count(reply.data) <= 1, reply.data[:600]
    await _gateway_idle(gw)
    await _assert_serves_normal_request(gw)
    assert counting_upstream.requests() == [("GET", "/healthy")]


@dataclass(frozen=True, slots=True)
class Tolerated:
    """A look-alike that is valid HTTP: one request reaches the upstream, re-framed."""

    name: str
    data: bytes
    body: bytes
    target: str = "/target"


_HELLO_CHUNKED = b"5\r\nhello\r\n0\r\n\r\n"

TOLERATED: tuple[Tolerated, ...] = (
    Tolerated(
        "te-chunked-capitalised", _post(b"Transfer-Encoding: Chunked\r\n", _HELLO_CHUNKED), b"hello"
    ),
    Tolerated(
        "te-chunked-upper", _post(b"Transfer-Encoding: CHUNKED\r\n", _HELLO_CHUNKED), b"hello"
    ),
    Tolerated(
        "te-chunked-leading-ows",
        _post(b"Transfer-Encoding:\t chunked\r\n", _HELLO_CHUNKED),
        b"hello",
    ),
    Tolerated(
        "te-chunked-trailing-space",
        _post(b"Transfer-Encoding: chunked \r\n", _HELLO_CHUNKED),
        b"hello",
    ),
    Tolerated("cl-leading-zeros", _post(b"Content-Length: 0005\r\n", b"hello"), b"hello"),
    Tolerated("cl-ows", _post(b"Content-Length:\t 5 \t\r\n", b"hello"), b"hello"),
    Tolerated("chunk-extension", _chunked(b'5;name=val;q="x"\r\nhello\r\n0\r\n\r\n'), b"hello"),
    Tolerated("chunk-size-leading-zeros", _chunked(b"0005\r\nhello\r\n0\r\n\r\n"), b"hello"),
    Tolerated(
        "chunk-plain-trailer", _chunked(b"5\r\nhello\r\n0\r\nX-Checksum: 1\r\n\r\n"), b"hello"
    ),
    Tolerated(
        "request-inside-cl-body",
        _post(b"Content-Length: %d\r\n" % len(SMUGGLED), SMUGGLED),
        SMUGGLED,
    ),
    Tolerated(
        "request-inside-chunk",
        _chunked(b"%x\r\n" % len(SMUGGLED) + SMUGGLED + b"\r\n0\r\n\r\n"),
        SMUGGLED,
    ),
    Tolerated("request-line-double-space", _line(b"GET  /target HTTP/1.1"), b""),
    Tolerated("absolute-uri-same-host", _line(b"GET http://h/target HTTP/1.1"), b""),
)


@pytest.mark.parametrize("case", TOLERATED, ids=[case.name for case in TOLERATED])
async def test_tolerated_request_reaches_upstream_reframed(
    case: Tolerated, counting_upstream: CountingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(_start_policy(counting_upstream))
    reply = await send_raw(gw.port, case.data, half_close=False, wait_s=1.0)
    assert status_of(reply.data) == 200, reply.data[:300]
    assert response_count(reply.data) == 1
    await _assert_serves_normal_request(gw)
    method = case.data.split(b" ", 1)[0].decode()
    assert counting_upstream.requests() == [(method, case.target), ("GET", "/healthy")]
    forwarded = counting_upstream.seen[0]
    assert forwarded.outcome == "complete"
    assert forwarded.body == case.body
    framing = [
        (name.lower(), value)
        for name, value in forwarded.raw_headers
        if name.lower() in (b"content-length", b"transfer-encoding")
    ]
    # Re-framed by the gateway: one framing header, in its canonical spelling.
    if b"chunked" in case.data.lower():
        assert framing == [(b"transfer-encoding", b"chunked")]
    elif case.body:
        assert framing == [(b"content-length", b"%d" % len(case.body))]
    else:
        assert framing in ([], [(b"content-length", b"0")])
    assert [v for n, v in forwarded.raw_headers if n.lower() == b"host"] == [b"h"]


@dataclass(frozen=True, slots=True)
class BrokenStream:
    """A body that starts well (so the gateway is already streaming it) and then goes bad."""

    name: str
    head: bytes
    good_part: bytes
    bad_part: bytes | None  # None: the client disconnects instead


_CHUNKED_HEAD = _post(b"Transfer-Encoding: chunked\r\n")
_LENGTH_HEAD = _post(b"Content-Length: 100\r\n")

BROKEN_STREAMS: tuple[BrokenStream, ...] = (
    BrokenStream("bad-chunk-size", _CHUNKED_HEAD, b"5\r\nhello\r\n", b"zz\r\nxx\r\n0\r\n\r\n"),
    BrokenStream("chunk-overrun", _CHUNKED_HEAD, b"5\r\nhello\r\n", b"3\r\nabcdef\r\n0\r\n\r\n"),
    BrokenStream("smuggle-after-last-chunk", _CHUNKED_HEAD, b"5\r\nhello\r\n", b"0\r\n" + SMUGGLED),
    BrokenStream(
        "trailer-content-length",
        _CHUNKED_HEAD,
        b"5\r\nhello\r\n",
        b"0\r\nContent-Length: 5\r\n\r\n",
    ),
    BrokenStream("client-gone-mid-chunk", _CHUNKED_HEAD, b"a\r\nhello", None),
    BrokenStream("client-gone-before-last-chunk", _CHUNKED_HEAD, b"5\r\nhello\r\n", None),
    BrokenStream("client-gone-mid-length", _LENGTH_HEAD, b"x" * 60, None),
)


@pytest.mark.parametrize("case", BROKEN_STREAMS, ids=[case.name for case in BROKEN_STREAMS])
async def test_body_that_breaks_mid_stream_never_completes_upstream(
    case: BrokenStream, counting_upstream: CountingUpstream, start_gateway: GatewayFactory
) -> None:
    """The upstream already has the head; it must see its body cut off, never a clean end.

    A gateway that ended the upstream body cleanly (a last chunk, or the bytes so far as a
    complete message) would hand the upstream a truncated request as if it were whole.
    """
    gw = await start_gateway(_start_policy(counting_upstream))
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(case.head + case.good_part)
        await writer.drain()
        await wait_until(lambda: len(counting_upstream.seen) == 1, "the head to reach the upstream")
        if case.bad_part is None:
            writer.close()
            await writer.wait_closed()
        else:
            writer.write(case.bad_part)
            await writer.drain()
            reply = await _read_until_closed(reader, 5.0)
            assert reply.closed_by_server
            # 400 if the gateway can still answer; a cut connection is the honest alternative.
            assert status_of(reply.data) in (0, 400), reply.data[:300]
    finally:
        writer.close()
    await wait_until(
        lambda: counting_upstream.seen[0].outcome != "pending", "the upstream body to end"
    )
    assert counting_upstream.seen[0].outcome == "aborted"
    assert counting_upstream.seen[0].body == b""
    await _gateway_idle(gw)
    await _assert_serves_normal_request(gw)
    assert counting_upstream.requests() == [("POST", "/target"), ("GET", "/healthy")]


async def test_connection_header_cannot_strip_host(
    counting_upstream: CountingUpstream, start_gateway: GatewayFactory
) -> None:
    """``Connection`` may name hop-by-hop extras, not ``Host``: the gateway routed on it.

    RFC 9110 section 7.6.1 forbids a sender to list a field meant for every recipient; dropping
    ``Host`` on a client's say-so would make the upstream pick a host the gateway did not.
    """
    gw = await start_gateway(_start_policy(counting_upstream))
    reply = await send_raw(
        gw.port,
        b"GET /target HTTP/1.1\r\nHost: h\r\nConnection: close, Host\r\n\r\n",
        half_close=False,
    )
    if status_of(reply.data) == 400:
        # Refusing is fine too, if the refusal is the gateway's own (not the upstream's 400
        # for a request that arrived without Host) and nothing reached the upstream.
        assert b'"error": "bad_request"' in reply.data, reply.data[:300]
        assert counting_upstream.requests() == []
    else:
        assert status_of(reply.data) == 200, reply.data[:300]
        assert counting_upstream.requests() == [("GET", "/target")]
        hosts = [v for n, v in counting_upstream.seen[0].raw_headers if n.lower() == b"host"]
        assert hosts == [b"h"]


_PUBLIC_ONLY = (
    "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
    "upstreams:\n  backend:\n    url: {url}\n"
    "routes:\n  - name: public\n    upstream: backend\n    match:\n      path_prefix: /public/\n"
)


@pytest.mark.parametrize(
    "target",
    [b"/public/../admin", b"/public/%2e%2e/admin", b"/public/%2E%2E/admin", b"/public/..%2fadmin"],
    ids=["literal", "encoded-dots", "encoded-dots-upper", "encoded-slash"],
)
async def test_dot_segments_cannot_escape_a_route_prefix(
    target: bytes, counting_upstream: CountingUpstream, start_gateway: GatewayFactory
) -> None:
    """Routes match a path; the upstream resolves dot segments (RFC 3986 5.2.4) in it.

    ``/public/../admin`` is ``/admin`` to an upstream that normalises, so routing it as
    ``/public/`` would let a client reach (and be limited as) a route it does not match.
    The gateway may refuse it (400) or route the normalised path (404 here), not forward it.
    """
    gw = await start_gateway(_PUBLIC_ONLY.format(url=counting_upstream.url))
    reply = await send_raw(
        gw.port,
        b"GET " + target + b" HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        half_close=False,
    )
    assert status_of(reply.data) in (400, 404), reply.data[:300]
    assert counting_upstream.requests() == []


async def test_gateway_serves_after_whole_corpus_on_one_instance(
    counting_upstream: CountingUpstream, start_gateway: GatewayFactory
) -> None:
    """All refusals on one gateway, eight at a time: nothing leaks into later requests."""
    gw = await start_gateway(_start_policy(counting_upstream))
    for start in range(0, len(HOSTILE), 8):
        batch = HOSTILE[start : start + 8]
        replies = await asyncio.gather(
            *(send_raw(gw.port, case.data, half_close=case.half_close) for case in batch)
        )
        for case, reply in zip(batch, replies, strict=True):
            assert status_of(reply.data) in case.statuses, case.name
            assert reply.closed_by_server, case.name
    await _gateway_idle(gw)
    for _ in range(3):
        await _assert_serves_normal_request(gw)
    assert counting_upstream.requests() == [("GET", "/healthy")] * 3


@pytest.mark.slow
async def test_the_corpus_on_both_listeners_logs_one_line_per_cause_and_no_traceback(
    counting_upstream: CountingUpstream,
    start_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The whole corpus, once to the proxy listener and once to the admin listener: nothing
    at ERROR and no traceback (before: one ERROR "Error handling request" and its traceback
    for most of them), one INFO line per listener and cause, naming the peer (the clock
    stands still: every repeat of a cause is suppressed)."""
    caplog.set_level(logging.DEBUG)
    gw = await start_gateway(_start_policy(counting_upstream), clock=FakeClock())
    # All at once: the admin listener keeps some of these connections open until the reply
    # wait ends, which in batches added up to 40 s.
    await asyncio.gather(
        *(
            send_raw(port, case.data, half_close=case.half_close)
            for port in (gw.port, gw.gateway.admin_port)
            for case in HOSTILE
        )
    )
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.client"]
    print(f"\n{2 * len(HOSTILE)} hostile requests on two listeners: {len(lines)} lines")
    prefix = re.compile(r"client protocol error on the (proxy|admin) listener from 127\.0\.0\.1: ")
    assert all(prefix.match(line) and "\n" not in line for line in lines), lines
    assert len(lines) == len(set(lines))  # each cause once
    assert {line.split()[5] for line in lines} == {"proxy", "admin"}


def test_valid_hosts_are_remembered_within_a_bound() -> None:
    """``check_request`` remembers the Host values it found valid (a repeated Host costs a set
    lookup, not the pattern's match): many different hosts keep the memory bounded, and an
    invalid Host is refused whatever was remembered before it."""
    version = aiohttp.HttpVersion11
    for number in range(3 * forwarding._VALID_HOSTS_MAX):
        check_request(((b"Host", b"h%d.example:80" % number),), version)
        assert len(forwarding._VALID_HOSTS) <= forwarding._VALID_HOSTS_MAX
    check_request(((b"Host", b"h1.example:80"),), version)
    for invalid in (b"a b", b"h1.example:80, h2", b"h1.example:x", b"[::1"):
        with pytest.raises(BadRequest):
            check_request(((b"Host", invalid),), version)


def test_header_names_are_lowered_from_a_bounded_memory() -> None:
    """``lower_name`` remembers the names it lowered: many different names (a client making
    them up) keep the memory bounded, and each answer is the name in lower case."""
    for number in range(3 * forwarding._LOWER_NAMES_MAX):
        name = b"X-Made-Up-%d" % number
        assert forwarding.lower_name(name) == name.lower()
        assert len(forwarding._LOWER_NAMES) <= forwarding._LOWER_NAMES_MAX
    assert forwarding.lower_name(b"Content-LENGTH") == b"content-length"
