"""A policy's test cases (``gateway test POLICY CASES.yaml``): the file's schema and its loading.

A case is a list of steps: requests at virtual instants (``at``, then ``repeat`` of them
``every`` so long or at a ``rate``) and what must come of them (``expect`` for each request,
``expect_last`` for the last of the step, ``expect_counts`` over the step). The file is read
as a policy is: pydantic models with ``extra="forbid"``, each problem one
``file:line: path: reason`` line.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from gateway.policy.loader import (
    Loc,
    PolicyError,
    PolicyProblem,
    error_in_words,
    format_loc,
    line_for,
    yaml_with_lines,
)
from gateway.policy.models import Duration, RateField

US: Final = 1_000_000
# Requests one step may send: a case is a test, not a load generator.
MAX_REPEAT: Final = 100_000
DEFAULT_CLIENT: Final = "192.0.2.1"


def _header_value(value: Any) -> Any:
    """``Retry-After: 1`` (a number to YAML) is the header's text ``1``."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value:g}" if isinstance(value, float) else str(value)
    return value


HeaderValue = Annotated[str, BeforeValidator(_header_value)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RequestSpec(_Model):
    """One request as a client sends it: the gateway routes, keys and limits it as it would."""

    method: str = "GET"
    path: str = Field("/", description="the request target: path and query")
    client_ip: str = Field(DEFAULT_CLIENT, description="the peer address the gateway sees")
    host: str | None = None
    headers: dict[str, HeaderValue] = Field(default_factory=dict)
    duration: Duration | None = Field(
        None,
        description="how long the upstream takes to answer: a concurrency limit's slots are "
        "held that long (by default given back at once)",
    )


class Expectation(_Model):
    """What must come of a request; only what is written is checked."""

    status: int | None = Field(
        None, description="the gateway's answer: 200 stands for forwarded to the upstream"
    )
    delay: Duration | None = Field(None, description="how long the request waits in the queue")
    rejected_by: str | None = None
    headers: dict[str, HeaderValue | None] = Field(
        default_factory=dict, description="response headers; null: the header is absent"
    )


class Counts(_Model):
    """What came of a step's requests, counted."""

    admitted: int | None = Field(None, ge=0, description="forwarded at once")
    delayed: int | None = Field(None, ge=0)
    rejected: int | None = Field(None, ge=0)


class Step(_Model):
    at: Duration | None = Field(
        None,
        description="the first request's instant from the case's start (default: where "
        "the previous step ended)",
    )
    request: RequestSpec = Field(default_factory=RequestSpec)
    repeat: int = Field(1, ge=1, le=MAX_REPEAT)
    every: Duration | None = None
    rate: RateField | None = None
    expect: Expectation | None = None
    expect_last: Expectation | None = None
    expect_counts: Counts | None = None

    @model_validator(mode="after")
    def _one_spacing(self) -> Step:
        if self.every is not None and self.rate is not None:
            raise ValueError("give every or rate, not both: rate 10r/s is every 100ms")
        return self

    def gap_us(self) -> int:
        """Between two of the step's requests."""
        if self.rate is not None:
            return round(self.rate.period_s * US / self.rate.requests)
        return round((self.every or 0.0) * US)


class Case(_Model):
    name: str = Field(min_length=1)
    steps: tuple[Step, ...] = Field(min_length=1)


class CasesFile(_Model):
    cases: tuple[Case, ...] = Field(min_length=1)


_KNOWN_KEYS: Final = sorted(
    {
        key
        for model in (RequestSpec, Expectation, Counts, Step, Case, CasesFile)
        for key in model.model_fields
    }
)


@dataclass(frozen=True, slots=True)
class LoadedCases:
    file: str
    cases: tuple[Case, ...]
    lines: dict[Loc, int]

    def step_line(self, case: int, step: int) -> int | None:
        return line_for(self.lines, ("cases", case, "steps", step))


def parse_cases(text: str, file: str) -> LoadedCases:
    """Validated test cases, or a ``PolicyError`` with one ``file:line: path: reason`` each."""
    data, lines = yaml_with_lines(text, file)
    if not isinstance(data, dict):
        raise PolicyError(file, [PolicyProblem(1, "", "expected a mapping with cases: [...]")])
    try:
        parsed = CasesFile.model_validate(data)
    except ValidationError as exc:
        problems = []
        errors = exc.errors(include_url=False)
        for error in errors:
            loc, reason = error_in_words(error, data)
            if error["type"] == "too_short":
                # pydantic also says a list whose items failed is too short: only the items'
                # problems are the file's.
                raw = tuple(error["loc"])
                if any(
                    tuple(other["loc"])[: len(raw)] == raw != tuple(other["loc"])
                    for other in errors
                ):
                    continue
                reason = f"is empty: give at least {error['ctx']['min_length']}"
            elif error["type"] == "extra_forbidden":
                reason += _did_you_mean(loc)
            problems.append(PolicyProblem(line_for(lines, loc), format_loc(loc), reason))
        raise PolicyError(file, problems) from None
    problems = _order_problems(parsed, lines)
    if problems:
        raise PolicyError(file, problems)
    return LoadedCases(file, parsed.cases, lines)


def load_cases(path: str | Path) -> LoadedCases:
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(file, [PolicyProblem(None, "", f"cannot read: {exc.strerror}")]) from None
    except UnicodeDecodeError:
        raise PolicyError(file, [PolicyProblem(None, "", "not valid UTF-8")]) from None
    return parse_cases(text, file)


def _did_you_mean(loc: Loc) -> str:
    if not loc or not isinstance(loc[-1], str):
        return ""
    close = difflib.get_close_matches(loc[-1], _KNOWN_KEYS, n=1, cutoff=0.6)
    return f": did you mean `{close[0]}`?" if close else ""


def _order_problems(parsed: CasesFile, lines: dict[Loc, int]) -> list[PolicyProblem]:
    """Steps go forward in time: a step's ``at`` before the previous step's last request is
    a mistake (a clock does not run back), and duplicate case names confuse a report."""
    problems = []
    seen: set[str] = set()
    for c, case in enumerate(parsed.cases):
        if case.name in seen:
            loc: Loc = ("cases", c, "name")
            problems.append(
                PolicyProblem(line_for(lines, loc), format_loc(loc), "another case has this name")
            )
        seen.add(case.name)
        last_us = 0
        for s, step in enumerate(case.steps):
            if step.at is not None:
                at_us = round(step.at * US)
                if at_us < last_us:
                    loc = ("cases", c, "steps", s, "at")
                    problems.append(
                        PolicyProblem(
                            line_for(lines, loc),
                            format_loc(loc),
                            f"{format_ms(at_us)} is before the previous step's last request "
                            f"({format_ms(last_us)}): steps go forward in time",
                        )
                    )
                last_us = at_us
            last_us += (step.repeat - 1) * step.gap_us()
    return problems


def format_ms(t_us: int) -> str:
    """An instant or a delay in milliseconds, as a case writes it."""
    return f"{t_us / 1000:g}ms"
