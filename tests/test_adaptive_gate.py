"""An upstream's adaptive gate in one worker: places up to the controller's limit, a first-come-
first-served wait for max_delay beyond it, and nothing held by a request that left."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

from gateway.algorithms.registry import gradient_params
from gateway.clock import FakeClock
from gateway.edge.adaptive_gate import AdaptiveGate
from gateway.policy.models import AdaptiveSettings

MS = 1000


def gate(clock: FakeClock, max_delay_s: float = 0.0, max_queue: int = 10) -> AdaptiveGate:
    params = replace(gradient_params(AdaptiveSettings()), probe_requests=3)
    return AdaptiveGate(params, clock, lambda: 0.0, max_delay_s=max_delay_s, max_queue=max_queue)


async def test_places_up_to_the_limit_then_shed_at_once() -> None:
    clock = FakeClock()
    adaptive = gate(clock)
    assert adaptive.controller.limit == 3  # probing at min_limit
    assert [await adaptive.enter() for _ in range(5)] == [True, True, True, False, False]
    assert adaptive.shed == 2
    started = clock.now_us()
    clock.advance(0.02)
    adaptive.release(started)
    assert await adaptive.enter()


async def test_beyond_the_limit_requests_wait_in_order_for_a_place() -> None:
    clock = FakeClock()
    adaptive = gate(clock, max_delay_s=30.0)
    for _ in range(3):
        assert adaptive.try_enter()
    order: list[int] = []

    async def one(number: int) -> None:
        assert await adaptive.enter()
        order.append(number)

    waiters = [asyncio.ensure_future(one(n)) for n in range(3)]
    await asyncio.sleep(0)
    assert adaptive.waiting == 3
    assert not adaptive.try_enter()  # a newcomer does not pass those waiting
    for _ in range(3):
        adaptive.release(clock.now_us(), measured=False)
        await asyncio.sleep(0)
    await asyncio.gather(*waiters)
    assert order == [0, 1, 2]
    assert adaptive.controller.in_flight == 3 and adaptive.waiting == 0


async def test_a_request_that_waits_too_long_is_shed_and_leaves_the_line() -> None:
    clock = FakeClock()
    adaptive = gate(clock, max_delay_s=0.05)
    for _ in range(3):
        adaptive.try_enter()
    assert not await adaptive.enter()
    assert adaptive.shed == 1 and adaptive.waiting == 0
    adaptive.release(clock.now_us(), measured=False)
    assert adaptive.controller.in_flight == 2  # nobody was granted the place on leaving


async def test_the_line_is_bounded_by_max_queue() -> None:
    clock = FakeClock()
    adaptive = gate(clock, max_delay_s=30.0, max_queue=1)
    for _ in range(3):
        adaptive.try_enter()
    first = asyncio.ensure_future(adaptive.enter())
    await asyncio.sleep(0)
    assert not await adaptive.enter()  # the line is full
    assert adaptive.shed == 1
    adaptive.release(clock.now_us(), measured=False)
    assert await first


async def test_a_client_that_leaves_while_waiting_holds_nothing() -> None:
    clock = FakeClock()
    adaptive = gate(clock, max_delay_s=30.0)
    for _ in range(3):
        adaptive.try_enter()
    leaving = asyncio.ensure_future(adaptive.enter())
    staying = asyncio.ensure_future(adaptive.enter())
    await asyncio.sleep(0)
    leaving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await leaving
    assert adaptive.waiting == 1
    adaptive.release(clock.now_us(), measured=False)
    assert await staying
    assert adaptive.controller.in_flight == 3


async def test_the_latencies_released_are_what_the_controller_measures() -> None:
    clock = FakeClock()
    adaptive = gate(clock)
    for _ in range(3):
        adaptive.try_enter()
    started = clock.now_us()
    clock.advance(0.025)
    for _ in range(3):
        adaptive.release(started)
    assert not adaptive.controller.probing
    assert adaptive.controller.min_latency_us == 25 * MS
