"""Penalty boxes in the replica, for the local fallback while Redis is away.

With Redis the boxes live beside the limits' states and the decision script reads and strikes
them. While Redis cannot answer (``on_failure: local``) the fallback decides in process, and
keeps boxes of its own here as the in-process store does: a key it rejects too often is
refused at once for the block. The blocks this replica met in Redis (a Redis verdict that was
a box's refusal) are kept here too, so a key blocked before the outage stays refused during
it. What the fallback strikes stays in the replica: Redis's boxes do not hear of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.algorithms.penalty_box import PenaltyBox
from gateway.clock import Clock
from gateway.limits.compiled import Check, CompiledLimit
from gateway.stores.penalty_table import PenaltyTable

# The box of a limit without a penalty whose blocks were met in Redis (an operator's): never
# struck, so its parameters say nothing.
_BLOCKS_ONLY = PenaltyBox(1, 1.0, 1.0)


class FallbackPenalties:
    """The fallback's penalty boxes by limit name."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.tables: dict[str, PenaltyTable] = {}
        self._penalized: frozenset[str] = frozenset()  # limits whose rejections strike

    def configure(self, limits: Sequence[CompiledLimit]) -> None:
        """The boxes of the limits with a penalty (kept over a reload while the penalty stays
        the same), and those of blocks met in Redis while their limit exists."""
        tables: dict[str, PenaltyTable] = {}
        for limit in limits:
            spec = limit.spec
            penalty = spec.penalty
            kept = self.tables.get(limit.name)
            if penalty is None or spec.dry_run or spec.lease is not None:
                if kept is not None and kept.box is _BLOCKS_ONLY:
                    tables[limit.name] = kept
                continue
            box = PenaltyBox(penalty.after, penalty.within, penalty.block)
            if kept is not None and _same(kept.box, box):
                kept.max_keys = spec.max_keys
                tables[limit.name] = kept
            else:
                tables[limit.name] = PenaltyTable(box, spec.max_keys)
        self._penalized = frozenset(
            name for name, table in tables.items() if table.box is not _BLOCKS_ONLY
        )
        self.tables = tables

    def blocked(self, checks: Sequence[Check], now_us: int) -> tuple[int, int] | None:
        """The first check whose key is in its limit's box at ``now_us``, and when the block
        ends; None when none is."""
        tables = self.tables
        for index, check in enumerate(checks):
            table = tables.get(check.limit.name)
            if table is not None:
                until_us = table.blocked_until(check.key, now_us)
                if until_us:
                    return index, until_us
        return None

    def strike(self, checks: Sequence[Check], rejected_by: Sequence[int], now_us: int) -> None:
        """Count a rejection against each rejecting limit's box (those with a penalty)."""
        for index in rejected_by:
            check = checks[index]
            if check.limit.name in self._penalized:
                self.tables[check.limit.name].strike(check.key, now_us)

    def met_block(self, check: Check, seconds_left: float) -> None:
        """Redis refused ``check``'s key by its box for ``seconds_left`` more: kept here."""
        name = check.limit.name
        table = self.tables.get(name)
        if table is None:
            table = self.tables[name] = PenaltyTable(_BLOCKS_ONLY, check.limit.spec.max_keys)
        now_us = self.clock.now_us()
        until_us = now_us + round(seconds_left * 1_000_000)
        if table.blocked_until(check.key, now_us) < until_us:
            table.block(check.key, until_us)


def _same(one: PenaltyBox, other: PenaltyBox) -> bool:
    return (one.after, one.within_us, one.block_us) == (
        other.after,
        other.within_us,
        other.block_us,
    )
