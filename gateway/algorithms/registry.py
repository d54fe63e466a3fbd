"""Build an algorithm from a limit in the policy file."""

from __future__ import annotations

from typing import Any

from gateway.algorithms.base import Algorithm
from gateway.algorithms.leaky_bucket import LeakyBucket
from gateway.policy import LeakyBucketLimit, Limit, TokenBucketLimit, WindowLimit


def build_algorithm(spec: Limit) -> Algorithm[Any]:
    if isinstance(spec, LeakyBucketLimit):
        return LeakyBucket(
            spec.rate.requests,
            spec.rate.period_s,
            spec.burst,
            None if spec.nodelay else (spec.delay or 0),
        )
    if isinstance(spec, WindowLimit):
        raise NotImplementedError(spec.algorithm)
    if isinstance(spec, TokenBucketLimit):
        raise NotImplementedError(spec.algorithm)
    raise ValueError(f"unknown algorithm {spec!r}")
