"""A test upstream with a capacity: ``C`` requests served at once, the rest queue in order.

Each request holds one of ``C`` workers for ``service_ms`` (20 ms by default); beyond ``C`` in
flight, requests wait first come, first served. So its latency is flat up to ``C`` and grows
with its concurrency beyond: about ``service_ms * n / C`` at ``n`` in flight. That is the
backend the adaptive limit must find the capacity of (tests/test_capacity_upstream.py checks it
behaves so; bench/adaptive_curves.py and the adaptive tests load it through the gateway).

HTTP, on loopback:

- any path: ``200`` after the request's wait and service; ``?ms=N`` serves it for ``N`` ms;
- ``PUT /_capacity?c=N`` (and ``&ms=M``): change ``C`` (and the service time) at run time:
  ``C`` up, waiting requests start at once; ``C`` down, requests in service finish first;
- ``GET /_stats``: JSON of ``capacity``, ``service_ms``, ``in_service``, ``queued``,
  ``peak_in_flight`` (since the last stats read), ``served``.

Run: ``python bench/capacity_upstream.py --port 0 --capacity 8 --service-ms 20`` (prints the
port it listens on).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from aiohttp import web

T = TypeVar("T")


class CapacityQueue(Generic[T]):
    """``capacity`` workers and a first-come-first-served line; pure, so the simulation
    (bench/capacity_sim.py) and the server share it. A ticket is whatever the caller starts."""

    __slots__ = ("_line", "capacity", "in_service", "peak_in_flight")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.in_service = 0
        self.peak_in_flight = 0
        self._line: deque[T] = deque()

    @property
    def queued(self) -> int:
        return len(self._line)

    def arrive(self, ticket: T) -> bool:
        """True: served at once (a worker is taken); False: it waits in line."""
        in_flight = self.in_service + len(self._line) + 1
        self.peak_in_flight = max(self.peak_in_flight, in_flight)
        if self.in_service < self.capacity:
            self.in_service += 1
            return True
        self._line.append(ticket)
        return False

    def finish(self) -> list[T]:
        """A request's service ended: the waiters that start now (their workers taken)."""
        self.in_service -= 1
        return self._start_waiting()

    def leave(self, ticket: T) -> None:
        """A waiting request went away before its turn."""
        with contextlib.suppress(ValueError):
            self._line.remove(ticket)

    def set_capacity(self, capacity: int) -> list[T]:
        """Change ``C``; the waiters that start now."""
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        return self._start_waiting()

    def _start_waiting(self) -> list[T]:
        started: list[T] = []
        while self._line and self.in_service < self.capacity:
            started.append(self._line.popleft())
            self.in_service += 1
        return started


class CapacityUpstream:
    """The HTTP side: a request waits for a worker, holds it ``service_ms``, answers 200."""

    def __init__(self, capacity: int, service_ms: float) -> None:
        self.queue: CapacityQueue[asyncio.Future[None]] = CapacityQueue(capacity)
        self.service_ms = service_ms
        self.served = 0

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path == "/_capacity" and request.method == "PUT":
            return self._set(request)
        if request.path == "/_stats":
            return self._stats()
        service_ms = self.service_ms
        if "ms" in request.query:
            service_ms = float(request.query["ms"])
        await self._serve(service_ms)
        self.served += 1
        return web.Response(text="ok\n")

    async def _serve(self, service_ms: float) -> None:
        queue = self.queue
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not queue.arrive(waiter):
            try:
                await waiter
            except asyncio.CancelledError:  # the client went away while waiting
                if waiter.done() and not waiter.cancelled():
                    self._finish()  # its turn had come: pass the worker on
                else:
                    queue.leave(waiter)
                raise
        try:
            await asyncio.sleep(service_ms / 1000)
        finally:
            self._finish()

    def _finish(self) -> None:
        for waiter in self.queue.finish():
            if not waiter.done():
                waiter.set_result(None)

    def _set(self, request: web.BaseRequest) -> web.Response:
        try:
            capacity = int(request.query.get("c", str(self.queue.capacity)))
            service_ms = float(request.query.get("ms", str(self.service_ms)))
            if service_ms < 0:
                raise ValueError("negative service time")
            started = self.queue.set_capacity(capacity)
        except ValueError as exc:
            return web.Response(status=400, text=f"{exc}\n")
        self.service_ms = service_ms
        for waiter in started:
            if not waiter.done():
                waiter.set_result(None)
        return self._stats()

    def _stats(self) -> web.Response:
        queue = self.queue
        body = {
            "capacity": queue.capacity,
            "service_ms": self.service_ms,
            "in_service": queue.in_service,
            "queued": queue.queued,
            "peak_in_flight": queue.peak_in_flight,
            "served": self.served,
        }
        queue.peak_in_flight = queue.in_service + queue.queued
        return web.json_response(body)


async def serve(
    host: str, port: int, capacity: int, service_ms: float, ready: Callable[[int], None]
) -> None:
    """Listen until SIGTERM/SIGINT; ``ready`` gets the bound port (useful with port 0)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.setblocking(False)
    upstream = CapacityUpstream(capacity, service_ms)
    # A client that hangs up leaves the line (aiohttp cancels its handler only when asked).
    server = web.Server(upstream.handle, handler_cancellation=True, access_log=None)
    runner = web.ServerRunner(server, handle_signals=False)
    await runner.setup()
    await web.SockSite(runner, sock, backlog=4096).start()
    ready(sock.getsockname()[1])
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--capacity", type=int, default=8, help="requests served at once (C)")
    parser.add_argument("--service-ms", type=float, default=20.0, help="each request's service")
    args = parser.parse_args()

    def ready(port: int) -> None:
        print(f"capacity upstream listening on {args.host}:{port}", flush=True)

    asyncio.run(serve(args.host, args.port, args.capacity, args.service_ms, ready))


if __name__ == "__main__":
    main()
