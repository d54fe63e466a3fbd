"""A policy's limits compiled for the hot path, and one request's check against one of them.

The engine builds these and every store decides them; they live apart from both so that a
store needs nothing from the engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from gateway.algorithms.base import Algorithm, ByProtocol, Decides
from gateway.algorithms.calendar_window import CalendarWindow
from gateway.algorithms.concurrency import Concurrency
from gateway.limits.keys import KeyBuilder
from gateway.limits.response_charge import ResponseCharge
from gateway.limits.routing import CompiledMatch
from gateway.policy.models import Limit
from gateway.policy.overrides import Tiering

# The ``model`` label of the units of a response that named no model (and of every unit of a
# limit without ``cost_from``), and of the models past a limit's ``server.metrics_max_models``.
NO_MODEL: Final = ""
OTHER_MODELS: Final = "other"


class DecisionCounts(NamedTuple):
    """How often a limit decided each way: the record the metrics read, by name."""

    allowed: int = 0
    delayed: int = 0
    rejected: int = 0
    dry_run_delayed: int = 0
    dry_run_rejected: int = 0
    # Refused by the limit's penalty (a blocked key), the limit itself not asked.
    penalized: int = 0


class ChargeCounts(NamedTuple):
    """What a limit charged after the response did: responses charged, the units they took
    (what each key had room for, up to its cost), and charges the store could not make."""

    charged_responses: int = 0
    charged_units: int = 0
    charge_failures: int = 0
    # Units requests held while in flight (``hold: in_flight``: their cost or reserve), and
    # the part of them their responses gave back when settled.
    held_units: int = 0
    returned_units: int = 0


@dataclass(slots=True)
class LimitCounters:
    """Per-limit figures that outlive a reload while the limit keeps its name.

    The hot path increments the decision fields in place; ``decisions()`` reads them as one
    record."""

    allowed: int = 0
    delayed: int = 0
    rejected: int = 0
    dry_run_delayed: int = 0
    dry_run_rejected: int = 0
    penalized: int = 0
    waiting: int = 0
    # Requests between the queue-bound check and their decision (or their place in the queue):
    # counted against max_queue too, so requests decided together cannot overfill the queue.
    deciding: int = 0
    # A concurrency limit's slots this process's requests hold (summed over workers and
    # replicas: the slots in use), and the requests its line turned away or timed out.
    slots_held: int = 0
    # A limit charged after the response: responses charged, the units they were charged
    # (each takes what its key has room for, up to that), and charges the store could not make.
    charged_responses: int = 0
    charged_units: int = 0
    charge_failures: int = 0
    held_units: int = 0
    returned_units: int = 0
    # A limit with ``cost_from``: the three unit counts above by the model its responses named
    # (``model_label``), summing to them; the models given a label of their own so far.
    # ``hold: in_flight``: the units this process's requests hold now, from their admission
    # until their response is settled (``hold_in_flight``).
    units_in_flight: int = 0
    charged_by_model: dict[str, int] = field(default_factory=dict)
    held_by_model: dict[str, int] = field(default_factory=dict)
    returned_by_model: dict[str, int] = field(default_factory=dict)
    models: set[str] = field(default_factory=set)
    # ``rejected`` by the status answered: the limit's own (429), 403 for ``unlisted: reject``.
    rejected_statuses: dict[int, int] = field(default_factory=dict)

    def reject(self, status: int) -> None:
        """Count one rejection, answered with ``status``."""
        self.rejected += 1
        statuses = self.rejected_statuses
        statuses[status] = statuses.get(status, 0) + 1

    def model_label(self, model: str, max_models: int) -> str:
        """The ``model`` label units of ``model`` are counted under: the model, while fewer
        than ``max_models`` have a label of their own (the metrics' series stay bounded
        whatever the responses name), else ``OTHER_MODELS``; ``NO_MODEL`` for none."""
        if not model or model in self.models:
            return model
        if len(self.models) >= max_models:
            return OTHER_MODELS
        self.models.add(model)
        return model

    def decisions(self) -> DecisionCounts:
        return DecisionCounts(
            self.allowed,
            self.delayed,
            self.rejected,
            self.dry_run_delayed,
            self.dry_run_rejected,
            self.penalized,
        )

    def charges(self) -> ChargeCounts:
        return ChargeCounts(
            self.charged_responses,
            self.charged_units,
            self.charge_failures,
            self.held_units,
            self.returned_units,
        )


@dataclass(slots=True)
class CompiledLimit:
    """A limit from the policy, ready for the hot path."""

    name: str
    spec: Limit
    algorithm: Algorithm[Any]
    keys: KeyBuilder
    match: CompiledMatch | None
    routes: frozenset[str] | None
    window_s: float
    counters: LimitCounters
    # Exemptions, cost and overrides; None for a limit with none of them.
    tiering: Tiering | None = None
    # The name of this limit's state table: ``name``, or ``name~N`` for an override's variant.
    table: str = ""
    # A concurrency limit: an admitted request holds ``cost`` slots until it gives them back.
    holds_slots: bool = False
    # What a response is charged (``count:``, ``cost_header:``); None for a limit charged when
    # it admits.
    response_charge: ResponseCharge | None = None
    # Decided on calendar time (``Clock.unix_us``): a calendar window.
    calendar: bool = False
    # A limit charged after the response whose requests hold their cost of the key's budget
    # while in flight (``hold: in_flight``): admission charges it as any limit's, and the
    # response settles it (``LimitEngine.charge_after``: refund or top-up).
    holds_budget: bool = field(init=False)
    # A limit charged after the response that admits without charging (``hold: none``): a
    # store never writes its decisions, its ``charge`` does.
    admits_free: bool = field(init=False)
    # The spec's figures each request reads, copied from it: compiled, an attribute of the
    # pydantic model is a generic attribute lookup, one of these a field read.
    dry_run: bool = field(init=False)
    max_delay: float = field(init=False)
    max_queue: int = field(init=False)
    status: int = field(init=False)
    # ``algorithm`` as the stores' request path calls it: compiled, a C call through the
    # class's method table, not a Python method call through the protocol.
    decides: Decides = field(init=False)
    # The check this limit's last reserving request made (``reserved_check``): a key that
    # repeats reuses it rather than building and freeing a record per request.
    last_check: Check | None = field(init=False, default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.table:
            self.table = self.name
        algorithm = self.algorithm
        self.decides = algorithm if isinstance(algorithm, Decides) else ByProtocol(algorithm)
        self.holds_slots = isinstance(self.algorithm, Concurrency)
        spec = self.spec
        self.dry_run = spec.dry_run
        self.max_delay = spec.max_delay
        self.max_queue = spec.max_queue
        self.status = spec.status
        if self.response_charge is None and spec.charged_after:
            self.response_charge = ResponseCharge(
                spec.count, spec.cost_header, spec.keep_cost_header, spec.cost_from
            )
        self.calendar = isinstance(self.algorithm, CalendarWindow)
        charged_after = self.response_charge is not None
        self.holds_budget = charged_after and spec.hold == "in_flight"
        self.admits_free = charged_after and spec.hold == "none"

    def applies(self, route_name: str, host: str, path: str, method: str) -> bool:
        """Whether the limit counts a request on this route, host, path and method. The route
        by its name (the request's facts hold it): reading a pydantic model's attribute costs
        some 400 instructions (``routing.RouteEntry``)."""
        if self.routes is not None and route_name not in self.routes:
            return False
        return self.match is None or self.match.matches(host, path, method)

    def reserved_check(self, key: str, cost: int) -> Check:
        """The check of a request that holds a place in this limit's queue: the last one
        when its key and cost repeat (a ``Check`` is never changed once built)."""
        last = self.last_check
        if (
            last is not None
            and last.key == key
            and last.cost == cost
            and last.max_delay_s == self.max_delay
        ):
            return last
        check = Check(self, key, self.max_delay, True, cost)
        self.last_check = check
        return check

    def queue_full(self) -> bool:
        """No room for one more delayed request (those being decided hold a place too)."""
        counters = self.counters
        return counters.waiting + counters.deciding >= self.max_queue

    @property
    def identity(self) -> tuple[str, tuple[str, ...], str]:
        """What must stay the same for a reload to keep this limit's state."""
        return (self.spec.algorithm, self.spec.key, self.spec.on_missing_key)


class Check:
    """One request's check against one limit. Treated as immutable (compared by value).

    A plain class, not a dataclass: several are built for every limited request, and
    compiled, a dataclass's ``__init__`` is the one ``dataclasses`` writes at run time,
    interpreted (bench/README.md)."""

    __slots__ = ("cost", "key", "limit", "max_delay_s", "reserved")

    def __init__(
        self,
        limit: CompiledLimit,
        key: str,
        max_delay_s: float = math.inf,
        reserved: bool = False,
        cost: int = 1,
    ) -> None:
        self.limit = limit
        self.key = key
        # The longest this request may wait on this limit: 0 when its queue is full.
        self.max_delay_s = max_delay_s
        # Whether this check holds a place in ``limit.counters.deciding``.
        self.reserved = reserved
        # Units this request takes from the quota (the limit's ``cost``).
        self.cost = cost

    def _fields(self) -> tuple[CompiledLimit, str, float, bool, int]:
        return (self.limit, self.key, self.max_delay_s, self.reserved, self.cost)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Check):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return (
            f"Check(limit={self.limit.name!r}, key={self.key!r}, max_delay_s={self.max_delay_s!r},"
            f" reserved={self.reserved!r}, cost={self.cost!r})"
        )


def with_variants(limits: Sequence[CompiledLimit]) -> Iterator[CompiledLimit]:
    """Each limit, then its overrides' variants (each with a state table of its own)."""
    for limit in limits:
        yield limit
        tiering = limit.tiering
        if tiering is not None and tiering.overrides is not None:
            yield from tiering.overrides.variants


def hold_in_flight(checks: Sequence[Check], sign: int) -> None:
    """Count (``sign`` 1) or uncount (-1) the units an admitted request's checks hold while
    it is in flight, in each limit whose requests hold their cost (``hold: in_flight``)."""
    for check in checks:
        limit = check.limit
        if limit.holds_budget:
            limit.counters.units_in_flight += sign * check.cost
