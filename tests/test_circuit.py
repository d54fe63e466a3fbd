"""The circuit breaker on a fake clock: when it opens, probes, backs off and closes."""

from __future__ import annotations

import logging

import pytest

from gateway.clock import FakeClock
from gateway.stores.redis.circuit import CircuitBreaker


def test_breaker_opens_probes_backs_off_and_closes(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(0)
    breaker = CircuitBreaker(
        "redis", failure_threshold=3, reset_timeout_s=1.0, max_reset_timeout_s=3.0, clock=clock
    )
    caplog.set_level(logging.INFO, logger="gateway.circuit")
    for _ in range(2):
        assert breaker.allow()
        breaker.failure("timeout")
    assert breaker.state == "closed"
    breaker.success()  # a success resets the count
    for _ in range(3):
        assert breaker.allow()
        breaker.failure("timeout")
    assert breaker.state == "open" and breaker.retry_in_s == 1.0
    assert not breaker.allow() and breaker.short_circuited == 1
    clock.advance(1.0)
    assert breaker.allow() and breaker.state == "half_open"
    assert not breaker.allow()  # one probe at a time
    breaker.failure("refused")
    assert breaker.state == "open" and breaker.retry_in_s == 2.0  # backed off
    clock.advance(2.0)
    assert breaker.allow()
    breaker.failure("refused")
    assert breaker.retry_in_s == 3.0  # capped
    clock.advance(3.0)
    assert breaker.allow()
    breaker.success()
    assert breaker.state == "closed" and breaker.allow()
    assert breaker.transitions == {
        "closed->open": 1,
        "open->half_open": 3,
        "half_open->open": 2,
        "half_open->closed": 1,
    }
    assert breaker.opened == 3 and breaker.probes == 3 and breaker.failures == 7
    messages = [r.getMessage() for r in caplog.records if r.name == "gateway.circuit"]
    assert len(messages) == 7
    assert messages[0].startswith("redis circuit closed->open (3 failures in a row")


def test_a_cancelled_probe_reopens_the_circuit_for_the_next_call_to_probe() -> None:
    clock = FakeClock(0)
    breaker = CircuitBreaker(
        "redis", failure_threshold=1, reset_timeout_s=1.0, max_reset_timeout_s=4.0, clock=clock
    )
    assert breaker.allow() and breaker.probe_out == 0  # closed: no probe
    breaker.failure("timeout")
    clock.advance(1.0)
    assert breaker.allow() and breaker.state == "half_open"
    first = breaker.probe_out
    assert first == 1 and not breaker.allow()
    breaker.cancelled(first)  # its client hung up before Redis answered
    assert breaker.state == "open" and breaker.retry_in_s == 0.0
    assert breaker.allow() and breaker.state == "half_open"  # the next call probes at once
    second = breaker.probe_out
    breaker.cancelled(first)  # a stale probe's cancellation leaves the new probe out
    assert breaker.state == "half_open" and not breaker.allow()
    breaker.failure("refused")  # a probe that fails still backs off as before
    assert breaker.state == "open" and breaker.retry_in_s == 2.0
    breaker.cancelled(second)  # no longer out: nothing to release
    assert breaker.state == "open" and breaker.retry_in_s == 2.0
    assert breaker.transitions["half_open->open"] == 2 and breaker.opened == 2
