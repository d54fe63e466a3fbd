"""A limit's ``penalty:``: a key it rejects that often is refused outright for a while."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from gateway.policy.units import parse_duration


def _positive_seconds(value: Any) -> float:
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        raise ValueError(f"invalid duration {value!r}: expected Go syntax like '10s', '15m'")
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError("must be longer than 0")
    return seconds


PositiveSeconds = Annotated[
    float,
    BeforeValidator(_positive_seconds),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": r"^(\d+(\.\d+)?(ms|us|µs|s|m|h))+$"},
                {"type": "number", "exclusiveMinimum": 0},
            ],
            "description": "Go-style duration ('500ms', '10s', '1m30s') or seconds; above 0",
        }
    ),
]


class Penalty(BaseModel):
    """A key this limit rejects ``after`` times within ``within`` is refused at once for
    ``block`` (before the upstream, without touching the limit), with ``Retry-After`` to the
    block's end."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    after: int = Field(ge=1, description="rejections that block the key")
    within: PositiveSeconds = Field(description="the span those rejections fall in")
    block: PositiveSeconds = Field(description="how long the key is then refused")
    status: Literal[429, 403] = Field(429, description="the status of a blocked key's requests")
