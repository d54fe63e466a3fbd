"""Build an algorithm from a limit in the policy file."""

from __future__ import annotations

from typing import Any

from gateway.algorithms.base import Algorithm
from gateway.algorithms.calendar_window import CalendarWindow
from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.leaky_bucket import LeakyBucket
from gateway.algorithms.sliding_log import SlidingLog
from gateway.algorithms.sliding_window import SlidingWindow
from gateway.algorithms.token_bucket import token_bucket
from gateway.policy.models import LeakyBucketLimit, Limit, TokenBucketLimit, WindowLimit

_WINDOWS: dict[str, type[FixedWindow | SlidingWindow | SlidingLog]] = {
    "fixed_window": FixedWindow,
    "sliding_window": SlidingWindow,
    "sliding_log": SlidingLog,
}


def build_algorithm(spec: Limit) -> Algorithm[Any]:
    """Raises ``ValueError`` for parameters the algorithm refuses (``gateway check`` reports it)."""
    if isinstance(spec, LeakyBucketLimit):
        return LeakyBucket(
            spec.rate.requests,
            spec.rate.period_s,
            spec.burst,
            None if spec.nodelay else (spec.delay or 0),
        )
    if isinstance(spec, WindowLimit):
        if isinstance(spec.window, str):  # a calendar period (the schema checks calendar: true)
            return CalendarWindow(spec.limit, spec.window, spec.timezone)
        return _WINDOWS[spec.algorithm](spec.limit, spec.window)
    if isinstance(spec, TokenBucketLimit):
        return token_bucket(
            spec.rate.requests,
            spec.rate.period_s,
            spec.burst,
            mode=spec.mode,
            warmup_s=spec.warmup,
            max_delay_s=spec.max_delay,
        )
    raise ValueError(f"unknown algorithm {spec!r}")
