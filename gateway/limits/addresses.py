"""Client addresses as the limits key them: parsed strictly, and an IPv6 client grouped by its
prefix. Here, below the edge, so that a request's facts (``keys.RequestFacts.of``) are made in
one place by the proxy, ``/explain`` and ``gateway replay`` alike."""

from __future__ import annotations

import functools
import re
import socket
from typing import Final

CACHE_SIZE: Final = 4096
_MAPPED_PREFIX: Final = bytes(10) + b"\xff\xff"
# A port after an address: digits, or an RFC 7239 obfuscated port ("_abc").
_PORT: Final = re.compile(r"[0-9]{1,5}|_[A-Za-z0-9._-]+")


def pack_address(text: str) -> bytes | None:
    """The address in one hop as 4 or 16 bytes, IPv4-mapped IPv6 as IPv4; None if it has none.

    Accepts "1.2.3.4", "1.2.3.4:80", "2001:db8::1", "[2001:db8::1]:80" and zone ids
    ("fe80::1%eth0"); ports and zones are dropped. ``inet_pton`` is the strict C parser (no
    leading zeros, no short forms) and many times faster than ``ipaddress`` (bench/README.md).
    """
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            return None
        host, rest = text[1:close], text[close + 1 :]
        if rest and not (rest[0] == ":" and _PORT.fullmatch(rest, 1)):
            return None
        if ":" not in host:
            return None  # brackets are for IPv6 only
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
        if not _PORT.fullmatch(port):
            return None
    else:
        host = text
    try:
        if ":" not in host:
            return socket.inet_pton(socket.AF_INET, host)
        # A zone id names an interface of the proxy, not a client.
        packed = socket.inet_pton(socket.AF_INET6, host.partition("%")[0])
    except (OSError, ValueError):  # ValueError: NUL or non-ASCII text
        return None
    return packed[12:] if packed.startswith(_MAPPED_PREFIX) else packed


def format_address(packed: bytes) -> str:
    """The canonical text of a packed address (RFC 5952 form for IPv6)."""
    return socket.inet_ntop(socket.AF_INET if len(packed) == 4 else socket.AF_INET6, packed)


def request_client_key(ip: str, ipv6_prefix: int) -> str:
    """``client_key`` as a request's facts take it: an IPv4 address (its own key) without
    the cache's lookup, which costs more than the answer (compiled, some 700 instructions a
    request: the call through ``lru_cache``, its key's hash; bench/README.md, "Fifth round")."""
    if ":" not in ip and 0 <= ipv6_prefix <= 128:
        return ip
    return client_key(ip, ipv6_prefix)


@functools.lru_cache(maxsize=CACHE_SIZE)
def client_key(ip: str, ipv6_prefix: int = 64) -> str:
    """The per-IP limit key: an IPv4 address as is, an IPv6 address as its ``/ipv6_prefix``.

    One IPv6 client usually holds a whole /64, so keying on single addresses would let it
    rotate through keys. Text that is not an IP address is its own key.
    """
    if not 0 <= ipv6_prefix <= 128:
        raise ValueError(f"ipv6_prefix must be between 0 and 128, got {ipv6_prefix}")
    if ":" not in ip:
        return ip
    packed = pack_address(ip)
    if packed is None:
        return ip
    if len(packed) == 4:
        return format_address(packed)
    host_bits = 128 - ipv6_prefix
    network = int.from_bytes(packed) >> host_bits << host_bits
    return f"{format_address(network.to_bytes(16))}/{ipv6_prefix}"
