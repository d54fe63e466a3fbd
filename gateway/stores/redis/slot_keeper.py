"""The concurrency slots this replica holds in Redis, kept alive while it runs.

A replica's slots of a key are one field of the key's hash, under the replica's id, with an
expiry (``lua/concurrency.lua``). Every ``interval_s`` (a third of the slots' time to live) the
keeper renews the field of each key this replica holds slots of; a replica that dies or is cut
off from Redis stops renewing, and its slots stop counting within the time to live.

A renewal keeps the count Redis has (a take or a release of the key may be on its way on another
connection: an increment or a decrement is right whenever it lands, a count set from here would
not be). Only when Redis has none of this replica's slots of the key left (it was cut off longer
than their time to live) is the field written again from the book here. So a release that ran
in Redis but whose answer was lost is not undone; nor is it over-counted for long: the key's
field expires within the time to live once this replica holds no more slots of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from gateway.limits.compiled import Check
from gateway.stores.redis.key_layout import LimitPlan

log = logging.getLogger("gateway.store")

# (check, its plan, the slots this replica holds of the key).
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
        self._task: asyncio.Task[None] | None = None
        self.renewals = 0  # rounds done (tests, debugging)

    @property
    def slots_held(self) -> int:
        return sum(held.slots for held in self.held.values())

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
                round_ = [(held.check, held.plan, held.slots) for held in self.held.values()]
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
