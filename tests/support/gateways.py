"""A gateway in the test's own event loop: ``start_gateway(policy_text_or_loaded, **options)``
starts one on free loopback ports; every one started is stopped at the end."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from gateway.engine.preflight import parse_and_build
from gateway.policy.loader import LoadedPolicy
from gateway.serving.lifecycle import Gateway


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
