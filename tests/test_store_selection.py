"""The policy file (or GATEWAY_STORE_URL) chooses where limit state lives."""

from __future__ import annotations

import os
from pathlib import Path

import aiohttp
import pytest

from gateway.clock import FakeClock
from gateway.engine.preflight import load_and_build
from gateway.stores import build_store
from tests.support import redis_harness
from tests.support.gateways import GatewayFactory
from tests.support.policies import policy_for
from tests.support.redis_harness import RedisServer
from tests.support.upstreams import RecordingUpstream

redis_server = redis_harness.redis_server

LIMIT = (
    "limits:\n  per_ip:\n    algorithm: leaky_bucket\n    rate: 1r/m\n    burst: 2\n"
    "    nodelay: true\n"
)


async def _statuses(url: str, n: int) -> list[int]:
    async with aiohttp.ClientSession() as session:
        out = []
        for _ in range(n):
            async with session.get(url) as resp:
                out.append(resp.status)
        return out


async def test_policy_store_url_puts_limits_in_redis(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    prefix = f"sel{os.getpid()}:"
    store = f"store:\n  url: {redis_server.url}\n  key_prefix: '{prefix}'\n"
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(upstream.url) + LIMIT + store)
    first = await start_gateway(load_and_build(path))
    second = await start_gateway(load_and_build(path))
    assert first.gateway.store.name == "redis"
    # Two gateways, one limit: burst 2 + 1 in all, whichever gateway a request goes to.
    statuses = await _statuses(first.url + "/", 2) + await _statuses(second.url + "/", 2)
    assert statuses == [200, 200, 200, 429]
    async with aiohttp.ClientSession() as session, session.get(first.admin_url + "/policy") as r:
        assert (await r.json())["store"] == "redis"


@pytest.mark.parametrize("client", ["thin", "redis-py"])
async def test_policy_chooses_the_redis_client(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    redis_server: RedisServer,
    tmp_path: Path,
    client: str,
) -> None:
    prefix = f"cli{os.getpid()}{client}:"
    # A deadline no loaded machine misses: a call past the 50 ms default would be decided by
    # the local fallback (a share of the limit), and this test is about which client decides.
    store = (
        f"store:\n  url: {redis_server.url}\n  key_prefix: '{prefix}'\n  client: {client}\n"
        "  timeout: 2s\n"
    )
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(upstream.url) + LIMIT + store)
    gw = await start_gateway(load_and_build(path))
    expected = {"thin": "ThinClient", "redis-py": "PipelineClient"}[client]
    assert type(gw.gateway.store.client).__name__ == expected  # type: ignore[attr-defined]
    assert await _statuses(gw.url + "/", 4) == [200, 200, 200, 429]


async def test_store_settings_change_only_on_restart(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(upstream.url) + LIMIT)
    gw = await start_gateway(load_and_build(path), policy_path=str(path))
    moved = "store:\n  url: redis://:s3cret@127.0.0.1:1\n  replicas: 3\n"
    path.write_text(policy_for(upstream.url) + LIMIT + moved)
    reloader = gw.gateway.reloader
    assert reloader is not None
    assert await reloader.reload() == "failed"
    # The file, each setting (the URL without its password) and what to do.
    assert reloader.status.last_error == (
        f"{path}: store.url ('memory' -> 'redis://:***@127.0.0.1:1'), store.replicas (1 -> 3) "
        "take effect on restart only; the running policy stays (restart the gateway to apply "
        "them, or revert them to reload the rest)"
    )
    assert gw.gateway.store.name == "memory"


def test_environment_overrides_the_policy_store(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = load_and_build(Path(__file__).parent / "fixtures" / "valid" / "default.yaml").policy
    assert build_store(policy.store).name == "memory"
    monkeypatch.setenv("GATEWAY_STORE_URL", "redis://127.0.0.1:6399/0")
    assert build_store(policy.store).name == "redis"


async def test_local_fallback_divides_by_replicas_times_workers(
    upstream: RecordingUpstream, start_gateway: GatewayFactory, tmp_path: Path
) -> None:
    """Two instances of three workers each are six processes, each falling back on its own:
    a 12-per-hour window becomes 2 per process while Redis is unreachable."""
    path = tmp_path / "policy.yaml"
    path.write_text(
        policy_for(upstream.url)
        + "limits:\n  hourly:\n    algorithm: fixed_window\n    limit: 12\n    window: 1h\n"
        + "store:\n  url: redis://127.0.0.1:1\n  replicas: 2\n"
    )
    # The fallback on a fake clock: on the real one the hour could end between the requests.
    gw = await start_gateway(load_and_build(path), workers=3, clock=FakeClock())
    assert gw.gateway.store.name == "redis"
    async with aiohttp.ClientSession() as session:
        answers = []
        for _ in range(3):
            async with session.get(gw.url + "/") as resp:
                answers.append((resp.status, resp.headers.get("RateLimit-Policy")))
    assert [status for status, _ in answers] == [200, 200, 429]
    assert all(policy is not None and ";q=2;" in policy for _, policy in answers)


async def test_a_dry_run_limit_adds_no_round_trip_to_redis(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    """An enforced and a dry-run limit: their script calls leave together, in one pipeline."""
    prefix = f"dry{os.getpid()}:"
    store = f"store:\n  url: {redis_server.url}\n  key_prefix: '{prefix}'\n"
    candidate = (
        "  candidate:\n    algorithm: leaky_bucket\n    rate: 1r/m\n    burst: 1\n"
        "    nodelay: true\n    dry_run: true\n"
    )
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(upstream.url) + LIMIT + candidate + store)
    gw = await start_gateway(load_and_build(path))
    redis_store = gw.gateway.store
    assert redis_store.name == "redis"
    # The first request also loads the scripts into Redis (NOSCRIPT, then SCRIPT LOAD).
    assert await _statuses(gw.url + "/", 1) == [200]
    before_trips = redis_store.round_trips  # type: ignore[attr-defined]
    before_calls = redis_store.counters.calls  # type: ignore[attr-defined]
    # One request at a time, so no two requests can share a pipeline.
    statuses = await _statuses(gw.url + "/", 3)
    assert statuses == [200, 200, 429]  # the dry-run limit (burst 1) changes nothing
    assert redis_store.counters.calls - before_calls == 6  # type: ignore[attr-defined]
    assert redis_store.round_trips - before_trips == 3  # type: ignore[attr-defined]
