"""What this replica admitted through Redis and has not yet charged to its local fallback.

With ``on_failure: local`` the fallback's state must already hold this replica's recent
admissions when Redis fails. Deciding each admitted request a second time in process was a
good part of the store's CPU per request (bench/README.md); instead the request path only
counts units per limit table and key, and the store charges the counts to the fallback (each
as much as it has room for) every ``FOLD_INTERVAL_S``, when more than ``MAX_PENDING_KEYS``
keys wait, and before anything decides or reads in the fallback.

Charging late is at least as strict as charging on time, for every algorithm: a bucket charged
late refills (or drains) before the charge rather than after it, so what the cap cuts off is
cut from the refill, not from the charge: it is left with no more tokens (no less excess); a
window count moved later lands in the same window or a later one, and weighs as much or more
at every later instant. Charging each limit as much as it has room for is at least as strict
as the all-or-nothing decision over a request's stacked checks, which charged none of them
when one was full.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from gateway.limits.compiled import Check

FOLD_INTERVAL_S: Final = 0.1
MAX_PENDING_KEYS: Final = 4096


class PendingCharges:
    """Units admitted through Redis per limit table and key, not yet in the fallback."""

    __slots__ = ("_tables", "keys", "max_keys")

    def __init__(self, max_keys: int = MAX_PENDING_KEYS) -> None:
        self.max_keys = max_keys
        self.keys = 0  # (table, key) pairs held
        self._tables: dict[str, dict[str, int]] = {}

    def __bool__(self) -> bool:
        return self.keys > 0

    def add(self, checks: Sequence[Check]) -> bool:
        """Count one admitted request; True when more keys wait than the bound allows."""
        tables = self._tables
        for check in checks:
            table = check.limit.table
            units = tables.get(table)
            if units is None:
                units = tables[table] = {}
            key = check.key
            held = units.get(key)
            if held is None:
                units[key] = check.cost
                self.keys += 1
            else:
                units[key] = held + check.cost
        return self.keys > self.max_keys

    def take(self) -> dict[str, dict[str, int]]:
        """Everything pending, forgotten here: the caller charges it."""
        taken = self._tables
        self._tables = {}
        self.keys = 0
        return taken
