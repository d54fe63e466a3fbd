"""The concurrency slots this replica holds in Redis, kept alive while it runs.

A replica's slots of a key are one field of the key's hash, under the replica's id, with an
expiry (``lua/concurrency.lua``). Every ``interval_s`` (a third of the slots' time to live) the
keeper renews the field of each key this replica holds slots of; a replica that dies or is cut
off from Redis stops renewing, and its slots stop counting within the time to live. The book
here is the replica's own account: a key with no call in flight has its field set to it when
renewed, so a release Redis did not hear of (a timeout) is set right within ``interval_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from gateway.limits.compiled import Check
from gateway.stores.redis.key_layout import LimitPlan

log = logging.getLogger("gateway.store")

# (check, its plan, what the renewal sets: 0 renews the count Redis has, n + 1 sets it to n).
Renewal = tuple[Check, LimitPlan, int]


class _Held:
    __slots__ = ("check", "plan", "slots")

    def __init__(self, check: Check, plan: LimitPlan) -> None:
        self.check = check
        self.plan = plan
        self.slots = 0


class SlotKeeper:
    """``redis key -> slots this replica holds``, and the task that renews them."""

    def __init__(
        self, renew: Callable[[Sequence[Renewal]], Awaitable[None]], interval_s: float
    ) -> None:
        self._renew = renew
        self.interval_s = interval_s
        self.held: dict[str, _Held] = {}
        # Calls in flight that may change a key's slots in Redis: its count is not set then.
        self._in_flight: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        self.renewals = 0  # rounds done (tests, debugging)

    @property
    def slots_held(self) -> int:
        return sum(held.slots for held in self.held.values())

    def calling(self, checks: Sequence[Check], plans: Sequence[LimitPlan]) -> list[str]:
        """A call that may take or give back slots is about to be sent: its slot keys."""
        keys = [
            plan.redis_key(check.key)
            for check, plan in zip(checks, plans, strict=True)
            if check.limit.holds_slots
        ]
        in_flight = self._in_flight
        for key in keys:
            in_flight[key] = in_flight.get(key, 0) + 1
        return keys

    def answered(self, keys: Sequence[str]) -> None:
        in_flight = self._in_flight
        for key in keys:
            left = in_flight[key] - 1
            if left:
                in_flight[key] = left
            else:
                del in_flight[key]

    def took(self, checks: Sequence[Check], plans: Sequence[LimitPlan]) -> None:
        """Redis admitted ``checks``: their slots are this replica's to renew."""
        for check, plan in zip(checks, plans, strict=True):
            if not check.limit.holds_slots:
                continue
            key = plan.redis_key(check.key)
            held = self.held.get(key)
            if held is None:
                held = self.held[key] = _Held(check, plan)
            held.slots += check.cost
        if self.held and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._keep())

    def give_back(self, check: Check, plan: LimitPlan) -> bool:
        """Whether ``check``'s slots were taken in Redis (then they leave the book; the caller
        gives them back there), not in the local fallback."""
        key = plan.redis_key(check.key)
        held = self.held.get(key)
        if held is None:
            return False
        held.slots -= check.cost
        if held.slots <= 0:
            del self.held[key]
        return True

    async def _keep(self) -> None:
        try:
            while self.held:
                await asyncio.sleep(self.interval_s)
                in_flight = self._in_flight
                round_ = [
                    (held.check, held.plan, 0 if key in in_flight else held.slots + 1)
                    for key, held in self.held.items()
                ]
                try:
                    await self._renew(round_)
                except Exception:  # never: the renewal counts its failures; logged if it does
                    log.exception("renewing concurrency slots in Redis failed")
                self.renewals += 1
        finally:
            self._task = None

    def close(self) -> None:
        task = self._task
        if task is not None:
            task.cancel()
            self._task = None
