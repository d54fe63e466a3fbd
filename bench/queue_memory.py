"""Memory of queued requests: RSS growth of a gateway holding N requests in a shaping queue.

Starts a gateway subprocess whose only limit delays every request for a long time, opens N client
connections that each send one request (all of which end up waiting in the queue), and reports
the gateway's RSS growth per waiting request.

Run: ``python bench/queue_memory.py --requests 10000``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

POLICY = """
server:
  listen: 127.0.0.1:{port}
  admin_listen: 127.0.0.1:{admin}
  max_connections: {conns}
  shutdown_timeout: 1s
upstreams:
  backend:
    url: http://127.0.0.1:9
routes:
  - name: all
    upstream: backend
limits:
  shaped:
    algorithm: leaky_bucket
    rate: 1r/m
    burst: {burst}
    max_queue: {burst}
    max_delay: 1000h
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def waiting(admin: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", admin)
    writer.write(b"GET /explain?path=/ HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    data = await reader.read()
    writer.close()
    body = json.loads(data.split(b"\r\n\r\n", 1)[1])
    return int(body["limits"][0]["waiting"])


async def measure(requests: int) -> dict[str, float]:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, requests * 2 + 1000), hard))
    port, admin = free_port(), free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(POLICY.format(port=port, admin=admin, conns=requests + 100, burst=requests * 2))
        path = f.name
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "--log-level", "WARNING", "run", "--config", path
    )
    writers = []
    try:
        for _ in range(100):
            try:
                _, probe = await asyncio.open_connection("127.0.0.1", admin)
                probe.close()
                break
            except OSError:
                await asyncio.sleep(0.1)
        baseline = rss_bytes(proc.pid)
        for i in range(requests):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /q HTTP/1.1\r\nHost: h\r\n\r\n")
            writers.append(writer)
            if i % 500 == 0:
                await asyncio.sleep(0)
        deadline = time.monotonic() + 60
        queued = 0
        while time.monotonic() < deadline:
            queued = await waiting(admin)
            if queued >= requests - 1:
                break
            await asyncio.sleep(0.5)
        loaded = rss_bytes(proc.pid)
    finally:
        for writer in writers:
            writer.close()
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 60)
        os.unlink(path)
    growth = loaded - baseline
    return {
        "requests": requests,
        "waiting_in_queue": queued,
        "rss_before_mib": baseline / 2**20,
        "rss_with_queue_mib": loaded / 2**20,
        "growth_mib": growth / 2**20,
        "bytes_per_waiting_request": growth / requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=10_000)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.requests)), indent=2))


if __name__ == "__main__":
    main()
