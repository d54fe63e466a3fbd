"""What the pool tests stand up: backends that say who they are and misbehave on demand, a
backend that hangs up mid-request, a DNS server whose answers the test changes, and a policy
for a gateway process in front of them."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass, field
from typing import cast

from aiohttp import web


@dataclass
class Backend:
    """A real upstream server on ``host:port`` that answers ``backend NAME`` and counts."""

    name: str
    host: str = "127.0.0.1"
    port: int = 0
    delay_s: float = 0.0
    fail_every: int = 0  # answer 503 to every n-th request (2: half of them)
    status: int = 200
    health_status: int = 200  # the answer to GET /healthz (not counted in ``requests``)
    health_checks: int = 0
    requests: int = 0
    seen: list[str] = field(default_factory=list)  # a header's values, when asked to keep them
    keep_header: str = ""
    runner: web.ServerRunner | None = None

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path == "/healthz":
            self.health_checks += 1
            return web.Response(status=self.health_status, text=f"health {self.name}")
        self.requests += 1
        if self.keep_header:
            self.seen.append(request.headers.get(self.keep_header, ""))
        await request.read()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_every and self.requests % self.fail_every == 0:
            return web.Response(status=503, text=f"backend {self.name} failing")
        return web.Response(status=self.status, text=f"backend {self.name}")

    async def start(self) -> Backend:
        self.runner = web.ServerRunner(web.Server(self.handle), shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port, reuse_address=True)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        """Gone at once: the listener closed and open connections cut."""
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class HangUp:
    """A raw server that reads a request head and part of its body, then resets the connection:
    counts the requests that reached it."""

    def __init__(self) -> None:
        self.attempts = 0
        self.server: asyncio.Server | None = None
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            self.attempts += 1
            with contextlib.suppress(TimeoutError, OSError, asyncio.IncompleteReadError):
                async with asyncio.timeout(0.3):
                    await reader.read(10)  # some of the body, if one comes
        except (asyncio.IncompleteReadError, OSError, asyncio.LimitOverrunError):
            pass
        sock = writer.get_extra_info("socket")
        if sock is not None:  # RST, not FIN: the connection is cut, not finished
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()

    async def start(self) -> HangUp:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class DnsServer(asyncio.DatagramProtocol):
    """Answers A questions for the names in ``records`` (others: NXDOMAIN); the test changes
    ``records`` as a cluster's endpoints change."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.questions = 0
        self.transport: asyncio.DatagramTransport | None = None
        self.port = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        self.questions += 1
        ident = data[:2]
        offset, labels = 12, []
        while data[offset]:
            length = data[offset]
            labels.append(data[offset + 1 : offset + 1 + length].decode())
            offset += 1 + length
        question = data[12 : offset + 5]
        qtype = struct.unpack("!H", data[offset + 1 : offset + 3])[0]
        name = ".".join(labels)
        addresses = self.records.get(name)
        rcode = 3 if addresses is None else 0
        answers = b""
        count = 0
        if addresses is not None and qtype == 1:
            for address in addresses:
                count += 1
                answers += b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 5, 4)
                answers += socket.inet_aton(address)
        flags = 0x8180 | rcode
        reply = ident + struct.pack("!HHHHH", flags, 1, count, 0, 0) + question + answers
        assert self.transport is not None
        self.transport.sendto(reply, addr)

    async def start(self) -> DnsServer:
        loop = asyncio.get_running_loop()
        await loop.create_datagram_endpoint(lambda: self, local_addr=("127.0.0.1", 0))
        assert self.transport is not None
        self.port = self.transport.get_extra_info("sockname")[1]
        return self

    def stop(self) -> None:
        if self.transport is not None:
            self.transport.close()


def process_policy(body: str) -> str:
    """``body`` (upstreams, routes...) as a template for the ``gateway_process`` fixture: its
    listeners filled in at start, its own braces (YAML flow mappings) kept."""
    escaped = body.replace("{", "{{").replace("}", "}}")
    return "server:\n  listen: 127.0.0.1:{port}\n  admin_listen: 127.0.0.1:{admin_port}\n" + escaped
