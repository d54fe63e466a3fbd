"""The parts of a limit that are models or field types of their own: its rate and window, which
requests it matches, its lease, its cost and reservation, the responses it charges."""

from __future__ import annotations

import re
from typing import Annotated, Any, Final

from pydantic import BeforeValidator, Field, PlainSerializer, WithJsonSchema, field_validator

from gateway.policy.cost_from import json_at
from gateway.policy.model_base import Timeout, _duration, _Model
from gateway.policy.route_models import RouteMatch
from gateway.policy.units import CALENDAR_PERIODS, Rate, parse_rate

_CALENDAR_LIKE_RE = re.compile(r"^\s*\d+\s*(d|w|mo|y)\s*$")


def _window_length(value: Any) -> float | str:
    if isinstance(value, str):
        if value.strip() in CALENDAR_PERIODS:
            return value.strip()
        if _CALENDAR_LIKE_RE.match(value):
            raise ValueError(
                f"invalid window {value!r}: a calendar window is 1d, 1w, 1mo or 1y (with "
                "calendar: true); other windows are Go durations like '90s', '15m', '720h'"
            )
    return _duration(value)


# A window: a duration, or a calendar period (with ``calendar: true``).
WindowLength = Annotated[
    float | str,
    BeforeValidator(_window_length),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": r"^(\d+(\.\d+)?(ms|us|µs|s|m|h))+$"},
                {"type": "number", "exclusiveMinimum": 0},
                {"enum": list(CALENDAR_PERIODS)},
            ],
            "description": "Go-style duration ('500ms', '10s', '1m30s') or seconds; with "
            "calendar: true, 1d, 1w, 1mo or 1y",
        }
    ),
]


def _rate(value: Any) -> Rate:
    if isinstance(value, Rate):
        return value
    if isinstance(value, str):
        return parse_rate(value)
    raise ValueError(f"invalid rate {value!r}: expected nginx syntax like '10r/s' or '30r/m'")


RateField = Annotated[
    Rate,
    BeforeValidator(_rate),
    PlainSerializer(str, return_type=str),
    WithJsonSchema(
        {"type": "string", "pattern": r"^\d+r/[sm]$", "description": "nginx-style rate: '10r/s'"}
    ),
]


class LimitMatch(RouteMatch):
    """Which requests a limit applies to: routes by name and/or request rules; empty = all."""

    routes: tuple[str, ...] | None = Field(None, description="route names this limit covers")

    @field_validator("routes")
    @classmethod
    def _check_routes(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is not None and not value:
            raise ValueError(
                "routes is empty: the limit would apply to no request (omit it for all)"
            )
        return value


class LeaseSettings(_Model):
    """Quota leasing on the Redis store: each replica takes batches of the limit's quota and
    decides from them locally (``gateway/stores/redis/lease.py`` says how grants are sized)."""

    share: float = Field(
        0.5, gt=0, le=1, description="a grant is at most this fraction of what remains"
    )
    low_water: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="below this fraction of the quota left, a grant is at most the share split "
        "evenly among the replicas that asked recently (above it, at most an even part of what "
        "remains)",
    )
    interval: Timeout | None = Field(
        None,
        description="a replica asks for what it spent over this long (with no history yet, for "
        "the quota's units over this long); a token bucket's lease expires after it (default: a "
        "fifth of the window, or of the bucket's refill time)",
    )


class Cost(_Model):
    """What one request costs a limit: by route name, else by method, else ``default``."""

    default: int = Field(1, ge=1, description="cost of a request no other entry names")
    routes: dict[str, Annotated[int, Field(ge=1)]] = Field(
        default_factory=dict, description="route name -> cost (asked first)"
    )
    methods: dict[str, Annotated[int, Field(ge=1)]] = Field(
        default_factory=dict, description="method -> cost"
    )

    @field_validator("methods")
    @classmethod
    def _upper(cls, value: dict[str, int]) -> dict[str, int]:
        return {method.upper(): cost for method, cost in value.items()}

    def of(self, route: str, method: str) -> int:
        cost = self.routes.get(route)
        if cost is None:
            cost = self.methods.get(method, self.default)
        return cost


class ReserveFrom(_Model):
    """A reservation read from the request's JSON body (``reserve: {body: max_tokens, default:
    4096}``): the first of the fields present that holds a whole number of 1 or more, else
    ``default``."""

    body: tuple[str, ...] = Field(
        description="fields of the request body (dotted), the first present giving the "
        "reservation: max_tokens, max_completion_tokens, max_output_tokens",
    )
    default: int = Field(ge=1, description="the reservation when none of the fields is there")

    @field_validator("body", mode="before")
    @classmethod
    def _one_or_more(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @field_validator("body")
    @classmethod
    def _check_fields(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("body is empty: name the request's field (max_tokens)")
        for name in value:
            if not _BODY_FIELD_RE.match(name):
                raise ValueError(
                    f"{name!r} is not a field of a JSON body: write a dotted name "
                    "(max_tokens, generation.max_tokens)"
                )
        return value

    def of_body(self, document: object) -> int:
        """The reservation for a request whose body is ``document`` (None: not read)."""
        for name in self.body:
            value = json_at(document, name.split("."))
            if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 53:
                return value
        return self.default


_BODY_FIELD_RE: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")


# ``5xx``: every status of a class.
_STATUS_CLASS_RE = re.compile(r"^[1-5]xx$")


def _status_item(value: Any) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool):
        if 100 <= value <= 599:
            return value
    elif isinstance(value, str):
        text = value.strip().lower()
        if _STATUS_CLASS_RE.match(text):
            return text
        if text.isascii() and text.isdigit() and 100 <= int(text) <= 599:
            return int(text)
    raise ValueError(
        f"invalid status {value!r}: expected a status code from 100 to 599 (401) or a class ('5xx')"
    )


StatusItem = Annotated[
    int | str,
    BeforeValidator(_status_item),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 100, "maximum": 599},
                {"type": "string", "pattern": "^[1-5][xX][xX]$"},
            ],
            "description": "a status code (401) or a class of them ('5xx')",
        }
    ),
]


class ResponseCount(_Model):
    """Which responses a limit is charged for: the request is admitted while the key has room
    and charged after its response, only when the status matches."""

    statuses: tuple[StatusItem, ...] = Field(
        description="status codes (401) and classes ('5xx') of the responses charged"
    )

    @field_validator("statuses")
    @classmethod
    def _some(cls, value: tuple[int | str, ...]) -> tuple[int | str, ...]:
        if not value:
            raise ValueError(
                "statuses is empty: the limit would charge no response (omit count to charge "
                "every response)"
            )
        return value

    def codes(self) -> frozenset[int]:
        """Every status code charged."""
        codes: set[int] = set()
        for item in self.statuses:
            if isinstance(item, int):
                codes.add(item)
            else:
                first = int(item[0]) * 100
                codes.update(range(first, first + 100))
        return frozenset(codes)
