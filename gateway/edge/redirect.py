"""A plain-HTTP listener that sends every request to HTTPS, as nginx's
``return 301 https://$host$request_uri`` does in a ``server`` block of its own.

The answer names the host the client's Host header already names (its port replaced by the
HTTPS one), never another: a Host that is not a host name or an IP literal is refused with 400,
as is a request without one. Like nginx's ``return`` (its rewrite phase runs before
``limit_req``), a redirect is not rate-limited, and nothing reaches an upstream.
"""

from __future__ import annotations

import re
from typing import Final

from aiohttp import web
from aiohttp.web_request import BaseRequest

from gateway.edge.responses import SERVER, error_response
from gateway.edge.server import GatewayProtocol
from gateway.limits.routing import RefusedTarget, origin_form

# A Host header: a DNS name or an IPv4 address, or an IPv6 literal in brackets; then a port.
_HOST_RE: Final = re.compile(
    r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.\-]*[A-Za-z0-9])?)(?::\d{1,5})?"
)
_KEEPS_METHOD: Final = 308  # POST stays POST, its body resent
_FOR_READS: Final = 301  # GET and HEAD: the permanent redirect every client knows
HTTPS_PORT: Final = 443


def https_location(host_header: str, target: str, port: int) -> str:
    """``https://`` the Host header's host (without its port), ``port`` unless 443, and the
    target; ``ValueError`` for a Host that names no host."""
    match = _HOST_RE.fullmatch(host_header.strip())
    if match is None:
        raise ValueError("invalid Host header")
    host = match.group(1).lower()
    authority = host if port == HTTPS_PORT else f"{host}:{port}"
    return f"https://{authority}{'/' if target == '*' else target}"


class HttpsRedirect:
    """The handler of a redirecting listener: ``port`` the HTTPS one clients reach, ``status``
    the one the policy sets (None: 301 for GET and HEAD, 308 for the rest)."""

    __slots__ = ("port", "status")

    def __init__(self, port: int, status: int | None) -> None:
        self.port = port
        self.status = status

    async def __call__(self, request: BaseRequest) -> web.StreamResponse:
        protocol = request.protocol
        if isinstance(protocol, GatewayProtocol):
            protocol.request_started(request.content)
        try:
            return self._answer(request)
        finally:
            if isinstance(protocol, GatewayProtocol):
                protocol.request_finished()

    def _answer(self, request: BaseRequest) -> web.StreamResponse:
        hosts = request.headers.getall("Host", [])
        if len(hosts) != 1:
            return error_response(400, "a request needs one Host header", close=True)
        try:
            target = origin_form(request.raw_path, request.method, hosts[0])
            location = https_location(hosts[0], target, self.port)
        except (RefusedTarget, ValueError) as exc:
            return error_response(400, str(exc), close=True)
        status = self.status
        if status is None:
            status = _FOR_READS if request.method in ("GET", "HEAD") else _KEEPS_METHOD
        response = web.Response(status=status, headers={"Location": location, "Server": SERVER})
        if request.body_exists:
            response.force_close()  # its body is not read: the connection cannot go on
        return response
