"""What a limit charged after the response (``count:``, ``cost_header:``) takes for a response.

Such a limit admits a request while the key has room for its ``cost`` and charges nothing
then; when the response comes, it is charged ``charge(status, header value, cost)``: nothing
for a status ``count`` does not name, else the upstream's cost header when the limit has one
and the value is valid, else the limit's ``cost``.
"""

from __future__ import annotations

from typing import Final

from gateway.policy.models import ResponseCount

# A cost header's value: a decimal integer of at most this many digits (anything longer is
# invalid, not a huge charge: a window's count stops at its limit anyway).
_MAX_COST_DIGITS: Final = 18


def parse_cost(value: str | None) -> int | None:
    """A cost header's value as a charge (0 or more); ``None`` when missing or invalid."""
    if value is None:
        return None
    text = value.strip(" \t")
    if not text or len(text) > _MAX_COST_DIGITS or not (text.isascii() and text.isdigit()):
        return None
    return int(text)


class ResponseCharge:
    """One limit's rule for charging responses, compiled from its policy."""

    __slots__ = ("cost_from", "cost_header", "keep_cost_header", "source", "statuses")

    def __init__(
        self,
        count: ResponseCount | None,
        cost_header: str | None,
        keep_cost_header: bool,
        cost_from: str | None = None,
    ) -> None:
        # None: every status is charged.
        self.statuses: frozenset[int] | None = count.codes() if count is not None else None
        # Lower case, as aiohttp's and the access log's header lookups take it.
        self.cost_header: str | None = cost_header.lower() if cost_header is not None else None
        self.keep_cost_header = keep_cost_header
        self.cost_from = cost_from
        # Where the reported cost is found among what the response reported (by the proxy,
        # or the access log's ``costs``): the cost header's name, or ``body:`` and the
        # ``cost_from``; None when the limit charges its cost.
        self.source: bytes | None = None
        if self.cost_header is not None:
            self.source = self.cost_header.encode()
        elif cost_from is not None:
            self.source = b"body:" + cost_from.encode()

    def charge(self, status: int, header_value: str | None, cost: int) -> int:
        """Units to charge for a response with ``status`` and the cost header's value
        (``None`` when absent); ``cost`` is the limit's configured cost for the request."""
        statuses = self.statuses
        if statuses is not None and status not in statuses:
            return 0
        if self.source is None:
            return cost
        reported = parse_cost(header_value)
        return cost if reported is None else reported


def settle(held: int, charge: int) -> tuple[int, int]:
    """``(top-up, refund)`` settling a hold of ``held`` units against the response's
    ``charge``: the charge beyond the hold is taken, the hold beyond the charge given back
    (never below zero: a charge of 0 gives the whole hold back)."""
    if charge > held:
        return charge - held, 0
    return 0, held - charge
