"""Micro-benchmark: gateway.edge.upstream_client.UpstreamPool against aiohttp.ClientSession.

Starts an upstream in a child process (aiohttp's low-level server, or a raw asyncio server that
answers every request with the same bytes, to show the client's own cost), then times N requests
through each client, sequentially and from 64 concurrent tasks. Each figure is the median of
``--repeat`` rounds; the machine is shared, so read the ratios rather than the absolutes.

    python bench/bench_upstream_client.py [--upstream aiohttp|raw] [--requests 20000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gateway.edge.upstream_client import UpstreamPool

BODY = b"x" * 100

_UPSTREAM_AIOHTTP = """
import asyncio, socket, sys
from aiohttp import web
BODY = b"x" * 100
async def handle(request):
    return web.Response(body=BODY, content_type="text/plain")
async def main():
    server = web.Server(handle)
    sock = socket.socket(); sock.bind(("127.0.0.1", 0)); sock.listen(1024)
    await asyncio.get_running_loop().create_server(server, sock=sock)
    print(sock.getsockname()[1], flush=True)
    await asyncio.Event().wait()
try:
    import uvloop; uvloop.install()
except ImportError:
    pass
asyncio.run(main())
"""

_UPSTREAM_RAW = """
import asyncio, socket
RESPONSE = (b"HTTP/1.1 200 OK\\r\\nContent-Type: text/plain\\r\\nContent-Length: 100\\r\\n\\r\\n"
            + b"x" * 100)
class Echo(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        self.buf = b""
    def data_received(self, data):
        self.buf += data
        n = self.buf.count(b"\\r\\n\\r\\n")
        if n:
            self.buf = self.buf.rsplit(b"\\r\\n\\r\\n", 1)[1]
            self.transport.write(RESPONSE * n)
async def main():
    sock = socket.socket(); sock.bind(("127.0.0.1", 0)); sock.listen(1024)
    await asyncio.get_running_loop().create_server(Echo, sock=sock)
    print(sock.getsockname()[1], flush=True)
    await asyncio.Event().wait()
try:
    import uvloop; uvloop.install()
except ImportError:
    pass
asyncio.run(main())
"""


def start_upstream(kind: str) -> tuple[subprocess.Popen[str], int]:
    code = _UPSTREAM_AIOHTTP if kind == "aiohttp" else _UPSTREAM_RAW
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise RuntimeError("upstream did not start")
    return proc, int(line)


async def timed(total: int, concurrency: int, one: Callable[[], Awaitable[None]]) -> float:
    """Requests per second for ``total`` calls of ``one`` spread over ``concurrency`` tasks."""
    per_task = total // concurrency

    async def worker() -> None:
        for _ in range(per_task):
            await one()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return per_task * concurrency / (time.perf_counter() - started)


async def run(port: int, total: int, repeat: int) -> dict[str, list[float]]:
    head = f"GET /bench HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    pool = UpstreamPool("127.0.0.1", port, max_connections=64, max_idle=64)

    async def via_pool() -> None:
        response = await pool.request(head, None, body_chunked=False)
        if response.body_complete:
            body = response.body_bytes()
        else:
            body = b"".join([chunk async for chunk in response.iter_chunks()])
        response.release()
        assert body == BODY

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64), auto_decompress=False)
    url = f"http://127.0.0.1:{port}/bench"

    async def via_session() -> None:
        async with session.get(url) as response:
            body = await response.read()
        assert body == BODY

    results: dict[str, list[float]] = {}
    try:
        for _ in range(repeat):
            for concurrency in (1, 64):
                for name, one in (("UpstreamPool", via_pool), ("ClientSession", via_session)):
                    n = total if concurrency > 1 else total // 2
                    rate = await timed(n, concurrency, one)
                    results.setdefault(f"{name} c={concurrency}", []).append(rate)
    finally:
        await session.close()
        await pool.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", choices=("aiohttp", "raw"), default="aiohttp")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-uvloop", action="store_true")
    args = parser.parse_args()
    if not args.no_uvloop:
        import uvloop

        uvloop.install()
    proc, port = start_upstream(args.upstream)
    try:
        results = asyncio.run(run(port, args.requests, args.repeat))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    print(f"upstream={args.upstream} requests={args.requests} repeat={args.repeat} (median req/s)")
    medians = {name: statistics.median(rates) for name, rates in results.items()}
    for name, rate in medians.items():
        print(f"  {name:<22} {rate:>10,.0f}")
    for concurrency in (1, 64):
        ratio = medians[f"UpstreamPool c={concurrency}"] / medians[f"ClientSession c={concurrency}"]
        print(f"  UpstreamPool/ClientSession c={concurrency}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
