"""Limit state in this process: one bounded table of per-key states per limit (a slot table
for a concurrency limit, whose keys are never evicted)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import Any

from gateway.algorithms.base import Decision
from gateway.algorithms.charging import charge_what_fits
from gateway.algorithms.combine import CombinedDecision, combine
from gateway.algorithms.concurrency import Concurrency
from gateway.clock import Clock, MonotonicClock, Reads, reads
from gateway.limits.compiled import Check, CompiledLimit, with_variants
from gateway.stores.immediate import DecidesNow
from gateway.stores.keyed_state import KeyedState
from gateway.stores.slot_table import SlotTable
from gateway.stores.store_stats import StoreStats


class MemoryStore(DecidesNow):
    """State in this process: one bounded LRU table of per-key states per limit."""

    name = "memory"
    verdicts_on_clock = True
    decides_penalties = False
    # Every slot is taken and given back in this process: a release wakes who waits for it.
    slots_shared = False

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or MonotonicClock()
        # The same clock, read on every decision through the native base (``Reads``).
        self._reads: Reads = reads(self.clock)
        self.tables: dict[str, KeyedState[Any]] = {}
        # Concurrency limits' tables, by table name (apart: nothing in them is evicted).
        self.slot_tables: dict[str, SlotTable] = {}
        self.stats = StoreStats()  # calls only: in-process calls take microseconds
        # Evictions of tables a reload dropped, so that ``evictions`` never goes down.
        self._dropped_evictions: dict[str, int] = {}

    def _table(self, limit: CompiledLimit) -> KeyedState[Any]:
        table = self.tables.get(limit.table)
        if table is None:
            table = self.tables[limit.table] = KeyedState(limit.spec.max_keys, limit.algorithm)
        return table

    def _slot_table(self, limit: CompiledLimit) -> SlotTable:
        table = self.slot_tables.get(limit.table)
        if table is None:
            algorithm = limit.algorithm
            assert isinstance(algorithm, Concurrency)
            table = self.slot_tables[limit.table] = SlotTable(limit.spec.max_keys, algorithm)
        return table

    async def decide(self, checks: Sequence[Check], *, commit: bool = True) -> CombinedDecision:
        return self.decide_now(checks, commit=commit)

    def decide_now(self, checks: Sequence[Check], *, commit: bool = True) -> CombinedDecision:
        """``decide`` without the coroutine: nothing here waits, so the engine calls this
        directly on the request path and saves a coroutine object per request."""
        clock = self._reads
        now_us = clock.now_us()
        self.stats.calls += 1
        if len(checks) == 1:
            return self._decide_one(checks[0], now_us, commit)
        # Compiled, a list's items are read by index, a ``Sequence``'s through Python's
        # iterator protocol: the engine passes a list.
        return self._decide_several(
            checks if isinstance(checks, list) else list(checks), now_us, commit
        )

    def _decide_several(self, checks: list[Check], now_us: int, commit: bool) -> CombinedDecision:
        """``decide_now`` for a request under several limits. An admission without a delay
        (the common case) is the verdict ``combine`` gives, built here without the input
        states' list and ``combine``'s loop; otherwise the input states are read again
        (nothing is written before the commit, so the read finds the states decided on)."""
        clock = self._reads
        unix_us = 0  # calendar time, read when a calendar window needs it
        known = self.tables
        settled = True  # every check admits without a delay
        tables: list[KeyedState[Any] | None] = []
        decisions: list[Decision] = []
        new_states: list[Any] = []
        # Declared: compiled, a name takes the type of its first assignment (a slot count).
        state: Any
        for check in checks:
            limit = check.limit
            at_us = now_us
            if limit.calendar:
                if not unix_us:
                    unix_us = clock.unix_us()
                at_us = unix_us
            if limit.holds_slots:
                slots = self._slot_table(limit)
                state = slots.get(check.key) if commit else slots.peek(check.key)
                tables.append(None)
            else:
                table = known.get(limit.table)
                if table is None:
                    table = self._table(limit)
                # A look (commit=False, for /explain) leaves the keys' places in the LRU order
                # alone.
                state = table.get(check.key) if commit else table.peek(check.key)
                tables.append(table)
            decision, new_state = limit.decides.decide(state, at_us, check.cost)
            if not decision.allowed or decision.delay_s > 0.0:
                settled = False
            decisions.append(decision)
            new_states.append(new_state)
        # Stamped with the instant decided at: a delayed request's refund needs it, and the
        # access log records it so ``gateway replay`` can decide the same request at the same
        # instant.
        if settled:
            verdict = CombinedDecision(
                True, 0.0, 0.0, (), None, tuple(decisions), tuple(new_states), now_us
            )
        else:
            verdict = combine(
                decisions,
                new_states,
                self._states_decided_on(checks, tables),
                now_us,
                [check.max_delay_s for check in checks],
            )
        if commit and verdict.allowed:
            for index, check in enumerate(checks):
                table = tables[index]
                if table is None:
                    self.slot_tables[check.limit.table].put(check.key, new_states[index])
                # A limit charged after the response with ``hold: none`` takes nothing now.
                elif not check.limit.admits_free:
                    # The instant it was decided at: calendar time for a calendar window.
                    at_us = unix_us if check.limit.calendar else now_us
                    table.put_at(check.key, new_states[index], at_us)
        return verdict

    def _states_decided_on(
        self, checks: list[Check], tables: list[KeyedState[Any] | None]
    ) -> list[Any]:
        """The states ``_decide_several`` decided ``checks`` on, read again without marking
        or counting anything: ``peek`` finds what ``get`` returned."""
        states: list[Any] = []
        for index, check in enumerate(checks):
            table = tables[index]
            if table is None:
                states.append(self.slot_tables[check.limit.table].peek(check.key))
            else:
                states.append(table.peek(check.key))
        return states

    def _decide_one(self, check: Check, now_us: int, commit: bool) -> CombinedDecision:
        """``decide_now`` for a request under one limit (the common case): the same steps and
        the same verdict as ``combine``, without the per-request lists."""
        limit = check.limit
        at_us = self._reads.unix_us() if limit.calendar else now_us
        # Declared: compiled, a name takes the type of its first assignment (a slot count).
        state: Any
        table: KeyedState[Any] | None = None
        if limit.holds_slots:
            slots = self._slot_table(limit)
            state = slots.get(check.key) if commit else slots.peek(check.key)
        else:
            table = self.tables.get(limit.table)
            if table is None:
                table = self._table(limit)
            # A look (commit=False, for /explain) leaves the key's place in the LRU order alone.
            state = table.get(check.key) if commit else table.peek(check.key)
        decision, new_state = limit.decides.decide(state, at_us, check.cost)
        if decision.allowed and decision.delay_s <= 0.0:
            # The verdict ``combine`` gives an admission without a delay (the common case),
            # built without its loop and its copies (``_decide_several`` does the same).
            verdict = CombinedDecision(True, 0.0, 0.0, (), None, (decision,), (new_state,), now_us)
        else:
            verdict = combine(
                (decision,),
                (new_state,),
                (state,),
                now_us,
                (check.max_delay_s,) if decision.delay_s > 0.0 else None,
            )
        if commit and verdict.allowed:
            if table is None:
                self.slot_tables[limit.table].put(check.key, new_state)
            # A limit charged after the response with ``hold: none`` takes nothing now.
            elif not limit.admits_free:
                table.put_at(check.key, new_state, at_us)
        return verdict

    def charge_now(self, checks: Sequence[Check], units: Sequence[int]) -> list[int]:
        """Charge each check ``units`` after its response, as much as its key has room for;
        what each took."""
        clock = self._reads
        taken: list[int] = []
        for check, cost in zip(checks, units, strict=True):
            limit = check.limit
            table = self.tables.get(limit.table)
            if table is None:
                table = self._table(limit)
            now_us = clock.unix_us() if limit.calendar else clock.now_us()
            state = table.get(check.key)
            # The table's algorithm: a reload since the admission may have rescaled the states.
            charged, new_state = charge_what_fits(table.algorithm, state, now_us, cost)
            if charged:
                table.put_at(check.key, new_state, now_us)
            taken.append(charged)
        return taken

    async def charge(self, checks: Sequence[Check], units: Sequence[int]) -> list[int]:
        return self.charge_now(checks, units)

    def try_decide_now(self, checks: Sequence[Check]) -> CombinedDecision:
        return self.decide_now(checks)

    async def decide_each(self, checks: Sequence[Check]) -> list[CombinedDecision]:
        return [await self.decide((check,)) for check in checks]

    def release(self, checks: Sequence[Check]) -> None:
        """Give back the slots of a request's concurrency checks (done at once: nothing to
        wait for)."""
        slot_tables = self.slot_tables
        for check in checks:
            table = slot_tables.get(check.limit.table)
            # A reload may have removed the limit: its slots went with it.
            if table is not None:
                table.release(check.key, check.cost)

    async def refund(self, checks: Sequence[Check], charged_us: int | None = None) -> None:
        self.refund_now(checks, charged_us)

    def refund_now(self, checks: Sequence[Check], charged_us: int | None = None) -> None:
        """``refund``, done rather than awaited."""
        clock = self._reads
        now_us = clock.now_us()
        unix_us = clock.unix_us()
        for check in checks:
            if check.limit.holds_slots:
                self.release((check,))
                continue
            table = self.tables.get(check.limit.table)
            # A reload may have removed the limit, or given its name another algorithm whose
            # states this request's charge is no part of: nothing to give back then.
            if table is None or type(table.algorithm) is not type(check.limit.algorithm):
                continue
            state = table.get(check.key)
            if state is None:
                continue
            at_us, charged_at_us = now_us, charged_us
            if check.limit.calendar:  # on calendar time; the verdict's instant is not
                at_us = unix_us
                if charged_us is not None:
                    charged_at_us = charged_us + unix_us - now_us
            # The table's algorithm: rescaled by a reload that changed its parameters.
            state = table.algorithm.refund(state, at_us, check.cost, charged_us=charged_at_us)
            table.put_at(check.key, state, at_us)

    def configure(self, limits: Sequence[CompiledLimit], previous: Sequence[CompiledLimit]) -> None:
        now_us = self.clock.now_us()
        unix_us = self.clock.unix_us()
        old = {limit.table: limit for limit in with_variants(previous)}
        tables: dict[str, KeyedState[Any]] = {}
        slot_tables: dict[str, SlotTable] = {}
        for limit in with_variants(limits):
            before = old.get(limit.table)
            if limit.holds_slots:
                slots = self.slot_tables.get(limit.table)
                if before is None or slots is None or before.identity != limit.identity:
                    continue
                # The requests in flight are still in flight: their slots stay held.
                slots.resize(limit.spec.max_keys)
                algorithm = limit.algorithm
                assert isinstance(algorithm, Concurrency)
                slots.algorithm = algorithm
                slot_tables[limit.table] = slots
                continue
            table = self.tables.get(limit.table)
            if before is None or table is None or before.identity != limit.identity:
                continue  # a new limit, or a different key or algorithm: start afresh
            table.resize(limit.spec.max_keys)
            if before.algorithm != limit.algorithm:
                at_us = unix_us if limit.calendar else now_us
                table.rescale(limit.algorithm, before.algorithm, at_us)
            tables[limit.table] = table
        for name, table in self.tables.items():
            if tables.get(name) is not table:
                self._dropped_evictions[name] = (
                    self._dropped_evictions.get(name, 0) + table.evictions
                )
        self.tables = tables
        self.slot_tables = slot_tables

    def slots_in_use(self, limit_name: str) -> int:
        """Slots held under a concurrency limit (and its overrides' variants)."""
        prefix = limit_name + "~"
        return sum(
            table.slots_in_use
            for name, table in self.slot_tables.items()
            if name == limit_name or name.startswith(prefix)
        )

    def _tables_of(self, limit_name: str) -> list[KeyedState[Any]]:
        """A limit's table and its overrides' (``name~N``)."""
        tables = self.tables
        found = [tables[limit_name]] if limit_name in tables else []
        prefix = limit_name + "~"
        if len(tables) > 1:
            found += [table for name, table in tables.items() if name.startswith(prefix)]
        return found

    def tracked_keys(self, limit_name: str) -> int:
        prefix = limit_name + "~"
        slot_keys = sum(
            len(table)
            for name, table in self.slot_tables.items()
            if name == limit_name or name.startswith(prefix)
        )
        return slot_keys + sum(len(table) for table in self._tables_of(limit_name))

    def evictions(self, limit_name: str) -> int:
        current = sum(table.evictions for table in self._tables_of(limit_name))
        dropped = self._dropped_evictions
        prefix = limit_name + "~"
        return current + sum(
            n for name, n in dropped.items() if name == limit_name or name.startswith(prefix)
        )

    # -- the keys' API (``stores.key_listing.MemoryKeys``) --

    def keys_held(self, table: str, most: int) -> list[str]:
        states = self.tables.get(table)
        if states is None:
            return []
        return list(islice(iter(states), most))

    def holds(self, table: str, key: str) -> bool:
        states = self.tables.get(table)
        return states is not None and key in states

    def forget(self, table: str, key: str) -> bool:
        states = self.tables.get(table)
        if states is None or key not in states:
            return False
        states.discard(key)
        return True

    async def prepare(self) -> None:
        """Nothing to get ready in process."""

    async def close(self) -> None:
        self.tables.clear()
        self.slot_tables.clear()
