"""What crosses the gateway: request checks against smuggling, and the header rewriting each way.

The gateway always re-frames the upstream request itself (``Content-Length`` or chunked), so any
framing ambiguity in what a client sent is refused here rather than passed on for the upstream to
read differently.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Final

# RFC 9110 section 7.6.1, plus the non-standard ones proxies conventionally drop.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Request headers the gateway sets or re-frames itself.
_REQUEST_REPLACED = HOP_BY_HOP | {b"content-length", b"expect", b"x-real-ip"}
_RESPONSE_REPLACED = HOP_BY_HOP | {b"content-length"}
# No header hidden beyond those (the default of the response filters).
_NONE: Final[frozenset[bytes]] = frozenset()

_DIGITS_RE = re.compile(rb"^[0-9]{1,18}$")
# RFC 9110 Host: uri-host [":" port]. A reg-name's comma is refused too: "a, b" reads as a list.
_HOST_RE = re.compile(rb"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~%!$&'()*+;=]+)(:[0-9]{0,5})?$")
# Host values already found valid, so a client's repeated Host costs a set lookup, not the
# pattern's match (some 2,400 instructions a request compiled); cleared when full, so a client
# sending ever-new hosts costs the match each time and no memory.
_VALID_HOSTS: set[bytes] = set()
_VALID_HOSTS_MAX: Final = 1024
# Header names in lower case, by the name as sent: the same few names come on every request,
# and a lookup here costs some 100 instructions where compiled code's call of ``bytes.lower``
# costs about 650 (a method found by name). Cleared when full: a client sending ever-new
# names costs the call each time and no memory.
_LOWER_NAMES: dict[bytes, bytes] = {}
_LOWER_NAMES_MAX: Final = 512
# Headers a Connection header may not remove: the request would change meaning upstream.
_NOT_HOP_BY_HOP = frozenset({b"host"})

RawHeaders = Sequence[tuple[bytes, bytes]]


class BadRequest(Exception):
    """A request the gateway refuses with 4xx before anything reaches the upstream."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class BadFraming(BadRequest):
    """Where the body ends cannot be trusted: answer and close at once, reading nothing more."""

    def __init__(self, reason: str) -> None:
        super().__init__(400, reason)


class RequestFraming:
    """How the request body is framed: a known length, chunked, or no body at all. (Plain
    classes here and below, not dataclasses: compiled, a dataclass's ``__init__`` is the one
    ``dataclasses`` writes at run time, interpreted, and a frozen one's sets every field through
    ``object.__setattr__``.)"""

    __slots__ = ("chunked", "connection", "content_length", "expect_continue", "has_body")

    def __init__(
        self,
        content_length: int | None,
        chunked: bool,
        expect_continue: bool,
        connection: frozenset[bytes] = frozenset(),
    ) -> None:
        self.content_length = content_length
        self.chunked = chunked
        self.expect_continue = expect_continue
        self.connection = connection  # header names the Connection header lists
        self.has_body = chunked or bool(content_length)


NO_BODY = RequestFraming(content_length=None, chunked=False, expect_continue=False)


def check_request(raw_headers: RawHeaders, version: tuple[int, int]) -> RequestFraming:
    """Refuse ambiguous or malformed framing; return how the body is framed.

    aiohttp's llhttp parser (strict for requests) already refuses most of these, and all of
    control characters and invalid names (tests/test_hostile_requests.py holds it to that);
    this is the gateway's own second line for framing, since a proxy must never forward what
    two parsers could read differently. It runs on every request: one pass, no regex per header.
    """
    content_length: bytes | None = None
    transfer_encoding: bytes | None = None
    expect: bytes | None = None
    connection: set[bytes] | None = None
    hosts = 0
    for name, value in raw_headers:
        lname = lower_name(name)
        if lname == b"content-length":
            if content_length is not None:
                raise BadFraming("duplicate Content-Length")
            content_length = value.strip()
        elif lname == b"transfer-encoding":
            if transfer_encoding is not None:
                raise BadFraming("duplicate Transfer-Encoding")
            transfer_encoding = value.strip()
        elif lname == b"host":
            hosts += 1
            if not _valid_host(value.strip()):
                raise BadRequest(400, "invalid Host")
        elif lname == b"expect":
            expect = value.strip().lower()
        elif lname == b"connection":
            if connection is None:
                connection = set()
            connection.update(t.strip().lower() for t in value.split(b","))
    if hosts > 1:
        raise BadRequest(400, "duplicate Host")
    if hosts == 0 and version >= (1, 1):
        raise BadRequest(400, "missing Host")
    if transfer_encoding is not None:
        if content_length is not None:
            raise BadFraming("both Content-Length and Transfer-Encoding")
        if transfer_encoding.lower() != b"chunked" or version < (1, 1):
            raise BadFraming("unsupported Transfer-Encoding")
    length: int | None = None
    if content_length is not None:
        if _DIGITS_RE.match(content_length) is None:
            raise BadFraming("invalid Content-Length")
        length = int(content_length)
    expect_continue = False
    if expect is not None:
        if expect != b"100-continue":
            raise BadRequest(417, "unsupported Expect")
        expect_continue = version >= (1, 1)
    named = _named_hop_by_hop(connection) if connection else frozenset()
    if length is None and transfer_encoding is None and not expect_continue and not named:
        return NO_BODY
    return RequestFraming(length, transfer_encoding is not None, expect_continue, named)


def lower_name(name: bytes) -> bytes:
    """``name.lower()``, remembered (``_LOWER_NAMES``)."""
    lower = _LOWER_NAMES.get(name)
    if lower is None:
        lower = name.lower()
        if len(_LOWER_NAMES) >= _LOWER_NAMES_MAX:
            _LOWER_NAMES.clear()
        _LOWER_NAMES[name] = lower
    return lower


def _valid_host(host: bytes) -> bool:
    """RFC 9110 Host syntax (``_HOST_RE``), remembered for the values that pass."""
    if host in _VALID_HOSTS:
        return True
    if _HOST_RE.match(host) is None:
        return False
    if len(_VALID_HOSTS) >= _VALID_HOSTS_MAX:
        _VALID_HOSTS.clear()
    _VALID_HOSTS.add(host)
    return True


def _named_hop_by_hop(tokens: set[bytes]) -> frozenset[bytes]:
    """What a Connection header adds to the standard hop-by-hop set (never Host)."""
    return frozenset(tokens - HOP_BY_HOP - _NOT_HOP_BY_HOP - {b""})


class ForwardedFor:
    """The forwarding facts the gateway adds to an upstream request."""

    __slots__ = ("client_ip", "host", "peer_ip", "proto", "trust_incoming")

    def __init__(
        self, peer_ip: str, client_ip: str, proto: str, host: str | None, trust_incoming: bool
    ) -> None:
        self.peer_ip = peer_ip
        self.client_ip = client_ip
        self.proto = proto
        self.host = host
        self.trust_incoming = trust_incoming


def build_request_head(
    method: str,
    target: str,
    raw_headers: RawHeaders,
    framing: RequestFraming,
    fwd: ForwardedFor,
    via: bytes,
    *,
    underscores: bool = False,
) -> bytes:
    """The upstream request line and headers, hop-by-hop dropped, framing set by the gateway.

    Header names with an underscore are dropped unless ``underscores`` (nginx's
    ``underscores_in_headers``): some servers (CGI, WSGI, PHP) read ``X_Real_IP`` as
    ``X-Real-IP``, so a client could pass one off as a header the gateway sets or drops.
    """
    named = framing.connection
    out = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1")]
    xff: bytes | None = None
    via_in: bytes | None = None
    proto_in = host_in = False
    for name, value in raw_headers:
        lname = lower_name(name)
        if lname in _REQUEST_REPLACED or (named and lname in named):
            continue
        # ``find``, not ``in``: CPython's ``bytes.__contains__`` first tries its operand as an
        # integer and formats the TypeError it then drops (some 1,800 instructions a header).
        if not underscores and lname.find(b"_") >= 0:
            continue
        if lname == b"x-forwarded-for":
            xff = value if xff is None else xff + b", " + value
            continue
        if lname == b"via":
            via_in = value if via_in is None else via_in + b", " + value
            continue
        if lname == b"x-forwarded-proto":
            if not fwd.trust_incoming or proto_in:
                continue
            proto_in = True
        elif lname == b"x-forwarded-host":
            if not fwd.trust_incoming or host_in:
                continue
            host_in = True
        out.append(b"%s: %s\r\n" % (name, value))
    peer = fwd.peer_ip.encode("latin-1")
    out.append(b"X-Forwarded-For: " + (xff + b", " + peer if xff else peer) + b"\r\n")
    if not proto_in:
        out.append(b"X-Forwarded-Proto: " + fwd.proto.encode("latin-1") + b"\r\n")
    if not host_in and fwd.host:
        out.append(b"X-Forwarded-Host: " + fwd.host.encode("latin-1") + b"\r\n")
    out.append(b"X-Real-IP: " + fwd.client_ip.encode("latin-1") + b"\r\n")
    out.append(b"Via: " + (via_in + b", " + via if via_in else via) + b"\r\n")
    if framing.chunked:
        out.append(b"Transfer-Encoding: chunked\r\n")
    elif framing.content_length is not None:
        out.append(b"Content-Length: " + str(framing.content_length).encode() + b"\r\n")
    out.append(b"\r\n")
    return b"".join(out)


def forwarded_response_fields(
    raw_headers: Iterable[tuple[bytes, bytes]], via: bytes, hidden: frozenset[bytes] = _NONE
) -> tuple[list[tuple[bytes, bytes]], bool]:
    """The upstream's response headers to send on, and whether they hold a ``Date``: the one
    hop-by-hop filter of responses (hop-by-hop, what its Connection header names and framing
    dropped, ``Via`` extended with ours), whatever serialises them. ``hidden``: lower-case
    names dropped too (the cost headers upstreams report to the gateway's limits).

    One pass; the rare Connection header that names extra headers costs a second, filtering one.
    """
    kept: list[tuple[bytes, bytes]] = []
    via_in: bytes | None = None
    connection: set[bytes] | None = None
    has_date = False
    for name, value in raw_headers:
        lname = lower_name(name)
        if lname in _RESPONSE_REPLACED:
            if lname == b"connection":
                if connection is None:
                    connection = set()
                connection.update(t.strip().lower() for t in value.split(b","))
            continue
        if hidden and lname in hidden:
            continue
        if lname == b"via":
            via_in = value if via_in is None else via_in + b", " + value
            continue
        if lname == b"date":
            has_date = True
        kept.append((name, value))
    if connection:
        named = _named_hop_by_hop(connection)
        if named:
            kept = [(name, value) for name, value in kept if name.lower() not in named]
    kept.append((b"Via", via_in + b", " + via if via_in else via))
    return kept, has_date


def response_headers(
    raw_headers: Iterable[tuple[bytes, bytes]], via: bytes, hidden: frozenset[bytes] = _NONE
) -> list[tuple[str, str]]:
    """``forwarded_response_fields`` as text, for aiohttp's response objects."""
    kept, _ = forwarded_response_fields(raw_headers, via, hidden)
    return [(name.decode("latin-1"), value.decode("latin-1")) for name, value in kept]


def response_head(
    status: int,
    reason: bytes,
    raw_headers: Iterable[tuple[bytes, bytes]],
    via: bytes,
    extra: bytes,
    content_length: int,
    keep_alive: bool,
    date: bytes,
    hidden: frozenset[bytes] = _NONE,
) -> bytes:
    """A whole HTTP/1.1 response head in bytes, for bodies the gateway already holds whole.

    The headers ``forwarded_response_fields`` keeps, without decoding every header to ``str``
    and back through aiohttp's response object (on a small proxied response that object is a
    large part of the gateway's own CPU time); ``extra`` is a block of whole header lines (the
    rate-limit headers, encoded by the engine), copied as it is.
    """
    kept, has_date = forwarded_response_fields(raw_headers, via, hidden)
    out = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]  # an empty reason is valid (RFC 9112)
    for name, value in kept:
        out.append(b"%s: %s\r\n" % (name, value))
    if not has_date:
        out.append(b"Date: " + date + b"\r\n")
    out.append(extra)
    out.append(b"Content-Length: %d\r\n" % content_length)
    if not keep_alive:
        out.append(b"Connection: close\r\n")
    out.append(b"\r\n")
    return b"".join(out)
