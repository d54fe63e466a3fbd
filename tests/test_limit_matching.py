"""Which limits a request meets, and in which bucket: matching rules, key parts, IPv6 grouping,
the rate-limit headers and the layered policy's global bucket, end to end through the real
gateway with a real upstream and an injected clock.

Most limits here are ``fixed_window`` with ``limit: 1`` and ``window: 1h``: the clock stands
still, so a bucket admits its first request and rejects every later one, and "shares a bucket"
reads directly as "the second request is refused".
"""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from multidict import CIMultiDictProxy

from gateway.clock import FakeClock
from gateway.engine.preflight import load_and_build
from tests.support.gateways import GatewayFactory, RunningGateway
from tests.support.policies import policy_for
from tests.support.upstreams import RecordingUpstream

TRUST_LOOPBACK = "  trusted_proxies: [127.0.0.1/32]\n"
ONE_PER_HOUR = "    algorithm: fixed_window\n    limit: 1\n    window: 1h\n"
HEADER_NAMES = (
    "RateLimit-Policy",
    "RateLimit",
    "X-RateLimit-Limit",
    "X-RateLimit-Remaining",
    "X-RateLimit-Reset",
    "Retry-After",
)


async def send(
    session: aiohttp.ClientSession,
    gw: RunningGateway,
    path: str = "/",
    *,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    client: str | None = None,
) -> tuple[int, CIMultiDictProxy[str], bytes]:
    """One request; ``client`` is presented as the client address through X-Forwarded-For
    (the gateway trusts 127.0.0.1 in the policies that use it)."""
    all_headers = dict(headers or {})
    if client is not None:
        all_headers["X-Forwarded-For"] = client
    async with session.request(method, gw.url + path, headers=all_headers) as resp:
        return resp.status, resp.headers, await resp.read()


def limits_met(headers: CIMultiDictProxy[str]) -> list[str]:
    """Names of the limits that applied, from ``RateLimit-Policy`` (``"name";q=..;w=..``)."""
    value = headers.get("RateLimit-Policy")
    if value is None:
        return []
    return [item.strip().split(";", 1)[0].strip('"') for item in value.split(",")]


# --- matching: host, exact path, path_regex, methods --------------------------------------------

# (match rule, requests it covers, requests it does not); a request is (method, path, host).
MATCH_CASES = {
    "host": (
        "{host: api.example.com}",
        [("GET", "/", "api.example.com"), ("GET", "/x", "API.Example.com:8080")],
        [("GET", "/", "www.example.com"), ("GET", "/", "api.example.com.evil")],
    ),
    "host_wildcard": (
        "{host: '*.example.com'}",
        [("GET", "/", "a.example.com"), ("GET", "/", "b.c.example.com")],
        [("GET", "/", "example.com"), ("GET", "/", "badexample.com")],
    ),
    "exact_path": (
        "{path: /exact}",
        [("GET", "/exact", "h"), ("GET", "/exact?page=2", "h")],
        [("GET", "/exact/", "h"), ("GET", "/exactly", "h"), ("GET", "/exact/more", "h")],
    ),
    "path_regex": (
        r"{path_regex: '/items/\d+$'}",
        [("GET", "/items/42", "h"), ("GET", "/items/7", "h")],
        # matched from the start of the path, so a prefix before /items/ does not match
        [("GET", "/items/abc", "h"), ("GET", "/v1/items/42", "h"), ("GET", "/items/42/x", "h")],
    ),
    "methods": (
        "{methods: [post, DELETE]}",
        [("POST", "/", "h"), ("DELETE", "/any", "h")],
        [("GET", "/", "h"), ("PUT", "/", "h"), ("HEAD", "/", "h")],
    ),
    "path_and_method": (
        "{path_prefix: /api/, methods: [POST]}",
        [("POST", "/api/login", "h"), ("POST", "/api/", "h")],
        [("GET", "/api/login", "h"), ("POST", "/apix", "h"), ("POST", "/", "h")],
    ),
}


@pytest.mark.parametrize("case", sorted(MATCH_CASES))
async def test_limit_applies_only_to_matching_requests(
    case: str, upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    rule, covered, uncovered = MATCH_CASES[case]
    gw = await start_gateway(
        policy_for(upstream.url) + f"limits:\n  only:\n{ONE_PER_HOUR}    match: {rule}\n",
        clock=FakeClock(),
    )
    async with aiohttp.ClientSession() as session:

        async def run(request: tuple[str, str, str]) -> tuple[int, list[str]]:
            method, path, host = request
            status, headers, _ = await send(
                session, gw, path, method=method, headers={"Host": host}
            )
            return status, limits_met(headers)

        # Requests the rule does not cover never meet the limit, before or after it is spent.
        assert [await run(r) for r in uncovered] == [(200, [])] * len(uncovered)
        # The covered ones share one bucket (one client): the first spends it, the rest are 429.
        assert [await run(r) for r in covered] == [(200, ["only"])] + [(429, ["only"])] * (
            len(covered) - 1
        )
        assert [await run(r) for r in uncovered] == [(200, [])] * len(uncovered)


# --- key parts ----------------------------------------------------------------------------------


async def test_query_key_part_gives_one_bucket_per_value(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(
        policy_for(upstream.url) + f"limits:\n  tenant:\n{ONE_PER_HOUR}    key: ['query:tenant']\n",
        clock=FakeClock(),
    )
    async with aiohttp.ClientSession() as session:
        statuses = [
            (await send(session, gw, path))[0]
            for path in (
                "/?tenant=a",
                "/other?tenant=a",  # same value, any path: same bucket
                "/?tenant=b",
                "/?x=1&tenant=b",
                "/?tenant=A",  # values are compared exactly
            )
        ]
        assert statuses == [200, 429, 200, 429, 200]
        # Without the parameter the limit is skipped (on_missing_key defaults to skip).
        missing = [await send(session, gw, "/?tenantx=a") for _ in range(3)]
        assert [(status, limits_met(headers)) for status, headers, _ in missing] == [(200, [])] * 3


async def test_route_key_part_gives_one_bucket_per_route_for_all_clients(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    policy = (
        "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n"
        + TRUST_LOOPBACK
        + f"upstreams:\n  backend:\n    url: {upstream.url}\n"
        "routes:\n"
        "  - name: reports\n    match: {path_prefix: /reports}\n    upstream: backend\n"
        "  - name: rest\n    upstream: backend\n"
        f"limits:\n  per_route:\n{ONE_PER_HOUR}    key: [route]\n"
    )
    gw = await start_gateway(policy, clock=FakeClock())
    async with aiohttp.ClientSession() as session:
        statuses = [
            (await send(session, gw, path, client=client))[0]
            for path, client in (
                ("/reports/1", "198.51.100.1"),
                ("/reports/2", "198.51.100.2"),  # another client, same route: same bucket
                ("/", "198.51.100.1"),  # same client, other route: its own bucket
                ("/elsewhere", "198.51.100.3"),
            )
        ]
    assert statuses == [200, 429, 200, 429]


async def test_method_key_part_gives_one_bucket_per_method(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(
        policy_for(upstream.url) + f"limits:\n  per_method:\n{ONE_PER_HOUR}    key: [method]\n",
        clock=FakeClock(),
    )
    async with aiohttp.ClientSession() as session:
        statuses = [
            (await send(session, gw, path, method=method))[0]
            for method, path in (
                ("GET", "/"),
                ("GET", "/x"),
                ("POST", "/"),
                ("POST", "/y"),
                ("DELETE", "/"),
            )
        ]
    assert statuses == [200, 429, 200, 429, 200]


async def test_const_key_part_is_one_bucket_for_everyone(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(
        policy_for(upstream.url, server=TRUST_LOOPBACK)
        + f"limits:\n  shared:\n{ONE_PER_HOUR}    key: ['const:backend-a']\n",
        clock=FakeClock(),
    )
    async with aiohttp.ClientSession() as session:
        first = await send(session, gw, "/a", client="198.51.100.1")
        second = await send(session, gw, "/b", method="POST", client="203.0.113.7")
        async with session.get(
            gw.admin_url + "/explain", params={"path": "/c", "client_ip": "192.0.2.1"}
        ) as resp:
            explained = (await resp.json())["limits"][0]
    assert (first[0], second[0]) == (200, 429)
    assert json.loads(second[2])["limit"] == "shared"
    # The key is the constant text itself, whoever asks.
    assert explained["key"] == "backend-a"
    assert explained["next_request"]["allowed"] is False


async def test_combined_key_gives_one_bucket_per_client_and_api_key(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(
        policy_for(upstream.url, server=TRUST_LOOPBACK)
        + f"limits:\n  pair:\n{ONE_PER_HOUR}    key: [client_ip, 'header:X-API-Key']\n",
        clock=FakeClock(),
    )
    async with aiohttp.ClientSession() as session:
        statuses = [
            (await send(session, gw, headers={"X-API-Key": key}, client=ip))[0]
            for ip, key in (
                ("198.51.100.1", "k1"),
                ("198.51.100.1", "k1"),  # same pair: refused
                ("198.51.100.1", "k2"),  # same client, other key: own bucket
                ("198.51.100.2", "k1"),  # same key, other client: own bucket
                ("198.51.100.2", "k2"),
                ("198.51.100.2", "k2"),
            )
        ]
        assert statuses == [200, 429, 200, 200, 200, 429]
        # No API key: the limit is skipped for that request, not keyed on the IP alone.
        no_key = [await send(session, gw, client="198.51.100.1") for _ in range(2)]
        assert [(status, limits_met(headers)) for status, headers, _ in no_key] == [(200, [])] * 2


# --- IPv6 clients grouped by prefix -------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix_line", "same_bucket", "other_bucket", "key"),
    [
        # default /64: the interface id varies within one client's /64
        ("", "2001:db8:1:2:ffff::9", "2001:db8:1:3::1", "2001:db8:1:2::/64"),
        # /48: whole site grouped, the /64s inside it share; the next /48 does not
        ("ipv6_prefix: 48\n", "2001:db8:1:3::1", "2001:db8:2::1", "2001:db8:1::/48"),
    ],
)
async def test_ipv6_clients_share_a_bucket_per_prefix(
    prefix_line: str,
    same_bucket: str,
    other_bucket: str,
    key: str,
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
) -> None:
    gw = await start_gateway(
        policy_for(upstream.url, server=TRUST_LOOPBACK)
        + f"limits:\n  per_ip:\n{ONE_PER_HOUR}"
        + prefix_line,
        clock=FakeClock(),
    )
    async with aiohttp.ClientSession() as session:
        statuses = [
            (await send(session, gw, client=client))[0]
            for client in ("2001:db8:1:2::1", same_bucket, other_bucket, "2001:db8:1:2::abcd")
        ]
        # IPv4 clients are never grouped: neighbours have their own buckets.
        ipv4 = [(await send(session, gw, client=c))[0] for c in ("192.0.2.1", "192.0.2.2")]
        async with session.get(
            gw.admin_url + "/explain", params={"client_ip": "2001:db8:1:2::77"}
        ) as resp:
            explained = (await resp.json())["limits"][0]
    assert statuses == [200, 429, 200, 429]
    assert ipv4 == [200, 200]
    assert explained["key"] == key


# --- rate-limit headers -------------------------------------------------------------------------

# 645 s on the fake clock: a 1 m window began at 600 s and resets at 660 s, 15 s from now.
WINDOW_START_US = 645_000_000


async def test_x_ratelimit_trio_on_200_and_429(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    clock = FakeClock(WINDOW_START_US)
    gw = await start_gateway(
        policy_for(upstream.url)
        + "limits:\n  three:\n    algorithm: fixed_window\n    limit: 3\n    window: 1m\n"
        "headers:\n  x_ratelimit: true\n",
        clock=clock,
    )
    trio = ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset")
    async with aiohttp.ClientSession() as session:
        served = [await send(session, gw) for _ in range(3)]
        refused = await send(session, gw)
        clock.advance(5.5)
        later = await send(session, gw)
    assert [status for status, _, _ in served] == [200, 200, 200]
    assert [tuple(h[n] for n in trio) for _, h, _ in served] == [
        ("3", "2", "15"),
        ("3", "1", "15"),
        ("3", "0", "15"),
    ]
    assert refused[0] == 429
    assert tuple(refused[1][n] for n in trio) == ("3", "0", "15")
    assert refused[1]["Retry-After"] == "15"
    # 9.5 s left in the window: Reset and Retry-After round up to whole seconds.
    assert later[0] == 429
    assert tuple(later[1][n] for n in trio) == ("3", "0", "10")
    assert later[1]["Retry-After"] == "10"


async def test_x_ratelimit_trio_follows_the_tightest_stacked_limit(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    gw = await start_gateway(
        policy_for(upstream.url) + "limits:\n"
        "  hourly:\n    algorithm: fixed_window\n    limit: 10\n    window: 1h\n"
        "  minute:\n    algorithm: fixed_window\n    limit: 3\n    window: 1m\n"
        "headers:\n  x_ratelimit: true\n",
        clock=FakeClock(WINDOW_START_US),
    )
    async with aiohttp.ClientSession() as session:
        status, headers, _ = await send(session, gw)
    assert status == 200
    # minute has 2 left against hourly's 9, so the trio describes minute.
    assert (
        headers["X-RateLimit-Limit"],
        headers["X-RateLimit-Remaining"],
        headers["X-RateLimit-Reset"],
    ) == ("3", "2", "15")
    # The IETF fields list both, in policy order; the hour resets at 3600 s, 2955 s from now.
    assert headers["RateLimit-Policy"] == '"hourly";q=10;w=3600, "minute";q=3;w=60'
    assert headers["RateLimit"] == '"hourly";r=9;t=2955, "minute";r=2;t=15'


# header family switched off -> the headers that must then be absent
FAMILIES = {
    "ietf": ("RateLimit-Policy", "RateLimit"),
    "x_ratelimit": ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"),
    "retry_after": ("Retry-After",),
}


@pytest.mark.parametrize("off", [*sorted(FAMILIES), "all"])
async def test_each_header_family_can_be_switched_off(
    off: str, upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    switches = {family: family != off and off != "all" for family in FAMILIES}
    headers_yaml = "".join(f"  {f}: {str(on).lower()}\n" for f, on in switches.items())
    gw = await start_gateway(
        policy_for(upstream.url)
        + "limits:\n  one:\n    algorithm: fixed_window\n    limit: 1\n    window: 1m\n"
        + "headers:\n"
        + headers_yaml,
        clock=FakeClock(WINDOW_START_US),
    )
    async with aiohttp.ClientSession() as session:
        ok = await send(session, gw)
        refused = await send(session, gw)
    assert (ok[0], refused[0]) == (200, 429)
    absent = {name for family, names in FAMILIES.items() if not switches[family] for name in names}
    for name in HEADER_NAMES:
        on_429 = name in refused[1]
        # Retry-After belongs on rejections only; everything else on both.
        on_200 = name in ok[1]
        assert on_429 == (name not in absent), name
        assert on_200 == (name not in absent and name != "Retry-After"), name
    # The problem body still says when to retry, whatever the headers.
    problem = json.loads(refused[2])
    assert (problem["limit"], problem["retry_after_s"]) == ("one", 15)


# --- the layered policy's global token bucket ---------------------------------------------------

POLICIES = Path(__file__).parent.parent / "policies"


def _small_global_copy(tmp_path: Path, upstream_url: str) -> Path:
    """policies/layered.yaml with the global bucket shrunk to 1r/m burst 3, local listeners and
    loopback trusted (so tests can present several clients); nothing else changed."""
    text = (POLICIES / "layered.yaml").read_text()
    for old, new in (
        ("rate: 1000r/s\n    burst: 2000\n", "rate: 1r/m\n    burst: 3\n"),
        ("listen: 127.0.0.1:8080", "listen: 127.0.0.1:0"),
        ("admin_listen: 127.0.0.1:9090", "admin_listen: 127.0.0.1:0"),
        ("trusted_proxies: []", "trusted_proxies: [127.0.0.1/32]"),
        ("http://127.0.0.1:8000", upstream_url),
    ):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = tmp_path / "layered.yaml"
    path.write_text(text)
    return path


async def test_layered_global_token_bucket_rejects_every_client_once_spent(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    clock = FakeClock()
    gw = await start_gateway(
        load_and_build(_small_global_copy(tmp_path, upstream.url)), clock=clock
    )
    async with aiohttp.ClientSession() as session:
        spent = [(await send(session, gw, "/static/x", client="198.51.100.1"))[0] for _ in range(3)]
        # Another client, well inside its own per_ip allowance: the shared bucket is empty.
        status, headers, body = await send(session, gw, "/static/x", client="203.0.113.9")
        async with session.get(
            gw.admin_url + "/explain", params={"path": "/static/x", "client_ip": "203.0.113.9"}
        ) as resp:
            explained = {x["name"]: x for x in (await resp.json())["limits"]}
        # One token comes back per minute: exactly one more request, from anyone.
        clock.advance(60)
        refilled = [(await send(session, gw, "/", client="192.0.2.5"))[0] for _ in range(2)]
    assert spent == [200, 200, 200]
    assert status == 429
    assert json.loads(body)["limit"] == "global"
    assert headers["Retry-After"] == "60"
    # capacity 3 tokens at 1 per 60 s: a full bucket is 180 s of refill.
    assert '"global";q=3;w=180' in headers["RateLimit-Policy"]
    assert '"global";r=0;' in headers["RateLimit"]
    # The refused request was charged to no limit: per_ip holds only the first client's key.
    assert explained["per_ip"]["tracked_keys"] == 1
    assert explained["per_ip"]["next_request"]["remaining"] == 20  # burst 20 + 1, minus this one
    assert refilled == [200, 429]
    assert len(upstream.requests) == 4
