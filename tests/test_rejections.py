"""Rejections answered the operator's way (``rejection:`` per limit or for the whole policy):
the real gateway, a real upstream, real clients over loopback; the default stays problem+json."""

from __future__ import annotations

import json

import aiohttp
import pytest

from gateway.clock import FakeClock
from gateway.engine.preflight import parse_and_build
from gateway.policy.loader import PolicyError
from gateway.redact import hashed
from tests.support.gateways import GatewayFactory
from tests.support.policies import policy_for
from tests.support.upstreams import RecordingUpstream

POLICY = """rejection:
  content_type: application/json
  body: '{"error": "slow down", "limit": "$limit", "retry_in": $retry_after, "key": "$key_hash"}'
limits:
  per_key:
    algorithm: fixed_window
    limit: 1
    window: 1m
    key: ['header:X-Api-Key']
    match: {path: /}
  per_path:
    algorithm: fixed_window
    limit: 1
    window: 1m
    key: [route]
    match: {path_prefix: /own}
    rejection:
      status: 503
      content_type: text/plain; charset=utf-8
      body: "$limit says no ($status), again in ${retry_after_ms} ms; cost $$1"
  plain:
    algorithm: fixed_window
    limit: 1
    window: 1m
    key: [route]
    match: {path_prefix: /plain}
"""


async def _twice(
    session: aiohttp.ClientSession, url: str, key: str
) -> tuple[int, dict[str, str], bytes]:
    headers = {"X-Api-Key": key}
    async with session.get(url, headers=headers) as first:
        assert first.status == 200
    async with session.get(url, headers=headers) as second:
        return second.status, dict(second.headers), await second.read()


async def test_rejection_templates_global_and_per_limit(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    no_default = POLICY.replace("  plain:", "  unused:")
    gw = await start_gateway(
        policy_for(upstream.url, no_default), clock=FakeClock(start_us=60_000_000)
    )
    async with aiohttp.ClientSession() as session:
        status, headers, body = await _twice(session, gw.url + "/", "key-a")
        assert status == 429
        assert headers["Content-Type"] == "application/json"
        assert headers["Retry-After"] == "60"
        assert headers["RateLimit-Policy"] == '"per_key";q=1;w=60'
        assert json.loads(body) == {
            "error": "slow down",
            "limit": "per_key",
            "retry_in": 60,
            "key": hashed("key-a"),
        }
        status, headers, body = await _twice(session, gw.url + "/own", "key-b")
        assert status == 503
        assert headers["Content-Type"] == "text/plain; charset=utf-8"
        assert body.decode() == "per_path says no (503), again in 60000 ms; cost $1"


async def test_without_a_rejection_the_answer_stays_problem_json(
    upstream: RecordingUpstream, start_gateway: GatewayFactory
) -> None:
    policy = POLICY.split("limits:\n", 1)[1]
    gw = await start_gateway(
        policy_for(upstream.url, "limits:\n" + policy), clock=FakeClock(start_us=60_000_000)
    )
    async with aiohttp.ClientSession() as session:
        status, headers, body = await _twice(session, gw.url + "/plain", "key-c")
    assert status == 429
    assert headers["Content-Type"] == "application/problem+json"
    assert json.loads(body)["limit"] == "plain"


@pytest.mark.parametrize(
    ("rejection", "expected"),
    [
        (
            "rejection: {body: 'over $limits'}\n",
            "rejection.body: unknown variable $limits in the body: use $limit, $status, "
            "$retry_after, $retry_after_ms, $key_hash",
        ),
        (
            "rejection: {body: x, content_type: json}\n",
            "rejection.content_type: invalid content type 'json': expected type/subtype",
        ),
        ("rejection: {body: x, status: 200}\n", "rejection.status"),
    ],
)
def test_a_bad_template_is_refused_with_its_line(rejection: str, expected: str) -> None:
    text = policy_for("http://127.0.0.1:9", rejection)
    with pytest.raises(PolicyError) as raised:
        parse_and_build(text, "test.yaml")
    message = raised.value.format()
    assert "test.yaml:12: " + expected in message, message
