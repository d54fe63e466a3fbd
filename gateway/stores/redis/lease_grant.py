"""How much of a shared quota one grant hands a replica: pure integer arithmetic.

``lua/lease.lua`` computes the same figure inside Redis (atomically with the count it takes
it from); this module is its mirror for the tests and for reading. Shares are in permille so
that both sides compute with integers only, exactly.

The rules, for a quota of ``quota`` units of which ``remaining`` are neither spent nor leased:

* never more than ``share`` of what remains (rounded up, so a last unit can still be had):
  the last part of the quota is spread over the replicas instead of stranded on one;
* a replica asks for ``want`` units, what it spent over its lease interval lately: a busy
  replica gets more at once, an idle one less;
* a replica with no history yet (``want`` 0), and every replica near exhaustion (at most
  ``low_water`` of the quota left), gets that share split evenly among the replicas that
  asked recently (``asking``, itself included).
"""

from __future__ import annotations

from typing import Final

PERMILLE: Final = 1000


def permille(fraction: float) -> int:
    """A policy's fraction in whole permille, as both sides of the arithmetic take it."""
    return round(fraction * PERMILLE)


def want_within(want: int, lasts_us: int, interval_us: int) -> int:
    """What a replica that spends ``want`` units per ``interval_us`` would spend before a lease
    lasting ``lasts_us`` ends (a window about to end): no more is worth handing it."""
    if want > 0 and lasts_us < interval_us:
        return -(-want * lasts_us // interval_us)
    return want


def grant_size(
    remaining: int, quota: int, want: int, asking: int, share_pm: int, low_water_pm: int
) -> int:
    """Units one grant hands a replica (0 when nothing remains); never more than ``remaining``
    for ``0 < share_pm <= 1000``."""
    if remaining <= 0:
        return 0
    cap = -(-remaining * share_pm // PERMILLE)
    if want <= 0 or remaining * PERMILLE <= quota * low_water_pm:
        cap = -(-cap // max(asking, 1))
    if want <= 0:
        return cap
    return min(want, cap)
