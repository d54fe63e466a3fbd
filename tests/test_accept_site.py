"""The proxy listener accepts every connection waiting in the kernel's queue at once, on the
loop the gateway runs on (uvloop's own server takes one per loop turn: bench/README.md,
"Fairness at 256 connections"). Counted in loop turns, not timed."""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import struct
import time

import pytest
from aiohttp import web

from gateway.serving.accept_site import AcceptSite, BatchAcceptor

PENDING = 64
# Loop turns from the listener's readiness to aiohttp holding a connection: the accept, the
# task that opens the transport, ``connection_made``; and a few to spare.
MOST_TURNS = 8


def accept_queue_length(sock: socket.socket) -> int:
    """Connections the kernel holds for ``accept`` (Linux: ``tcpi_unacked`` of a listener)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    return int(struct.unpack_from("I", info, 24)[0])


def wait_for_accept_queue(sock: socket.socket, length: int) -> None:
    """Until the kernel holds ``length`` connections (the handshakes end outside the loop)."""
    deadline = time.monotonic() + 5.0
    while accept_queue_length(sock) < length:
        assert time.monotonic() < deadline, f"the kernel queued {accept_queue_length(sock)}"
        time.sleep(0.001)


async def _turns_to_take(pending: int) -> tuple[int, int]:
    """Loop turns until aiohttp holds ``pending`` connections that connected at once, and how
    many the listener accepted at its first readiness."""

    async def hello(request: web.BaseRequest) -> web.Response:
        return web.Response(text="ok")

    server = web.Server(hello)
    runner = web.ServerRunner(server)
    await runner.setup()
    site = AcceptSite(runner, "127.0.0.1", 0, backlog=1024, reuse_port=None)
    await site.start()
    clients: list[socket.socket] = []
    try:
        acceptor = site._server
        assert isinstance(acceptor, BatchAcceptor)
        (listener,) = acceptor.sockets
        for _ in range(pending):
            clients.append(socket.create_connection(("127.0.0.1", site.port)))
        wait_for_accept_queue(listener, pending)
        turns = 0
        while len(server.connections) < pending and turns < 10 * pending:
            await asyncio.sleep(0)  # one turn of the loop
            turns += 1
        assert len(server.connections) == pending
        return turns, acceptor.accepted
    finally:
        for client in clients:
            client.close()
        await runner.cleanup()


def test_waiting_connections_are_accepted_together_on_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        turns, accepted = runner.run(_turns_to_take(PENDING))
    assert accepted == PENDING
    assert turns <= MOST_TURNS


async def test_waiting_connections_are_accepted_together_on_asyncio() -> None:
    turns, accepted = await _turns_to_take(PENDING)
    assert accepted == PENDING
    assert turns <= MOST_TURNS


async def test_a_closed_site_accepts_nothing_more() -> None:
    async def hello(request: web.BaseRequest) -> web.Response:
        return web.Response(text="ok")

    runner = web.ServerRunner(web.Server(hello))
    await runner.setup()
    site = AcceptSite(runner, "127.0.0.1", 0, backlog=16, reuse_port=None)
    await site.start()
    port = site.port
    assert runner.addresses == [("127.0.0.1", port)]
    await runner.cleanup()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


async def test_out_of_file_descriptors_pauses_accepting_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """EMFILE: the listener stays readable, so accepting again at once would spin; it pauses
    (the loop retries after ``ACCEPT_RETRY_DELAY_S``) with one line, and the waiting connections
    are accepted once descriptors are free again."""

    async def hello(request: web.BaseRequest) -> web.Response:
        return web.Response(text="ok")

    runner = web.ServerRunner(web.Server(hello))
    await runner.setup()
    site = AcceptSite(runner, "127.0.0.1", 0, backlog=16, reuse_port=None)
    await site.start()
    clients: list[socket.socket] = []
    try:
        acceptor = site._server
        assert isinstance(acceptor, BatchAcceptor)
        (listener,) = acceptor.sockets
        for _ in range(4):
            clients.append(socket.create_connection(("127.0.0.1", site.port)))
        wait_for_accept_queue(listener, 4)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        lowest_free = os.dup(0)
        os.close(lowest_free)
        # Every descriptor below the limit is taken: the next accept fails with EMFILE.
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
        try:
            with caplog.at_level(logging.ERROR, logger="gateway.listener"):
                assert acceptor.accept_pending(listener) == 0
                assert acceptor.accept_pending(listener) == 0
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert not acceptor.is_serving()
        lines = [r.getMessage() for r in caplog.records if r.name == "gateway.listener"]
        assert len(lines) == 1 and "cannot accept connections" in lines[0], lines
        acceptor.start()  # what the retry timer does
        assert acceptor.accept_pending(listener) == 4
    finally:
        for client in clients:
            client.close()
        await runner.cleanup()
