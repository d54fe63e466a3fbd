"""Faults and load the probe of the gateway tried, kept as tests (docs/reliability.md has the
matrix, with the tests elsewhere that belong to it): SIGTERM with keep-alive clients, repeated
slowloris rounds, a reload storm under load, and raw-request fuzzing. Each is bounded in time and
in count; figures print with ``-s``.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from tests import test_lifecycle as lifecycle
from tests.conftest import GatewayFactory, RecordingUpstream, policy_for
from tests.rawhttp import status_of
from tests.test_lifecycle import GatewayProcess, SlowUpstream

pytestmark = pytest.mark.reliability

gateway_process = lifecycle.gateway_process
slow_upstream = lifecycle.slow_upstream


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
    slow_upstream: SlowUpstream, gateway_process: Callable[..., Awaitable[GatewayProcess]]
) -> None:
    """Idle keep-alive connections are closed with a FIN, a request in flight on a keep-alive
    connection is answered whole and then told ``Connection: close`` (or closed cleanly), and
    nothing is reset."""
    gw = await gateway_process(
        policy=lifecycle._policy_file(slow_upstream.url, server="  shutdown_timeout: 10s\n")
    )
    idle = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(8)]
    busy = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(4)]
    for reader, writer in idle + busy:
        assert status_of(await _request(reader, writer, "/warm-up")) == 200
    in_flight = [
        asyncio.create_task(_request(reader, writer, f"/delay/1.5/{i}"))
        for i, (reader, writer) in enumerate(busy)
    ]
    await lifecycle.wait_for(
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
    assert await lifecycle._exit_code(gw, 15.0) == 0


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
    ends = await asyncio.gather(
        *(_end_of(reader, header_timeout_s + 5.0) for reader, _ in opened)
    )
    for _, writer in opened:
        writer.close()
    return sum(1 for end in ends if end in ("eof", "reset"))


@pytest.mark.slow
async def test_repeated_slowloris_rounds_do_not_grow_memory(
    upstream: RecordingUpstream, gateway_process: Callable[..., Awaitable[GatewayProcess]]
) -> None:
    """Growth that stops after the first rounds is a pool (allocator arenas, freelists); growth
    each round would be a leak. Legitimate requests are served between the rounds."""
    connections, rounds = 1000, 6
    gw = await gateway_process(
        policy=lifecycle._policy_file(
            upstream.url, server="  header_timeout: 1s\n  max_connections: 5000\n"
        )
    )
    pid = gw.proc.pid
    rss = [_rss_kib(pid)]
    async with aiohttp.ClientSession(timeout=lifecycle.CLIENT_TIMEOUT) as session:
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
    from gateway.policy_loader import load_policy

    first, second = await make_upstream(), await make_upstream()
    path = tmp_path / "policy.yaml"
    limit = (
        "limits:\n  per_ip:\n    algorithm: leaky_bucket\n    rate: {rate}r/s\n"
        "    burst: 100000\n"
    )

    def policy(i: int) -> str:
        if i % 5 == 4:
            return policy_for(first.url) + "limits:\n  broken: {algorithm: nope}\n"
        upstream = (first, second)[i % 2]
        return policy_for(upstream.url) + limit.format(rate=10000 + i)

    path.write_text(policy(0))
    gw = await start_gateway(load_policy(path), policy_path=str(path))
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
    async with aiohttp.ClientSession(timeout=lifecycle.CLIENT_TIMEOUT) as session:
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
    await lifecycle.wait_for(lambda: not gw.gateway._retired, "retired runtimes to close")
    fds_after = len(os.listdir("/proc/self/fd"))
    print(
        f"\nreload storm: 200 reloads (40 invalid) in {took_s:.1f} s under load, "
        f"{len(statuses)} requests all 200, fds {fds_before} -> {fds_after}"
    )
    # Each reload's pool to the upstream it left is closed: 160 reloads leaving theirs open
    # would hold hundreds of descriptors (both ends are in this process).
    assert fds_after <= fds_before + 40
