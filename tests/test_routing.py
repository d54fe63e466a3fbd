"""Route matching through the real gateway: host, path and method rules, in file order.

Each test stands up several real upstreams and asserts which one each request reached (or that the
gateway answered 404 itself and none did). Requests go over raw sockets so the Host header and the
request target are exactly what the table says, with no client-side normalisation.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from tests.support.gateways import GatewayFactory
from tests.support.rawhttp import exchange, split_head, status_of
from tests.support.upstreams import RecordingUpstream

UpstreamFactory = Callable[[], Awaitable[RecordingUpstream]]
Case = tuple[str, str, str]  # method, Host header, request target

NO_ROUTE = "404"


def routing_policy(urls: dict[str, str], routes: str) -> str:
    """A policy with upstreams ``urls`` (name -> URL) and ``routes`` (the YAML list, indented)."""
    lines = ["server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\nupstreams:\n"]
    for name, url in urls.items():
        lines.append(f"  {name}:\n    url: {url}\n")
    lines.append("routes:\n" + routes)
    return "".join(lines)


def urls_of(upstreams: dict[str, RecordingUpstream]) -> dict[str, str]:
    return {name: up.url for name, up in upstreams.items()}


async def where_routed(
    port: int, upstreams: dict[str, RecordingUpstream], method: str, host: str, target: str
) -> str:
    """The name of the upstream that got the request, or ``NO_ROUTE`` after checking the 404."""
    before = {name: len(up.requests) for name, up in upstreams.items()}
    body = b"Content-Length: 0\r\n" if method in ("POST", "PUT") else b""
    response = await exchange(
        port,
        f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n".encode()
        + body
        + b"Connection: close\r\n\r\n",
    )
    reached = [name for name, up in upstreams.items() if len(up.requests) > before[name]]
    assert len(reached) <= 1, reached
    if not reached:
        assert status_of(response) == 404, response
        headers, payload = split_head(response)
        assert (b"Content-Type", b"application/problem+json") in headers
        assert json.loads(payload) == {
            "type": "about:blank",
            "title": "Not Found",
            "status": 404,
            "detail": "no route matches this request",
        }
        return NO_ROUTE
    assert status_of(response) == 200, response
    recorded = upstreams[reached[0]].requests[-1]
    assert recorded.method == method
    assert recorded.raw_path.endswith(target)  # after the upstream URL's path, if it has one
    return reached[0]


async def route_all(
    port: int, upstreams: dict[str, RecordingUpstream], cases: list[Case]
) -> dict[Case, str]:
    return {case: await where_routed(port, upstreams, *case) for case in cases}


async def test_host_exact_and_wildcard(
    make_upstream: UpstreamFactory, start_gateway: GatewayFactory
) -> None:
    ups = {"api": await make_upstream(), "tenants": await make_upstream()}
    gw = await start_gateway(
        routing_policy(
            urls_of(ups),
            "  - name: api\n    upstream: api\n    match:\n      host: api.example.com\n"
            "  - name: tenants\n    upstream: tenants\n    match:\n      host: '*.example.com'\n",
        )
    )
    expected = {
        ("GET", "api.example.com", "/"): "api",
        # The port is ignored, and host names compare case-insensitively.
        ("GET", "api.example.com:8443", "/x"): "api",
        ("GET", "API.Example.COM", "/x"): "api",
        # The exact route comes first; any other subdomain, at any depth, takes the wildcard.
        ("GET", "shop.example.com", "/"): "tenants",
        ("GET", "a.b.example.com:80", "/y"): "tenants",
        ("GET", "Shop.EXAMPLE.com", "/"): "tenants",
        # The wildcard needs a subdomain, and a suffix match on the name is not a subdomain.
        ("GET", "example.com", "/"): NO_ROUTE,
        ("GET", "badexample.com", "/"): NO_ROUTE,
        ("GET", "api.example.com.evil.net", "/"): NO_ROUTE,
        ("GET", "example.org", "/"): NO_ROUTE,
    }
    assert await route_all(gw.port, ups, list(expected)) == expected


async def test_exact_path_and_path_regex(
    make_upstream: UpstreamFactory, start_gateway: GatewayFactory
) -> None:
    ups = {"login": await make_upstream(), "users": await make_upstream()}
    gw = await start_gateway(
        routing_policy(
            urls_of(ups),
            "  - name: login\n    upstream: login\n    match:\n      path: /login\n"
            "  - name: users\n    upstream: users\n    match:\n"
            "      path_regex: '/users/[0-9]+(/profile)?$'\n",
        )
    )
    expected = {
        ("GET", "h", "/login"): "login",
        ("GET", "h", "/login?next=/home"): "login",  # the query is not part of the path
        ("GET", "h", "/login/"): NO_ROUTE,
        ("GET", "h", "/login2"): NO_ROUTE,
        ("GET", "h", "/Login"): NO_ROUTE,
        ("GET", "h", "/users/42"): "users",
        ("GET", "h", "/users/42/profile"): "users",
        ("GET", "h", "/users/42?tab=1"): "users",
        ("GET", "h", "/users/abc"): NO_ROUTE,
        ("GET", "h", "/users/42/other"): NO_ROUTE,
        # Matched from the start of the path, not anywhere in it.
        ("GET", "h", "/v1/users/42"): NO_ROUTE,
        # Routes see the path the upstream will resolve, not its encoded or dotted spelling.
        ("GET", "h", "/%6Cogin"): "login",
        ("GET", "h", "/users/7/../../login"): "login",
    }
    assert await route_all(gw.port, ups, list(expected)) == expected


async def test_methods(make_upstream: UpstreamFactory, start_gateway: GatewayFactory) -> None:
    ups = {"writes": await make_upstream(), "reads": await make_upstream()}
    gw = await start_gateway(
        routing_policy(
            urls_of(ups),
            "  - name: writes\n    upstream: writes\n    match:\n      path_prefix: /data/\n"
            "      methods: [post, PUT]\n"
            "  - name: reads\n    upstream: reads\n    match:\n      methods: [GET]\n",
        )
    )
    expected = {
        ("POST", "h", "/data/1"): "writes",
        ("PUT", "h", "/data/1"): "writes",
        ("GET", "h", "/data/1"): "reads",
        ("GET", "h", "/elsewhere"): "reads",
        ("POST", "h", "/elsewhere"): NO_ROUTE,
        ("DELETE", "h", "/data/1"): NO_ROUTE,
    }
    assert await route_all(gw.port, ups, list(expected)) == expected


async def test_first_matching_route_wins(
    make_upstream: UpstreamFactory, start_gateway: GatewayFactory
) -> None:
    ups = {"first": await make_upstream(), "second": await make_upstream()}
    # Both routes take /api/admin; the broader one is listed first, so it wins there.
    broad_first = (
        "  - name: api\n    upstream: first\n    match:\n      path_prefix: /api/\n"
        "  - name: admin\n    upstream: second\n    match:\n      path_prefix: /api/admin\n"
        "  - name: rest\n    upstream: second\n"
    )
    gw = await start_gateway(routing_policy(urls_of(ups), broad_first))
    expected = {
        ("GET", "h", "/api/admin"): "first",
        ("GET", "h", "/api/users"): "first",
        ("GET", "h", "/other"): "second",
    }
    assert await route_all(gw.port, ups, list(expected)) == expected

    # The same two routes the other way round: file order, not specificity, decides.
    swapped = (
        "  - name: admin\n    upstream: second\n    match:\n      path_prefix: /api/admin\n"
        "  - name: api\n    upstream: first\n    match:\n      path_prefix: /api/\n"
    )
    gw = await start_gateway(routing_policy(urls_of(ups), swapped))
    expected = {
        ("GET", "h", "/api/admin"): "second",
        ("GET", "h", "/api/users"): "first",
        ("GET", "h", "/other"): NO_ROUTE,
    }
    assert await route_all(gw.port, ups, list(expected)) == expected


async def test_several_upstreams_each_get_only_their_routes(
    make_upstream: UpstreamFactory, start_gateway: GatewayFactory
) -> None:
    ups = {name: await make_upstream() for name in ("alpha", "beta", "based")}
    gw = await start_gateway(
        routing_policy(
            {**urls_of(ups), "based": ups["based"].url + "/base"},
            "  - name: a\n    upstream: alpha\n    match:\n      path_prefix: /a/\n"
            "  - name: b\n    upstream: beta\n    match:\n      path_prefix: /b/\n"
            "  - name: c\n    upstream: based\n    match:\n      path_prefix: /c/\n",
        )
    )
    cases: list[Case] = [("GET", "h", f"/{p}/{i}?q={i}") for i in range(3) for p in "abc"]
    routed = await route_all(gw.port, ups, cases)
    assert routed == {case: {"a": "alpha", "b": "beta", "c": "based"}[case[2][1]] for case in cases}
    assert [r.raw_path for r in ups["alpha"].requests] == ["/a/0?q=0", "/a/1?q=1", "/a/2?q=2"]
    assert [r.raw_path for r in ups["beta"].requests] == ["/b/0?q=0", "/b/1?q=1", "/b/2?q=2"]
    # An upstream URL with a path puts it in front of the request target.
    assert [r.raw_path for r in ups["based"].requests] == [
        "/base/c/0?q=0",
        "/base/c/1?q=1",
        "/base/c/2?q=2",
    ]


async def test_unmatched_gets_json_404_and_reaches_no_upstream(
    make_upstream: UpstreamFactory, start_gateway: GatewayFactory
) -> None:
    ups = {"only": await make_upstream()}
    gw = await start_gateway(
        routing_policy(
            urls_of(ups),
            "  - name: only\n    upstream: only\n    match:\n      host: app.example.com\n"
            "      path_prefix: /app/\n      methods: [GET]\n",
        )
    )
    # Each request fails exactly one of the route's three rules.
    expected = {
        ("GET", "app.example.com", "/app/x"): "only",
        ("GET", "other.example.com", "/app/x"): NO_ROUTE,
        ("GET", "app.example.com", "/api/x"): NO_ROUTE,
        ("POST", "app.example.com", "/app/x"): NO_ROUTE,
    }
    assert await route_all(gw.port, ups, list(expected)) == expected
    assert [r.raw_path for r in ups["only"].requests] == ["/app/x"]
