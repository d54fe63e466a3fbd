"""Route matching: the first route (in file order) whose host, path and method rules all match."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote

from gateway.policy.models import Route, RouteMatch


@dataclass(frozen=True, slots=True)
class CompiledMatch:
    """Match rules (host, path, methods) pre-compiled for the hot path."""

    host_exact: str | None
    host_suffix: str | None
    path_exact: str | None
    path_prefix: str | None
    path_regex: re.Pattern[str] | None
    methods: frozenset[str] | None

    def matches(self, host: str, path: str, method: str) -> bool:
        if self.methods is not None and method not in self.methods:
            return False
        if self.host_exact is not None and host != self.host_exact:
            return False
        if self.host_suffix is not None and not (
            host.endswith(self.host_suffix) and len(host) > len(self.host_suffix)
        ):
            return False
        if self.path_exact is not None:
            return path == self.path_exact
        if self.path_prefix is not None:
            return path.startswith(self.path_prefix)
        if self.path_regex is not None:
            return self.path_regex.match(path) is not None
        return True


def compile_match(match: RouteMatch) -> CompiledMatch:
    host_exact = host_suffix = None
    if match.host is not None:
        host = match.host.lower()
        if host.startswith("*."):
            host_suffix = host[1:]
        else:
            host_exact = host
    return CompiledMatch(
        host_exact=host_exact,
        host_suffix=host_suffix,
        path_exact=match.path,
        path_prefix=match.path_prefix,
        path_regex=re.compile(match.path_regex) if match.path_regex is not None else None,
        methods=frozenset(match.methods) if match.methods is not None else None,
    )


class RefusedTarget(ValueError):
    """A request target the gateway answers with 400 before routing it."""


def origin_form(target: str, method: str, host_header: str | None) -> str:
    """The target as routes match it and the upstream gets it (after its base path), for the
    proxy and ``gateway replay`` alike: an origin-form target as is, ``*`` for ``OPTIONS``,
    and the origin-form part of an absolute-form one (RFC 9112 3.2.2) whose authority is the
    Host header's; ``RefusedTarget`` otherwise (an authority that disagrees with Host would
    let two parsers pick different hosts)."""
    if target.startswith("/"):
        return target
    if target == "*" and method == "OPTIONS":
        return target
    if "://" in target:
        authority, slash, rest = target.split("://", 1)[1].partition("/")
        if "@" in authority or authority.lower() != (host_header or "").lower():
            raise RefusedTarget("request target disagrees with Host")
        return slash + rest if slash else "/"
    raise RefusedTarget("invalid request target")


def routing_path(raw_path: str) -> str:
    """The path routes and limits match on: percent-decoded, dot segments resolved.

    The upstream gets the target exactly as sent, and an upstream resolves ``/public/../admin``
    (or ``/public/%2e%2e%2fadmin``) to ``/admin``; matching the raw text instead would let a
    client reach, and be limited as, a route it does not really ask for.
    """
    path = raw_path.split("?", 1)[0]
    if "%" in path:
        path = unquote(path, errors="surrogateescape")
    if "/." not in path:
        return path
    return _remove_dot_segments(path)


def _remove_dot_segments(path: str) -> str:
    """RFC 3986 section 5.2.4, for an absolute path."""
    output: list[str] = []
    segments = path.split("/")
    for segment in segments[1:]:
        if segment == "..":
            if output:
                output.pop()
        elif segment != ".":
            output.append(segment)
    trailing = "/" if segments[-1] in (".", "..") else ""
    return "/" + "/".join(output) + trailing


def normalise_host(host_header: str | None) -> str:
    """Lower-case host without port, as routes compare it ('[::1]:80' -> '[::1]')."""
    if not host_header:
        return ""
    host = host_header.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[: end + 1] if end != -1 else host
    colon = host.rfind(":")
    return host[:colon] if colon != -1 else host


class RouteEntry:
    """A route as the request path reads it, its fields copied once when the table is built:
    reading a pydantic model's attribute costs some 400 instructions (``BaseModel`` defines
    ``__getattr__``, which sends every read through Python's slower lookup), a native field's
    a load. ``config`` is the policy's model, for what else reads it (the limits)."""

    __slots__ = ("config", "connect_timeout", "max_body_size", "name", "read_timeout", "upstream")

    def __init__(self, route: Route, default_max_body_size: int) -> None:
        self.config = route
        self.name: str = route.name
        self.upstream: str = route.upstream
        self.connect_timeout: float = route.connect_timeout or 0.0  # 0: the upstream's
        self.read_timeout: float = route.read_timeout or 0.0
        max_body = route.max_body_size
        # The largest body the route takes: its own, else ``server.max_body_size`` (0: any).
        self.max_body_size: int = max_body if max_body is not None else default_max_body_size


class RouteTable:
    """Routes tried in order; ``match`` returns the first that takes the request, or None."""

    __slots__ = ("_routes",)

    def __init__(self, routes: Sequence[Route], max_body_size: int = 0) -> None:
        self._routes = tuple((compile_match(r.match), RouteEntry(r, max_body_size)) for r in routes)

    def entry(self, host: str, path: str, method: str) -> RouteEntry | None:
        """The first route that takes the request, as the request path reads it."""
        for compiled, entry in self._routes:
            if compiled.matches(host, path, method):
                return entry
        return None

    def match(self, host: str, path: str, method: str) -> Route | None:
        entry = self.entry(host, path, method)
        return entry.config if entry is not None else None
