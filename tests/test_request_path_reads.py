"""A proxied request reads no attribute of the policy's pydantic models: ``BaseModel`` defines
``__getattr__``, so each read goes through Python's slower attribute lookup (some 400
instructions, where a native field is a load); what the request path reads of the policy is
copied once into native records (``routing.RouteEntry``, ``server_pool.RetryRule``, the
runtime's fields).

A gateway in the test's loop in front of a real upstream; reads of any model's attribute are
recorded while a few requests pass, under no limits, three never-binding ones, and one on
named routes."""

from __future__ import annotations

from typing import Any

import aiohttp
import pydantic
import pytest

from tests.support.gateways import GatewayFactory
from tests.support.policies import limited_policy, policy_for
from tests.support.upstreams import RecordingUpstream

THREE_LIMITS = (
    "  per_ip:\n    algorithm: leaky_bucket\n    rate: 100000r/s\n    burst: 1000\n"
    "    key: [client_ip]\n"
    "  per_route:\n    algorithm: sliding_window\n    limit: 1000000\n    window: 1m\n"
    "    key: [route]\n"
    "  everyone:\n    algorithm: token_bucket\n    rate: 100000r/s\n    burst: 100000\n"
)
# A limit on named routes: whether it applies is read from the request's route name.
ROUTED_LIMIT = (
    "  on_all:\n    algorithm: fixed_window\n    limit: 1000000\n    window: 1m\n"
    "    match: {routes: [all]}\n"
)
POLICIES = {"none": "", "three": THREE_LIMITS, "routed": ROUTED_LIMIT}


@pytest.mark.parametrize("limits", sorted(POLICIES))
async def test_a_proxied_request_reads_no_policy_model_attribute(
    upstream: RecordingUpstream,
    start_gateway: GatewayFactory,
    monkeypatch: pytest.MonkeyPatch,
    limits: str,
) -> None:
    text = POLICIES[limits]
    policy = limited_policy(upstream.url, text) if text else policy_for(upstream.url)
    gw = await start_gateway(policy)
    reads: list[tuple[str, str]] = []
    recording = False
    generic = object.__getattribute__

    def recorded(model: Any, name: str) -> Any:
        if recording and not name.startswith("__"):
            reads.append((type(model).__name__, name))
        return generic(model, name)

    monkeypatch.setattr(pydantic.BaseModel, "__getattribute__", recorded)
    async with aiohttp.ClientSession() as session:
        for number in range(6):
            recording = number > 0  # the first request sets up the connections
            async with session.get(gw.url + f"/items/{number}") as resp:
                assert resp.status == 200
                await resp.read()
    assert reads == []
