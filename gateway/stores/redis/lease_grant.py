"""How much of a shared quota one grant hands a replica: pure arithmetic.

``lua/lease.lua`` computes the same figure inside Redis (atomically with the count it takes
it from); this module is its mirror for the tests and for reading. Shares are in permille so
that both sides compute with integers, exactly; ``first_ask`` in doubles, as both do.

The rules, for a quota of ``quota`` units of which ``remaining`` are neither spent nor leased:

* never more than ``share`` of what remains (rounded up, so a last unit can still be had),
  nor more than an even part of what remains among the replicas that asked recently
  (``asking``, itself included): replicas that together want more than remains get equal
  parts, so when the quota runs out none holds much more than another (what each admits
  then is what a per-request limit would admit of its requests);
* a replica asks for ``want`` units, what it spent over its lease interval lately: a busy
  replica gets more at once, an idle one less;
* a replica with no history yet (``want`` 0), and every replica near exhaustion (at most
  ``low_water`` of the quota left), gets the share split evenly among those replicas;
* a replica with no history gets no more than the quota's units over one lease interval at
  the quota's own rate (``first_ask``), split evenly too: at a cold start the first replica
  to ask finds no other asking, and was handed half of the whole quota (more than it could
  spend before the others ran the rest out: 1,500 / 750 / 750 of 3,000 for three equal
  replicas).
"""

from __future__ import annotations

import math
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


def first_ask(quota: int, span: float, lasts_us: int | None, interval_us: int, bucket: bool) -> int:
    """The quota's units over ``lasts_us`` (at most ``interval_us``; None: the interval) at the
    quota's own rate: ``quota`` per window of ``span`` us, or one token per ``span`` us for a
    bucket. Computed in doubles, as the script does."""
    over = interval_us if lasts_us is None or lasts_us >= interval_us else lasts_us
    if bucket:
        return math.ceil(float(over) / float(span))
    return math.ceil(float(quota) * float(over) / float(span))


def grant_size(
    remaining: int,
    quota: int,
    want: int,
    asking: int,
    share_pm: int,
    low_water_pm: int,
    first: int,
) -> int:
    """Units one grant hands a replica (0 when nothing remains); never more than ``remaining``
    for ``0 < share_pm <= 1000``. ``first`` is ``first_ask``, for a replica with no history."""
    if remaining <= 0:
        return 0
    asking = max(asking, 1)
    cap = -(-remaining * share_pm // PERMILLE)
    even = -(-remaining // asking)
    if want <= 0 or remaining * PERMILLE <= quota * low_water_pm:
        even = -(-cap // asking)
    cap = min(cap, even)
    if want <= 0:
        return min(-(-first // asking), cap)
    return min(want, cap)
