"""``gateway replay --fail-if 'rejected > 1%'``: a replay as a CI gate.

A condition names a figure of the replayed policy (an outcome over all requests, or one
limit's ``rejected`` or ``delayed``), a comparison and a bound: a share with ``%`` or a count
without. The replay fails (exit 1) when any condition holds, naming each that did.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

# Outcomes over all requests, as the report counts them.
OUTCOMES: Final = ("rejected", "delayed", "allowed", "denied", "unlimited", "unrouted")
# Per limit: the verdicts a limit gives (a dry-run limit's: what it would have given).
LIMIT_FIGURES: Final = ("rejected", "delayed")
_OPERATORS: Final = {
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}
_CONDITION: Final = re.compile(
    r"^\s*(?:(?P<limit>[A-Za-z0-9_.-]+?)\.)?(?P<figure>[a-z_]+)\s*"
    r"(?P<op>>=|<=|==|!=|>|<)\s*(?P<bound>[0-9]+(?:\.[0-9]+)?)\s*(?P<pct>%?)\s*$"
)
_EXAMPLE: Final = "write e.g. 'rejected > 1%', 'delayed >= 500' or 'per_ip.rejected > 0.5%'"


class GateError(ValueError):
    """A condition that cannot be read, or names a limit the policy lacks."""


@dataclass(frozen=True, slots=True)
class Condition:
    text: str
    limit: str | None  # None: over all requests
    figure: str
    operator: str
    bound: float
    share: bool  # the bound is a percentage of the requests (the limit's decided requests)

    def measure(self, policy: dict[str, Any]) -> tuple[float, str]:
        """This condition's figure in the replay's document of one policy, and as shown."""
        if self.limit is None:
            count = policy["outcomes"][self.figure]
            whole = policy["requests"]
        else:
            limit = next((lim for lim in policy["limits"] if lim["name"] == self.limit), None)
            if limit is None:
                names = ", ".join(lim["name"] for lim in policy["limits"]) or "none"
                raise GateError(
                    f"{self.text!r}: the policy has no limit {self.limit!r} (its limits: {names})"
                )
            field = f"dry_run_{self.figure}" if limit["dry_run"] else self.figure
            count = limit[field]
            whole = limit["decided"]
        if not self.share:
            return float(count), f"{count:,}"
        value = 100.0 * count / whole if whole else 0.0
        return value, f"{value:.2f}% ({count:,} of {whole:,})"

    def holds(self, policy: dict[str, Any]) -> tuple[bool, str]:
        value, shown = self.measure(policy)
        return _OPERATORS[self.operator](value, self.bound), shown


def parse_condition(text: str) -> Condition:
    """``rejected > 1%``, ``delayed >= 500``, ``per_ip.rejected > 0.5%``."""
    match = _CONDITION.match(text)
    if match is None:
        raise GateError(f"{text!r}: expected FIGURE OPERATOR NUMBER[%]: {_EXAMPLE}")
    limit, figure = match["limit"], match["figure"]
    known = LIMIT_FIGURES if limit is not None else OUTCOMES
    if figure not in known:
        where = (
            f"a limit's figures are {', '.join(LIMIT_FIGURES)}"
            if limit
            else (f"the figures are {', '.join(OUTCOMES)} (or LIMIT.rejected, LIMIT.delayed)")
        )
        raise GateError(f"{text!r}: unknown figure {figure!r}: {where}")
    bound = float(match["bound"])
    if match["pct"] and bound > 100.0:
        raise GateError(f"{text!r}: a share is at most 100%")
    return Condition(text.strip(), limit, figure, match["op"], bound, bool(match["pct"]))


def failures(conditions: list[Condition], policy: dict[str, Any]) -> list[str]:
    """One line per condition that holds for the replayed policy: the gate fails on any."""
    failed = []
    for condition in conditions:
        holds, shown = condition.holds(policy)
        if holds:
            failed.append(f"{condition.text}: {shown}")
    return failed
