"""Arrival patterns for ``gateway simulate``: when requests come, written on the command line.

``KIND:name=value,...``: ``constant`` (a steady rate), ``burst`` (``size`` at once, ``every``
so long), ``poisson`` (a rate, exponential gaps from a fixed seed), ``ramp`` (a rate rising or
falling linearly) and ``log`` (the instants, clients and paths of an access log). Every
pattern is deterministic: the same text gives the same requests.
"""

from __future__ import annotations

import heapq
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

from gateway.policy.units import parse_duration
from gateway.replay.log_formats import (
    LogError,
    ReadStats,
    Request,
    close_log,
    in_time_order,
    open_log,
    read_log,
)

US: Final = 1_000_000
# Requests all patterns together may send: a simulation to look at, not a load test.
MAX_ARRIVALS: Final = 2_000_000
_RATE_RE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*r/(s|m|h)\s*$")
_PERIOD_S: Final = {"s": 1.0, "m": 60.0, "h": 3600.0}
_KINDS: Final = {
    "constant": ("rate", "for"),
    "burst": ("size", "every", "for"),
    "poisson": ("rate", "for"),
    "ramp": ("from", "to", "for"),
    "log": (),
}
_COMMON: Final = ("start", "path", "client", "clients", "seed", "method")
_EXAMPLES: Final = (
    "constant:rate=10r/s,for=30s; burst:size=20,every=10s,for=1m; "
    "poisson:rate=10r/s,for=1m,seed=1; ramp:from=1r/s,to=50r/s,for=1m; log:access.log"
)


class PatternError(ValueError):
    """A pattern that cannot be read: one line for the user."""


@dataclass(frozen=True, slots=True)
class Pattern:
    text: str
    kind: str
    params: dict[str, str] = field(default_factory=dict)
    log: str | None = None

    def start_us(self) -> int:
        return _duration_us(self, "start", "0s")

    def span_us(self) -> int:
        return _duration_us(self, "for", "0s")


def parse_rate_per_s(text: str) -> float:
    match = _RATE_RE.match(text)
    if match is None:
        raise ValueError(f"invalid rate {text!r}: expected e.g. 10r/s, 2.5r/s, 30r/m")
    return float(match.group(1)) / _PERIOD_S[match.group(2)]


def parse_pattern(text: str) -> Pattern:
    kind, _, rest = text.partition(":")
    kind = kind.strip()
    if kind not in _KINDS:
        raise PatternError(f"{text!r}: unknown pattern {kind!r}: write one of {_EXAMPLES}")
    if kind == "log":
        if not rest.strip():
            raise PatternError(f"{text!r}: name the log: log:access.log")
        return Pattern(text, kind, {}, rest.strip())
    params: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        name, equals, value = item.partition("=")
        if not equals or name.strip() not in (*_KINDS[kind], *_COMMON):
            known = ", ".join((*_KINDS[kind], *_COMMON))
            raise PatternError(f"{text!r}: {item!r}: a {kind} pattern takes {known}")
        params[name.strip()] = value.strip()
    missing = [name for name in _KINDS[kind] if name not in params]
    if missing:
        raise PatternError(
            f"{text!r}: a {kind} pattern needs {', '.join(missing)}: write e.g. "
            + next(e for e in _EXAMPLES.split("; ") if e.startswith(kind))
        )
    pattern = Pattern(text, kind, params)
    _check_values(pattern)
    return pattern


def _check_values(pattern: Pattern) -> None:
    """Every value read once here, so a mistake is found before anything runs."""
    try:
        for name in ("rate", "from", "to"):
            if name in pattern.params:
                parse_rate_per_s(pattern.params[name])
        for name in ("for", "every", "start"):
            if name in pattern.params:
                parse_duration(pattern.params[name])
        for name in ("size", "clients", "seed"):
            if name in pattern.params and not pattern.params[name].isdigit():
                raise ValueError(f"{name} must be a whole number, got {pattern.params[name]!r}")
    except ValueError as exc:
        raise PatternError(f"{pattern.text!r}: {exc}") from None
    if pattern.kind == "burst" and _duration_us(pattern, "every", "0s") <= 0:
        raise PatternError(f"{pattern.text!r}: every must be longer than 0")
    if pattern.kind in ("constant", "poisson") and _rate(pattern, "rate") <= 0:
        raise PatternError(f"{pattern.text!r}: rate must be above 0")


def _duration_us(pattern: Pattern, name: str, default: str) -> int:
    return round(parse_duration(pattern.params.get(name, default)) * US)


def _rate(pattern: Pattern, name: str) -> float:
    return parse_rate_per_s(pattern.params[name])


def _instants(pattern: Pattern) -> Iterator[int]:
    """The pattern's arrival instants in microseconds from its start, in order."""
    span = pattern.span_us()
    kind = pattern.kind
    if kind == "constant":
        gap = US / _rate(pattern, "rate")
        count = math.floor(span / gap - 1e-9) + 1 if span > 0 else 0
        for i in range(count):
            yield round(i * gap)
    elif kind == "burst":
        size = int(pattern.params["size"])
        every = _duration_us(pattern, "every", "1s")
        t = 0
        while t < span:
            for _ in range(size):
                yield t
            t += every
    elif kind == "poisson":
        rng = random.Random(int(pattern.params.get("seed", "1")))
        rate = _rate(pattern, "rate")
        at = rng.expovariate(rate) * US
        while at < span:
            yield round(at)
            at += rng.expovariate(rate) * US
    elif kind == "ramp":
        yield from _ramp(_rate(pattern, "from"), _rate(pattern, "to"), span)


def _ramp(first: float, last: float, span_us: int) -> Iterator[int]:
    """The k-th arrival where the rate's integral reaches k: N(t) = a t + (b - a) t^2 / 2T."""
    span_s = span_us / US
    slope = (last - first) / span_s if span_s else 0.0
    total = first * span_s + slope * span_s * span_s / 2
    k = 0
    while k < total - 1e-9:
        if abs(slope) < 1e-12:
            t = k / first
        else:
            # slope/2 t^2 + first t - k = 0, the root in [0, span].
            t = (-first + math.sqrt(max(0.0, first * first + 2 * slope * k))) / slope
        yield round(t * US)
        k += 1


def _generated(pattern: Pattern, headers: tuple[tuple[str, str], ...]) -> Iterator[Request]:
    start = pattern.start_us()
    path = pattern.params.get("path", "/")
    method = pattern.params.get("method", "GET").upper()
    client = pattern.params.get("client", "192.0.2.1")
    clients = int(pattern.params.get("clients", "1") or "1")
    addresses = [client] if clients <= 1 else [_nth_client(i) for i in range(clients)]
    for i, t_us in enumerate(_instants(pattern)):
        address = addresses[i % len(addresses)]
        yield Request(start + t_us, pattern.text, i + 1, address, method, path, None, headers, None)


def _nth_client(i: int) -> str:
    """Distinct documentation-range addresses (198.18.0.0/15, for benchmarks)."""
    return f"198.{18 + (i >> 16) % 2}.{(i >> 8) & 0xFF}.{i & 0xFF}"


def _from_log(pattern: Pattern, stats: ReadStats) -> Iterator[Request]:
    """A log's requests, moved to start at the pattern's start."""
    assert pattern.log is not None
    opened = open_log(pattern.log)
    try:
        first: int | None = None
        start = pattern.start_us()
        for request in in_time_order(read_log(opened, "auto", stats), 30 * US, stats):
            if first is None:
                first = request.t_us
            yield request.at(request.t_us - first + start)
    finally:
        close_log(opened)


def arrivals(
    patterns: list[Pattern], headers: tuple[tuple[str, str], ...], stats: ReadStats
) -> Iterator[Request]:
    """Every pattern's requests, merged in time order. Raises ``PatternError`` past
    ``MAX_ARRIVALS`` and ``LogError`` for a log that cannot be read."""
    streams = [_from_log(p, stats) if p.kind == "log" else _generated(p, headers) for p in patterns]
    for count, request in enumerate(heapq.merge(*streams, key=lambda r: r.t_us), 1):
        if count > MAX_ARRIVALS:
            raise PatternError(
                f"the patterns send more than {MAX_ARRIVALS:,} requests: shorten them "
                "(for=) or lower their rates"
            )
        yield request


__all__ = ["LogError", "Pattern", "PatternError", "arrivals", "parse_pattern"]
