"""A gateway in the test's own event loop: ``start_gateway(policy_text_or_loaded, **options)``
starts one on free loopback ports; every one started is stopped at the end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from gateway.engine.preflight import parse_and_build
from gateway.policy.loader import LoadedPolicy
from gateway.serving.lifecycle import Gateway
from tests.support.waiting import wait_until


@dataclass
class RunningGateway:
    gateway: Gateway

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.proxy_port}"

    @property
    def port(self) -> int:
        return self.gateway.proxy_port

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.admin_port}"


GatewayFactory = Callable[..., Awaitable[RunningGateway]]


async def hang_up_while_queued(
    gw: RunningGateway, limit_name: str, request: bytes = b"GET /queued HTTP/1.1\r\nHost: h\r\n\r\n"
) -> None:
    """Send ``request`` on a connection of its own, wait until it waits in ``limit_name``'s
    shaping queue, hang up, and wait until it has left the queue."""
    engine = gw.gateway.handler.runtime.engine
    limit = next(limit for limit in engine.limits if limit.name == limit_name)
    _, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(request)
    await wait_until(lambda: limit.counters.waiting == 1, "the request queued")
    writer.close()
    await wait_until(lambda: limit.counters.waiting == 0, "the request gone from the queue")


@pytest.fixture
async def start_gateway() -> AsyncIterator[GatewayFactory]:
    started: list[Gateway] = []

    async def start(policy: str | LoadedPolicy, **kwargs: Any) -> RunningGateway:
        loaded = parse_and_build(policy, "test.yaml") if isinstance(policy, str) else policy
        gateway = Gateway(loaded, **kwargs)
        await gateway.start()
        started.append(gateway)
        return RunningGateway(gateway)

    yield start
    for gateway in reversed(started):
        await gateway.stop()
