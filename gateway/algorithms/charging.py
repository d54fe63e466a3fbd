"""Charging after the fact: as much of a cost as a key has room for, never more.

A limit counted by its responses (``count:``, ``cost_header:``) admits a request while its key
has room and charges the response's cost once the response says what it is. Such a charge
cannot be refused (the request has gone through), so it takes what fits: the whole cost, or
what the key has left if that is less. It is the state ``decide`` returns for that many units,
as the Redis script's charge (mode ``c``) computes it: the algorithm's own arithmetic, so the
state stays what its stores and Lua mirror hold, and in process and Redis charge alike.
"""

from __future__ import annotations

from typing import Any

from gateway.algorithms.base import Algorithm


def room(algorithm: Algorithm[Any], state: Any, now_us: int) -> int:
    """Units the key has left at ``now_us``: the largest cost ``decide`` admits (every
    algorithm admits any cost below one it admits)."""
    decision, _ = algorithm.decide(state, now_us, 1)
    return decision.remaining + 1 if decision.allowed else 0


def charge_what_fits(
    algorithm: Algorithm[Any], state: Any, now_us: int, cost: int
) -> tuple[int, Any]:
    """``(units charged, new state)`` for ``cost`` units at ``now_us``: ``min(cost, room)``
    units, and the state unchanged when none fits (or ``cost`` is below 1)."""
    if cost < 1:
        return 0, state
    decision, new_state = algorithm.decide(state, now_us, cost)
    if decision.allowed:
        return cost, new_state
    fits = min(cost, room(algorithm, state, now_us))
    if fits < 1:
        return 0, state
    return fits, algorithm.decide(state, now_us, fits)[1]
