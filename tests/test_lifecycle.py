"""Connection and process lifecycle: header deadline, connection cap, idle timeout, SIGTERM.

The per-connection protections run on an in-process gateway; everything about processes (signals,
exit codes, ``--workers``, the CLI) starts ``python -m gateway`` as a real subprocess on free
loopback ports, in front of a real aiohttp upstream served by the test's own event loop. Every
wait is bounded; every subprocess (and any worker it forked) is killed in a finalizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import zlib
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import RawTestServer

from gateway.edge.server import GatewayServer
from tests.support.gateways import GatewayFactory
from tests.support.network import TIMEOUT
from tests.support.policies import policy_for, policy_template
from tests.support.processes import StartGateway, alive, children, exit_code
from tests.support.rawhttp import status_of
from tests.support.upstreams import RecordingUpstream, SlowUpstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.reliability


# -- helpers ------------------------------------------------------------------------------------


def assert_no_errors_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Cutting a connection is routine: it must not raise in a loop callback or log errors."""
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


async def read_until_closed(reader: asyncio.StreamReader, within_s: float) -> tuple[bytes, bool]:
    """Read until the peer closes (True) or ``within_s`` passes (False)."""
    chunks: list[bytes] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while (remaining := deadline - loop.time()) > 0:
        try:
            chunk = await asyncio.wait_for(reader.read(65536), remaining)
        except TimeoutError:
            break
        except ConnectionResetError:
            return b"".join(chunks), True
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)
    return b"".join(chunks), False


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One response with a ``Content-Length`` body, read exactly (the connection stays usable)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head + await asyncio.wait_for(reader.readexactly(length), 5)


async def get_ok(url: str) -> str:
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(url) as resp,
    ):
        assert resp.status == 200, await resp.text()
        return await resp.text()


# -- slow clients and the header deadline -------------------------------------------------------


async def test_slow_clients_cut_at_header_deadline_while_others_are_served(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await start_gateway(policy_for(upstream.url, server="  header_timeout: 1s\n"))
    loop = asyncio.get_running_loop()

    async def slowloris() -> float | None:
        """Trickle header bytes 100 ms apart, never finishing: seconds until the gateway cuts."""
        started = loop.time()
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        trickle = b"GET /slow HTTP/1.1\r\nHost: h\r\nX-Padding: " + b"a" * 100
        try:
            for byte in trickle:
                writer.write(bytes([byte]))
                try:
                    data = await asyncio.wait_for(reader.read(65536), 0.1)
                except TimeoutError:
                    continue
                except ConnectionResetError:
                    data = b""
                assert data == b"", f"a slow client got an answer: {data!r}"
                return loop.time() - started
            return None  # the whole trickle went through: never cut
        finally:
            writer.close()

    async def normal_clients() -> int:
        """Well-behaved requests on fresh connections, spread over the slow clients' lifetime."""
        served = 0
        async with aiohttp.ClientSession(
            timeout=TIMEOUT, connector=aiohttp.TCPConnector(force_close=True)
        ) as session:
            for i in range(30):
                async with session.get(f"{gw.url}/normal/{i}") as resp:
                    assert resp.status == 200
                    served += 1
                await asyncio.sleep(0.05)
        return served

    slow = asyncio.gather(*(slowloris() for _ in range(5)))
    served = await normal_clients()
    for cut_after_s in await slow:
        # Deadline 1 s from connect; timers, scheduling and the 100 ms trickle add some slack.
        assert cut_after_s is not None and 0.8 <= cut_after_s <= 2.5, cut_after_s
    assert served == 30
    assert sorted(r.raw_path for r in upstream.requests) == sorted(
        f"/normal/{i}" for i in range(30)
    )
    server = gw.gateway.server
    assert server.header_timeouts >= 5
    assert_no_errors_logged(caplog)


async def test_silent_connection_closed_at_header_deadline(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await start_gateway(
        policy_for(upstream.url, server="  header_timeout: 1s\n  keepalive_timeout: 60s\n")
    )
    loop = asyncio.get_running_loop()
    started = loop.time()
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        data, closed = await read_until_closed(reader, 5.0)
    finally:
        writer.close()
    assert closed and data == b""
    assert 0.8 <= loop.time() - started <= 2.5
    assert_no_errors_logged(caplog)


async def test_a_connection_made_once_shutdown_began_is_closed_at_once() -> None:
    """aiohttp closes the idle connections it knows when shutdown begins; one whose
    ``connection_made`` comes after (accepted as the listener closed) would otherwise wait for
    a request until its header deadline, and hold the stopping worker that long."""

    async def handler(request: web.BaseRequest) -> web.Response:
        return web.Response(text="ok")

    server = GatewayServer(handler, header_timeout=30.0, max_connections=100)
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(server, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        server.pre_shutdown()  # what the runner does first on SIGTERM
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            data, closed = await read_until_closed(reader, 3.0)
        finally:
            writer.close()
        assert closed and data == b""
        assert server.open_connections == 0
    finally:
        listener.close()
        await server.shutdown(1.0)


async def test_header_deadline_applies_to_each_request_on_a_keepalive_connection(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """After one good request, a second one trickled too slowly is cut at the deadline."""
    gw = await start_gateway(
        policy_for(upstream.url, server="  header_timeout: 1s\n  keepalive_timeout: 60s\n")
    )
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(b"GET /first HTTP/1.1\r\nHost: h\r\n\r\n")
        assert status_of(await read_response(reader)) == 200
        # Idle for a while first: only the new request's bytes start its deadline.
        await asyncio.sleep(1.2)
        writer.write(b"GET /second HTTP/1.1\r\n")
        started = loop.time()
        cut = False
        for _ in range(40):
            try:
                data = await asyncio.wait_for(reader.read(65536), 0.1)
            except TimeoutError:
                writer.write(b"X")
                continue
            except ConnectionResetError:
                cut = True
                break
            assert data == b"", data
            cut = True
            break
        assert cut
        assert 0.8 <= loop.time() - started <= 2.5
    finally:
        writer.close()
    assert [r.raw_path for r in upstream.requests] == ["/first"]
    assert_no_errors_logged(caplog)


# -- connection cap and idle keep-alive ---------------------------------------------------------


async def test_connection_cap_refuses_extra_connections_with_503(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    cap = 4
    gw = await start_gateway(
        policy_for(upstream.url, server=f"  max_connections: {cap}\n  header_timeout: 30s\n")
    )
    server = gw.gateway.server
    idle = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(cap)]
    try:
        await wait_until(lambda: server.open_connections == cap, "the idle connections to register")
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            try:
                data, closed = await read_until_closed(reader, 5.0)
            finally:
                writer.close()
            assert status_of(data) == 503, data
            assert b"Connection: close" in data
            assert closed
        # The idle connections under the cap were left alone.
        assert all(not reader.at_eof() for reader, _ in idle)
        for _, writer in idle[:2]:
            writer.close()
        await wait_until(lambda: server.open_connections == cap - 2, "two connections to close")
        assert await get_ok(gw.url + "/after") == "ok GET /after"
        # A connection under the cap still works too.
        reader, writer = idle[2]
        writer.write(b"GET /idle-one HTTP/1.1\r\nHost: h\r\n\r\n")
        assert status_of(await read_response(reader)) == 200
    finally:
        for _, writer in idle:
            writer.close()
    assert [r.raw_path for r in upstream.requests] == ["/after", "/idle-one"]


async def test_idle_keepalive_connection_is_closed_after_timeout(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(
        policy_for(upstream.url, server="  keepalive_timeout: 1s\n  header_timeout: 30s\n")
    )
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        # Busy for longer than the idle timeout: requests 200 ms apart keep it open.
        for i in range(8):
            writer.write(b"GET /busy/%d HTTP/1.1\r\nHost: h\r\n\r\n" % i)
            assert status_of(await read_response(reader)) == 200
            await asyncio.sleep(0.2)
        idle_since = loop.time()
        data, closed = await read_until_closed(reader, 5.0)
    finally:
        writer.close()
    assert closed and data == b""
    assert 0.7 <= loop.time() - idle_since <= 4.0
    assert len(upstream.requests) == 8


# -- real processes -----------------------------------------------------------------------------


def _tcp_sockets() -> dict[int, tuple[int, str]]:
    """Socket inode -> (local port, state hex) for every IPv4 TCP socket on the machine."""
    table = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        table[int(cols[9])] = (int(cols[1].split(":")[1], 16), cols[3])
    return table


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


_TCP_LISTEN = "0A"
_TCP_ESTABLISHED = "01"


async def _can_connect(port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1.0)
    except (ConnectionRefusedError, ConnectionResetError, TimeoutError):
        # Reset: the connection reached the backlog of a listener that then closed.
        return False
    writer.close()
    return True


async def test_sigterm_lets_in_flight_requests_finish_and_exits_zero(
    slow_upstream: SlowUpstream, gateway_process: StartGateway
) -> None:
    gw = await gateway_process(
        policy=policy_template(slow_upstream.url, server="  shutdown_timeout: 10s\n")
    )
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(
        timeout=TIMEOUT, connector=aiohttp.TCPConnector(force_close=True)
    ) as session:

        async def fetch(i: int) -> tuple[int, str]:
            async with session.get(f"{gw.url}/delay/1.5/{i}") as resp:
                return resp.status, await resp.text()

        in_flight = [asyncio.create_task(fetch(i)) for i in range(4)]
        await wait_until(lambda: len(slow_upstream.arrived) == 4, "4 requests at the upstream")
        gw.proc.send_signal(signal.SIGTERM)
        signalled_at = loop.time()

        # New connections are refused while the old ones are still being answered.
        refused_at = None
        while loop.time() - signalled_at < 1.2:
            if not await _can_connect(gw.port):
                refused_at = loop.time()
                break
            await asyncio.sleep(0.02)
        assert refused_at is not None, "the gateway still accepted connections after SIGTERM"
        assert not any(task.done() for task in in_flight), "refusal only came after the answers"

        results = await asyncio.gather(*in_flight)
    assert results == [(200, f"done /delay/1.5/{i}") for i in range(4)]
    assert await exit_code(gw, 10.0 + 5.0) == 0
    assert loop.time() - signalled_at < 10.0


async def test_sigterm_cuts_requests_longer_than_shutdown_timeout(
    slow_upstream: SlowUpstream, gateway_process: StartGateway
) -> None:
    gw = await gateway_process(
        policy=policy_template(slow_upstream.url, server="  shutdown_timeout: 1s\n")
    )
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:

        async def fetch() -> int | str:
            try:
                async with session.get(f"{gw.url}/delay/30/too-long") as resp:
                    await resp.read()
                    return resp.status
            except aiohttp.ClientError as exc:
                return type(exc).__name__

        request = asyncio.create_task(fetch())
        await wait_until(lambda: len(slow_upstream.arrived) == 1, "the request at the upstream")
        gw.proc.send_signal(signal.SIGTERM)
        signalled_at = loop.time()
        assert await exit_code(gw, 8.0) == 0
        exited_after = loop.time() - signalled_at
        outcome = await asyncio.wait_for(request, 5)
    # Cut at about the 1 s deadline, long before the upstream's 30 s answer.
    assert 0.5 <= exited_after <= 6.0, exited_after
    assert outcome != 200
    assert slow_upstream.answered == []


async def test_two_workers_share_one_port_and_stop_on_sigterm(
    slow_upstream: SlowUpstream, gateway_process: StartGateway
) -> None:
    gw = await gateway_process(
        "--workers",
        "2",
        policy=policy_template(slow_upstream.url, server="  shutdown_timeout: 2s\n"),
    )
    loop = asyncio.get_running_loop()
    # Both workers must be up, not only the first one to answer /readyz.
    workers: list[int] = []

    def two_listening_workers() -> bool:
        workers[:] = []
        sockets = _tcp_sockets()
        for pid in children(gw.proc.pid):
            try:
                inodes = _socket_inodes(pid)
            except OSError:
                continue
            if any(sockets.get(i) == (gw.port, _TCP_LISTEN) for i in inodes):
                workers.append(pid)
        return len(workers) == 2

    await wait_until(two_listening_workers, "two worker processes listening on the port", 20.0)

    # Fresh connections are spread over both (SO_REUSEPORT hashes each connection).
    async with aiohttp.ClientSession(
        timeout=TIMEOUT, connector=aiohttp.TCPConnector(force_close=True)
    ) as session:
        for i in range(40):
            async with session.get(f"{gw.url}/n/{i}") as resp:
                assert resp.status == 200
    # Which worker forwarded each request: the one owning the upstream connection it came on.
    sockets = _tcp_sockets()
    served_by = set()
    for pid in workers:
        local_ports = {
            sockets[i][0]
            for i in _socket_inodes(pid)
            if i in sockets and sockets[i][1] == _TCP_ESTABLISHED
        }
        if local_ports & set(slow_upstream.peers):
            served_by.add(pid)
    assert served_by == set(workers)

    gw.proc.send_signal(signal.SIGTERM)
    signalled_at = loop.time()
    assert await exit_code(gw, 2.0 + 8.0) == 0
    await wait_until(lambda: not any(alive(pid) for pid in workers), "the workers to exit", 5.0)
    assert loop.time() - signalled_at < 10.0
    assert not await _can_connect(gw.port)


async def test_run_with_upstream_url_and_no_policy_file(
    upstream: RecordingUpstream, gateway_process: StartGateway
) -> None:
    gw = await gateway_process("--upstream", upstream.url)
    assert await get_ok(gw.url + "/any/path?q=1") == "ok GET /any/path?q=1"
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(gw.url + "/upload", data=b"payload") as resp,
    ):
        assert resp.status == 200
    assert [(r.method, r.raw_path, r.body) for r in upstream.requests] == [
        ("GET", "/any/path?q=1", b""),
        ("POST", "/upload", b"payload"),
    ]
    gw.proc.send_signal(signal.SIGTERM)
    assert await exit_code(gw, 10.0) == 0


async def test_refuses_to_start_on_pure_python_parser(
    upstream: RecordingUpstream, gateway_process: StartGateway
) -> None:
    gw = await gateway_process(
        "--upstream", upstream.url, env={"AIOHTTP_NO_EXTENSIONS": "1"}, wait_ready=False
    )
    code = await asyncio.wait_for(gw.proc.wait(), 20)
    assert code != 0
    log = gw.log()
    assert "pure-Python HTTP parser" in log, log
    assert "Traceback" not in log
    assert not await _can_connect(gw.port)


async def test_sighup_to_the_supervisor_reloads_every_worker_and_keeps_them(
    slow_upstream: SlowUpstream, gateway_process: StartGateway
) -> None:
    gw = await gateway_process("--workers", "2", policy=policy_template(slow_upstream.url))
    await wait_until(
        lambda: "worker 0 serving" in gw.log() and "worker 1 serving" in gw.log(),
        "both workers serving",
        20.0,
    )
    workers = sorted(children(gw.proc.pid))
    gw.proc.send_signal(signal.SIGHUP)
    # Each worker re-reads the file; it has not changed, and each says so.
    await wait_until(lambda: gw.log().count(" unchanged (sha256 ") == 2, "two workers reloading")
    await asyncio.sleep(0.5)
    assert gw.proc.returncode is None, gw.log()
    assert sorted(children(gw.proc.pid)) == workers  # no worker died and was restarted
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(gw.url + "/after-hup") as resp,
    ):
        assert (resp.status, await resp.text()) == (200, "done /after-hup")


async def test_sighup_without_a_policy_file_is_logged_not_fatal(
    upstream: RecordingUpstream, gateway_process: StartGateway
) -> None:
    gw = await gateway_process("--upstream", upstream.url)
    gw.proc.send_signal(signal.SIGHUP)
    await wait_until(lambda: "no policy file to reload" in gw.log(), "the SIGHUP log line")
    assert gw.proc.returncode is None
    assert await get_ok(gw.url + "/after-hup") == "ok GET /after-hup"


# -- streaming memory bound ---------------------------------------------------------------------

MIB = 1024 * 1024
STREAMED_BYTES = 200 * MIB
STREAM_BLOCK = 256 * 1024


def generated_blocks(total: int) -> Iterator[bytes]:
    """``total`` bytes in blocks that each start with their index, so a lost or repeated block
    changes the checksum; made one at a time, never held whole."""
    filler = bytes(range(256)) * (STREAM_BLOCK // 256)
    for index, offset in enumerate(range(0, total, STREAM_BLOCK)):
        yield (index.to_bytes(8, "big") + filler[8:])[: total - offset]


def checksum_of_generated(total: int) -> int:
    crc = 0
    for block in generated_blocks(total):
        crc = zlib.crc32(block, crc)
    return crc


@dataclass
class StreamCount:
    """A consumer that counts and checksums what it reads, a little slower than it could: it
    pauses 1 ms after each MiB, so the sender outpaces it and only flow control in the gateway
    keeps the difference out of the gateway's memory."""

    bytes: int = 0
    crc: int = 0
    framing: str = ""

    async def add(self, chunk: bytes) -> None:
        mib_before = self.bytes // MIB
        self.bytes += len(chunk)
        self.crc = zlib.crc32(chunk, self.crc)
        if self.bytes // MIB != mib_before:
            await asyncio.sleep(0.001)


def framing_of(headers: Mapping[str, str]) -> str:
    if headers.get("Transfer-Encoding") == "chunked":
        return "chunked"
    return f"content-length {headers['Content-Length']}" if "Content-Length" in headers else ""


@pytest.fixture
async def streaming_upstream() -> AsyncIterator[tuple[str, list[StreamCount]]]:
    """GET /download/N[?chunked] streams N generated bytes; POST /upload consumes the body,
    counting and checksumming it (each upload's count is appended to the list it yields)."""
    uploads: list[StreamCount] = []

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.method == "POST":
            count = StreamCount(framing=framing_of(request.headers))
            uploads.append(count)
            while chunk := await request.content.readany():
                await count.add(chunk)
            return web.Response(text=f"{count.bytes} {count.crc}")
        total = int(request.path.rsplit("/", 1)[1])
        response = web.StreamResponse()
        if "chunked" in request.query:
            response.enable_chunked_encoding()
        else:
            response.content_length = total
        await response.prepare(request)
        for block in generated_blocks(total):
            await response.write(block)
        await response.write_eof()
        return response

    server = RawTestServer(handle, host="127.0.0.1", auto_decompress=False)
    await server.start_server()
    yield f"http://127.0.0.1:{server.port}", uploads
    await server.close()


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _reset_peak_rss(pid: int) -> None:
    """Restart VmHWM from the current RSS (writing 5 to clear_refs, Linux 4.0 and later).
    Where that is refused, VmHWM keeps earlier peaks: the growth measured is only larger."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


@pytest.mark.slow
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_200_mib_each_way_streams_through_with_bounded_memory(
    framing: str,
    streaming_upstream: tuple[str, list[StreamCount]],
    gateway_process: StartGateway,
) -> None:
    upstream_url, uploads = streaming_upstream
    # The default max_body_size (100 MiB) would refuse the upload with 413.
    gw = await gateway_process(policy=policy_template(upstream_url, server="  max_body_size: 0\n"))
    pid = gw.proc.pid
    chunked = framing == "chunked"
    timeout = aiohttp.ClientTimeout(total=30)

    async def upload(total: int) -> str:
        async def body() -> AsyncIterator[bytes]:
            for block in generated_blocks(total):
                yield block

        # A generator body goes chunked unless the length is declared.
        headers = {} if chunked else {"Content-Length": str(total)}
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(gw.url + "/upload", data=body(), headers=headers) as resp,
        ):
            assert resp.status == 200, await resp.text()
            return await resp.text()

    async def download(total: int) -> StreamCount:
        query = "?chunked" if chunked else ""
        async with (
            aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session,
            session.get(f"{gw.url}/download/{total}{query}") as resp,
        ):
            assert resp.status == 200
            count = StreamCount(framing=framing_of(resp.headers))
            async for chunk in resp.content.iter_any():
                await count.add(chunk)
        return count

    # Warm up every path the big transfers take, then take the baseline and restart the
    # high-water mark (VmHWM) from it.
    warm = 4 * MIB
    assert await upload(warm) == f"{warm} {checksum_of_generated(warm)}"
    assert (await download(warm)).bytes == warm
    baseline_kib = _status_kib(pid, "VmRSS")
    _reset_peak_rss(pid)

    uploaded = await upload(STREAMED_BYTES)
    downloaded = await download(STREAMED_BYTES)
    peak_kib = _status_kib(pid, "VmHWM")

    expected_framing = "chunked" if chunked else f"content-length {STREAMED_BYTES}"
    expected_crc = checksum_of_generated(STREAMED_BYTES)
    got_upload = uploads[-1]
    assert (got_upload.framing, got_upload.bytes, got_upload.crc) == (
        expected_framing,
        STREAMED_BYTES,
        expected_crc,
    )
    assert uploaded == f"{STREAMED_BYTES} {expected_crc}"
    assert (downloaded.framing, downloaded.bytes, downloaded.crc) == (
        expected_framing,
        STREAMED_BYTES,
        expected_crc,
    )
    growth_mib = (peak_kib - baseline_kib) / 1024
    assert growth_mib < 50, (
        f"gateway RSS grew by {growth_mib:.1f} MiB (baseline {baseline_kib} KiB)"
    )
