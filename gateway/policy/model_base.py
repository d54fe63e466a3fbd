"""What every section of the policy schema shares: the frozen base model that rejects unknown
keys, and the field types written alike across sections (durations, timeouts, sizes, names,
listen addresses, key parts, header names, log levels)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, WithJsonSchema

from gateway.policy.units import parse_duration, parse_size


def _duration(value: Any) -> float:
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        return parse_duration(value)
    raise ValueError(f"invalid duration {value!r}: expected Go syntax like '500ms', '10s', '1m'")


def _size(value: Any) -> int:
    if isinstance(value, str | int) and not isinstance(value, bool):
        return parse_size(value)
    raise ValueError(f"invalid size {value!r}: expected bytes or nginx syntax like '64k', '10m'")


Duration = Annotated[
    float,
    BeforeValidator(_duration),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": r"^(\d+(\.\d+)?(ms|us|µs|s|m|h))+$|^0$"},
                {"type": "number", "minimum": 0},
            ],
            "description": "Go-style duration ('500ms', '10s', '1m30s') or seconds",
        }
    ),
]


def _positive(value: float) -> float:
    if value <= 0:
        raise ValueError("must be longer than 0: a zero timeout would expire at once, every time")
    return value


# Timeouts where zero would fail every time (a request disconnected before its headers can
# arrive, a connect that cannot start).
Timeout = Annotated[
    float,
    BeforeValidator(_duration),
    AfterValidator(_positive),
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
Size = Annotated[
    int,
    BeforeValidator(_size),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": r"^\d+[kKmMgG]?$"},
                {"type": "integer", "minimum": 0},
            ],
            "description": "bytes, or nginx-style size ('64k', '10m', '1g')",
        }
    ),
]


_HOST_PORT_RE = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]+):(\d{1,5})$")


_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"


# Names of upstreams and limits: they appear in headers (RateLimit-Policy quotes the limit's
# name), metric labels and Redis keys, so only plain ASCII.
def _check_name(name: str) -> str:
    if not re.fullmatch(_NAME_RE, name):
        raise ValueError(
            f"invalid name {name!r}: use ASCII letters, digits, '_', '.' and '-', "
            "starting with a letter or digit"
        )
    return name


Name = Annotated[
    str, AfterValidator(_check_name), WithJsonSchema({"type": "string", "pattern": _NAME_RE})
]
KNOWN_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"}
)


def split_host_port(text: str) -> tuple[str, int]:
    """``'127.0.0.1:8080'`` / ``'[::1]:8080'`` -> host and port; raises ValueError."""
    match = _HOST_PORT_RE.match(text.strip())
    if match is None:
        raise ValueError(f"invalid listen address {text!r}: expected HOST:PORT, e.g. 0.0.0.0:8080")
    host, port = match.group(1), int(match.group(2))
    if port > 65535:
        raise ValueError(f"invalid listen address {text!r}: port out of range")
    return host.strip("[]"), port


def _off(value: Any) -> Any:
    return "off" if value is False else value  # YAML reads a bare `off` as false


# The levels of a limit's rejection lines (nginx's limit_req_log_level); delays one lower.
LimitLogLevel = Annotated[
    Literal["error", "warning", "info", "off"],
    BeforeValidator(_off),
    WithJsonSchema({"enum": ["error", "warning", "info", "off", False]}),
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_KEY_PART_RE = re.compile(
    r"^(client_ip|route|method|global|header:[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
    r"|query:[^\s&=]+|const:\S+|plan:[A-Za-z0-9][A-Za-z0-9_.\-]*"
    r"|body:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*|jwt:[A-Za-z0-9_.:\-/]+)$"
)


def check_key_parts(value: tuple[str, ...], *, plans: bool = False) -> tuple[str, ...]:
    """Key parts as a limit's ``key`` (``plans``: with ``plan:LIMIT``) and a pool's
    ``hash_key`` take them."""
    if not value:
        raise ValueError("key needs at least one part")
    for part in value:
        limit_only = part.startswith(("plan:", "body:", "jwt:"))
        if not _KEY_PART_RE.match(part) or (limit_only and not plans):
            expected = (
                "global, const:TEXT, plan:LIMIT, jwt:CLAIM or body:FIELD (a JSON field of the "
                "request body: model, metadata.user)"
                if plans
                else "global or const:TEXT"
            )
            raise ValueError(
                f"invalid key part {part!r}: expected client_ip, header:NAME, query:NAME, "
                f"route, method, {expected}"
            )
    return value


_HEADER_NAME_RE = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
