"""Which rule said no: the rejecting limit named in the problem body, in a header of the
operator's choosing (only when asked), in the access log and in the metrics: the real gateway,
a real upstream, real clients over loopback."""

from __future__ import annotations

import json
import logging

import aiohttp
import pytest

from gateway.clock import FakeClock
from gateway.engine.preflight import parse_and_build
from gateway.policy.loader import PolicyError
from tests.support.gateways import GatewayFactory
from tests.support.metrics import scrape_until, value
from tests.support.policies import policy_for
from tests.support.upstreams import RecordingUpstream

# Two limits on every request: the per-route one is the tighter, so it is the one saying no.
LIMITS = """limits:
  per_ip:
    algorithm: fixed_window
    limit: 100
    window: 1h
  per_route:
    algorithm: fixed_window
    limit: 1
    window: 1h
    key: [route]
"""


@pytest.mark.parametrize("header", [None, "X-RateLimit-Rejected-By"])
async def test_the_rejecting_limit_is_named_everywhere(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    caplog: pytest.LogCaptureFixture,
    header: str | None,
) -> None:
    headers = f"headers:\n  rejected_by: {header}\n" if header else ""
    policy = policy_for(
        upstream.url,
        LIMITS + headers,
        server="  access_log: true\n  access_log_format: json\n",
    )
    gw = await start_gateway(policy, clock=FakeClock())
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        async with aiohttp.ClientSession() as session:
            async with session.get(gw.url + "/") as first:
                assert first.status == 200
                assert "X-RateLimit-Rejected-By" not in first.headers  # rejections only
            async with session.get(gw.url + "/") as second:
                assert second.status == 429
                body = json.loads(await second.read())
                named = second.headers.get("X-RateLimit-Rejected-By")
            samples = await scrape_until(
                session,
                gw.admin_url,
                lambda s: (
                    s.get(
                        (
                            "gateway_limit_decisions_total",
                            frozenset({("limit", "per_route"), ("result", "rejected")}),
                        ),
                        0,
                    )
                    == 1
                ),
            )
    assert body["limit"] == "per_route"
    assert named == ("per_route" if header else None)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert [line["limit_name"] for line in lines] == [None, "per_route"]
    assert value(samples, "gateway_limit_decisions_total", limit="per_ip", result="rejected") == 0


def test_the_header_must_be_one_the_gateway_does_not_write() -> None:
    text = policy_for("http://127.0.0.1:9", LIMITS + "headers:\n  rejected_by: Retry-After\n")
    with pytest.raises(PolicyError) as raised:
        parse_and_build(text, "test.yaml")
    assert "headers.rejected_by: Retry-After is a header the gateway writes itself" in (
        raised.value.format()
    )
