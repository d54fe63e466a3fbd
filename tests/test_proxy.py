"""End-to-end forwarding through the real gateway to real upstream servers, over loopback."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import socket

import aiohttp
import pytest
from aiohttp import web

from tests.support.gateways import GatewayFactory
from tests.support.policies import policy_for
from tests.support.rawhttp import exchange, split_head, status_of
from tests.support.upstreams import RecordedRequest, RecordingUpstream


def _values(headers: list[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [v for n, v in headers if n.lower() == name.lower()]


async def test_raw_path_and_query_forwarded_byte_for_byte(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(policy_for(upstream.url))
    target = b"/a%2Fb/./c;m=1?x=%20y&x=2&b=%E2%82%AC&c=+&d=%7e&&e"
    response = await exchange(
        gw.port, b"GET " + target + b" HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
    )
    assert status_of(response) == 200
    assert upstream.requests[0].raw_path.encode() == target


async def test_repeated_headers_kept_in_order(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(policy_for(upstream.url))
    await exchange(
        gw.port,
        b"GET / HTTP/1.1\r\nHost: h\r\nX-Multi: 1\r\nX-Other: a\r\nX-Multi: 2\r\n"
        b"x-multi: 3\r\nConnection: close\r\n\r\n",
    )
    headers = upstream.requests[0].raw_headers
    assert _values(headers, b"x-multi") == [b"1", b"2", b"3"]
    names = [n.lower() for n, _ in headers]
    assert names.index(b"x-multi") < names.index(b"x-other")


async def test_hop_by_hop_request_headers_dropped(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(policy_for(upstream.url))
    await exchange(
        gw.port,
        b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close, X-Secret\r\nX-Secret: s\r\n"
        b"Keep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nTE: trailers\r\n"
        b"Trailer: X-T\r\nUpgrade: websocket\r\nX-Kept: yes\r\n\r\n",
    )
    names = {n.lower() for n, _ in upstream.requests[0].raw_headers}
    for dropped in (
        b"x-secret",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"upgrade",
        b"transfer-encoding",
    ):
        assert dropped not in names, dropped
    assert b"x-kept" in names


async def test_hop_by_hop_response_headers_dropped(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    async def reply(request: web.BaseRequest, rec: RecordedRequest) -> web.StreamResponse:
        return web.Response(
            text="x",
            headers={
                "Connection": "X-Resp-Hop",
                "X-Resp-Hop": "1",
                "Keep-Alive": "timeout=1",
                "Proxy-Connection": "close",
                "Trailer": "X-T",
                "Upgrade": "h2c",
                "X-Resp-Kept": "yes",
            },
        )

    upstream.reply = reply
    gw = await start_gateway(policy_for(upstream.url))
    async with aiohttp.ClientSession() as session, session.get(gw.url + "/") as resp:
        assert resp.status == 200
        for dropped in ("X-Resp-Hop", "Keep-Alive", "Proxy-Connection", "Trailer", "Upgrade"):
            assert dropped not in resp.headers, dropped
        assert resp.headers["X-Resp-Kept"] == "yes"
        assert "1.1 gateway" in resp.headers["Via"]


async def test_forwarding_headers_added(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(policy_for(upstream.url))
    await exchange(
        gw.port,
        b"GET / HTTP/1.1\r\nHost: shop.example:8080\r\nX-Forwarded-For: 1.2.3.4\r\n"
        b"X-Forwarded-Proto: https\r\nX-Real-IP: 6.6.6.6\r\nVia: 1.0 edge\r\n"
        b"Connection: close\r\n\r\n",
    )
    headers = upstream.requests[0].raw_headers
    assert _values(headers, b"x-forwarded-for") == [b"1.2.3.4, 127.0.0.1"]
    # The peer is not a trusted proxy: its claims about proto and client IP are replaced.
    assert _values(headers, b"x-forwarded-proto") == [b"http"]
    assert _values(headers, b"x-forwarded-host") == [b"shop.example:8080"]
    assert _values(headers, b"x-real-ip") == [b"127.0.0.1"]
    via = _values(headers, b"via")
    assert len(via) == 1 and via[0].startswith(b"1.0 edge, 1.1 gateway")


async def test_xff_from_untrusted_peer_is_ignored(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(policy_for(upstream.url, server="  trusted_proxies: [10.0.0.0/8]\n"))
    await exchange(
        gw.port,
        b"GET / HTTP/1.1\r\nHost: h\r\nX-Forwarded-For: 9.9.9.9\r\nConnection: close\r\n\r\n",
    )
    assert _values(upstream.requests[0].raw_headers, b"x-real-ip") == [b"127.0.0.1"]


async def test_xff_chain_through_two_trusted_proxies(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(
        policy_for(upstream.url, server="  trusted_proxies: [127.0.0.1/32, 10.0.0.0/8]\n")
    )
    await exchange(
        gw.port,
        b"GET / HTTP/1.1\r\nHost: h\r\nX-Forwarded-For: 6.6.6.6, 9.9.9.9\r\n"
        b"X-Forwarded-For: 10.1.2.3\r\nX-Forwarded-Proto: https\r\nConnection: close\r\n\r\n",
    )
    headers = upstream.requests[0].raw_headers
    # 127.0.0.1 (peer) and 10.1.2.3 are trusted; 9.9.9.9 is the right-most untrusted hop.
    assert _values(headers, b"x-real-ip") == [b"9.9.9.9"]
    assert _values(headers, b"x-forwarded-proto") == [b"https"]
    assert _values(headers, b"x-forwarded-for") == [b"6.6.6.6, 9.9.9.9, 10.1.2.3, 127.0.0.1"]


async def test_unmatched_request_gets_problem_json_404(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    policy = (
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
        f"upstreams:\n  backend:\n    url: {upstream.url}\n"
        "routes:\n  - name: api\n    upstream: backend\n    match:\n      path_prefix: /api/\n"
        "      methods: [GET]\n"
    )
    gw = await start_gateway(policy)
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.url + "/other") as resp:
            assert resp.status == 404
            assert resp.content_type == "application/problem+json"
            assert (await resp.json())["status"] == 404
        async with session.post(gw.url + "/api/x") as resp:
            assert resp.status == 404
        async with session.get(gw.url + "/api/x") as resp:
            assert resp.status == 200
    assert [r.raw_path for r in upstream.requests] == ["/api/x"]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.reliability
async def test_connection_refused_gives_502(start_gateway: GatewayFactory) -> None:
    gw = await start_gateway(policy_for(f"http://127.0.0.1:{_closed_port()}"))
    async with aiohttp.ClientSession() as session, session.get(gw.url + "/") as resp:
        assert resp.status == 502
        body = await resp.json()
        assert body["status"] == 502
        assert "Traceback" not in json.dumps(body)


@pytest.mark.reliability
async def test_read_timeout_gives_504(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    async def reply(request: web.BaseRequest, rec: RecordedRequest) -> web.StreamResponse:
        await asyncio.sleep(3)
        return web.Response(text="late")

    upstream.reply = reply
    policy = policy_for(upstream.url).replace("read_timeout: 5s", "read_timeout: 300ms")
    gw = await start_gateway(policy)
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with aiohttp.ClientSession() as session, session.get(gw.url + "/") as resp:
        assert resp.status == 504
        assert (await resp.json())["status"] == 504
    assert loop.time() - started < 2.5


@pytest.mark.reliability
async def test_connect_timeout_gives_504(start_gateway: GatewayFactory) -> None:
    # A listener whose accept queue is full drops further SYNs: the gateway's connect hangs
    # until its connect_timeout, as with a host that does not answer.
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filler.connect(listener.getsockname())
        port = listener.getsockname()[1]
        policy = policy_for(f"http://127.0.0.1:{port}").replace(
            "connect_timeout: 2s", "connect_timeout: 300ms"
        )
        gw = await start_gateway(policy)
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            for _ in range(2):
                started = loop.time()
                async with session.get(gw.url + "/") as resp:
                    assert resp.status == 504
                    body = await resp.json()
                elapsed = loop.time() - started
                assert body["status"] == 504
                assert "Traceback" not in json.dumps(body)
                # Cut at the 300 ms connect timeout, not at the 5 s read timeout.
                assert 0.25 <= elapsed < 2.0, elapsed


async def test_custom_reason_phrase_passes_through_unchanged(
    start_gateway: GatewayFactory,
) -> None:
    # Exact status lines, sent raw: each path through the gateway (small body answered in one
    # write, streamed chunked body, no body, unregistered status) must keep the reason as sent.
    answers = {
        b"/small": b"HTTP/1.1 200 Totally Fine\r\nContent-Length: 2\r\n\r\nok",
        b"/streamed": b"HTTP/1.1 201 Made It, Thanks\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"/empty": b"HTTP/1.1 204 Nothing To See Here\r\n\r\n",
        b"/teapot": b"HTTP/1.1 418 I'm A Teapot Today\r\nContent-Length: 0\r\n\r\n",
        b"/custom": b"HTTP/1.1 299 Custom Status\r\nContent-Length: 2\r\n\r\nok",
        # An empty reason phrase is valid and stays empty (not replaced by the standard one).
        b"/blank": b"HTTP/1.1 200 \r\nContent-Length: 2\r\n\r\nok",
        b"/blank-streamed": b"HTTP/1.1 202 \r\nTransfer-Encoding: chunked\r\n\r\n",
    }

    async def raw_upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                path = head.split(b" ", 2)[1]
                writer.write(answers[path])
                if path in (b"/streamed", b"/blank-streamed"):
                    # Pauses keep the body streaming rather than received whole with its head.
                    for piece in (b"3\r\nabc\r\n", b"0\r\n\r\n"):
                        await writer.drain()
                        await asyncio.sleep(0.05)
                        writer.write(piece)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionResetError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(raw_upstream, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        gw = await start_gateway(policy_for(f"http://127.0.0.1:{port}"))
        for version in (b"1.1", b"1.0"):
            for path, answer in answers.items():
                response = await exchange(
                    gw.port,
                    b"GET " + path + b" HTTP/" + version + b"\r\nHost: h\r\n"
                    b"Connection: close\r\n\r\n",
                )
                sent_status = answer.split(b"\r\n", 1)[0].split(b" ", 1)[1]
                assert response.split(b"\r\n", 1)[0] == b"HTTP/" + version + b" " + sent_status
                if path in (b"/streamed", b"/blank-streamed"):
                    assert b"abc" in response
    finally:
        server.close()


async def test_connection_header_never_reaches_upstream(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(policy_for(upstream.url))
    response = await exchange(
        gw.port,
        b"GET /1 HTTP/1.1\r\nHost: h\r\nConnection: keep-alive\r\n\r\n"
        b"GET /2 HTTP/1.1\r\nHost: h\r\nconnection: X-Foo, keep-alive\r\nX-Foo: f\r\n\r\n"
        b"GET /3 HTTP/1.1\r\nHost: h\r\nCONNECTION: Upgrade\r\nConnection: TE\r\n\r\n"
        b"GET /4 HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
    )
    assert response.count(b"HTTP/1.1 200 ") == 4
    old_client = await exchange(
        gw.port, b"GET /5 HTTP/1.0\r\nHost: h\r\nConnection: keep-alive\r\n\r\n", read_for=1
    )
    assert status_of(old_client) == 200
    assert [r.raw_path for r in upstream.requests] == ["/1", "/2", "/3", "/4", "/5"]
    for recorded in upstream.requests:
        names = [n.lower() for n, _ in recorded.raw_headers]
        assert b"connection" not in names, (recorded.raw_path, recorded.raw_headers)
        assert b"x-foo" not in names
        assert b"keep-alive" not in names


async def test_head_keeps_length_and_sends_no_body(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    async def reply(request: web.BaseRequest, rec: RecordedRequest) -> web.StreamResponse:
        return web.Response(body=b"x" * 1234)

    upstream.reply = reply
    gw = await start_gateway(policy_for(upstream.url))
    response = await exchange(
        gw.port,
        b"HEAD /h HTTP/1.1\r\nHost: h\r\n\r\n"
        b"GET /g HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
    )
    first, _, rest = response.partition(b"\r\n\r\n")
    assert status_of(first) == 200
    assert b"Content-Length: 1234" in first
    # The next response starts right after the HEAD response's head: no body was sent.
    assert status_of(rest) == 200
    assert rest.endswith(b"x" * 1234)


async def test_204_and_304_have_no_body(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    async def reply(request: web.BaseRequest, rec: RecordedRequest) -> web.StreamResponse:
        status = int(rec.raw_path.strip("/"))
        return web.Response(status=status, headers={"ETag": '"v1"'})

    upstream.reply = reply
    gw = await start_gateway(policy_for(upstream.url))
    response = await exchange(
        gw.port,
        b"GET /204 HTTP/1.1\r\nHost: h\r\n\r\nGET /304 HTTP/1.1\r\nHost: h\r\n\r\n"
        b"GET /200 HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
    )
    parts = response.split(b"HTTP/1.1 ")
    assert [p[:3] for p in parts[1:]] == [b"204", b"304", b"200"]
    assert parts[1].endswith(b"\r\n\r\n") and parts[2].endswith(b"\r\n\r\n")


async def test_chunked_upload_and_download(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    async def reply(request: web.BaseRequest, rec: RecordedRequest) -> web.StreamResponse:
        stream = web.StreamResponse()
        stream.enable_chunked_encoding()
        await stream.prepare(request)
        for i in range(50):
            await stream.write(b"%05d" % i * 100)
            if i % 10 == 0:
                # Pauses keep the body streaming: a body received whole with its head may be
                # re-framed with a Content-Length, which is not what this test is about.
                await asyncio.sleep(0.01)
        await stream.write_eof()
        return stream

    upstream.reply = reply
    gw = await start_gateway(policy_for(upstream.url))

    async def body() -> object:
        for i in range(20):
            yield bytes([65 + i]) * 1000

    async with (
        aiohttp.ClientSession() as session,
        session.post(gw.url + "/up", data=body()) as resp,
    ):
        assert resp.status == 200
        assert resp.headers.get("Transfer-Encoding") == "chunked"
        assert await resp.read() == b"".join(b"%05d" % i * 100 for i in range(50))
    assert upstream.requests[0].body == b"".join(bytes([65 + i]) * 1000 for i in range(20))
    assert _values(upstream.requests[0].raw_headers, b"transfer-encoding") == [b"chunked"]


async def test_bytes_pass_unchanged_no_decompression(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    compressed = gzip.compress(b"hello " * 1000)

    async def reply(request: web.BaseRequest, rec: RecordedRequest) -> web.StreamResponse:
        return web.Response(body=compressed, headers={"Content-Encoding": "gzip"})

    upstream.reply = reply
    gw = await start_gateway(policy_for(upstream.url))
    async with (
        aiohttp.ClientSession(auto_decompress=False) as session,
        session.post(gw.url + "/", data=compressed, headers={"Content-Encoding": "gzip"}) as resp,
    ):
        assert await resp.read() == compressed
        assert resp.headers["Content-Encoding"] == "gzip"
    assert upstream.requests[0].body == compressed


@pytest.mark.reliability
async def test_body_over_limit_gets_413_and_never_reaches_upstream(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(policy_for(upstream.url, server="  max_body_size: 1k\n"))
    declared = await exchange(
        gw.port, b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 2000\r\n\r\n" + b"x" * 2000
    )
    assert status_of(declared) == 413
    chunked = await exchange(
        gw.port,
        b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"400\r\n"
        + b"x" * 1024
        + b"\r\n"
        + b"400\r\n"
        + b"x" * 1024
        + b"\r\n0\r\n\r\n",
    )
    assert status_of(chunked) == 413
    assert all(len(r.body) <= 1024 for r in upstream.requests)
    assert not any(len(r.body) > 1024 for r in upstream.requests)


async def test_expect_100_continue_answered_by_gateway(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(policy_for(upstream.url, server="  max_body_size: 1k\n"))
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(
        b"POST /up HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
    )
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"hello")
    final = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert status_of(final) == 200
    writer.close()
    assert upstream.requests[0].body == b"hello"
    assert not _values(upstream.requests[0].raw_headers, b"expect")

    # Too large: refused before the client sends its body, no 100 Continue.
    too_big = await exchange(
        gw.port,
        b"POST /up HTTP/1.1\r\nHost: h\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n",
    )
    assert status_of(too_big) == 413
    assert b"100 Continue" not in too_big
    assert len(upstream.requests) == 1


@pytest.mark.reliability
async def test_client_disconnect_cancels_upstream_request(start_gateway: GatewayFactory) -> None:
    closed = asyncio.Event()
    got_request = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        got_request.set()
        await reader.read()  # returns b"" when the gateway closes its upstream connection
        closed.set()
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        gw = await start_gateway(policy_for(f"http://127.0.0.1:{port}"))
        _, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: h\r\n\r\n")
        await asyncio.wait_for(got_request.wait(), 5)
        writer.close()
        await asyncio.wait_for(closed.wait(), 2)
    finally:
        server.close()


async def test_keepalive_reuses_upstream_connections(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    """Sequential requests share one pooled upstream connection, whatever the client does."""
    gw = await start_gateway(policy_for(upstream.url))
    async with aiohttp.ClientSession() as session:
        for i in range(10):
            async with session.get(f"{gw.url}/kept/{i}") as resp:
                assert resp.status == 200
                await resp.read()
    # A new client connection per request: the upstream leg is pooled on its own.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for i in range(10):
            async with session.get(f"{gw.url}/fresh/{i}") as resp:
                assert resp.status == 200
                await resp.read()
    assert len(upstream.requests) == 20
    assert {r.peer for r in upstream.requests} == {"127.0.0.1"}
    # The upstream saw every request come from the same source port: one connection.
    assert len({r.peer_port for r in upstream.requests}) == 1, [
        r.peer_port for r in upstream.requests
    ]
    handler = gw.gateway.handler
    assert handler.runtime.upstreams["backend"].pool.members[0].connections.open_connections == 1


async def test_admin_health_and_policy(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(policy_for(upstream.url))
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.admin_url + "/healthz") as resp:
            assert resp.status == 200
        async with session.get(gw.admin_url + "/readyz") as resp:
            assert resp.status == 200
        async with session.get(gw.admin_url + "/policy") as resp:
            body = await resp.json()
            assert len(body["sha256"]) == 64
            assert body["policy"]["routes"][0]["name"] == "all"


@pytest.mark.reliability
async def test_truncated_upstream_body_is_not_passed_off_as_complete(
    start_gateway: GatewayFactory,
) -> None:
    async def truncating(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 70000)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(truncating, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        gw = await start_gateway(policy_for(f"http://127.0.0.1:{port}"))
        response = await exchange(gw.port, b"GET / HTTP/1.1\r\nHost: h\r\n\r\n", read_for=5)
        headers, body = split_head(response)
        if status_of(response) == 200:
            declared = int(_values(headers, b"content-length")[0])
            assert len(body) < declared  # the client can tell: connection closed short
        else:
            assert status_of(response) == 502
    finally:
        server.close()


@pytest.mark.reliability
async def test_stalled_body_gets_408_and_the_upstream_is_cut(
    start_gateway: GatewayFactory,
) -> None:
    upstream_closed = asyncio.Event()

    async def reading(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        while await reader.read(65536):
            pass
        upstream_closed.set()
        writer.close()

    server = await asyncio.start_server(reading, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        gw = await start_gateway(
            policy_for(f"http://127.0.0.1:{port}", server="  body_timeout: 500ms\n")
        )
        loop = asyncio.get_running_loop()
        started = loop.time()
        response = await exchange(
            gw.port,
            b"POST /up HTTP/1.1\r\nHost: h\r\nContent-Length: 100\r\n\r\n" + b"x",
            read_for=5,
        )
        assert status_of(response) == 408
        assert loop.time() - started < 3
        await asyncio.wait_for(upstream_closed.wait(), 2)
    finally:
        server.close()


@pytest.mark.parametrize("passed", [False, True])
async def test_clients_see_the_gateways_server_header_unless_the_upstreams_is_passed(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, passed: bool
) -> None:
    async def reply(request: web.BaseRequest, rec: RecordedRequest) -> web.StreamResponse:
        return web.Response(text="x", headers={"Server": "Apache/2.4.1 (Unix) PHP/5.3"})

    upstream.reply = reply
    setting = "  pass_upstream_server_header: true\n" if passed else ""
    gw = await start_gateway(policy_for(upstream.url, server=setting))
    expected = [b"Apache/2.4.1 (Unix) PHP/5.3"] if passed else [b"gateway"]
    # GET: the whole answer written in one go; HEAD and HTTP/1.0: relayed through aiohttp.
    for request in (
        b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        b"HEAD / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        b"GET / HTTP/1.0\r\nHost: h\r\n\r\n",
    ):
        response = await exchange(gw.port, request)
        assert status_of(response) == 200, response
        headers, _ = split_head(response)
        assert _values(headers, b"Server") == expected, request


_CUT_SHORT_HEADS = {
    "length": b"HTTP/1.1 200 OK\r\nContent-Length: 10000\r\n\r\n" + b"x" * 100,
    "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n64\r\n"
    + b"x" * 100
    + b"\r\n",
}


async def _cut_short_upstream(framing: str, stall: bool) -> asyncio.Server:
    """An upstream that declares ``Content-Length: 10000`` (or chunks), sends 100 bytes, then
    closes (or, with ``stall``, sends nothing more until the gateway gives up on it)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(_CUT_SHORT_HEADS[framing])
            await writer.drain()
            if stall:
                await reader.read()  # until the gateway cuts this connection
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


def _aiohttp_errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """What reached aiohttp's own loggers (``Error handling request``, ``Unhandled
    exception``), and any record with a traceback."""
    return [r for r in caplog.records if r.name.startswith("aiohttp") or r.exc_info]


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("framing", "stall"),
    [("length", False), ("length", True), ("chunked", False)],
    ids=["closed", "stalled", "chunked-closed"],
)
async def test_an_upstream_body_cut_short_is_a_broken_framing_and_one_log_line(
    start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture, framing: str, stall: bool
) -> None:
    """An upstream that declares 10,000 bytes and sends 100, then closes (or stalls past
    ``read_timeout``): every client sees a body shorter than its ``Content-Length``, never one
    that looks complete; the log holds one ``gateway.upstream`` line for the cause and nothing
    from aiohttp (the probe: one ERROR traceback per request, 1,001 lines for 1,000)."""
    caplog.set_level(logging.DEBUG)
    server = await _cut_short_upstream(framing, stall)
    port = server.sockets[0].getsockname()[1]
    requests = 200
    try:
        policy = policy_for(f"http://127.0.0.1:{port}").replace(
            "read_timeout: 5s", "read_timeout: 200ms"
        )
        gw = await start_gateway(policy)
        request = b"GET / HTTP/1.1\r\nHost: h\r\n\r\n"
        if stall:  # each waits out the read timeout: at once
            responses = await asyncio.gather(
                *(exchange(gw.port, request, read_for=5) for _ in range(requests))
            )
        else:
            responses = [await exchange(gw.port, request, read_for=5) for _ in range(requests)]
    finally:
        server.close()
    for response in responses:
        assert status_of(response) == 200, response[:200]
        headers, body = split_head(response)
        if framing == "length":
            assert _values(headers, b"content-length") == [b"10000"]
            assert len(body) < 10000  # the connection closed short: the client can tell
        else:
            assert _values(headers, b"transfer-encoding") == [b"chunked"]
            assert body.startswith(b"64\r\n") and not body.endswith(b"0\r\n\r\n")
    cause = "timeout" if stall else "reset"
    upstream_lines = [r.getMessage() for r in caplog.records if r.name == "gateway.upstream"]
    print(
        f"\nupstream body cut short ({cause}): {requests} requests, {len(caplog.records)} log "
        f"records, {len(upstream_lines)} from gateway.upstream, "
        f"{len(_aiohttp_errors(caplog))} from aiohttp or with a traceback"
    )
    assert _aiohttp_errors(caplog) == []
    assert len(upstream_lines) == 1, upstream_lines
    assert f"(cause {cause}," in upstream_lines[0]


@pytest.mark.reliability
async def test_a_client_leaving_mid_body_logs_nothing_and_frees_the_upstream(
    start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that reads the head of a long streamed answer and closes: no traceback from
    aiohttp (a write to a closed connection raised into its handler), the upstream
    connection cut rather than drained."""
    caplog.set_level(logging.DEBUG)
    upstream_closed = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(2000):  # bounded: 2,000 chunks of 64 KiB, 10 ms apart
                writer.write(b"10000\r\n" + b"x" * 65536 + b"\r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            upstream_closed.set()
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        gw = await start_gateway(policy_for(f"http://127.0.0.1:{port}"))
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        await asyncio.wait_for(reader.readexactly(65536), 5)
        writer.transport.abort()
        await asyncio.wait_for(upstream_closed.wait(), 10)
    finally:
        server.close()
    assert _aiohttp_errors(caplog) == []
