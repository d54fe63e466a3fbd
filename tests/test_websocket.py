"""WebSocket proxying: a real aiohttp WebSocket upstream, a real aiohttp WebSocket client through
the gateway, and raw sockets where the bytes on the wire are the point (half-close, refusals)."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import WSCloseCode, WSMsgType, web

from gateway.clock import FakeClock
from tests.support.gateways import GatewayFactory, RunningGateway
from tests.support.metrics import scrape_until, value
from tests.support.network import TIMEOUT
from tests.support.policies import policy_for
from tests.support.rawhttp import exchange, split_head, status_of
from tests.support.upstreams import RecordingUpstream
from tests.support.waiting import wait_until

MESSAGES = 10_000
LARGE = 4 * 1024 * 1024
_HANDSHAKE = (
    b"GET /ws HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
)


@dataclass
class WsUpstream:
    url: str
    closes: list[int | None] = field(default_factory=list)  # close codes the upstream saw
    handshakes: list[web.BaseRequest] = field(default_factory=list)


@pytest.fixture
async def ws_upstream() -> AsyncIterator[WsUpstream]:
    """Echoes every message; ``close:CODE`` makes it close first with that code; ``send:N``
    makes it send N messages of its own; a handshake on /refuse is answered 403."""
    state = WsUpstream(url="")

    async def handle(request: web.Request) -> web.StreamResponse:
        state.handshakes.append(request)
        if request.path == "/refuse":
            return web.json_response({"no": "websocket"}, status=403)
        ws = web.WebSocketResponse(max_msg_size=0, autoping=True)
        await ws.prepare(request)
        async for msg in ws:
            if msg.type == WSMsgType.TEXT and msg.data.startswith("close:"):
                await ws.close(code=int(msg.data[6:]), message=b"bye")
                break
            if msg.type == WSMsgType.TEXT and msg.data.startswith("send:"):
                for i in range(int(msg.data[5:])):
                    await ws.send_str(f"up {i}")
                continue
            if msg.type == WSMsgType.TEXT:
                await ws.send_str(msg.data)
            elif msg.type == WSMsgType.BINARY:
                await ws.send_bytes(msg.data)
        state.closes.append(ws.close_code)
        return ws

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    state.url = f"http://127.0.0.1:{port}"
    yield state
    await runner.cleanup()


async def _gateway(
    start_gateway: GatewayFactory,
    upstream_url: str,
    server: str = "",
    limits: str = "",
    clock: FakeClock | None = None,
) -> RunningGateway:
    return await start_gateway(
        policy_for(upstream_url, server=server) + (f"limits:\n{limits}" if limits else ""),
        clock=clock,
    )


async def test_ten_thousand_messages_each_way(
    ws_upstream: WsUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await _gateway(start_gateway, ws_upstream.url)
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.ws_connect(gw.url + "/ws") as ws,
    ):

        async def send() -> None:
            for i in range(MESSAGES):
                await ws.send_str(f"message {i}")

        sender = asyncio.create_task(send())
        async with asyncio.timeout(30):
            echoed = [(await ws.receive_str()) for _ in range(MESSAGES)]
            await sender
            await ws.send_str(f"send:{MESSAGES}")
            pushed = [(await ws.receive_str()) for _ in range(MESSAGES)]
        assert echoed == [f"message {i}" for i in range(MESSAGES)]
        assert pushed == [f"up {i}" for i in range(MESSAGES)]
    # The client closed first: the upstream saw its close handshake.
    await wait_until(lambda: ws_upstream.closes == [WSCloseCode.OK])
    await wait_until(lambda: gw.gateway.server.upgrades.open == 0)


async def test_large_frames_both_ways(
    ws_upstream: WsUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await _gateway(start_gateway, ws_upstream.url)
    payloads = [os.urandom(LARGE), os.urandom(LARGE // 2 + 1)]
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.ws_connect(gw.url + "/ws", max_msg_size=0) as ws,
    ):
        async with asyncio.timeout(30):
            for payload in payloads:
                await ws.send_bytes(payload)
            for payload in payloads:
                echoed = await ws.receive_bytes()
                assert hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()
    stats = gw.gateway.server.upgrades
    await wait_until(lambda: stats.open == 0)
    # Frames add a few bytes of header (and the client's mask) to each payload.
    total = sum(len(p) for p in payloads)
    assert total < stats.bytes_from_client < total + 1024
    assert total < stats.bytes_from_upstream < total + 1024


async def test_upstream_closes_first(
    ws_upstream: WsUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await _gateway(start_gateway, ws_upstream.url)
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.ws_connect(gw.url + "/ws") as ws,
    ):
        await ws.send_str("close:4001")
        async with asyncio.timeout(10):
            msg = await ws.receive()
        assert msg.type == WSMsgType.CLOSE
        assert msg.data == 4001
        assert msg.extra == "bye"
        async with asyncio.timeout(10):
            assert (await ws.receive()).type == WSMsgType.CLOSED
    assert ws.close_code == 4001
    # The client's answering close frame (aiohttp answers 1000) reached the upstream.
    await wait_until(lambda: ws_upstream.closes == [WSCloseCode.OK])
    await wait_until(lambda: gw.gateway.server.upgrades.open == 0)
    await wait_until(lambda: gw.gateway.server.open_connections == 0)


async def test_rejected_handshake_gets_429_with_its_headers(
    ws_upstream: WsUpstream, start_gateway: GatewayFactory
) -> None:
    # A fake clock: on the real one the minute could end between the two handshakes.
    gw = await _gateway(
        start_gateway,
        ws_upstream.url,
        limits="  per_ip:\n    algorithm: fixed_window\n    limit: 1\n    window: 1m\n",
        clock=FakeClock(),
    )
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.ws_connect(gw.url + "/ws") as ws:
            await ws.send_str("hi")
            assert await ws.receive_str() == "hi"
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await session.ws_connect(gw.url + "/ws")
    assert refused.value.status == 429
    headers = refused.value.headers
    assert headers is not None
    assert headers["RateLimit-Policy"] == '"per_ip";q=1;w=60'
    assert headers["RateLimit"].startswith('"per_ip";r=0;t=')
    assert int(headers["Retry-After"]) >= 1
    assert len(ws_upstream.handshakes) == 1  # the refused one never reached the upstream


async def test_non_101_answer_is_relayed_and_the_connection_stays_http(
    ws_upstream: WsUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await _gateway(start_gateway, ws_upstream.url)
    refusal = _HANDSHAKE.replace(b"GET /ws", b"GET /refuse")
    response = await exchange(
        gw.port, refusal + b"GET /after HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
    )
    assert status_of(response) == 403
    headers, rest = split_head(response)
    assert (b"Content-Type", b"application/json; charset=utf-8") in headers
    assert rest.startswith(b'{"no": "websocket"}HTTP/1.1 ')  # the next request was served
    assert [r.path for r in ws_upstream.handshakes] == ["/refuse", "/after"]
    assert gw.gateway.server.upgrades.total == 0


@pytest.mark.parametrize(
    "request_bytes",
    [
        # h2c: never honoured (HTTP/2 to the upstream past every check); forwarded plain.
        b"GET / HTTP/1.1\r\nHost: h\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n",
        # a WebSocket upgrade on POST or with a body is not a handshake.
        b"POST / HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Content-Length: 2\r\n\r\nab",
        b"GET / HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Content-Length: 2\r\n\r\nab",
        # HTTP/1.0 has no Upgrade.
        b"GET / HTTP/1.0\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
        # a protocol server.upgrade_protocols does not name
        b"GET / HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: x-tunnel\r\n\r\n",
    ],
    ids=["h2c", "post", "get-with-body", "http10", "unlisted"],
)
async def test_other_upgrades_are_forwarded_as_plain_requests(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, request_bytes: bytes
) -> None:
    gw = await _gateway(start_gateway, upstream.url)
    pipelined = b"GET /next HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
    if b"GET / HTTP/1." in request_bytes and b"Content-Length" not in request_bytes:
        # aiohttp's parser stops at any upgrade request (llhttp pauses there) and reads no
        # request pipelined behind one it does not switch for; HTTP/1.0 closes anyway.
        pipelined = b""
    response = await exchange(gw.port, request_bytes + pipelined, read_for=1)
    if not pipelined:
        assert status_of(response) == 200
        assert len(upstream.requests) == 1
    else:
        assert response.count(b"HTTP/1.1 200 ") == 2, response
        assert upstream.requests[1].raw_path == "/next"
    for recorded in upstream.requests:
        names = {n.lower() for n, _ in recorded.raw_headers}
        assert b"upgrade" not in names and b"connection" not in names
    assert gw.gateway.server.upgrades.total == 0


async def _raw_upstream(
    serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    protocol: bytes = b"websocket",
) -> tuple[asyncio.Server, str]:
    """An upstream that answers the handshake with a bare 101 and then runs ``serve``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: %s\r\n"
            b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n" % protocol
        )
        try:
            await serve(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def _handshake(
    port: int, protocol: bytes = b"websocket"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_HANDSHAKE.replace(b"Upgrade: websocket", b"Upgrade: " + protocol))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    return reader, writer, head


async def test_half_close_is_passed_on_both_ways(start_gateway: GatewayFactory) -> None:
    """The client ends its sending half; the upstream reads to the end, then answers on the
    still-open other half, and only then closes."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received = await reader.read()  # until the client's end of stream
        writer.write(b"after-eof:" + received)
        await writer.drain()

    server, url = await _raw_upstream(serve)
    async with server:
        gw = await _gateway(start_gateway, url)
        reader, writer, head = await _handshake(gw.port)
        assert head.startswith(b"HTTP/1.1 101 Switching Protocols\r\n")
        assert b"\r\nUpgrade: websocket\r\n" in head and b"\r\nConnection: Upgrade\r\n" in head
        assert b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in head
        assert b"\r\nServer: gateway\r\n" in head  # the gateway's own, as on every answer
        writer.write(b"hello")
        writer.write_eof()
        async with asyncio.timeout(5):
            assert await reader.read() == b"after-eof:hello"
        writer.close()
        await wait_until(lambda: gw.gateway.server.upgrades.open == 0)
        await wait_until(lambda: gw.gateway.server.open_connections == 0)


async def test_flow_control_holds_a_fast_upstream_to_a_slow_client(
    start_gateway: GatewayFactory,
) -> None:
    """An upstream sending 64 MiB to a client that reads nothing is stopped by back-pressure
    (the gateway reads no more than it can pass on), and every byte arrives once read."""
    total = 64 * 1024 * 1024
    written = 0
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal written
        block = b"x" * 65536
        while written < total:
            writer.write(block)
            await writer.drain()
            written += len(block)
        done.set()
        await reader.read()

    server, url = await _raw_upstream(serve)
    async with server:
        gw = await _gateway(start_gateway, url)
        reader, writer, _ = await _handshake(gw.port)
        await asyncio.sleep(1.0)  # the client reads nothing meanwhile
        assert written < total // 2, written  # kernel buffers and the high-water mark, no more
        received = 0
        async with asyncio.timeout(30):
            while received < total:
                chunk = await reader.read(1 << 20)
                assert chunk
                received += len(chunk)
        assert received == total and done.is_set()
        writer.close()
        await wait_until(lambda: gw.gateway.server.upgrades.open == 0)


async def test_idle_timeout_closes_both_sides(
    ws_upstream: WsUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await _gateway(start_gateway, ws_upstream.url, server="  websocket_idle_timeout: 300ms\n")
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.ws_connect(gw.url + "/ws", autoping=False, heartbeat=None) as ws,
    ):
        await ws.send_str("hi")
        assert await ws.receive_str() == "hi"
        async with asyncio.timeout(5):
            msg = await ws.receive()
        assert msg.type in (WSMsgType.CLOSED, WSMsgType.CLOSE, WSMsgType.ERROR)
    await wait_until(lambda: gw.gateway.server.upgrades.open == 0)
    assert gw.gateway.server.upgrades.idle_timeouts == 1
    await wait_until(lambda: len(ws_upstream.closes) == 1)


async def test_upstream_down_gets_502(start_gateway: GatewayFactory) -> None:
    gw = await _gateway(start_gateway, "http://127.0.0.1:1")
    response = await exchange(gw.port, _HANDSHAKE)
    assert status_of(response) == 502


async def test_metrics_count_websocket_connections_and_bytes(
    ws_upstream: WsUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await _gateway(start_gateway, ws_upstream.url)
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for _ in range(3):
            async with session.ws_connect(gw.url + "/ws") as ws:
                await ws.send_bytes(b"x" * 1000)
                assert len(await ws.receive_bytes()) == 1000
        async with session.ws_connect(gw.url + "/ws") as held:
            samples = await scrape_until(
                session,
                gw.admin_url,
                lambda s: (
                    value(s, "gateway_websocket_connections_total") == 4
                    and value(s, "gateway_websocket_connections_open") == 1
                ),
            )
            await held.close()
        assert (
            3000
            < value(samples, "gateway_websocket_bytes_total", direction="client_to_upstream")
            < 3200
        )
        assert (
            3000
            < value(samples, "gateway_websocket_bytes_total", direction="upstream_to_client")
            < 3200
        )
        assert (
            value(samples, "gateway_requests_total", route="all", method="GET", status="1xx") == 3
        )
        samples = await scrape_until(
            session,
            gw.admin_url,
            lambda s: value(s, "gateway_websocket_connections_open") == 0,
        )


async def test_shutdown_gives_open_websockets_the_shutdown_timeout_then_closes_them(
    ws_upstream: WsUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await _gateway(start_gateway, ws_upstream.url, server="  shutdown_timeout: 1s\n")
    loop = asyncio.get_running_loop()
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.ws_connect(gw.url + "/ws") as ws,
    ):
        await ws.send_str("hi")
        assert await ws.receive_str() == "hi"
        started = loop.time()
        stopping = asyncio.create_task(gw.gateway.stop())
        await asyncio.sleep(0.3)
        await ws.send_str("still relayed while draining")
        assert await ws.receive_str() == "still relayed while draining"
        async with asyncio.timeout(5):
            msg = await ws.receive()
            await stopping
        assert msg.type in (WSMsgType.CLOSED, WSMsgType.CLOSE, WSMsgType.ERROR)
        assert 0.9 < loop.time() - started < 4
    await wait_until(lambda: gw.gateway.server.upgrades.open == 0)
    await wait_until(lambda: len(ws_upstream.closes) == 1)


async def test_a_reload_does_not_wait_for_open_websockets(
    ws_upstream: WsUpstream, start_gateway: GatewayFactory
) -> None:
    """The relay holds nothing of the policy it was admitted under: the old runtime retires
    (its pools closed) while the WebSocket goes on."""
    from gateway.engine.preflight import parse_and_build

    gw = await _gateway(start_gateway, ws_upstream.url)
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.ws_connect(gw.url + "/ws") as ws,
    ):
        await ws.send_str("before")
        assert await ws.receive_str() == "before"
        old = gw.gateway.handler.runtime
        gw.gateway.apply(parse_and_build(policy_for(ws_upstream.url) + "# changed\n", "test.yaml"))
        assert gw.gateway.handler.runtime is not old
        await wait_until(lambda: not gw.gateway._retired)
        assert old.inflight == 0
        await ws.send_str("after")
        assert await ws.receive_str() == "after"
    await wait_until(lambda: gw.gateway.server.upgrades.open == 0)
    assert old.inflight == 0


async def test_bytes_sent_in_the_same_packet_as_the_101_reach_the_client(
    start_gateway: GatewayFactory,
) -> None:
    """An upstream that writes its first frame in the same packet as its 101 (read with the
    head, before the relay exists), then half-closes at once: the bytes and the end of stream
    reach the client, and the client can still answer."""

    replies: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"\r\nfirst"
        )
        writer.write_eof()
        try:
            replies.append(await reader.read())
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        gw = await _gateway(start_gateway, url)
        reader, writer, head = await _handshake(gw.port)
        assert head.startswith(b"HTTP/1.1 101 ")
        async with asyncio.timeout(5):
            assert await reader.read() == b"first"  # then the end of stream
        writer.write(b"reply")
        writer.write_eof()
        await wait_until(lambda: gw.gateway.server.upgrades.open == 0)
        assert replies == [b"reply"]
        writer.close()


async def test_a_protocol_the_policy_lists_is_relayed_and_a_101_to_another_is_refused(
    start_gateway: GatewayFactory,
) -> None:
    async def shout(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write((await reader.read()).upper())
        await writer.drain()

    server = "  upgrade_protocols: [websocket, X-Tunnel]\n"
    tunnel, tunnel_url = await _raw_upstream(shout, protocol=b"x-tunnel")
    liar, liar_url = await _raw_upstream(shout, protocol=b"websocket")
    async with tunnel, liar:
        gw = await _gateway(start_gateway, tunnel_url, server=server)
        reader, writer, head = await _handshake(gw.port, b"x-tunnel")
        assert head.startswith(b"HTTP/1.1 101 ") and b"\r\nUpgrade: x-tunnel\r\n" in head
        writer.write(b"quiet")
        writer.write_eof()
        async with asyncio.timeout(5):
            assert await reader.read() == b"QUIET"
        writer.close()
        # An upstream that switches to a protocol other than the one asked for is not tunnelled.
        gw = await _gateway(start_gateway, liar_url, server=server)
        reader, writer, head = await _handshake(gw.port, b"x-tunnel")
        assert status_of(head) == 502
        writer.close()
