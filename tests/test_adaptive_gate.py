"""An upstream's adaptive gate in one worker: places up to the controller's limit, a first-come-
first-served wait for max_delay beyond it, and nothing held by a request that left."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import pytest

from gateway.algorithms.registry import gradient_params
from gateway.clock import FakeClock
from gateway.edge.adaptive_gate import AdaptiveGate
from gateway.policy.models import AdaptiveSettings
from tests.support.virtual_clock import run_on_virtual_clock

MS = 1000


def gate(clock: FakeClock, max_delay_s: float = 0.0, max_queue: int = 10) -> AdaptiveGate:
    # Measuring at the floor from the start: three places (the line's mechanics, not the
    # cold start's).
    params = replace(gradient_params(AdaptiveSettings()), probe_requests=3, initial_limit=3)
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


# The line's deadlines on the loop's own clock, virtual (tests/support/virtual_clock.py): a
# timer fires at its due instant whatever the machine's load, so outcomes are exact.


def full_gate(max_delay_s: float) -> AdaptiveGate:
    """A gate whose three places (probing at min_limit) are taken."""
    adaptive = gate(FakeClock(), max_delay_s=max_delay_s)
    for _ in range(3):
        assert adaptive.try_enter()
    return adaptive


def test_the_front_is_shed_at_its_deadline_while_those_behind_it_get_places() -> None:
    async def main() -> None:
        adaptive = full_gate(max_delay_s=1.0)
        first = asyncio.ensure_future(adaptive.enter())  # due at 1.0
        await asyncio.sleep(0.5)
        second = asyncio.ensure_future(adaptive.enter())  # due at 1.5
        third = asyncio.ensure_future(adaptive.enter())
        await asyncio.sleep(0.6)
        assert first.done() and first.result() is False
        assert not second.done() and not third.done()
        assert adaptive.waiting == 2 and adaptive.shed == 1
        adaptive.release(0, measured=False)
        adaptive.release(0, measured=False)
        assert await second and await third
        assert adaptive.controller.in_flight == 3
        assert adaptive.waiting == 0 and adaptive.shed == 1

    run_on_virtual_clock(main)


def test_a_timer_set_for_a_waiter_granted_since_does_not_shed_the_next_early() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        adaptive = full_gate(max_delay_s=1.0)
        first = asyncio.ensure_future(adaptive.enter())  # the timer is set for 1.0
        await asyncio.sleep(0.5)
        second = asyncio.ensure_future(adaptive.enter())  # due at 1.5
        await asyncio.sleep(0)
        adaptive.release(0, measured=False)
        assert await first
        await asyncio.sleep(0.6)  # past 1.0: the timer fired for a waiter no longer there
        assert not second.done() and adaptive.shed == 0
        assert await second is False
        assert loop.time() == pytest.approx(1.5, abs=0.002)
        assert adaptive.shed == 1 and adaptive.waiting == 0
        assert adaptive.controller.in_flight == 3

    run_on_virtual_clock(main)


def test_each_waiter_is_shed_at_its_own_deadline_in_order() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        adaptive = full_gate(max_delay_s=1.0)
        shed_at: list[tuple[int, float]] = []

        async def one(number: int) -> None:
            assert not await adaptive.enter()
            shed_at.append((number, loop.time()))

        waiters = []
        for number in range(3):
            waiters.append(asyncio.ensure_future(one(number)))
            await asyncio.sleep(0.25)
        await asyncio.gather(*waiters)
        assert [number for number, _ in shed_at] == [0, 1, 2]
        assert [at for _, at in shed_at] == pytest.approx([1.0, 1.25, 1.5], abs=0.002)
        assert adaptive.shed == 3 and adaptive.waiting == 0

    run_on_virtual_clock(main)


def test_waiters_cancelled_in_the_middle_of_the_line_leave_it() -> None:
    async def main() -> None:
        adaptive = full_gate(max_delay_s=1.0)
        first, second, third, last = (asyncio.ensure_future(adaptive.enter()) for _ in range(4))
        await asyncio.sleep(0)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        assert adaptive.waiting == 3
        third.cancel()  # still in the line when the places come free: passed over
        adaptive.release(0, measured=False)
        adaptive.release(0, measured=False)
        with pytest.raises(asyncio.CancelledError):
            await third
        assert await first and await last
        assert adaptive.controller.in_flight == 3
        assert adaptive.waiting == 0 and adaptive.shed == 0

    run_on_virtual_clock(main)


def test_a_waiter_granted_as_it_is_cancelled_passes_the_place_on() -> None:
    async def main() -> None:
        adaptive = full_gate(max_delay_s=1.0)
        leaving = asyncio.ensure_future(adaptive.enter())
        staying = asyncio.ensure_future(adaptive.enter())
        await asyncio.sleep(0)
        adaptive.release(0, measured=False)  # the place goes to ``leaving``...
        leaving.cancel()  # ...which is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert await staying
        assert adaptive.controller.in_flight == 3
        assert adaptive.waiting == 0 and adaptive.shed == 0

    run_on_virtual_clock(main)


def test_a_waiter_shed_as_it_is_cancelled_holds_nothing() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        adaptive = full_gate(max_delay_s=1.0)
        leaving = asyncio.ensure_future(adaptive.enter())
        await asyncio.sleep(0)
        # The gate's timer sheds it at its deadline, 1.0; this one, due then too and set
        # after it, cancels it before it runs again.
        loop.call_at(1.0, leaving.cancel)
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert adaptive.controller.in_flight == 3
        assert adaptive.waiting == 0 and adaptive.shed == 1

    run_on_virtual_clock(main)


def test_a_waiter_cancelled_at_its_deadline_is_not_counted_and_the_next_still_times_out() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        adaptive = full_gate(max_delay_s=1.0)
        leaving = asyncio.ensure_future(adaptive.enter())
        loop.call_at(1.0, leaving.cancel)  # due with the gate's timer, and before it
        await asyncio.sleep(0.5)
        staying = asyncio.ensure_future(adaptive.enter())  # due at 1.5
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert await asyncio.wait_for(staying, 10.0) is False  # the virtual 10 s: not a hang
        assert loop.time() == pytest.approx(1.5, abs=0.002)
        assert adaptive.shed == 1 and adaptive.waiting == 0
        assert adaptive.controller.in_flight == 3

    run_on_virtual_clock(main)
