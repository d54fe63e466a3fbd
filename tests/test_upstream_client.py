"""The upstream client against real servers on loopback.

Normal behaviour runs against a real aiohttp application; hostile and edge-case responses come
from raw asyncio socket servers that send exactly the bytes each test means.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import ssl
import subprocess
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.edge.upstream_client import (
    UpstreamClosed,
    UpstreamConnectError,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeout,
)
from tests.support.waiting import wait_until

HELLO = b"hello from upstream " * 5  # 100 bytes
MIB = 1024 * 1024
PIECES = (b"first piece;", b"second piece;", b"third and last piece")


def get(path: str, extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: upstream.test\r\n" + extra + b"\r\n"


def head_of(method: str, path: str, extra: bytes = b"") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: upstream.test\r\n".encode() + extra + b"\r\n"


async def read_all(response: UpstreamResponse) -> bytes:
    if response.body_complete:
        return response.body_bytes()
    return b"".join([chunk async for chunk in response.iter_chunks()])


def header(response: UpstreamResponse, name: bytes) -> bytes | None:
    for key, value in response.headers:
        if key.lower() == name.lower():
            return value
    return None


# -- a real aiohttp upstream ----------------------------------------------------------------------


@dataclass(repr=False)
class Recorder:
    """What reached the aiohttp upstream, and on which connection."""

    conn_ids: dict[Any, int] = field(default_factory=dict)
    paths: list[str] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0
    hang_started: asyncio.Event = field(default_factory=asyncio.Event)
    hang_cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def connections(self) -> int:
        return len(self.conn_ids)


REC = web.AppKey("rec", Recorder)


@web.middleware
async def _record(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    rec = request.app[REC]
    rec.conn_ids.setdefault(request.transport, len(rec.conn_ids))
    rec.paths.append(request.path_qs)
    rec.in_flight += 1
    rec.peak_in_flight = max(rec.peak_in_flight, rec.in_flight)
    try:
        response = await handler(request)
    finally:
        rec.in_flight -= 1
    if not response.prepared:
        response.headers["X-Conn"] = str(rec.conn_ids[request.transport])
    return response


async def _hello(request: web.Request) -> web.StreamResponse:
    return web.Response(body=HELLO, content_type="text/plain")


async def _sized(request: web.Request) -> web.StreamResponse:
    return web.Response(body=b"a" * int(request.match_info["n"]))


async def _chunked(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    response.enable_chunked_encoding()
    await response.prepare(request)
    for piece in PIECES:
        await response.write(piece)
        await asyncio.sleep(0.005)
    await response.write_eof()
    return response


def _block(index: int) -> bytes:
    return bytes([index % 251]) * MIB


async def _stream(request: web.Request) -> web.StreamResponse:
    mib = int(request.match_info["mib"])
    response = web.StreamResponse()
    response.content_length = mib * MIB
    await response.prepare(request)
    for index in range(mib):
        await response.write(_block(index))
    await response.write_eof()
    return response


async def _echo(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    return web.Response(
        body=body,
        headers={
            "X-Len": str(len(body)),
            "X-Request-Chunked": str(request.headers.get("Transfer-Encoding") == "chunked"),
        },
    )


async def _status(request: web.Request) -> web.StreamResponse:
    return web.Response(status=int(request.match_info["code"]))


async def _slow_head(request: web.Request) -> web.StreamResponse:
    await asyncio.sleep(float(request.query.get("delay", "0")))
    return web.Response(body=request.query.get("tag", "").encode())


async def _slow_body(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    response.content_length = 10
    await response.prepare(request)
    await response.write(b"12345")
    await asyncio.sleep(float(request.query.get("delay", "0")))
    await response.write(b"67890")
    await response.write_eof()
    return response


async def _hang(request: web.Request) -> web.StreamResponse:
    rec = request.app[REC]
    rec.hang_started.set()
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        rec.hang_cancelled.set()
        raise
    return web.Response()


async def _close(request: web.Request) -> web.StreamResponse:
    response = web.Response(body=HELLO)
    response.force_close()
    return response


@dataclass(repr=False)
class AiohttpUpstream:
    server: TestServer
    rec: Recorder

    @property
    def port(self) -> int:
        assert self.server.port is not None
        return self.server.port


def _app() -> web.Application:
    app = web.Application(middlewares=[_record], client_max_size=64 * MIB)
    app[REC] = Recorder()
    app.router.add_get("/hello", _hello)
    app.router.add_get("/sized/{n}", _sized)
    app.router.add_get("/chunked", _chunked)
    app.router.add_get("/stream/{mib}", _stream)
    app.router.add_route("*", "/echo", _echo)
    app.router.add_get("/status/{code}", _status)
    app.router.add_get("/slow-head", _slow_head)
    app.router.add_get("/slow-body", _slow_body)
    app.router.add_get("/hang", _hang)
    app.router.add_get("/close", _close)
    return app


@pytest.fixture
async def aio_upstream() -> AsyncIterator[AiohttpUpstream]:
    app = _app()
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield AiohttpUpstream(server, app[REC])
    await server.close()


PoolFactory = Callable[..., UpstreamPool]


@pytest.fixture
async def make_pool() -> AsyncIterator[PoolFactory]:
    pools: list[UpstreamPool] = []

    def make(port: int, **kwargs: Any) -> UpstreamPool:
        # Short enough that a regression fails fast rather than hanging a minute.
        kwargs.setdefault("read_timeout_s", 5.0)
        kwargs.setdefault("connect_timeout_s", 5.0)
        pool = UpstreamPool("127.0.0.1", port, **kwargs)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        await pool.close()
        assert pool.open_connections == 0


# -- raw socket upstreams -------------------------------------------------------------------------

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "RawUpstream"], Awaitable[None]]


class RawUpstream:
    """A real TCP server on loopback whose replies are scripted byte for byte."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.closed_connections = 0
        self.requests: list[bytes] = []
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> RawUpstream:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            await self.script(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # torn down by close(); ending quietly keeps asyncio from logging it
        finally:
            self.closed_connections += 1
            writer.close()
            self._tasks.discard(task)

    async def close_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        await self.close_tasks()
        await self._server.wait_closed()


@pytest.fixture
async def raw_upstream() -> AsyncIterator[Callable[[Script], Awaitable[RawUpstream]]]:
    started: list[RawUpstream] = []

    async def start(script: Script) -> RawUpstream:
        server = await RawUpstream(script).start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request as our client frames it (test bodies never contain the chunked terminator)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lowered = head.lower()
    if b"transfer-encoding: chunked" in lowered:
        return head + await reader.readuntil(b"0\r\n\r\n")
    for line in lowered.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return head + await reader.readexactly(int(line.split(b":")[1]))
    return head


def replying(*parts: bytes, then_close: bool = False, pause_s: float = 0.0) -> Script:
    """A script answering every request with ``parts`` (written separately, ``pause_s`` apart)."""

    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: RawUpstream
    ) -> None:
        while (request := await read_request(reader)) is not None:
            up.requests.append(request)
            for part in parts:
                writer.write(part)
                await writer.drain()
                if pause_s:
                    await asyncio.sleep(pause_s)
            if then_close:
                return

    return script


OK_RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"


# -- keep-alive pool ------------------------------------------------------------------------------


async def test_sequential_requests_reuse_one_connection(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port)
    for _ in range(20):
        response = await pool.request(get("/hello"), None, body_chunked=False)
        assert response.status == 200
        assert response.reason == b"OK"
        assert response.version == (1, 1)
        assert response.keep_alive
        assert response.content_length == len(HELLO)
        assert response.body_complete
        assert response.body_bytes() == HELLO
        response.release()
    assert aio_upstream.rec.connections == 1
    assert pool.open_connections == 1
    assert pool.idle_connections == 1


async def test_headers_raw_in_order_with_repeats(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory
) -> None:
    up = await raw_upstream(
        replying(
            b"HTTP/1.1 201 Created Here\r\nSet-Cookie: a=1\r\nX-Mixed-Case: V\r\n"
            b"Set-Cookie: b=2\r\nContent-Length: 2\r\n\r\nok"
        )
    )
    pool = make_pool(up.port)
    response = await pool.request(get("/"))
    assert response.status == 201
    assert response.reason == b"Created Here"
    assert response.headers == [
        (b"Set-Cookie", b"a=1"),
        (b"X-Mixed-Case", b"V"),
        (b"Set-Cookie", b"b=2"),
        (b"Content-Length", b"2"),
    ]
    assert await read_all(response) == b"ok"
    response.release()


async def test_concurrency_bounded_by_max_connections(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port, max_connections=4)

    async def one(index: int) -> bytes:
        response = await pool.request(get(f"/slow-head?delay=0.02&tag={index}"))
        body = await read_all(response)
        response.release()
        return body

    bodies = await asyncio.gather(*(one(index) for index in range(24)))
    assert bodies == [str(index).encode() for index in range(24)]
    assert aio_upstream.rec.connections == 4
    assert aio_upstream.rec.peak_in_flight == 4
    assert pool.open_connections == 4


async def test_waiters_are_served_in_arrival_order(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port, max_connections=1)

    async def one(tag: str, delay: float) -> None:
        response = await pool.request(get(f"/slow-head?delay={delay}&tag={tag}"))
        assert await read_all(response) == tag.encode()
        response.release()

    tasks = [asyncio.create_task(one("a", 0.1))]
    for tag in "bcde":
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(one(tag, 0)))
    await asyncio.gather(*tasks)
    tags = [path.rsplit("=", 1)[1] for path in aio_upstream.rec.paths]
    assert tags == list("abcde")
    assert aio_upstream.rec.connections == 1


async def test_idle_connections_are_reused_last_in_first_out(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port)
    responses = await asyncio.gather(
        *(pool.request(get("/slow-head?delay=0.05")) for _ in range(3))
    )
    conn_ids = [header(response, b"X-Conn") for response in responses]
    assert len(set(conn_ids)) == 3
    for response in responses:  # released in order: the last one is the warmest
        response.release()
    for _ in range(3):
        again = await pool.request(get("/hello"))
        assert header(again, b"X-Conn") == conn_ids[-1]
        again.release()


async def test_idle_connections_close_after_idle_timeout(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port, idle_timeout_s=0.2)
    response = await pool.request(get("/hello"))
    response.release()
    assert pool.idle_connections == 1
    started = time.monotonic()
    await wait_until(lambda: pool.open_connections == 0)
    assert 0.15 < time.monotonic() - started < 2.0
    response = await pool.request(get("/hello"))
    assert response.body_bytes() == HELLO
    response.release()
    assert aio_upstream.rec.connections == 2


async def test_idle_timeout_does_not_cut_a_busy_connection(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port, idle_timeout_s=0.1, read_timeout_s=5)
    response = await pool.request(get("/hello"))
    response.release()
    response = await pool.request(get("/slow-head?delay=0.3&tag=x"))
    assert response.body_bytes() == b"x"
    response.release()
    assert aio_upstream.rec.connections == 1


async def test_at_most_max_idle_connections_are_kept(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port, max_idle=1)
    responses = await asyncio.gather(
        *(pool.request(get("/slow-head?delay=0.05")) for _ in range(3))
    )
    for response in responses:
        response.release()
    await wait_until(lambda: pool.open_connections == 1)
    assert pool.idle_connections == 1


async def test_partly_read_response_discards_its_connection(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port)
    response = await pool.request(get("/stream/4"))
    assert not response.body_complete
    assert await response.read_chunk()
    response.release()
    await wait_until(lambda: pool.open_connections == 0)
    response = await pool.request(get("/hello"))
    assert response.body_bytes() == HELLO
    response.release()
    assert aio_upstream.rec.connections == 2


async def test_connection_close_response_is_not_reused(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port)
    for _ in range(2):
        response = await pool.request(get("/close"))
        assert not response.keep_alive
        assert await read_all(response) == HELLO
        response.release()
    assert aio_upstream.rec.connections == 2


@pytest.mark.parametrize("ending", ["idle timeout", "Connection: close"])
async def test_an_ended_connection_is_freed_at_once_not_left_to_the_collector(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory, ending: str
) -> None:
    """A connection that ends (its idle timeout, the upstream's close) is freed by reference
    counting. Its parser held its callbacks, bound to it: a cycle, freed only by
    a collection, which a serving worker runs after 100,000 net allocations (heap.py): under
    steady load, every half hour or so. Meanwhile each closed connection was kept, with its
    parser (about 20 every 45 s in the memory soak)."""
    gc.disable()
    try:
        gc.collect()
        pool = make_pool(aio_upstream.port, idle_timeout_s=0.05)
        response = await pool.request(get("/close" if ending != "idle timeout" else "/hello"))
        assert await read_all(response) == HELLO
        response.release()
        await wait_until(lambda: pool.open_connections == 0)
        for _ in range(3):  # the transport's last callbacks
            await asyncio.sleep(0.01)
        alive = [o for o in gc.get_objects() if type(o).__name__ == "_Connection"]
        assert alive == [], f"{len(alive)} ended connection(s) waiting for the collector"
    finally:
        gc.enable()


async def test_close_refuses_new_requests(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port)
    response = await pool.request(get("/hello"))
    response.release()
    await pool.close()
    assert pool.open_connections == 0
    with pytest.raises(UpstreamClosed):
        await pool.request(get("/hello"))


def test_pool_can_be_built_before_the_event_loop_runs() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        pool = UpstreamPool("127.0.0.1", listener.getsockname()[1])

        async def use() -> bytes:
            up = RawUpstream(replying(OK_RESPONSE))
            server = await asyncio.start_server(up._handle, sock=listener)
            try:
                return await _fetch(pool)
            finally:
                await pool.close()
                server.close()
                await up.close_tasks()

        assert asyncio.run(use()) == b"hello"


# -- bodies both ways -----------------------------------------------------------------------------


async def test_chunked_download(aio_upstream: AiohttpUpstream, make_pool: PoolFactory) -> None:
    pool = make_pool(aio_upstream.port)
    for _ in range(2):
        response = await pool.request(get("/chunked"))
        assert response.chunked
        assert response.content_length is None
        assert await read_all(response) == b"".join(PIECES)
        response.release()
    assert aio_upstream.rec.connections == 1


async def test_chunked_upload_streamed(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port)
    pieces = [b"x" * 1000, b"", b"y" * 70_000, b"z"]

    async def body() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece

    head = head_of("POST", "/echo", b"Transfer-Encoding: chunked\r\n")
    for _ in range(2):  # the connection stays usable after a chunked upload
        response = await pool.request(head, body(), body_chunked=True)
        assert header(response, b"X-Request-Chunked") == b"True"
        assert await read_all(response) == b"".join(pieces)
        response.release()
    assert aio_upstream.rec.connections == 1


@pytest.mark.parametrize("size", [0, 10, 200_000])
async def test_bytes_body_chunked_and_sized(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory, size: int
) -> None:
    pool = make_pool(aio_upstream.port)
    payload = bytes(range(256)) * (size // 256) + b"q" * (size % 256)
    chunked = head_of("POST", "/echo", b"Transfer-Encoding: chunked\r\n")
    response = await pool.request(chunked, payload, body_chunked=True)
    assert await read_all(response) == payload
    response.release()
    sized = head_of("PUT", "/echo", b"Content-Length: %d\r\n" % size)
    response = await pool.request(sized, payload, body_chunked=False)
    assert header(response, b"X-Len") == str(size).encode()
    assert await read_all(response) == payload
    response.release()
    assert aio_upstream.rec.connections == 1


async def test_streamed_upload_with_content_length(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port)

    async def body() -> AsyncIterator[bytes]:
        for index in range(8):
            yield _block(index)

    head = head_of("POST", "/echo", b"Content-Length: %d\r\n" % (8 * MIB))
    response = await pool.request(head, body(), body_chunked=False)
    echoed = await read_all(response)
    response.release()
    assert echoed == b"".join(_block(index) for index in range(8))


@pytest.mark.reliability
async def test_200_mib_download_through_a_slow_reader_keeps_memory_bounded(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port)
    expected_crc = 0
    for index in range(200):
        expected_crc = zlib.crc32(_block(index), expected_crc)
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        response = await pool.request(get("/stream/200"))
        assert response.content_length == 200 * MIB
        await asyncio.sleep(0.3)  # the upstream sends as fast as we let it meanwhile
        received = crc = reads = 0
        while chunk := await response.read_chunk():
            received += len(chunk)
            crc = zlib.crc32(chunk, crc)
            reads += 1
            if reads % 8 == 0:
                await asyncio.sleep(0.001)
        peak_growth = tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()
    response.release()
    assert received == 200 * MIB
    assert crc == expected_crc
    assert peak_growth < 12 * MIB, f"peak grew by {peak_growth / MIB:.1f} MiB"


async def test_streamed_upload_waits_for_the_upstream_to_drain(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory
) -> None:
    stalled = asyncio.Event()

    async def slow_reader(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: RawUpstream
    ) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(0.5)  # reads nothing for a while
        stalled.set()
        received = 0
        while received < 64 * MIB:
            received += len(await reader.read(MIB))
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%d" % (len(str(received)), received)
        )
        await writer.drain()
        await reader.read()

    up = await raw_upstream(slow_reader)
    pool = make_pool(up.port)
    yielded = 0
    yielded_while_stalled = -1

    async def body() -> AsyncIterator[bytes]:
        nonlocal yielded, yielded_while_stalled
        for index in range(64):
            if stalled.is_set() and yielded_while_stalled < 0:
                yielded_while_stalled = yielded
            yielded += MIB
            yield _block(index)

    head = head_of("POST", "/up", b"Content-Length: %d\r\n" % (64 * MIB))
    response = await pool.request(head, body(), body_chunked=False)
    assert await read_all(response) == str(64 * MIB).encode()
    response.release()
    # Without waiting on drain all 64 MiB would have been queued before the upstream read.
    assert 0 < yielded_while_stalled < 24 * MIB


async def test_upstream_answering_before_the_body_is_sent_stops_the_upload(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory
) -> None:
    async def refuse_early(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: RawUpstream
    ) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 4\r\n\r\nnope")
        await writer.drain()
        await asyncio.sleep(5)  # keeps the connection open and reads no more

    up = await raw_upstream(refuse_early)
    pool = make_pool(up.port, read_timeout_s=10)
    sent = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal sent
        for index in range(200):
            sent += 1
            yield _block(index)

    head = head_of("POST", "/up", b"Content-Length: %d\r\n" % (200 * MIB))
    started = time.monotonic()
    response = await pool.request(head, body(), body_chunked=False)
    assert response.status == 413
    assert await read_all(response) == b"nope"
    response.release()
    assert time.monotonic() - started < 3
    assert sent < 200
    await wait_until(lambda: pool.open_connections == 0)  # its framing is off: never reused


async def test_body_iterator_error_propagates_and_cuts_the_connection(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    class ClientWentAway(Exception):
        pass

    async def body() -> AsyncIterator[bytes]:
        yield b"partial"
        raise ClientWentAway

    pool = make_pool(aio_upstream.port)
    head = head_of("POST", "/echo", b"Transfer-Encoding: chunked\r\n")
    with pytest.raises(ClientWentAway):
        await pool.request(head, body(), body_chunked=True)
    await wait_until(lambda: pool.open_connections == 0)


# -- bodiless responses, interim responses, read-until-close --------------------------------------


async def test_head_response_has_no_body_and_connection_is_reused(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port)
    response = await pool.request(head_of("HEAD", "/sized/5000"), expect_no_body=True)
    assert response.status == 200
    assert response.content_length == 5000
    assert response.body_complete
    assert response.body_bytes() == b""
    response.release()
    response = await pool.request(get("/sized/7"))
    assert response.body_bytes() == b"aaaaaaa"
    response.release()
    assert aio_upstream.rec.connections == 1


async def test_head_response_followed_by_a_body_is_not_reused(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory
) -> None:
    up = await raw_upstream(
        replying(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", b"hello", pause_s=0.05)
    )
    pool = make_pool(up.port)
    response = await pool.request(head_of("HEAD", "/"), expect_no_body=True)
    assert response.body_bytes() == b""
    response.release()
    await wait_until(lambda: pool.open_connections == 0)
    response = await pool.request(head_of("HEAD", "/"), expect_no_body=True)
    assert response.status == 200
    response.release()
    assert up.connections == 2


@pytest.mark.parametrize("code", [204, 304])
async def test_no_body_statuses(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory, code: int
) -> None:
    pool = make_pool(aio_upstream.port)
    for _ in range(2):
        response = await pool.request(get(f"/status/{code}"))
        assert response.status == code
        assert response.body_complete
        assert response.body_bytes() == b""
        response.release()
    assert aio_upstream.rec.connections == 1


async def test_304_with_content_length_has_no_body(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory
) -> None:
    up = await raw_upstream(replying(b"HTTP/1.1 304 Not Modified\r\nContent-Length: 99\r\n\r\n"))
    pool = make_pool(up.port)
    for _ in range(2):
        response = await pool.request(get("/"))
        assert response.status == 304
        assert response.content_length == 99
        assert response.body_bytes() == b""
        response.release()
    assert up.connections == 1


async def test_expect_100_continue_from_aiohttp_is_skipped(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port)
    head = head_of("POST", "/echo", b"Expect: 100-continue\r\nContent-Length: 4\r\n")
    response = await pool.request(head, b"data")
    assert response.status == 200
    assert await read_all(response) == b"data"
    response.release()


async def test_interim_responses_are_skipped(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory
) -> None:
    up = await raw_upstream(
        replying(
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
        )
    )
    pool = make_pool(up.port)
    for _ in range(2):
        response = await pool.request(get("/"))
        assert response.status == 200
        assert response.reason == b"OK"
        assert response.headers == [(b"Content-Length", b"5")]
        assert await read_all(response) == b"hello"
        response.release()
    assert up.connections == 1


async def test_body_delimited_by_close(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory
) -> None:
    up = await raw_upstream(
        replying(b"HTTP/1.0 200 OK\r\n\r\nuntil ", b"the end", pause_s=0.02, then_close=True)
    )
    pool = make_pool(up.port)
    response = await pool.request(get("/"))
    assert response.version == (1, 0)
    assert not response.keep_alive
    assert response.content_length is None and not response.chunked
    assert await read_all(response) == b"until the end"
    response.release()


async def test_response_split_at_every_byte_parses_the_same(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory
) -> None:
    wire = (
        b"HTTP/1.1 200 Fine\r\nTransfer-Encoding: chunked\r\nX-A: b\r\n\r\n"
        b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    split_at = [0]

    async def split(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: RawUpstream
    ) -> None:
        while await read_request(reader) is not None:
            writer.write(wire[: split_at[0]])
            await writer.drain()
            await asyncio.sleep(0.002)
            writer.write(wire[split_at[0] :])
            await writer.drain()

    up = await raw_upstream(split)
    pool = make_pool(up.port)
    for position in range(1, len(wire)):
        split_at[0] = position
        response = await pool.request(get("/"))
        assert response.status == 200
        assert response.reason == b"Fine"
        assert response.headers == [(b"Transfer-Encoding", b"chunked"), (b"X-A", b"b")]
        assert await read_all(response) == b"hello, world"
        response.release()
    assert up.connections == 1


# -- timeouts, refusal, cancellation --------------------------------------------------------------


@pytest.mark.reliability
async def test_connect_refused_on_a_closed_port(make_pool: PoolFactory) -> None:
    with socket.socket() as bound_not_listening:
        bound_not_listening.bind(("127.0.0.1", 0))
        pool = make_pool(bound_not_listening.getsockname()[1])
        with pytest.raises(UpstreamConnectError):
            await pool.request(get("/"))
    assert pool.open_connections == 0


@pytest.mark.reliability
async def test_connect_timeout(make_pool: PoolFactory) -> None:
    # A listener whose accept queue is full drops further SYNs: the connect hangs.
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filler.connect(listener.getsockname())
        pool = make_pool(listener.getsockname()[1], connect_timeout_s=0.3)
        started = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            await pool.request(get("/"))
        assert 0.25 < time.monotonic() - started < 2.0


async def test_waiting_for_a_free_connection_counts_against_connect_timeout(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port, max_connections=1, connect_timeout_s=0.3)
    busy = asyncio.create_task(pool.request(get("/hang")))
    await aio_upstream.rec.hang_started.wait()
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout):
        await pool.request(get("/hello"))
    assert 0.25 < time.monotonic() - started < 2.0
    busy.cancel()
    with pytest.raises(asyncio.CancelledError):
        await busy
    response = await pool.request(get("/hello"))  # the slot came back
    assert response.body_bytes() == HELLO
    response.release()


async def test_read_timeout_waiting_for_the_head(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port, read_timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout):
        await pool.request(get("/slow-head?delay=5"))
    assert 0.25 < time.monotonic() - started < 2.0
    await wait_until(lambda: pool.open_connections == 0)


@pytest.mark.reliability
async def test_read_timeout_between_body_chunks(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port, read_timeout_s=0.3)
    response = await pool.request(get("/slow-body?delay=5"))
    assert await response.read_chunk() == b"12345"
    with pytest.raises(UpstreamTimeout):
        await response.read_chunk()
    response.release()
    await wait_until(lambda: pool.open_connections == 0)


async def test_a_slow_consumer_is_not_a_read_timeout(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port, read_timeout_s=0.2)
    response = await pool.request(get("/stream/1"))
    await asyncio.sleep(0.5)  # the body sits buffered; the upstream did its part
    assert len(await read_all(response)) == MIB
    response.release()
    assert pool.idle_connections == 1


async def test_cancelling_the_request_closes_the_upstream_connection(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port)
    task = asyncio.create_task(pool.request(get("/hang")))
    await aio_upstream.rec.hang_started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(aio_upstream.rec.hang_cancelled.wait(), 3)
    await wait_until(lambda: pool.open_connections == 0)


async def test_cancelling_a_body_read_closes_the_upstream_connection(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port)
    response = await pool.request(get("/slow-body?delay=5"))
    assert await response.read_chunk() == b"12345"
    reading = asyncio.create_task(response.read_chunk())
    await asyncio.sleep(0.05)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    await wait_until(lambda: pool.open_connections == 0)
    response.release()
    assert pool.open_connections == 0


async def test_cancelling_a_queued_request_gives_its_turn_away(
    aio_upstream: AiohttpUpstream, make_pool: PoolFactory
) -> None:
    pool = make_pool(aio_upstream.port, max_connections=1)
    first = await pool.request(get("/hello"))
    queued = asyncio.create_task(pool.request(get("/hello")))
    await asyncio.sleep(0.05)
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    first.release()
    response = await pool.request(get("/hello"))
    assert response.body_bytes() == HELLO
    response.release()
    assert aio_upstream.rec.connections == 1


# -- stale pooled connections ---------------------------------------------------------------------


def closing_second_request_silently() -> Script:
    """Answers the first request on each connection, then closes at the second: an idle close."""

    async def script(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: RawUpstream
    ) -> None:
        request = await read_request(reader)
        if request is None:
            return
        up.requests.append(request)
        writer.write(OK_RESPONSE)
        await writer.drain()
        request = await read_request(reader)
        if request is not None:
            up.requests.append(request)

    return script


async def test_stale_connection_retried_for_idempotent_replayable_request(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory
) -> None:
    up = await raw_upstream(closing_second_request_silently())
    pool = make_pool(up.port)
    for _ in range(2):
        response = await pool.request(get("/"))
        assert response.body_bytes() == b"hello"
        response.release()
    assert len(up.requests) == 3
    assert up.connections == 2


@pytest.mark.parametrize("method", ["POST", "PATCH"])
async def test_stale_connection_not_retried_for_non_idempotent_method(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory, method: str
) -> None:
    up = await raw_upstream(closing_second_request_silently())
    pool = make_pool(up.port)
    head = head_of(method, "/", b"Content-Length: 2\r\n")
    response = await pool.request(head, b"hi")
    response.release()
    with pytest.raises(UpstreamClosed):
        await pool.request(head, b"hi")
    assert len(up.requests) == 2
    assert up.connections == 1


async def test_stale_connection_not_retried_for_streamed_body(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory
) -> None:
    up = await raw_upstream(closing_second_request_silently())
    pool = make_pool(up.port)

    async def body() -> AsyncIterator[bytes]:
        yield b"hi"

    head = head_of("PUT", "/", b"Transfer-Encoding: chunked\r\n")
    response = await pool.request(head, body(), body_chunked=True)
    response.release()
    with pytest.raises(UpstreamClosed):
        await pool.request(head, body(), body_chunked=True)
    assert up.connections == 1


async def test_fresh_connection_closed_without_answer_is_not_retried(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory
) -> None:
    async def hang_up(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: RawUpstream
    ) -> None:
        request = await read_request(reader)
        assert request is not None
        up.requests.append(request)

    up = await raw_upstream(hang_up)
    pool = make_pool(up.port)
    with pytest.raises(UpstreamClosed):
        await pool.request(get("/"))
    assert up.connections == 1


# -- hostile upstreams ----------------------------------------------------------------------------

HOSTILE_HEADS = {
    "duplicate Content-Length": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n"
    b"\r\nhello",
    "conflicting Content-Length": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n"
    b"\r\nhello!",
    "Content-Length list": b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\nhello",
    "negative Content-Length": b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\nhello",
    "Content-Length overflow": b"HTTP/1.1 200 OK\r\n"
    b"Content-Length: 99999999999999999999999\r\n\r\n",
    "Content-Length then chunked": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "chunked then Content-Length": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
    b"Content-Length: 5\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "Transfer-Encoding gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nxxxxx",
    "Transfer-Encoding gzip, chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n"
    b"\r\n5\r\nhello\r\n0\r\n\r\n",
    "Transfer-Encoding twice": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "status out of range": b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n",
    "status 600": b"HTTP/1.1 600 Odd\r\nContent-Length: 0\r\n\r\n",
    "status 099": b"HTTP/1.1 099 Odd\r\nContent-Length: 0\r\n\r\n",
    "not HTTP": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "HTTP/2.0 status line": b"HTTP/2.0 200 OK\r\nContent-Length: 0\r\n\r\n",
    "bare LF line ends": b"HTTP/1.1 200 OK\nContent-Length: 5\n\nhello",
    "obs-fold": b"HTTP/1.1 200 OK\r\nX-A: one\r\n two\r\nContent-Length: 0\r\n\r\n",
    "NUL in header value": b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 0\r\n\r\n",
    "space before colon": b"HTTP/1.1 200 OK\r\nContent-Length : 5\r\n\r\nhello",
    "101 Switching Protocols": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
    b"Connection: Upgrade\r\n\r\n",
    # llhttp would read "hello" as the 199's body and hand it on as the 200's.
    "1xx with a body length": b"HTTP/1.1 199 Odd\r\nContent-Length: 5\r\n\r\nhello"
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "oversized head": b"HTTP/1.1 200 OK\r\n" + b"X-Filler: " + b"f" * 70_000 + b"\r\n"
    b"Content-Length: 0\r\n\r\n",
    "many headers": b"HTTP/1.1 200 OK\r\n" + b"X-F: 0123456789\r\n" * 4000 + b"\r\n",
}

HOSTILE_BODIES = {
    "invalid chunk size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n",
    "chunk size overflow": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"ffffffffffffffffff\r\nhello\r\n",
    "chunk size with 0x": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n",
    "chunk data too long": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"2\r\nhello\r\n0\r\n\r\n",
    "negative chunk size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n",
}


async def _fetch(pool: UpstreamPool, path: str = "/") -> bytes:
    response = await pool.request(get(path))
    try:
        return await read_all(response)
    finally:
        response.release()


@pytest.mark.reliability
@pytest.mark.parametrize("wire", HOSTILE_HEADS.values(), ids=HOSTILE_HEADS.keys())
@pytest.mark.parametrize("split", [False, True], ids=["one-write", "byte-pieces"])
async def test_hostile_head_is_a_protocol_error_and_never_reused(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]],
    make_pool: PoolFactory,
    wire: bytes,
    split: bool,
) -> None:
    if split and len(wire) > 200:
        # Trickle the head: the limit must hold when it never arrives in one piece.
        parts = tuple(wire[i : i + 997] for i in range(0, len(wire), 997))
    elif split:
        parts = tuple(wire[i : i + 1] for i in range(len(wire)))
    else:
        parts = (wire,)
    up = await raw_upstream(replying(*parts))
    pool = make_pool(up.port)
    with pytest.raises(UpstreamProtocolError):
        await _fetch(pool)
    await wait_until(lambda: pool.open_connections == 0)


@pytest.mark.reliability
@pytest.mark.parametrize("wire", HOSTILE_BODIES.values(), ids=HOSTILE_BODIES.keys())
async def test_hostile_body_is_a_protocol_error_and_never_reused(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory, wire: bytes
) -> None:
    head, _, body = wire.partition(b"\r\n\r\n")
    up = await raw_upstream(replying(head + b"\r\n\r\n", body, pause_s=0.02))
    pool = make_pool(up.port)
    response = await pool.request(get("/"))
    with pytest.raises(UpstreamProtocolError):
        await read_all(response)
    response.release()
    await wait_until(lambda: pool.open_connections == 0)


@pytest.mark.parametrize(
    "parts",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", b"only ten b"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"a\r\nonly ten b\r\n"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"a\r\nonly ten b\r\n0\r\n"),
    ],
    ids=["content-length", "chunked", "chunked-no-final-crlf"],
)
@pytest.mark.reliability
async def test_early_close_mid_body_is_told_apart_from_the_end(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]],
    make_pool: PoolFactory,
    parts: tuple[bytes, ...],
) -> None:
    up = await raw_upstream(replying(*parts, pause_s=0.02, then_close=True))
    pool = make_pool(up.port)
    response = await pool.request(get("/"))
    assert not response.body_complete
    received = b""
    with pytest.raises(UpstreamClosed):
        while chunk := await response.read_chunk():
            received += chunk
    assert received == b"only ten b"
    response.release()
    assert pool.open_connections == 0


@pytest.mark.reliability
async def test_endless_header_line_hits_the_head_limit(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory
) -> None:
    async def endless(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: RawUpstream
    ) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Endless: ")
        for _ in range(1000):
            writer.write(b"e" * 1000)
            await writer.drain()
            await asyncio.sleep(0.001)

    up = await raw_upstream(endless)
    pool = make_pool(up.port, max_response_head_bytes=16 * 1024)
    started = time.monotonic()
    with pytest.raises(UpstreamProtocolError):
        await pool.request(get("/"))
    assert time.monotonic() - started < 2.0
    await wait_until(lambda: pool.open_connections == 0)


async def test_head_under_the_limit_in_pieces_is_accepted(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory
) -> None:
    wire = b"HTTP/1.1 200 OK\r\nX-Filler: " + b"f" * 48_000 + b"\r\nContent-Length: 2\r\n\r\nok"
    up = await raw_upstream(replying(wire[:24_000], wire[24_000:], pause_s=0.02))
    pool = make_pool(up.port, max_response_head_bytes=64 * 1024)
    assert await _fetch(pool) == b"ok"


async def test_close_before_the_head_ends(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory
) -> None:
    up = await raw_upstream(replying(b"HTTP/1.1 200 OK\r\nContent-Len", then_close=True))
    pool = make_pool(up.port)
    with pytest.raises(UpstreamClosed):
        await pool.request(get("/"))
    assert pool.open_connections == 0


async def test_bytes_after_the_response_discard_the_connection_not_the_response(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory
) -> None:
    smuggled = b"HTTP/1.1 302 Found\r\nLocation: /evil\r\nContent-Length: 8\r\n\r\nsmuggled"
    up = await raw_upstream(replying(OK_RESPONSE + smuggled))
    pool = make_pool(up.port)
    for _ in range(2):
        response = await pool.request(get("/"))
        assert response.status == 200
        assert response.reason == b"OK"
        assert response.headers == [(b"Content-Length", b"5")]
        assert await read_all(response) == b"hello"
        response.release()
    assert up.connections == 2  # the smuggled response was never read as the next answer


async def test_unsolicited_bytes_on_an_idle_connection_discard_it(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory
) -> None:
    up = await raw_upstream(replying(OK_RESPONSE, b"HTTP/1.1 200 OK\r\n", pause_s=0.05))
    pool = make_pool(up.port)
    assert await _fetch(pool) == b"hello"
    await wait_until(lambda: pool.open_connections == 0)
    assert await _fetch(pool) == b"hello"
    assert up.connections == 2


async def test_trailers_are_not_headers(
    raw_upstream: Callable[[Script], Awaitable[RawUpstream]], make_pool: PoolFactory
) -> None:
    up = await raw_upstream(
        replying(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n0\r\nX-Checksum: abc\r\n\r\n"
        )
    )
    pool = make_pool(up.port)
    response = await pool.request(get("/"))
    assert await read_all(response) == b"hello"
    assert response.headers == [(b"Transfer-Encoding", b"chunked")]
    response.release()
    assert pool.idle_connections == 1


# -- uvloop, which the gateway runs on --------------------------------------------------------


def test_core_behaviour_under_uvloop() -> None:
    """uvloop's transports differ from asyncio's (types, buffering, pause/resume): run the
    main paths on it too."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        app = _app()
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        hostile = await RawUpstream(replying(HOSTILE_HEADS["Content-Length then chunked"])).start()
        assert server.port is not None
        pool = UpstreamPool("127.0.0.1", server.port, read_timeout_s=0.3)
        try:
            for _ in range(5):
                assert await _fetch(pool, "/hello") == HELLO
            assert await _fetch(pool, "/chunked") == b"".join(PIECES)
            response = await pool.request(head_of("HEAD", "/sized/10"), expect_no_body=True)
            assert response.content_length == 10 and response.body_bytes() == b""
            response.release()

            async def body() -> AsyncIterator[bytes]:
                for index in range(4):
                    yield _block(index)

            head = head_of("POST", "/echo", b"Transfer-Encoding: chunked\r\n")
            response = await pool.request(head, body(), body_chunked=True)
            assert header(response, b"X-Len") == str(4 * MIB).encode()
            response.close()
            assert app[REC].connections == 1

            tracemalloc.start()
            try:
                baseline = tracemalloc.get_traced_memory()[0]
                response = await pool.request(get("/stream/32"))
                await asyncio.sleep(0.2)  # reading must pause meanwhile
                received = 0
                while chunk := await response.read_chunk():
                    received += len(chunk)
                peak_growth = tracemalloc.get_traced_memory()[1] - baseline
            finally:
                tracemalloc.stop()
            response.release()
            assert received == 32 * MIB
            assert peak_growth < 8 * MIB, f"peak grew by {peak_growth / MIB:.1f} MiB"

            with pytest.raises(UpstreamTimeout):
                await pool.request(get("/slow-head?delay=5"))
            task = asyncio.create_task(pool.request(get("/hang")))
            await app[REC].hang_started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(app[REC].hang_cancelled.wait(), 3)

            hostile_pool = UpstreamPool("127.0.0.1", hostile.port)
            with pytest.raises(UpstreamProtocolError):
                await _fetch(hostile_pool)
            await wait_until(lambda: hostile_pool.open_connections == 0)
            await hostile_pool.close()
        finally:
            await pool.close()
            await hostile.close()
            await server.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


# -- TLS ------------------------------------------------------------------------------------------


@pytest.fixture
def tls_files(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-days", "1", "-subj", "/CN=upstream.test",
            "-addext", "subjectAltName=DNS:upstream.test",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    yield cert, key


async def test_tls_upstream_with_server_hostname(
    tls_files: tuple[Path, Path], make_pool: PoolFactory
) -> None:
    cert, key = tls_files
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    app = _app()
    server = TestServer(app, host="127.0.0.1")
    await server.start_server(ssl=server_ctx)
    try:
        assert server.port is not None
        client_ctx = ssl.create_default_context(cafile=str(cert))
        pool = make_pool(server.port, ssl=client_ctx, server_hostname="upstream.test")
        for _ in range(2):
            assert await _fetch(pool, "/hello") == HELLO
        assert app[REC].connections == 1
        wrong_name = make_pool(server.port, ssl=client_ctx, server_hostname="other.test")
        with pytest.raises(UpstreamConnectError):
            await wrong_name.request(get("/hello"))
        await pool.close()
    finally:
        await server.close()
