"""Several limits on one request, combined the way nginx combines several ``limit_req``.

``ngx_http_limit_req_handler`` looks every zone up before charging any: zones 0..n-2 are only
looked up (their nodes are pinned, their excess is not written), the last zone is charged
during its lookup, and only when no zone rejects does ``ngx_http_limit_req_account`` go back
and charge the others (recomputing each excess at the same cached millisecond, so with the same
result). So:

* a request rejected by any limit is charged to none: the zones looked up before the rejecting
  one keep their excess and last time, and the zones after it are never looked up. For a key
  new to an earlier zone nginx leaves a node with excess 0 and last 0 behind, which acts as no
  node at all;
* an admitted request is charged to every limit;
* the delay is the longest of the per-zone delays, each computed from that zone's own excess,
  ``delay=`` threshold and rate (a ``nodelay`` zone contributes nothing); on a tie nginx reports
  the later zone, which only matters for its log line.

One quirk is not reproduced: a key new to a zone other than the last is charged by the account
step from that ``last = 0``, giving ``max(0, 1000 - rate_milli * now_ms // 1000)`` instead of 0.
With nginx's clock (``CLOCK_MONOTONIC``, so time since boot) that is 0 once the host has been up
``1e6 / rate_milli`` ms: one second at 1r/s, 62.5 s at 1r/m; so it only shows right after boot.

Algorithms are pure, so this evaluates every limit (nginx stops at the first rejection) to give
a Retry-After good for all rejecting limits; the states to commit are the same either way.
Each item must hold a distinct state (nginx refuses the same zone twice in one location).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.algorithms.base import Algorithm, Decision


class CombinedDecision:
    """The verdict of all limits on one request and the states to commit for it.

    ``states[i]`` is what to store for limit ``i``: the new state when the request is allowed,
    the input state unchanged when any limit rejected it. ``delay_s`` is the longest delay and
    ``delayed_by`` the limit imposing it (``None`` when no delay); ``rejected_by`` lists every
    limit that rejects, in order (nginx names only the first); ``retry_after_s`` is the longest
    retry-after among them, 0 when allowed. ``now_us`` is the instant of the decision, when a
    store sets it for a delayed request: a refund (the client left the queue) then gives
    windows back exactly what this decision charged.

    A plain typed class, not a NamedTuple, as ``Decision`` is (one per request; compiled, a
    native record built by a direct C call). Never changed once built; compared field by field.
    """

    __slots__ = (
        "allowed",
        "decisions",
        "delay_s",
        "delayed_by",
        "now_us",
        "rejected_by",
        "retry_after_s",
        "states",
    )

    def __init__(
        self,
        allowed: bool,
        delay_s: float,
        retry_after_s: float,
        rejected_by: tuple[int, ...],
        delayed_by: int | None,
        decisions: tuple[Decision, ...],
        states: tuple[Any, ...],
        now_us: int | None = None,
    ) -> None:
        self.allowed = allowed
        self.delay_s = delay_s
        self.retry_after_s = retry_after_s
        self.rejected_by = rejected_by
        self.delayed_by = delayed_by
        self.decisions = decisions
        self.states = states
        self.now_us = now_us

    def fields(
        self,
    ) -> tuple[
        bool,
        float,
        float,
        tuple[int, ...],
        int | None,
        tuple[Decision, ...],
        tuple[Any, ...],
        int | None,
    ]:
        """The eight fields in order (what the NamedTuple's items were)."""
        return (
            self.allowed,
            self.delay_s,
            self.retry_after_s,
            self.rejected_by,
            self.delayed_by,
            self.decisions,
            self.states,
            self.now_us,
        )

    def replace(
        self, *, states: tuple[Any, ...] | None = None, now_us: int | None = None
    ) -> CombinedDecision:
        """This verdict with other ``states`` (when given) and ``now_us``."""
        return CombinedDecision(
            self.allowed,
            self.delay_s,
            self.retry_after_s,
            self.rejected_by,
            self.delayed_by,
            self.decisions,
            self.states if states is None else states,
            now_us,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CombinedDecision):
            return NotImplemented
        return self.fields() == other.fields()

    def __hash__(self) -> int:
        return hash(self.fields())

    def __repr__(self) -> str:
        return "CombinedDecision" + repr(self.fields())


def combine(
    decisions: Sequence[Decision],
    new_states: Sequence[Any],
    input_states: Sequence[Any],
    now_us: int | None = None,
    max_delays_s: Sequence[float] | None = None,
) -> CombinedDecision:
    """The verdict of decisions taken at one instant, by nginx's rule: every store (in process,
    shared, Redis's script reply, the leases) and ``decide_all`` call this one function.

    All admit or none is charged (a rejected request's ``states`` are ``input_states``); the
    longest delay wins and, on equal delays, the later limit is named (nginx's account loop);
    a delay over its check's bound in ``max_delays_s`` turns the admission into a rejection
    (``refuse_long_delays``). ``now_us`` is the instant decided at, kept for a refund.
    """
    delay_s = 0.0
    delayed_by: int | None = None
    for index, decision in enumerate(decisions):
        if not decision.allowed:
            return _rejected(decisions, input_states, now_us)
        delay = decision.delay_s
        if delay > 0.0 and delay >= delay_s:
            delay_s = delay
            delayed_by = index
    verdict = CombinedDecision(
        True, delay_s, 0.0, (), delayed_by, tuple(decisions), tuple(new_states), now_us
    )
    if delayed_by is not None and max_delays_s is not None:
        return refuse_long_delays(verdict, input_states, max_delays_s)
    return verdict


def decide_all(
    items: Sequence[tuple[Algorithm[Any], Any]],
    now_us: int,
    cost: int = 1,
    *,
    stamp_us: int | None = None,
    costs: Sequence[int] | None = None,
) -> CombinedDecision:
    """The plain reference the stores are tested against: every ``(algorithm, state)`` decided
    at ``now_us``, then ``combine``. ``stamp_us`` is the verdict's ``now_us``; ``costs``, one
    per item, replaces ``cost`` when limits weigh the request differently."""
    decisions: list[Decision] = []
    new_states: list[Any] = []
    for index, (algorithm, state) in enumerate(items):
        decision, new_state = algorithm.decide(state, now_us, costs[index] if costs else cost)
        decisions.append(decision)
        new_states.append(new_state)
    return combine(decisions, new_states, [state for _, state in items], stamp_us)


def _rejected(
    decisions: Sequence[Decision], input_states: Sequence[Any], stamp_us: int | None
) -> CombinedDecision:
    """Some limit rejects: nothing is charged, and the Retry-After is good for all of them."""
    rejected_by = tuple([index for index, decision in enumerate(decisions) if not decision.allowed])
    retry_after_s = max([decisions[index].retry_after_s for index in rejected_by])
    return CombinedDecision(
        False,
        0.0,
        retry_after_s,
        rejected_by,
        None,
        tuple(decisions),
        tuple(input_states),
        stamp_us,
    )


def refuse_long_delays(
    verdict: CombinedDecision, input_states: Sequence[Any], max_delays_s: Sequence[float]
) -> CombinedDecision:
    """Turn an admission into a rejection when some limit's delay exceeds its bound.

    A shaping queue has bounds (the longest wait, the number waiting): a request that would
    break one is rejected at once and, like any rejection, charged to no limit. Checking here,
    before anything is committed, keeps that exact for every algorithm (a window cannot take a
    charge back afterwards).
    """
    if not verdict.allowed or verdict.delay_s <= 0.0:
        return verdict
    decisions = verdict.decisions
    over = tuple(
        [index for index, bound in enumerate(max_delays_s) if decisions[index].delay_s > bound]
    )
    if not over:
        return verdict
    retry_after_s = max([decisions[index].delay_s for index in over])
    return CombinedDecision(
        False,
        0.0,
        retry_after_s,
        over,
        None,
        verdict.decisions,
        tuple(input_states),
        verdict.now_us,
    )
