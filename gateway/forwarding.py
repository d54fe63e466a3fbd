"""What crosses the gateway: request checks against smuggling, and the header rewriting each way.

The gateway always re-frames the upstream request itself (``Content-Length`` or chunked), so any
framing ambiguity in what a client sent is refused here rather than passed on for the upstream to
read differently.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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

_BAD_VALUE_RE = re.compile(rb"[\x00\r\n]")
_TOKEN_RE = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_DIGITS_RE = re.compile(rb"^[0-9]{1,18}$")
# RFC 9110 Host: uri-host [":" port]. A reg-name's comma is refused too: "a, b" reads as a list.
_HOST_RE = re.compile(rb"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~%!$&'()*+;=]+)(:[0-9]{0,5})?$")
# Headers a Connection header may not remove: the request would change meaning upstream.
_NOT_HOP_BY_HOP = frozenset({b"host"})

RawHeaders = Sequence[tuple[bytes, bytes]]


class BadRequest(Exception):
    """A request the gateway refuses with 4xx before anything reaches the upstream."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class RequestFraming:
    """How the request body is framed: a known length, chunked, or no body at all."""

    content_length: int | None
    chunked: bool
    expect_continue: bool

    @property
    def has_body(self) -> bool:
        return self.chunked or bool(self.content_length)


NO_BODY = RequestFraming(content_length=None, chunked=False, expect_continue=False)


def check_request(raw_headers: RawHeaders, version: tuple[int, int]) -> RequestFraming:
    """Refuse ambiguous or malformed framing; return how the body is framed.

    aiohttp's llhttp parser (strict for requests) already refuses most of these; this is the
    gateway's own second line, since a proxy must never forward what two parsers could read
    differently.
    """
    content_length: bytes | None = None
    transfer_encoding: bytes | None = None
    expect: bytes | None = None
    hosts = 0
    for name, value in raw_headers:
        if _BAD_VALUE_RE.search(value) is not None:
            raise BadRequest(400, "control character in header value")
        if _TOKEN_RE.match(name) is None:
            raise BadRequest(400, "invalid header name")
        lname = name.lower()
        if lname == b"content-length":
            if content_length is not None:
                raise BadRequest(400, "duplicate Content-Length")
            content_length = value.strip()
        elif lname == b"transfer-encoding":
            if transfer_encoding is not None:
                raise BadRequest(400, "duplicate Transfer-Encoding")
            transfer_encoding = value.strip()
        elif lname == b"host":
            hosts += 1
            if _HOST_RE.match(value.strip()) is None:
                raise BadRequest(400, "invalid Host")
        elif lname == b"expect":
            expect = value.strip().lower()
    if hosts > 1:
        raise BadRequest(400, "duplicate Host")
    if hosts == 0 and version >= (1, 1):
        raise BadRequest(400, "missing Host")
    if transfer_encoding is not None:
        if content_length is not None:
            raise BadRequest(400, "both Content-Length and Transfer-Encoding")
        if transfer_encoding.lower() != b"chunked" or version < (1, 1):
            raise BadRequest(400, "unsupported Transfer-Encoding")
    length: int | None = None
    if content_length is not None:
        if _DIGITS_RE.match(content_length) is None:
            raise BadRequest(400, "invalid Content-Length")
        length = int(content_length)
    expect_continue = False
    if expect is not None:
        if expect != b"100-continue":
            raise BadRequest(417, "unsupported Expect")
        expect_continue = version >= (1, 1)
    if length is None and transfer_encoding is None and not expect_continue:
        return NO_BODY
    return RequestFraming(length, transfer_encoding is not None, expect_continue)


def connection_tokens(raw_headers: RawHeaders) -> frozenset[bytes]:
    """Header names listed in ``Connection``: hop-by-hop for this one message."""
    tokens: set[bytes] = set()
    for name, value in raw_headers:
        if len(name) == 10 and name.lower() == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b","))
    tokens.discard(b"")
    return frozenset(tokens - _NOT_HOP_BY_HOP)


@dataclass(frozen=True, slots=True)
class ForwardedFor:
    """The forwarding facts the gateway adds to an upstream request."""

    peer_ip: str
    client_ip: str
    proto: str
    host: str | None
    trust_incoming: bool


def build_request_head(
    method: str,
    target: str,
    raw_headers: RawHeaders,
    framing: RequestFraming,
    fwd: ForwardedFor,
    via: bytes,
) -> bytes:
    """The upstream request line and headers, hop-by-hop dropped, framing set by the gateway."""
    named = connection_tokens(raw_headers)
    out = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1")]
    append = out.append
    xff: bytes | None = None
    via_in: bytes | None = None
    proto_in = host_in = False
    for name, value in raw_headers:
        lname = name.lower()
        if lname in _REQUEST_REPLACED or lname in named:
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
        append(name + b": " + value + b"\r\n")
    peer = fwd.peer_ip.encode("latin-1")
    append(b"X-Forwarded-For: " + (xff + b", " + peer if xff else peer) + b"\r\n")
    if not proto_in:
        append(b"X-Forwarded-Proto: " + fwd.proto.encode("latin-1") + b"\r\n")
    if not host_in and fwd.host:
        append(b"X-Forwarded-Host: " + fwd.host.encode("latin-1") + b"\r\n")
    append(b"X-Real-IP: " + fwd.client_ip.encode("latin-1") + b"\r\n")
    append(b"Via: " + (via_in + b", " + via if via_in else via) + b"\r\n")
    if framing.chunked:
        append(b"Transfer-Encoding: chunked\r\n")
    elif framing.content_length is not None:
        append(b"Content-Length: " + str(framing.content_length).encode() + b"\r\n")
    append(b"\r\n")
    return b"".join(out)


def response_headers(
    raw_headers: Iterable[tuple[bytes, bytes]], via: bytes
) -> list[tuple[str, str]]:
    """Upstream response headers to send on: hop-by-hop and framing dropped, ``Via`` appended."""
    raw = list(raw_headers)
    named = connection_tokens(raw)
    out: list[tuple[str, str]] = []
    via_in: bytes | None = None
    for name, value in raw:
        lname = name.lower()
        if lname in _RESPONSE_REPLACED or lname in named:
            continue
        if lname == b"via":
            via_in = value if via_in is None else via_in + b", " + value
            continue
        out.append((name.decode("latin-1"), value.decode("latin-1")))
    out.append(("Via", (via_in + b", " + via if via_in else via).decode("latin-1")))
    return out
