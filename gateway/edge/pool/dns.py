"""Host names to addresses, asked again every ``resolve_interval``: the system's resolver, or a
DNS server the policy names (nginx's ``resolver``), asked directly over UDP for A and AAAA.

The DNS client is the smallest that does the job: one question per datagram, answers matched by
id and question, names decompressed, nothing cached (the pool asks on its own schedule).
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
import struct
from typing import Final

_TYPE_A: Final = 1
_TYPE_AAAA: Final = 28
_CLASS_IN: Final = 1
_MAX_NAME_JUMPS: Final = 32


class ResolveError(Exception):
    """A name that could not be resolved (the pool keeps the addresses it had)."""


def is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolve(
    host: str, port: int, resolver: tuple[str, int] | None, timeout_s: float
) -> list[str]:
    """The addresses of ``host``, in the order given, without repeats; ``ResolveError`` if none."""
    if is_address(host):
        return [host]
    if resolver is None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError) as exc:
            raise ResolveError(f"{host}: {exc or 'timed out'}") from None
        addresses = [str(info[4][0]) for info in infos]
    else:
        addresses = []
        for qtype in (_TYPE_A, _TYPE_AAAA):
            addresses += await query(host, qtype, resolver, timeout_s)
    unique = list(dict.fromkeys(addresses))
    if not unique:
        raise ResolveError(f"{host}: no address")
    return unique


def encode_query(ident: int, name: str, qtype: int) -> bytes:
    labels = b"".join(
        bytes([len(label)]) + label
        for label in (p.encode("idna") for p in name.rstrip(".").split("."))
    )
    return (
        struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0)
        + labels
        + b"\0"
        + struct.pack("!HH", qtype, _CLASS_IN)
    )


def _skip_name(data: bytes, offset: int) -> int:
    """The offset just after the (possibly compressed) name at ``offset``."""
    while True:
        if offset >= len(data):
            raise ResolveError("truncated DNS answer")
        length = data[offset]
        if length & 0xC0 == 0xC0:
            return offset + 2
        if length == 0:
            return offset + 1
        offset += 1 + length


def decode_answer(data: bytes, ident: int, qtype: int) -> list[str]:
    """The addresses of type ``qtype`` in a DNS response to query ``ident``."""
    if len(data) < 12:
        raise ResolveError("truncated DNS answer")
    got_id, flags, questions, answers, _, _ = struct.unpack("!HHHHHH", data[:12])
    if got_id != ident or not flags & 0x8000:
        raise ResolveError("DNS answer to another question")
    rcode = flags & 0x000F
    if rcode == 3:
        return []  # no such name
    if rcode != 0:
        raise ResolveError(f"DNS server answered rcode {rcode}")
    offset = 12
    for _ in range(questions):
        offset = _skip_name(data, offset) + 4
    out: list[str] = []
    for _ in range(answers):
        offset = _skip_name(data, offset)
        if offset + 10 > len(data):
            raise ResolveError("truncated DNS answer")
        rtype, rclass, _ttl, length = struct.unpack("!HHIH", data[offset : offset + 10])
        offset += 10
        rdata = data[offset : offset + length]
        offset += length
        if len(rdata) != length:
            raise ResolveError("truncated DNS answer")
        if rclass != _CLASS_IN or rtype != qtype:
            continue  # a CNAME on the way, say: its target's records follow
        if rtype == _TYPE_A and length == 4:
            out.append(str(ipaddress.IPv4Address(rdata)))
        elif rtype == _TYPE_AAAA and length == 16:
            out.append(str(ipaddress.IPv6Address(rdata)))
    return out


class _Exchange(asyncio.DatagramProtocol):
    def __init__(self, ident: int, qtype: int) -> None:
        self.ident = ident
        self.qtype = qtype
        self.result: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        if self.result.done():
            return
        try:
            self.result.set_result(decode_answer(data, self.ident, self.qtype))
        except ResolveError as exc:
            if "another question" not in str(exc):
                self.result.set_exception(exc)

    def error_received(self, exc: Exception) -> None:
        if not self.result.done():
            self.result.set_exception(ResolveError(f"DNS server unreachable: {exc}"))


async def query(name: str, qtype: int, server: tuple[str, int], timeout_s: float) -> list[str]:
    """One question to ``server``: the addresses of ``name`` of type ``qtype``."""
    loop = asyncio.get_running_loop()
    ident = random.getrandbits(16)
    transport, protocol = await loop.create_datagram_endpoint(
        lambda: _Exchange(ident, qtype), remote_addr=server
    )
    try:
        transport.sendto(encode_query(ident, name, qtype))
        async with asyncio.timeout(timeout_s):
            return await protocol.result
    except TimeoutError:
        raise ResolveError(f"{name}: DNS server {server[0]}:{server[1]} did not answer") from None
    finally:
        transport.close()
