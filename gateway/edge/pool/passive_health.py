"""Passive health as nginx's ``max_fails`` and ``fail_timeout``, on the times it is handed.

As ``ngx_http_upstream_round_robin.c`` does it: each failure counts and stamps the time; a
server with ``max_fails`` failures is skipped until ``fail_timeout`` has passed since the last
check, then picked once (the pick stamps the check time, so the rest wait another
``fail_timeout``): that trial's success clears the count, its failure takes the server out again.
A success clears the count only once a check has passed since the last failure, so failures
spread within ``fail_timeout`` add up even between successes.
"""

from __future__ import annotations


class PassiveHealth:
    __slots__ = ("checked_at", "fail_timeout_s", "failed_at", "fails", "max_fails")

    def __init__(self, max_fails: int, fail_timeout_s: float) -> None:
        self.max_fails = max_fails  # 0: never taken out
        self.fail_timeout_s = fail_timeout_s
        self.fails = 0
        self.failed_at = 0.0  # nginx's ``accessed``
        self.checked_at = 0.0

    def available(self, now: float) -> bool:
        return not (
            self.max_fails
            and self.fails >= self.max_fails
            and now - self.checked_at <= self.fail_timeout_s
        )

    def picked(self, now: float) -> None:
        if now - self.checked_at > self.fail_timeout_s:
            self.checked_at = now

    def failed(self, now: float) -> bool:
        """Count a failure; True if it takes the server out (the count reaches ``max_fails``)."""
        self.fails += 1
        self.failed_at = now
        self.checked_at = now
        return self.max_fails > 0 and self.fails == self.max_fails

    def succeeded(self) -> bool:
        """Count a success; True if it brings a server that was out back."""
        if self.failed_at < self.checked_at:
            was_out = self.max_fails > 0 and self.fails >= self.max_fails
            self.fails = 0
            return was_out
        return False
