"""Client IP resolution behind trusted proxies: the key every per-IP limit depends on.

Semantics follow nginx ``realip`` with ``real_ip_recursive on``: the TCP peer is the client unless
it is a trusted proxy; then the forwarding header is walked from the right, past trusted hops, and
the first address that is not trusted is the client. If every hop is trusted, the left-most one is.
A client that is not trusted never has its headers read, so it cannot choose its own key.

Anything the walk cannot use stops it, and the address to its right (the view of the last trusted
hop) is the answer: a malformed entry, an RFC 7239 ``for=unknown`` or obfuscated ``for=_id``, a
``Forwarded`` element without ``for=``. A proxy-written part of the header is therefore always
read correctly, whatever garbage the client put to its left.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Final, Literal

from gateway.limits.addresses import CACHE_SIZE, client_key, format_address, pack_address

__all__ = ["UNKNOWN_PEER", "ClientIPResolver", "client_key"]

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

UNKNOWN_PEER: Final = "0.0.0.0"
"""What ``resolve`` returns when the transport has no peer address (a Unix socket, say)."""

_MAPPED_V4: Final = ipaddress.IPv6Network("::ffff:0:0/96")


# RFC 7239 is parsed right to left, on the reversed header, so that the proxies' elements at the
# right are read before any client-written text at the left can confuse the parser (an
# unterminated quote, say). In the reversed text a quoted-string's inner '"' is always followed
# by the '\' that escaped it, and its closing quote by '=', so the match is unambiguous and linear.
_TCHAR: Final = r"[!#$%&'*+.^_`|~0-9A-Za-z-]"
_REVERSED_PAIR: Final = re.compile(
    rf'[ \t]*(?:(?:({_TCHAR}++)|"((?:[^"]|"\\)*+)")=({_TCHAR}++)[ \t]*)?'
)
_QUOTED_CONTENT: Final = re.compile(r"(?:[\t !#-\[\]-~]|\\[\t !-~])*+")
_QUOTED_PAIR: Final = re.compile(r"\\([\t !-~])")


def _normalise_network(network: IPNetwork) -> IPNetwork:
    """``::ffff:10.0.0.0/104`` -> ``10.0.0.0/8``, since mapped addresses are compared as IPv4."""
    if (
        isinstance(network, ipaddress.IPv6Network)
        and network.prefixlen >= 96
        and network.subnet_of(_MAPPED_V4)
    ):
        v4 = ipaddress.IPv4Address(int(network.network_address) & 0xFFFFFFFF)
        return ipaddress.IPv4Network((v4, network.prefixlen - 96))
    return network


# A hop as the walk sees it: the normalised address and whether it is a trusted proxy.
_Hop = tuple[str, bool]


def _make_classifier(
    networks: Sequence[IPNetwork], cache_size: int
) -> Callable[[str], _Hop | None]:
    """One function from hop text to ``(address, trusted)``, None if the text is no address.

    The same few proxies and clients repeat, so results are kept in a bounded LRU: a hit is
    cheaper than a parse.
    """
    # (network, mask) as integers: a masked compare is the whole membership test.
    v4 = tuple((int(n.network_address), int(n.netmask)) for n in networks if n.version == 4)
    v6 = tuple((int(n.network_address), int(n.netmask)) for n in networks if n.version == 6)

    def classify(text: str) -> _Hop | None:
        packed = pack_address(text)
        if packed is None:
            return None
        value = int.from_bytes(packed)
        trusted = any(value & mask == net for net, mask in (v4 if len(packed) == 4 else v6))
        return format_address(packed), trusted

    return functools.lru_cache(maxsize=cache_size)(classify) if cache_size else classify


def _xff_entries(header_values: Sequence[str]) -> Iterator[str | None]:
    """X-Forwarded-For entries, right-most first; empty elements skipped (RFC 9110 5.6.1)."""
    joined = header_values[0] if len(header_values) == 1 else ",".join(header_values)
    for raw in reversed(joined.split(",")):
        entry = raw.strip(" \t")
        if entry:
            yield entry


def _forwarded_nodes(header_values: Sequence[str]) -> Iterator[str | None]:
    """RFC 7239 ``for=`` values, right-most element first; None where the walk must stop.

    An element that is malformed, lacks ``for=`` or repeats it yields None; empty elements are
    skipped like any empty list element.
    """
    text = (header_values[0] if len(header_values) == 1 else ",".join(header_values))[::-1]
    end = len(text)
    pos = 0
    node: str | None = None
    pairs = 0
    while True:
        match = _REVERSED_PAIR.match(text, pos)
        assert match is not None  # every part of the pattern is optional
        reversed_token, reversed_quoted, reversed_name = match.groups()
        if reversed_name is not None:
            pairs += 1
            if reversed_name.lower() == "rof":
                if node is not None:
                    yield None  # "for" twice in one element (RFC 7239 section 4: MUST NOT)
                    return
                if reversed_token is not None:
                    node = reversed_token[::-1]
                else:
                    assert reversed_quoted is not None
                    content = reversed_quoted[::-1]
                    if not _QUOTED_CONTENT.fullmatch(content):
                        yield None
                        return
                    node = _QUOTED_PAIR.sub(r"\1", content)
        pos = match.end()
        separator = text[pos] if pos < end else ","
        if separator == ";":
            pos += 1
            continue
        if separator != ",":
            yield None  # text that is neither a pair nor a separator
            return
        if node is not None:
            yield node
        elif pairs:
            yield None  # an element that does not say for whom it was forwarded
            return
        if pos >= end:
            return
        pos += 1
        node = None
        pairs = 0


class ClientIPResolver:
    """Resolves the client address of a request from its peer and its forwarding header."""

    __slots__ = ("_classify", "_entries", "_has_trusted", "_header_name")

    def __init__(
        self,
        trusted_cidrs: Sequence[str],
        header: Literal["x-forwarded-for", "forwarded"] = "x-forwarded-for",
        *,
        cache_size: int = CACHE_SIZE,
    ) -> None:
        """Parse the trusted networks once; ``cache_size=0`` turns the parse cache off."""
        if isinstance(trusted_cidrs, str):
            raise TypeError("trusted_cidrs must be a sequence of CIDR strings, not one string")
        if header not in ("x-forwarded-for", "forwarded"):
            raise ValueError(
                f"unsupported client IP header {header!r}: use 'x-forwarded-for' or 'forwarded'"
            )
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        networks: list[IPNetwork] = []
        for cidr in trusted_cidrs:
            try:
                # strict=False: "10.1.2.3/8" means 10.0.0.0/8, as in nginx set_real_ip_from.
                network = ipaddress.ip_network(cidr.strip(), strict=False)
            except ValueError as exc:
                raise ValueError(f"invalid trusted proxy CIDR {cidr!r}: {exc}") from None
            networks.append(_normalise_network(network))
        self._has_trusted = bool(networks)
        self._classify = _make_classifier(tuple(networks), cache_size)
        self._header_name: str = header
        self._entries = _xff_entries if header == "x-forwarded-for" else _forwarded_nodes

    @property
    def header_name(self) -> str:
        """The lower-case name of the header to pass to ``resolve``."""
        return self._header_name

    def is_trusted(self, peer: str | None) -> bool:
        """Whether ``peer`` is a trusted proxy, so that its forwarding header is believed."""
        if peer is None or not self._has_trusted:
            return False
        hop = self._classify(peer)
        return hop is not None and hop[1]

    def resolve(self, peer: str | None, header_values: Sequence[str]) -> str:
        """The client address: the peer, or from ``header_values`` if the peer is trusted.

        ``header_values`` are all lines of ``header_name`` in the order received. Never raises; a
        peer that is not an IP address is returned unchanged.
        """
        if peer is None:
            return UNKNOWN_PEER
        hop = self._classify(peer)
        if hop is None:
            return peer
        address, trusted = hop
        if not trusted or not header_values:
            return address
        for entry in self._entries(header_values):
            if entry is None:
                break
            hop = self._classify(entry)
            if hop is None:
                break
            address, trusted = hop
            if not trusted:
                break
        return address
