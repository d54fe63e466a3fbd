"""Log lines rate-limited per cause: the first written, the rest counted and reported."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.log_throttle import MAX_CAUSES, LogThrottle

log = logging.getLogger("test.throttle")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _write(throttle: LogThrottle, cause: str, message: str) -> None:
    if throttle.due(cause):
        throttle.log(logging.ERROR, cause, message)


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.throttle"]


def test_a_storm_is_one_line_per_cause_per_interval_with_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    throttle = LogThrottle(log, 10.0, clock)
    for i in range(1000):
        clock.now = 100.0 + i * 0.005  # 5 s of failures of one cause, 2 of another
        _write(throttle, "refused", f"refused #{i}")
        if i % 500 == 0:
            _write(throttle, "tls", f"tls #{i}")
    assert _lines(caplog) == ["refused #0", "tls #0"]
    throttle.flush()  # within the interval: nothing due yet
    assert len(_lines(caplog)) == 2

    clock.now = 110.0
    throttle.flush()
    assert _lines(caplog)[2:] == [
        "refused #0 (and 999 more like this in the last 10s)",
        "tls #0 (and 1 more like this in the last 10s)",
    ]
    # The storm goes on: still one line per interval.
    clock.now = 111.0
    _write(throttle, "refused", "refused later")
    assert len(_lines(caplog)) == 4
    clock.now = 121.0
    _write(throttle, "refused", "refused after")
    assert _lines(caplog)[4] == "refused after (and 1 more like this since the last such line)"
    # Quiet for an interval: the next line is written at once, with nothing to count.
    clock.now = 140.0
    _write(throttle, "refused", "refused again")
    assert _lines(caplog)[5:] == ["refused again"]


async def test_the_count_is_written_when_the_interval_ends_even_if_the_storm_stopped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On a running loop the summary needs no later line: a timer writes it."""
    throttle = LogThrottle(log, 0.05)
    for i in range(5):
        _write(throttle, "reset", f"reset #{i}")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while len(_lines(caplog)) < 2:
        assert loop.time() < deadline, _lines(caplog)
        await asyncio.sleep(0.02)
    assert _lines(caplog) == ["reset #0", "reset #0 (and 4 more like this in the last 0.05s)"]


def test_causes_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    throttle = LogThrottle(log, 10.0, clock)
    for i in range(MAX_CAUSES + 10):
        _write(throttle, f"cause-{i}", "x")
    assert len(throttle._causes) <= MAX_CAUSES
    clock.now += 11
    _write(throttle, "another", "y")
    assert len(throttle._causes) < MAX_CAUSES
