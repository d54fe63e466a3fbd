"""Loopback ports for processes a test starts, and the client timeout tests use."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import aiohttp

TIMEOUT = aiohttp.ClientTimeout(total=10)


def _below_ephemeral_ports() -> range:
    """Ports the kernel never hands out as the local end of an outgoing connection."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(10_000, max(low, 11_000))


_PORT_PICKER = random.Random()  # its own: pytest-randomly reseeds `random` for every test
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a process started next to listen on. Taken below the
    ephemeral range: a port that ``bind(0)`` picks is also one an outgoing connection (another
    gateway's to Redis or to an upstream) may take as its local end in the second or two
    before the process binds it, which then fails to start with "address in use". Never the
    same port twice in one test run, so processes started together cannot be given one port,
    and one a test's process may still bind late is not handed to the next test."""
    ports = _below_ephemeral_ports()
    if len(_HANDED_OUT) > len(ports) // 2:
        _HANDED_OUT.clear()
    for _ in range(200):
        port = _PORT_PICKER.choice(ports)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def get_status(session: aiohttp.ClientSession, url: str, **kwargs: object) -> int:
    async with session.get(url, **kwargs) as resp:  # type: ignore[arg-type]
        await resp.read()
        return resp.status
