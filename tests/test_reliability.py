"""Faults and load the probe of the gateway tried, kept as tests (docs/reliability.md has the
matrix, with the tests elsewhere that belong to it): SIGTERM with keep-alive clients, repeated
slowloris rounds, a reload storm under load, raw-request fuzzing, and memory over time (a
four-minute soak, left out of the default run). Each is bounded in time and in count; figures
print with ``-s``.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.engine.preflight import parse_and_build
from gateway.serving.lifecycle import Gateway
from tests.support.gateways import GatewayFactory
from tests.support.network import TIMEOUT
from tests.support.policies import policy_for, policy_template
from tests.support.processes import StartGateway, exit_code
from tests.support.rawhttp import status_of
from tests.support.upstreams import RecordingUpstream, SlowUpstream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.reliability


async def _request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, within_s: float = 10.0
) -> bytes:
    """One keep-alive request and its whole response (a ``Content-Length`` body)."""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: h\r\n\r\n".encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), within_s)
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head + await asyncio.wait_for(reader.readexactly(length), within_s)


async def _end_of(reader: asyncio.StreamReader, within_s: float) -> str:
    """How the gateway ends a connection: "eof" (a clean FIN), "reset", or "open"."""
    try:
        data = await asyncio.wait_for(reader.read(65536), within_s)
    except TimeoutError:
        return "open"
    except ConnectionResetError:
        return "reset"
    return "eof" if data == b"" else f"data {data[:80]!r}"


# -- SIGTERM with keep-alive clients ------------------------------------------------------------


async def test_sigterm_with_keepalive_clients_finishes_in_flight_and_closes_idle_cleanly(
    slow_upstream: SlowUpstream, gateway_process: StartGateway
) -> None:
    """Idle keep-alive connections are closed with a FIN, a request in flight on a keep-alive
    connection is answered whole and then told ``Connection: close`` (or closed cleanly), and
    nothing is reset."""
    gw = await gateway_process(
        policy=policy_template(slow_upstream.url, server="  shutdown_timeout: 10s\n")
    )
    idle = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(8)]
    busy = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(4)]
    for reader, writer in idle + busy:
        assert status_of(await _request(reader, writer, "/warm-up")) == 200
    in_flight = [
        asyncio.create_task(_request(reader, writer, f"/delay/1.5/{i}"))
        for i, (reader, writer) in enumerate(busy)
    ]
    await wait_until(
        lambda: len([p for p in slow_upstream.arrived if p.startswith("/delay/")]) == 4,
        "4 requests at the upstream",
    )
    gw.proc.send_signal(signal.SIGTERM)
    idle_ends = await asyncio.gather(*(_end_of(reader, 5.0) for reader, _ in idle))
    answers = await asyncio.gather(*in_flight)
    busy_ends = await asyncio.gather(*(_end_of(reader, 5.0) for reader, _ in busy))
    for _, writer in idle + busy:
        writer.close()
    assert idle_ends == ["eof"] * 8, idle_ends
    for i, answer in enumerate(answers):
        assert status_of(answer) == 200 and answer.endswith(f"done /delay/1.5/{i}".encode())
    # After its answer a keep-alive connection is closed, not left for a reset at exit.
    assert busy_ends == ["eof"] * 4, busy_ends
    assert await exit_code(gw, 15.0) == 0


# -- repeated slowloris rounds: a pool or a leak? -----------------------------------------------


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def _slowloris_round(port: int, connections: int, header_timeout_s: float) -> int:
    """``connections`` clients that send part of a head and stall: how many the gateway cut."""
    opened = []
    for _ in range(connections):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: h\r\nX-Padding: aaaa")
        opened.append((reader, writer))
    ends = await asyncio.gather(*(_end_of(reader, header_timeout_s + 5.0) for reader, _ in opened))
    for _, writer in opened:
        writer.close()
    return sum(1 for end in ends if end in ("eof", "reset"))


@pytest.mark.slow
async def test_repeated_slowloris_rounds_do_not_grow_memory(
    upstream: RecordingUpstream, gateway_process: StartGateway
) -> None:
    """Growth that stops after the first rounds is a pool (allocator arenas, freelists); growth
    each round would be a leak. Legitimate requests are served between the rounds."""
    connections, rounds = 1000, 6
    gw = await gateway_process(
        policy=policy_template(
            upstream.url, server="  header_timeout: 1s\n  max_connections: 5000\n"
        )
    )
    pid = gw.proc.pid
    rss = [_rss_kib(pid)]
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for _ in range(rounds):
            assert await _slowloris_round(gw.port, connections, 1.0) == connections
            for i in range(20):
                async with session.get(f"{gw.url}/between/{i}") as response:
                    assert response.status == 200
            rss.append(_rss_kib(pid))
    growth_mib = [round((after - rss[0]) / 1024, 1) for after in rss[1:]]
    print(f"\nslowloris {rounds} x {connections}: RSS growth after each round (MiB) {growth_mib}")
    # The later rounds add (almost) nothing: what the first rounds took is reused.
    late_growth_mib = (rss[-1] - rss[2]) / 1024
    assert late_growth_mib < 3.0, growth_mib


# -- reload storm -------------------------------------------------------------------------------


async def test_reload_storm_under_load_loses_nothing_and_retires_old_pools(
    make_upstream: Callable[[], Awaitable[RecordingUpstream]],
    start_gateway: GatewayFactory,
    tmp_path: Path,
) -> None:
    """200 reloads back to back under load from 8 clients: each switches the upstream and the
    limit, every fifth file is invalid. No request fails, the invalid ones keep the running
    policy, and the runtimes (and upstream pools) each reload retires are all closed."""
    from gateway.engine.preflight import load_and_build

    first, second = await make_upstream(), await make_upstream()
    path = tmp_path / "policy.yaml"
    limit = (
        "limits:\n  per_ip:\n    algorithm: leaky_bucket\n    rate: {rate}r/s\n    burst: 100000\n"
    )

    def policy(i: int) -> str:
        if i % 5 == 4:
            return policy_for(first.url) + "limits:\n  broken: {algorithm: nope}\n"
        upstream = (first, second)[i % 2]
        return policy_for(upstream.url) + limit.format(rate=10000 + i)

    path.write_text(policy(0))
    gw = await start_gateway(load_and_build(path), policy_path=str(path))
    reloader = gw.gateway.reloader
    assert reloader is not None
    fds_before = len(os.listdir("/proc/self/fd"))
    statuses: list[int] = []
    errors: list[BaseException] = []
    stop = asyncio.Event()

    async def client(session: aiohttp.ClientSession) -> None:
        for _ in range(5000):  # bounded
            if stop.is_set():
                return
            try:
                async with session.get(gw.url + "/") as response:
                    await response.read()
                    statuses.append(response.status)
            except aiohttp.ClientError as exc:
                errors.append(exc)

    loop = asyncio.get_running_loop()
    started = loop.time()
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        clients = [asyncio.create_task(client(session)) for _ in range(8)]
        results = []
        for i in range(1, 201):
            # By rename: the file watcher may read it too (then this call finds it unchanged).
            tmp = path.with_name("policy.tmp")
            tmp.write_text(policy(i))
            os.replace(tmp, path)
            results.append(await reloader.reload())
            await asyncio.sleep(0.005)  # let requests through between reloads
        stop.set()
        await asyncio.gather(*clients)
    took_s = loop.time() - started
    assert errors == [], errors[:3]
    assert statuses and set(statuses) == {200}
    expected = ["failed" if i % 5 == 4 else "ok" for i in range(1, 201)]
    assert [r if r != "unchanged" else "ok" for r in results] == expected, results
    assert reloader.status.succeeded == 160
    assert len(first.requests) + len(second.requests) == len(statuses)
    await wait_until(lambda: not gw.gateway._retired, "retired runtimes to close")
    fds_after = len(os.listdir("/proc/self/fd"))
    print(
        f"\nreload storm: 200 reloads (40 invalid) in {took_s:.1f} s under load, "
        f"{len(statuses)} requests all 200, fds {fds_before} -> {fds_after}"
    )
    # Each reload's pool to the upstream it left is closed: 160 reloads leaving theirs open
    # would hold hundreds of descriptors (both ends are in this process).
    assert fds_after <= fds_before + 40


# -- raw-request fuzzing ------------------------------------------------------------------------
#
# Hypothesis builds requests from a grammar with hostile variations (framing headers with odd
# values, bad separators, control bytes, versions, chunked bodies with odd sizes, requests
# hidden in bodies) and sends each on its own connection to one gateway, run on its own event
# loop in a thread so the property test itself stays synchronous.

# 100: the interim answer to ``Expect: 100-continue`` on a request with a body.
_FUZZ_STATUSES = frozenset({100, 200, 400, 404, 405, 408, 413, 414, 417, 431, 501, 505})
_STATUS_LINE_RE = re.compile(rb"(?:^|\r\n)HTTP/1\.[01] (\d{3}) ")


class _GatewayThread:
    """A gateway and a recording upstream on an event loop in a thread of their own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        # (method, raw path, X-Fuzz-Id) of each request the upstream parsed
        self.seen: list[tuple[bytes, bytes, bytes]] = []
        self.examples = 0
        self.port = 0
        self._upstream: web.ServerRunner | None = None
        self.gateway: Gateway | None = None

    def run(self, coro: Awaitable[Any], timeout_s: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)  # type: ignore[arg-type]

    async def start(self) -> None:
        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            fuzz_id = request.headers.get("X-Fuzz-Id", "").encode("latin-1")
            self.seen.append((request.method.encode(), request.raw_path.encode("latin-1"), fuzz_id))
            await request.read()
            return web.Response(text="upstream")

        self._upstream = web.ServerRunner(web.Server(handle, auto_decompress=False))
        await self._upstream.setup()
        await web.TCPSite(self._upstream, "127.0.0.1", 0).start()
        upstream_port = self._upstream.addresses[0][1]
        policy = policy_for(
            f"http://127.0.0.1:{upstream_port}",
            server="  max_body_size: 64k\n  header_timeout: 2s\n  body_timeout: 2s\n",
        )
        self.gateway = Gateway(parse_and_build(policy, "fuzz.yaml"))
        await self.gateway.start()
        self.port = self.gateway.proxy_port

    async def stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
        if self._upstream is not None:
            await self._upstream.cleanup()

    def close(self) -> None:
        try:
            self.run(self.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture(scope="module")
def fuzz_gateway() -> Iterator[_GatewayThread]:
    running = _GatewayThread()
    try:
        running.run(running.start())
        yield running
    finally:
        running.close()


_TOKEN = st.sampled_from([b"GET", b"POST", b"PUT", b"HEAD", b"OPTIONS", b"DELETE", b"PATCH"])
_ODD_BYTES = st.binary(min_size=0, max_size=12)
_TARGET = st.one_of(
    st.just(b"/fuzz"),
    st.just(b"/fuzz"),
    st.builds(lambda b: b"/fuzz/" + b, st.binary(max_size=10)),
    st.sampled_from([b"*", b"http://h/fuzz", b"http://other/fuzz", b"fuzz", b"/fuzz/../x"]),
)
_HEADER_NAME = st.one_of(
    st.sampled_from(
        [
            b"Host", b"Content-Length", b"Transfer-Encoding", b"Expect", b"Connection",
            b"Transfer_Encoding", b"Content-Length ", b"X-Forwarded-For", b"Upgrade", b"TE",
        ]
    ),
    st.binary(min_size=0, max_size=10),
)  # fmt: skip
_HEADER_VALUE = st.one_of(
    st.sampled_from(
        [
            b"h", b"0", b"5", b"-1", b"99999999999999999999", b"chunked", b"Chunked",
            b"chunked, chunked", b"gzip, chunked", b"identity", b"100-continue", b"close",
            b"keep-alive", b"h, h", b"", b" 5 ", b"0x5",
        ]
    ),
    _ODD_BYTES,
)  # fmt: skip
_CHUNK_SIZE = st.sampled_from(
    [b"0", b"5", b"a", b"ffff", b"8000000000000000", b"10000000000000000", b"-1", b"5;x=y", b" 5"]
)
_BODY = st.one_of(
    st.just(b""),
    st.binary(max_size=64),
    st.just(b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: h\r\n\r\n"),
    st.builds(
        lambda size, data, tail: size + b"\r\n" + data + b"\r\n" + tail,
        _CHUNK_SIZE,
        st.binary(max_size=16),
        st.sampled_from(
            [b"0\r\n\r\n", b"", b"0\r\nX: y\r\n\r\n", b"0\r\nContent-Length: 9\r\n\r\n"]
        ),
    ),
)


def _mostly(usual: bytes, *odd: bytes) -> st.SearchStrategy[bytes]:
    """``usual`` about four times in five, else one of ``odd``."""
    return st.sampled_from([usual] * (4 * len(odd)) + list(odd))


_PLAIN_HEADERS = st.sampled_from(
    [(b"Accept", b"*/*"), (b"X-Test", b"1"), (b"User-Agent", b"fuzz"), (b"Content-Length", b"0")]
)


@st.composite
def raw_requests(draw: st.DrawFn) -> bytes:
    """A request that is mostly well formed, with a few hostile parts drawn in."""
    sep = draw(_mostly(b"\r\n", b"\n", b"\r", b"\r\n "))
    version = draw(_mostly(b"HTTP/1.1", b"HTTP/1.0", b"HTTP/0.9", b"HTTP/2.0", b"http/1.1", b""))
    line = draw(_TOKEN) + b" " + draw(_TARGET) + b" " + version
    headers = [b"Host: h"] if draw(_mostly(b"y", b"n")) == b"y" else []
    pairs = draw(
        st.lists(st.one_of(_PLAIN_HEADERS, st.tuples(_HEADER_NAME, _HEADER_VALUE)), max_size=4)
    )
    for name, value in pairs:
        headers.append(name + b":" + draw(_mostly(b" ", b"", b"\t")) + value)
    if draw(st.booleans()):
        headers.append(b"Connection: close")
    return sep.join([line, *headers]) + sep + sep + draw(_BODY)


_CONTENT_LENGTH_5 = re.compile(rb"(?im)^content-length:[ \t]*5[ \t]*\r?$")
_TRANSFER_ENCODING = re.compile(rb"(?im)^transfer-encoding\s*:")


def _frames_smuggled_as_next_request(data: bytes) -> bool:
    """Whether a ``/smuggled`` request after a 5-byte body is the client's own next request:
    the head frames the body by ``Content-Length: 5`` alone, so what follows those 5 bytes
    (``0\\r\\n\\r\\n``) is not body but a pipelined request the client wrote."""
    head, _, body = data.partition(b"\r\n\r\n")
    return (
        body.startswith(b"0\r\n\r\nGET /smuggled ")
        and len(_CONTENT_LENGTH_5.findall(head)) == 1
        and not _TRANSFER_ENCODING.search(head)
        and b"Connection: close" not in head
    )


def _exchange(port: int, data: bytes) -> bytes:
    """Send ``data``; read until the gateway closes or 0.3 s pass without a byte."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        sock.settimeout(0.3)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)
@given(data=raw_requests())
# Content-Length 5 frames the body as "0\r\n\r\n": the request after it is the client's own,
# pipelined, and is forwarded (as nginx does); it must not be mistaken for a smuggled one.
@example(
    data=b"POST /fuzz HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\n"
    b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: h\r\n\r\n"
)
def test_fuzzed_raw_requests_get_4xx_or_are_forwarded_as_sent(
    fuzz_gateway: _GatewayThread, data: bytes
) -> None:
    """Whatever the bytes: no 5xx, no crash, and the upstream only ever sees a request line
    the client wrote (never one hidden in a body: ``/smuggled`` only arrives inside bodies)."""
    # Tagged after the request line: a request forwarded late (a slow moment) is still told
    # apart from the next example's.
    fuzz_gateway.examples += 1
    fuzz_id = b"%d" % fuzz_gateway.examples
    line, sep, rest = data.partition(b"\n")
    data = line + sep + b"X-Fuzz-Id: " + fuzz_id + b"\r" * line.endswith(b"\r") + sep + rest
    seen_before = len(fuzz_gateway.seen)
    reply = _exchange(fuzz_gateway.port, data)
    statuses = {int(s) for s in _STATUS_LINE_RE.findall(reply)}
    assert statuses <= _FUZZ_STATUSES, (statuses, data, reply[:300])
    if _frames_smuggled_as_next_request(data):
        # The client's own second request (it carries no X-Fuzz-Id), answered in this exchange.
        fuzz_gateway.seen[seen_before:] = [
            seen
            for seen in fuzz_gateway.seen[seen_before:]
            if not (seen[1].startswith(b"/smuggled") and seen[2] == b"")
        ]
    for method, path, seen_id in list(fuzz_gateway.seen):
        assert not path.startswith(b"/smuggled"), (data, fuzz_gateway.seen[-3:])
        if seen_id == fuzz_id:
            # The method the client wrote, and its path (origin-form of an absolute target).
            assert method + b" " in data and path in data, (method, path, data)


def test_gateway_serves_normally_after_the_fuzzing(fuzz_gateway: _GatewayThread) -> None:
    reply = _exchange(
        fuzz_gateway.port, b"GET /after HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
    )
    print(f"\nfuzzing: {len(fuzz_gateway.seen) - 1} fuzzed requests reached the upstream")
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
    server = fuzz_gateway.gateway.server if fuzz_gateway.gateway else None
    assert server is not None

    async def open_connections() -> int:
        for _ in range(300):
            if server.open_connections == 0:
                break
            await asyncio.sleep(0.01)
        return server.open_connections

    assert fuzz_gateway.run(open_connections()) == 0


# -- many keys ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_many_keys_stay_bounded_in_count_and_bytes() -> None:
    """150,000 client IPs through a table bounded at 100,000 (bench/bench_algorithms.py runs
    1,000,000): at most the bound is tracked, the most recent half never evicted, and a
    filled table costs under 250 bytes a key, key strings included."""
    import tracemalloc

    from gateway.algorithms.fixed_window import FixedWindow
    from gateway.stores.keyed_state import KeyedState

    algorithm = FixedWindow(5, 60)
    now_us = 2520 * 1_000_000
    _, state = algorithm.decide(None, now_us)

    def ip(i: int) -> str:
        return f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"

    table: KeyedState[Any] = KeyedState(100_000, algorithm)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(100_000):
            table.put(ip(i), state, now_us)
        filled_bytes_per_key = (tracemalloc.get_traced_memory()[0] - before) / len(table)
    finally:
        tracemalloc.stop()
    for i in range(100_000, 150_000):
        table.put(ip(i), state, now_us)
    assert len(table) <= 100_000
    assert all(ip(i) in table for i in range(150_000 - table.generation_keys, 150_000))
    print(f"\nmany keys: {filled_bytes_per_key:.0f} bytes per tracked key (100,000 filled)")
    assert filled_bytes_per_key < 250


# -- memory over time ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.soak
def test_rss_levels_off_under_mixed_traffic_with_key_churn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Four minutes of ``bench/soak_memory.py``: a gateway process with three stacked limits,
    300 requests a second from 1,000 clients at a time, a tenth of them replaced every 10 s,
    about 40 % rejected. What grows by design is bounded: the dashboard's history by time (15
    minutes; 60 s here, so that it fills early) and each limit's key table by ``max_keys``
    (2,000 here). Once both are full RSS must level off: over the last two minutes it grows by
    at most 0.75 MiB and by no more than over the first two (0.29-0.42 MiB in runs here; a
    40-byte object kept per request made it 1.01), and the open descriptors stay within the
    connections in use. Not in the default run (``soak``): ``-m reliability`` or ``-m soak``
    runs it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import soak_memory

    with soak_memory.running(tmp_path, workers=1, history_s=60, max_keys=2000) as (gw, port):
        samples = asyncio.run(
            soak_memory.drive(
                port,
                gw.pid,
                seconds=240,
                interval_s=10,
                rate=300,
                clients=1000,
                churn=0.1,
                report=False,
            )
        )
    start, middle, end = (soak_memory.at_minutes(samples, m) for m in (0, 2, 4))
    assert start is not None and middle is not None and end is not None
    early, late = middle.rss_mib - start.rss_mib, end.rss_mib - middle.rss_mib
    with capsys.disabled():
        print(
            f"\nRSS {start.rss_mib:.1f} MiB at the start, {middle.rss_mib:.1f} after 2 minutes "
            f"(+{early:.2f}), {end.rss_mib:.1f} after 4 (+{late:.2f})\n"
            + soak_memory.summary(samples)
        )
    answered = sum(s.admitted + s.rejected for s in samples)
    assert sum(s.errors for s in samples) == 0
    assert 0.3 < sum(s.rejected for s in samples) / answered < 0.5
    curve = soak_memory.sparkline([s.rss_mib for s in samples])
    assert late <= 0.75 and late <= early, (early, late, curve)
    # The gateway's own (listeners, loop) plus at most 64 client and 64 upstream connections.
    assert max(s.fds for s in samples) <= 2 * 64 + 40
