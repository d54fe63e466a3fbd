"""Parsers for the units operators write in policy files, in the syntax they already know.

Rates follow nginx (``10r/s``, ``30r/m``), durations follow Go (``500ms``, ``1s``, ``1m30s``),
sizes follow nginx (``512``, ``64k``, ``10m``, ``1g``) and time zones are IANA names
(``Europe/Berlin``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, tzinfo
from typing import Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

_RATE_RE = re.compile(r"^\s*(\d+)\s*r/(s|m)\s*$")
_DURATION_PART_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|us|µs|s|m|h)")
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kKmMgG]?)\s*$")
_DURATION_UNIT_S = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_SIZE_UNIT = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
# The calendar periods a fixed window can be aligned to: day, ISO week (from Monday), month, year.
CALENDAR_PERIODS: Final = ("1d", "1w", "1mo", "1y")
_ZONE_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_+\-]*(/[A-Za-z0-9_+\-]+)*")


@dataclass(frozen=True, slots=True)
class Rate:
    """``requests`` per ``period_s`` seconds, kept as written: nginx scales r/m apart from r/s."""

    requests: int
    period_s: int

    @property
    def per_second(self) -> float:
        return self.requests / self.period_s

    def __str__(self) -> str:
        return f"{self.requests}r/{'s' if self.period_s == 1 else 'm'}"


def parse_rate(text: str) -> Rate:
    match = _RATE_RE.match(text)
    if match is None:
        raise ValueError(f"invalid rate {text!r}: expected nginx syntax like '10r/s' or '30r/m'")
    requests = int(match.group(1))
    if requests <= 0:
        raise ValueError(f"invalid rate {text!r}: must be at least 1 request")
    return Rate(requests, 1 if match.group(2) == "s" else 60)


def parse_duration(text: str | float | int) -> float:
    """Seconds from a Go-style duration; bare numbers are seconds."""
    if isinstance(text, bool):
        raise ValueError(f"invalid duration {text!r}")
    if isinstance(text, int | float):
        if not math.isfinite(text):
            raise ValueError(f"invalid duration {text!r}: must be a finite number of seconds")
        if text < 0:
            raise ValueError(f"invalid duration {text!r}: must not be negative")
        return float(text)
    stripped = text.strip()
    if stripped == "0":
        return 0.0
    pos = 0
    total = 0.0
    for match in _DURATION_PART_RE.finditer(stripped):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _DURATION_UNIT_S[match.group(2)]
        pos = match.end()
    if pos == 0 or pos != len(stripped):
        raise ValueError(
            f"invalid duration {text!r}: expected Go syntax like '500ms', '10s', '1m30s'"
        )
    return total


def parse_size(text: str | int) -> int:
    """Bytes from an nginx-style size (``64k``, ``10m``, ``1g``); bare numbers are bytes."""
    if isinstance(text, bool):
        raise ValueError(f"invalid size {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"invalid size {text!r}: must not be negative")
        return text
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"invalid size {text!r}: expected bytes or nginx syntax like '64k', '10m'")
    return int(match.group(1)) * _SIZE_UNIT[match.group(2).lower()]


def time_zone(name: str) -> tzinfo:
    """The zone an IANA name (``Europe/Berlin``) stands for; ``UTC`` needs no time zone database.

    Raises ``ValueError`` naming the zone: unknown, or no database on this machine to look it
    up in (the ``tzdata`` package provides one where the system has none).
    """
    if name == "UTC":
        return UTC
    # Leap-second zones (right/...) count seconds datetime cannot: their days would be off.
    if _ZONE_NAME_RE.fullmatch(name) is None or name.startswith("right/"):
        raise ValueError(f"invalid time zone {name!r}: expected an IANA name like 'Europe/Berlin'")
    try:
        return ZoneInfo(name)
    except ZoneInfoNotFoundError:
        raise ValueError(
            f"unknown time zone {name!r}: expected an IANA name like 'Europe/Berlin' or "
            "'America/New_York' (where the system has no time zone database, install the "
            "tzdata package)"
        ) from None
    except (ValueError, OSError):  # a file of the database that is not a zone (zone.tab)
        raise ValueError(
            f"invalid time zone {name!r}: expected an IANA name like 'Europe/Berlin'"
        ) from None
