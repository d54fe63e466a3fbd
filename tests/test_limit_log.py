"""A limit's rejections and delays in the log (nginx's ``limit_req_log_level``): one line per
limit and kind per interval, at the level the policy sets (delays one lower), ``off`` for none,
API keys hashed. A real gateway, real requests over loopback, the limiter on a fake clock."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from gateway.clock import FakeClock
from tests.support.gateways import GatewayFactory
from tests.support.network import TIMEOUT, get_status
from tests.support.policies import PER_IP_BURST_4, limited_policy
from tests.support.upstreams import RecordingUpstream


def _limit_records(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "gateway.limits"]


async def _send(url: str, count: int, headers: dict[str, str] | None = None) -> list[int]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        return [await get_status(session, url, headers=headers) for _ in range(count)]


async def test_rejections_are_one_warning_per_limit_per_interval(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    gw = await start_gateway(limited_policy(upstream.url, PER_IP_BURST_4), clock=FakeClock())
    assert (await _send(gw.url + "/secret?token=abc", 12)).count(429) == 7
    assert _limit_records(caplog) == [
        (
            "WARNING",
            "limit per_ip rejected a request (429, retry after 62.5s): over the limit; "
            "key '127.0.0.1', client 127.0.0.1, GET on route all",
        )
    ]


async def test_levels_from_the_policy_and_off(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    quiet = PER_IP_BURST_4.replace("  per_ip:", "  quiet:") + "    log_level: off\n"
    loud = PER_IP_BURST_4.replace("  per_ip:", "  loud:") + "    log_level: error\n"
    gw = await start_gateway(
        limited_policy(upstream.url, quiet + loud + PER_IP_BURST_4, "  limit_log_level: info\n"),
        clock=FakeClock(),
    )
    assert (await _send(gw.url + "/", 6)).count(429) == 1  # all three reject the 6th
    # A line per limit that rejected it, at its level; none for quiet.
    records = _limit_records(caplog)
    assert [(level, message.split(" rejected")[0]) for level, message in records] == [
        ("ERROR", "limit loud"),
        ("INFO", "limit per_ip"),
    ]
    assert "): over the limit; key '127.0.0.1'" in records[0][1]


async def test_a_delay_is_logged_one_level_lower(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    smooth = "  smooth:\n    algorithm: leaky_bucket\n    rate: 20r/s\n    burst: 5\n"
    gw = await start_gateway(limited_policy(upstream.url, smooth), clock=FakeClock())
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        statuses = await asyncio.gather(*(get_status(session, gw.url + "/") for _ in range(3)))
    assert statuses == [200, 200, 200]
    (record,) = _limit_records(caplog)
    assert record[0] == "INFO"  # warning for a rejection, so info for a delay
    assert record[1].startswith("limit smooth delayed a request by 50 ms; key '127.0.0.1'")


async def test_api_keys_are_hashed_and_dry_run_limits_say_would(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    per_key = (
        "  per_key:\n    algorithm: fixed_window\n    limit: 1\n    window: 1h\n"
        "    key: ['header:X-Api-Key']\n    dry_run: true\n"
    )
    gw = await start_gateway(limited_policy(upstream.url, per_key), clock=FakeClock())
    secret = "key-0123456789abcdef"
    assert await _send(gw.url + "/", 3, {"X-Api-Key": secret}) == [200, 200, 200]
    ((level, message),) = _limit_records(caplog)
    assert level == "WARNING"
    assert message.startswith("limit per_key (dry run) would have rejected a request; key 'sha256:")
    assert secret not in message


async def test_a_full_queue_is_named_as_the_reason(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    full = "  full:\n    algorithm: leaky_bucket\n    rate: 20r/s\n    burst: 5\n    max_queue: 0\n"
    gw = await start_gateway(limited_policy(upstream.url, full), clock=FakeClock())
    assert await _send(gw.url + "/", 2) == [200, 429]
    ((level, message),) = _limit_records(caplog)
    assert level == "WARNING"
    assert message.startswith(
        "limit full rejected a request (429, retry after 0.05s): its queue is full or the wait "
        "is over max_delay; key '127.0.0.1'"
    )
