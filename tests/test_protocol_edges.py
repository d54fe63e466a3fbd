"""Protocol edges found by probing the gateway: headers it must not invent, versions it does not
speak, framing errors it must not linger on, header names some upstreams misread.

Each upstream here is a raw socket server writing exact bytes, so what the client sees can only
have come from the upstream or from the gateway.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import cast

import pytest
from aiohttp.streams import StreamReader
from hypothesis import given
from hypothesis import strategies as st

from gateway.edge.server import ChunkSizes
from tests.support.gateways import GatewayFactory
from tests.support.network import free_port
from tests.support.policies import policy_for
from tests.support.rawhttp import split_head, status_of
from tests.support.upstreams import RecordingUpstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.reliability


_LARGE = 1024 * 1024

# What each path answers with: no Content-Type, no Server, in every framing the gateway has
# a separate path for (whole and small, large with a length, chunked, close-delimited, cut short).
_UPSTREAM_REPLIES: dict[bytes, bytes] = {
    b"/small": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
    b"/large-length": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % _LARGE + b"x" * _LARGE,
    b"/large-chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"%x\r\n" % _LARGE
    + b"x" * _LARGE
    + b"\r\n0\r\n\r\n",
    b"/close-delimited": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"x" * 1000,
    b"/truncated": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % _LARGE + b"x" * 70000,
    b"/typed": b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nServer: upstream/1\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % _LARGE + b"x" * _LARGE + b"\r\n0\r\n\r\n",
}


@pytest.fixture
async def raw_upstream() -> AsyncIterator[str]:
    """Answers each request with the exact bytes of ``_UPSTREAM_REPLIES`` and closes."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1]
            writer.write(_UPSTREAM_REPLIES[path])
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def _read_all(port: int, data: bytes, *, within_s: float = 5.0) -> tuple[bytes, bool]:
    """Send ``data``; read until the gateway closes (True) or ``within_s`` passes (False)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    chunks: list[bytes] = []
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(within_s):
            while chunk := await reader.read(65536):
                chunks.append(chunk)
        return b"".join(chunks), True
    except TimeoutError:
        return b"".join(chunks), False
    except ConnectionResetError:
        return b"".join(chunks), True
    finally:
        writer.close()


def _names(response: bytes) -> list[bytes]:
    headers, _ = split_head(response)
    return [name.lower() for name, _ in headers]


@pytest.mark.parametrize("version", [b"HTTP/1.1", b"HTTP/1.0"])
@pytest.mark.parametrize(
    "path", [b"/small", b"/large-length", b"/large-chunked", b"/close-delimited", b"/truncated"]
)
@pytest.mark.parametrize("passed", [False, True])
async def test_no_content_type_or_server_the_upstream_never_sent(
    path: bytes, version: bytes, passed: bool, raw_upstream: str, start_gateway: GatewayFactory
) -> None:
    """aiohttp adds ``Content-Type: application/octet-stream`` and ``Server: Python/x
    aiohttp/y`` to a response that has none; a proxy passing one on must not. ``Server`` is
    the gateway's own, or with the upstream's passed, none."""
    setting = "  pass_upstream_server_header: true\n" if passed else ""
    gw = await start_gateway(policy_for(raw_upstream, server=setting))
    response, closed = await _read_all(
        gw.port, b"GET " + path + b" " + version + b"\r\nHost: h\r\nConnection: close\r\n\r\n"
    )
    assert closed
    assert status_of(response) == 200, response[:200]
    names = _names(response)
    assert b"content-type" not in names, response[:400]
    headers, _ = split_head(response)
    servers = [v for n, v in headers if n.lower() == b"server"]
    assert servers == ([] if passed else [b"gateway"]), response[:400]
    assert b"aiohttp" not in response.partition(b"\r\n\r\n")[0].lower()


@pytest.mark.parametrize("passed", [False, True])
async def test_upstream_content_type_and_server_pass_unchanged(
    passed: bool, raw_upstream: str, start_gateway: GatewayFactory
) -> None:
    setting = "  pass_upstream_server_header: true\n" if passed else ""
    gw = await start_gateway(policy_for(raw_upstream, server=setting))
    response, _ = await _read_all(
        gw.port, b"GET /typed HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
    )
    headers, _ = split_head(response)
    assert [v for n, v in headers if n.lower() == b"content-type"] == [b"text/html"]
    servers = [v for n, v in headers if n.lower() == b"server"]
    assert servers == ([b"upstream/1"] if passed else [b"gateway"])


@pytest.mark.parametrize(
    "data",
    [
        b"POST /a HTTP/1.0\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST /a HTTP/1.0\r\nHost: h\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked"
        b"\r\n\r\n5\r\nab",
        b"POST /a HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        b"POST /a HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: "
        b"chunked\r\n\r\n",
    ],
    ids=["te-http-1.0", "te-http-1.0-keep-alive-partial", "te-gzip-chunked", "te-twice"],
)
async def test_framing_refusal_closes_at_once(
    data: bytes, upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    """A 400 for framing the gateway cannot trust closes at once: there is no body end to
    read up to, so aiohttp's lingering read held the socket for its full 10 s."""
    gw = await start_gateway(policy_for(upstream.url))
    loop = asyncio.get_running_loop()
    started = loop.time()
    response, closed = await _read_all(gw.port, data, within_s=3.0)
    assert status_of(response) == 400, response[:200]
    assert closed, "the gateway kept the connection open after refusing its framing"
    assert loop.time() - started < 1.0
    assert upstream.requests == []


@pytest.mark.parametrize("version", [b"HTTP/0.9", b"HTTP/2.0", b"HTTP/3.0"])
async def test_other_http_versions_get_505_in_http_1_1(
    version: bytes, upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(policy_for(upstream.url))
    response, closed = await _read_all(gw.port, b"GET /a " + version + b"\r\nHost: h\r\n\r\n")
    assert closed
    if version == b"HTTP/3.0":
        # llhttp refuses this line itself: aiohttp's 400, in HTTP/1.x.
        assert response.startswith((b"HTTP/1.0 400 ", b"HTTP/1.1 400 ")), response[:200]
    else:
        assert response.startswith(b"HTTP/1.1 505 "), response[:200]
    assert upstream.requests == []


@pytest.mark.parametrize("underscores", [False, True])
async def test_header_names_with_underscores(
    underscores: bool, upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    """Dropped by default (nginx's ``underscores_in_headers off``): CGI-style upstreams read
    ``X_Real_IP`` as ``X-Real-IP`` and ``Transfer_Encoding`` as ``Transfer-Encoding``."""
    server = "  underscores_in_headers: true\n" if underscores else ""
    gw = await start_gateway(policy_for(upstream.url, server=server))
    response, _ = await _read_all(
        gw.port,
        b"GET /a HTTP/1.1\r\nHost: h\r\nX_Real_IP: 6.6.6.6\r\nTransfer_Encoding: chunked\r\n"
        b"X-Kept: 1\r\nConnection: close\r\n\r\n",
    )
    assert status_of(response) == 200
    names = [name for name, _ in upstream.requests[0].raw_headers]
    assert b"X-Kept" in names
    if underscores:
        assert b"X_Real_IP" in names and b"Transfer_Encoding" in names
    else:
        assert not [name for name in names if b"_" in name], names
    real_ip = [v for n, v in upstream.requests[0].raw_headers if n.lower() == b"x-real-ip"]
    assert real_ip == [b"127.0.0.1"]


async def test_no_versions_in_the_gateways_own_answers(
    raw_upstream: str, start_gateway: GatewayFactory
) -> None:
    """Neither a parser refusal nor the admin listener names Python's or aiohttp's version."""
    gw = await start_gateway(policy_for(raw_upstream))
    refused, _ = await _read_all(gw.port, b"GET /a HTTP/1.1\r\nHost: h\r\nX-A: a\x01b\r\n\r\n")
    assert status_of(refused) == 400
    admin_port = gw.gateway.admin_port
    for path in (b"/healthz", b"/metrics", b"/no-such-page"):
        answer, _ = await _read_all(
            admin_port, b"GET " + path + b" HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
        )
        assert status_of(answer) in (200, 404), answer[:200]
        for response in (refused, answer):
            head = response.partition(b"\r\n\r\n")[0].lower()
            assert b"python" not in head and b"aiohttp" not in head, head


@pytest.fixture
async def head_counter() -> AsyncIterator[tuple[str, list[bytes]]]:
    """An upstream that records every request head it is sent, and reads bodies to the end."""
    heads: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            heads.append(await reader.readuntil(b"\r\n\r\n"))
            while await reader.read(65536):
                pass
        except (asyncio.IncompleteReadError, ConnectionResetError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", heads
    finally:
        server.close()


_CHUNKED_HEAD = b"POST /up HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    ("size_line", "status"),
    [
        (b"%x" % (2 * 1024 * 1024), 413),  # past max_body_size (1m)
        (b"00000000%x;ext=1" % (1024 * 1024 + 1), 413),
        (b"%x" % 2**63, 400),  # llhttp takes it (it refuses 2**64 itself)
        (b"%x" % (2**64 - 1), 400),
    ],
    ids=["2MiB", "1MiB+1-padded-with-extension", "2**63", "2**64-1"],
)
async def test_oversized_chunk_refused_at_once_and_never_forwarded(
    size_line: bytes,
    status: int,
    head_counter: tuple[str, list[bytes]],
    start_gateway: GatewayFactory,
) -> None:
    url, heads = head_counter
    gw = await start_gateway(policy_for(url, server="  max_body_size: 1m\n"))
    loop = asyncio.get_running_loop()
    started = loop.time()
    response, closed = await _read_all(
        gw.port, _CHUNKED_HEAD + size_line + b"\r\nabc", within_s=3.0
    )
    assert status_of(response) == status, response[:200]
    assert closed and loop.time() - started < 1.0
    assert heads == []


async def test_chunk_past_the_limit_after_streaming_began_cuts_at_once(
    head_counter: tuple[str, list[bytes]], start_gateway: GatewayFactory
) -> None:
    """The first chunk is fine and goes upstream; the second announces more than the limit
    allows: the body is refused when its size line arrives, not after a body timeout."""
    url, heads = head_counter
    gw = await start_gateway(policy_for(url, server="  max_body_size: 1m\n  body_timeout: 30s\n"))
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(_CHUNKED_HEAD + b"5\r\nhello\r\n")
        await writer.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while not heads:
            assert loop.time() < deadline, "the head never reached the upstream"
            await asyncio.sleep(0.01)
        started = loop.time()
        writer.write(b"%x\r\nabc" % (1024 * 1024))
        await writer.drain()
        async with asyncio.timeout(3):
            answer = await reader.read()
        assert loop.time() - started < 1.0
        assert status_of(answer) in (0, 413), answer[:200]
    finally:
        writer.close()


@pytest.mark.parametrize("piece", [1, 3, 7, 64])
async def test_chunked_body_in_small_pieces_reaches_upstream_whole(
    piece: int, upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    """Chunk sizes read across reads of any size: a body just under the limit still passes."""
    gw = await start_gateway(policy_for(upstream.url, server="  max_body_size: 2k\n"))
    chunks = [b"a" * 1000, b"b" * 40, b"c" * 1000]
    body = b"".join(b"%x;n=v\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\nX-T: 1\r\n\r\n"
    data = _CHUNKED_HEAD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n") + body
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        for start in range(0, len(data), piece):
            writer.write(data[start : start + piece])
            await writer.drain()
        async with asyncio.timeout(5):
            answer = await reader.read()
    finally:
        writer.close()
    assert status_of(answer) == 200, answer[:200]
    assert upstream.requests[0].body == b"".join(chunks)


@given(
    sizes=st.lists(st.integers(1, 300), max_size=6),
    extension=st.sampled_from([b"", b";a=b", b';q="x;y"']),
    cuts=st.lists(st.integers(0, 4000), max_size=8),
)
def test_chunk_sizes_read_across_any_split(
    sizes: list[int], extension: bytes, cuts: list[int]
) -> None:
    """Whatever the read boundaries, the sizes read are the sizes sent, and the last chunk
    ends the reading (what follows is trailers, then the next request)."""
    body = b"".join(b"%x%s\r\n%s\r\n" % (n, extension, b"\n" * n) for n in sizes)
    body += b"0\r\nX-T: 1\r\n\r\nGET /next HTTP/1.1\r\n\r\n"
    reader = ChunkSizes(cast(StreamReader, None))  # feeding never touches the payload
    points = sorted({min(c, len(body)) for c in cuts} | {0, len(body)})
    for start, end in itertools.pairwise(points):
        reader.feed(body[start:end])
    assert reader.done and reader.total == sum(sizes)
    assert reader.largest == max(sizes, default=0)


_ANSWERS = [
    # (request, status, detail): the gateway's own answers, each from a different place
    (
        b"GET /a HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        502,
        "upstream 'backend': connection failed",
    ),
    (b"GET /a HTTP/2.0\r\nHost: h\r\n\r\n", 505, "only HTTP/1.0 and HTTP/1.1 are served"),
    (b"CONNECT h:443 HTTP/1.1\r\nHost: h\r\n\r\n", 405, "CONNECT is not supported"),
    (b"GET /a HTTP/3.0\r\nHost: h\r\n\r\n", 400, None),  # refused by the parser (aiohttp's)
]


@pytest.mark.parametrize(("data", "status", "detail"), _ANSWERS)
@pytest.mark.parametrize("legacy", [False, True])
async def test_every_answer_of_the_gateways_own_is_problem_json(
    data: bytes, status: int, detail: str | None, legacy: bool, start_gateway: GatewayFactory
) -> None:
    setting = "  error_body: legacy\n" if legacy else ""
    gw = await start_gateway(policy_for(f"http://127.0.0.1:{free_port()}", server=setting))
    response, closed = await _read_all(gw.port, data)
    assert closed  # each of these ends the connection (the parser's 400 as aiohttp's did)
    assert status_of(response) == status, response[:300]
    headers, body = split_head(response)
    types = [v for n, v in headers if n.lower() == b"content-type"]
    fields = json.loads(body)
    if legacy:  # the body of old, for clients written against it
        assert types == [b"application/json"]
        assert set(fields) == {"status", "error", "message"} and fields["status"] == status
        assert detail is None or fields["message"] == detail
    else:
        assert types == [b"application/problem+json"]
        assert set(fields) == {"type", "title", "status", "detail"}
        assert (fields["type"], fields["status"]) == ("about:blank", status)
        assert detail is None or fields["detail"] == detail
    assert b"aiohttp" not in response


async def test_a_connection_over_the_cap_gets_problem_json(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(policy_for(upstream.url, server="  max_connections: 1\n"))
    _, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        await wait_until(lambda: gw.gateway.server.open_connections == 1)
        response, _ = await _read_all(gw.port, b"")
    finally:
        writer.close()
    assert status_of(response) == 503, response
    headers, body = split_head(response)
    assert (b"Content-Type", b"application/problem+json") in headers
    assert json.loads(body)["detail"] == "too many connections"
