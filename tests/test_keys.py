"""Limit keys: distinct requests never share a bucket by crafting a header or query value."""

from __future__ import annotations

import aiohttp
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy, MultiDict, MultiDictProxy

from gateway.clock import FakeClock
from gateway.limits.keys import KeyBuilder, RequestFacts
from tests.support.gateways import GatewayFactory
from tests.support.policies import policy_for
from tests.support.upstreams import RecordingUpstream


def facts(
    client: str = "192.0.2.1",
    headers: dict[str, str] | None = None,
    query: dict[str, str] | None = None,
) -> RequestFacts:
    query_proxy = MultiDictProxy(MultiDict(query or {}))
    return RequestFacts(
        client_key=client,
        route="api",
        method="GET",
        headers=CIMultiDictProxy(CIMultiDict(headers or {})),
        query=lambda: query_proxy,
    )


values = st.text(alphabet=st.sampled_from("ab\x1e\x1f.1"), max_size=6)


@given(joined=st.text(alphabet=st.sampled_from("a\x1e\x1f"), max_size=8))
def test_two_query_parts_are_joined_without_ambiguity(joined: str) -> None:
    """Every way of splitting one string at a separator into (a, b) gives its own key."""
    builder = KeyBuilder(("query:a", "query:b"))
    splits = {(joined[:i], joined[i + 1 :]) for i, c in enumerate(joined) if c == "\x1f"}
    keys = {builder.build(facts(query={"a": a, "b": b})) for a, b in splits}
    assert len(keys) == len(splits)


@given(value=values, client=st.sampled_from(["192.0.2.1", "2001:db8::/64"]))
def test_a_header_value_never_poses_as_the_client_ip_fallback(value: str, client: str) -> None:
    builder = KeyBuilder(("header:X-API-Key",), on_missing_key="client_ip")
    fallback = builder.build(facts(client=client))
    assert builder.build(facts(client="198.51.100.7", headers={"X-API-Key": client})) != fallback
    assert builder.build(facts(client="198.51.100.7", headers={"X-API-Key": value})) != fallback


def test_plain_values_are_kept_as_they_are() -> None:
    builder = KeyBuilder(("client_ip", "header:X-API-Key"))
    assert builder.build(facts(headers={"X-API-Key": "k1"})) == "192.0.2.1\x1fk1"
    assert KeyBuilder(("header:X-API-Key",)).build(facts()) is None  # skip: limit not applied


async def test_an_api_key_equal_to_an_ip_does_not_drain_that_ips_fallback_bucket(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    """A client without a key is limited by its IP; another client sending that IP as its
    API key must get a bucket of its own, not the keyless client's."""
    policy = policy_for(upstream.url) + (
        "limits:\n  by_key:\n    algorithm: leaky_bucket\n    rate: 1r/m\n    nodelay: true\n"
        "    key: ['header:X-API-Key']\n    on_missing_key: client_ip\n"
    )
    gw = await start_gateway(policy, clock=FakeClock())
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.url + "/", headers={"X-API-Key": "127.0.0.1"}) as resp:
            assert resp.status == 200
        async with session.get(gw.url + "/") as resp:  # no key: the IP's own bucket, still full
            assert resp.status == 200
        async with session.get(gw.url + "/") as resp:
            assert resp.status == 429
