"""A limit's rejections and delays in the log, as nginx's ``limit_req`` writes them (its
``limit_req_log_level``): a rejection at the limit's level, a delay one level lower, a dry-run
limit's would-reject at its level, at most one line per limit and kind per interval with the
count of the others. Keys are shown as on the dashboard: ``header:`` and ``query:`` parts (API
keys) hashed unless the limit says ``top_keys: plain``.

A request whose line is not due costs a dict lookup and a clock compare; a limit whose level is
``off`` costs the lookup.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from gateway.edge.request_record import RequestRecord
from gateway.limits.keys import key_in_words, shown_key
from gateway.log_throttle import LOG_INTERVAL_S, LogThrottle

if TYPE_CHECKING:
    from gateway.edge.runtime import Runtime
    from gateway.engine.limit_engine import Outcome
    from gateway.limits.compiled import Check

log = logging.getLogger("gateway.limits")

_LEVELS: Final = {"error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO}
# A delay is logged one level below a rejection (nginx's rule).
_LOWER: Final = {logging.ERROR: logging.WARNING, logging.WARNING: logging.INFO}


class LimitLog:
    """The log lines of one worker's limits; the levels are read from the runtime in force."""

    __slots__ = ("_delays", "_levels", "_rejections", "_runtime")

    def __init__(
        self, interval_s: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._rejections = LogThrottle(log, interval_s, clock)
        self._delays = LogThrottle(log, interval_s, clock)
        self._runtime: Runtime | None = None
        self._levels: dict[str, int] = {}

    def _level(self, runtime: Runtime, limit: str) -> int:
        if runtime is not self._runtime:
            self._runtime = runtime
            policy = runtime.loaded.policy
            default = policy.server.limit_log_level
            self._levels = {
                name: _LEVELS.get(spec.log_level or default, 0)
                for name, spec in policy.limits.items()
            }
        return self._levels.get(limit, 0)

    def rejected(
        self, runtime: Runtime, outcome: Outcome, request: RequestRecord, route: str
    ) -> None:
        """A line for each limit that rejected the request (when due, at its level)."""
        verdict = outcome.verdict
        if verdict is None:  # refused before any store call (unlisted: reject)
            if outcome.rejected_by is not None:
                self._rejected(runtime, outcome, outcome.rejected_by, None, request, route)
            return
        for index in verdict.rejected_by:
            check = outcome.checks[index]
            self._rejected(runtime, outcome, check.limit.name, check, request, route)

    def _rejected(
        self,
        runtime: Runtime,
        outcome: Outcome,
        name: str,
        check: Check | None,
        request: RequestRecord,
        route: str,
    ) -> None:
        level = self._level(runtime, name)
        if not level or not self._rejections.due(name):
            return
        retry = f", retry after {outcome.retry_after_s:.3g}s" if outcome.retry_after_s else ""
        why = outcome.reason
        verdict = outcome.verdict
        if check is not None and verdict is not None:
            queued = verdict.decisions[outcome.checks.index(check)].allowed
            why = "its queue is full or the wait is over max_delay" if queued else "over the limit"
        self._rejections.log(
            level,
            name,
            f"limit {name} rejected a request ({outcome.status}{retry}): {why}; "
            f"{_key(check)}{_request(request, route)}",
        )

    def delayed(
        self, runtime: Runtime, outcome: Outcome, request: RequestRecord, route: str
    ) -> None:
        verdict = outcome.verdict
        if verdict is None or verdict.delayed_by is None:
            return
        check = outcome.checks[verdict.delayed_by]
        name = check.limit.name
        level = self._level(runtime, name)
        if not level or not self._delays.due(name):
            return
        self._delays.log(
            _LOWER.get(level, logging.DEBUG),
            name,
            f"limit {name} delayed a request by {outcome.delay_s * 1000:.0f} ms; "
            f"{_key(check)}{_request(request, route)}",
        )

    def would_reject(
        self, runtime: Runtime, check: Check, request: RequestRecord, route: str
    ) -> None:
        name = check.limit.name
        level = self._level(runtime, name)
        if not level or not self._rejections.due(name):
            return
        self._rejections.log(
            level,
            name,
            f"limit {name} (dry run) would have rejected a request; {_key(check)}"
            f"{_request(request, route)}",
        )


def _request(request: RequestRecord, route: str) -> str:
    """The client and the request: its method and route (not its path, whose query may carry
    a token)."""
    client = request.client_ip or request.remote() or "-"
    return f"client {client}, {request.method} on route {route}"


def _key(check: Check | None) -> str:
    """``key '...', `` as the dashboard shows it, or nothing when no check names one."""
    if check is None:
        return ""
    spec = check.limit.spec
    shown = shown_key(spec.key, check.key, plain=spec.top_keys == "plain")
    return f"key {key_in_words(shown)!r}, "
