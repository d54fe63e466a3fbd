"""Build an algorithm from a limit in the policy file."""

from __future__ import annotations

from typing import Any

from gateway.algorithms.base import Algorithm
from gateway.algorithms.calendar_window import CalendarWindow
from gateway.algorithms.concurrency import Concurrency
from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.gradient_limit import GradientParams
from gateway.algorithms.leaky_bucket import LeakyBucket
from gateway.algorithms.sliding_log import SlidingLog
from gateway.algorithms.sliding_window import SlidingWindow
from gateway.algorithms.token_bucket import token_bucket
from gateway.policy.models import (
    AdaptiveSettings,
    ConcurrencyLimit,
    LeakyBucketLimit,
    Limit,
    TokenBucketLimit,
    WindowLimit,
)

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
    if isinstance(spec, ConcurrencyLimit):
        return Concurrency(spec.limit, spec.retry_after)
    raise ValueError(f"unknown algorithm {spec!r}")


def gradient_params(settings: AdaptiveSettings) -> GradientParams:
    """An upstream's ``adaptive:`` block as the controller's parameters."""
    return GradientParams(
        min_limit=settings.min_limit,
        max_limit=settings.max_limit,
        initial_limit=(
            settings.initial_limit if settings.initial_limit is not None else settings.max_limit
        ),
        buffer=settings.buffer,
        min_buffer_us=round(settings.min_buffer * 1_000_000),
        sample_interval_us=max(round(settings.sample_interval * 1_000_000), 1),
        probe_interval_us=max(round(settings.probe_interval * 1_000_000), 1),
        probe_requests=settings.probe_requests,
        jitter=settings.jitter,
    )
