"""Active health checks' verdict on one server, pure: ``unhealthy`` failed checks in a row take
it out, ``healthy`` passed checks in a row bring it back. A server starts healthy."""

from __future__ import annotations


class ActiveHealth:
    __slots__ = ("failed_in_row", "healthy", "healthy_after", "passed_in_row", "unhealthy_after")

    def __init__(self, healthy_after: int, unhealthy_after: int) -> None:
        self.healthy_after = healthy_after
        self.unhealthy_after = unhealthy_after
        self.healthy = True
        self.passed_in_row = 0
        self.failed_in_row = 0

    def record(self, passed: bool) -> bool:
        """One check's result; True if it changed the verdict."""
        if passed:
            self.passed_in_row += 1
            self.failed_in_row = 0
            if not self.healthy and self.passed_in_row >= self.healthy_after:
                self.healthy = True
                return True
        else:
            self.failed_in_row += 1
            self.passed_in_row = 0
            if self.healthy and self.failed_in_row >= self.unhealthy_after:
                self.healthy = False
                return True
        return False
