"""Logged traffic measured for ``gateway suggest``: each candidate key's arrivals, and what a
limit would need to admit them.

The logs are read by replay's readers (``log_formats``: every format replay reads, reordered
in time, merged); each request's instant, in whole milliseconds as the engine's leaky bucket
counts them, is kept per client address, per API key (when the log carries the header), per
path prefix, and overall. ``peak_in_window`` and ``leaky_need`` are exact: the most requests
any window of a length held, and the least nginx ``burst`` that admits every request at a rate.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

from gateway.limits.addresses import client_key
from gateway.replay.log_formats import (
    LogError,
    Opened,
    ReadStats,
    Request,
    close_log,
    in_time_order,
    open_log,
    read_log,
)

US: Final = 1_000_000
REORDER_WINDOW_US: Final = 30 * US
# The windows each key's peak is measured over, in milliseconds, as written.
WINDOWS: Final = (
    ("1s", 1_000),
    ("10s", 10_000),
    ("1m", 60_000),
    ("10m", 600_000),
    ("1h", 3_600_000),
)
NO_PREFIX: Final = "/"


def read_requests(paths: Sequence[str], fmt: str, stats: ReadStats) -> Iterator[Request]:
    """Every request of every log in time order, as replay reads them. Raises ``LogError``."""
    opened: list[Opened] = []
    try:
        for path in paths:
            opened.append(open_log(path))
        streams = [in_time_order(read_log(o, fmt, stats), REORDER_WINDOW_US, stats) for o in opened]
        if len(streams) == 1:
            yield from streams[0]
        else:
            yield from heapq.merge(*streams, key=lambda r: r.t_us)
    finally:
        for item in opened:
            close_log(item)


def path_prefix(target: str) -> str:
    """The first segment of a request's path: ``/api/v1/items?x`` is ``/api/``."""
    path = target.split("?", 1)[0]
    if not path.startswith("/"):
        return NO_PREFIX
    end = path.find("/", 1)
    return NO_PREFIX if end < 0 else path[: end + 1]


@dataclass
class Traffic:
    """Arrival instants (ms) per key of each kind, and of all requests."""

    by_client: dict[str, array[int]] = field(default_factory=dict)
    by_api_key: dict[str, array[int]] = field(default_factory=dict)
    by_prefix: dict[str, array[int]] = field(default_factory=dict)
    all_ms: array[int] = field(default_factory=lambda: array("q"))
    stats: ReadStats = field(default_factory=ReadStats)

    @property
    def requests(self) -> int:
        return len(self.all_ms)


def measure(paths: Sequence[str], fmt: str, api_key_header: str, ipv6_prefix: int = 64) -> Traffic:
    """Read the logs once, keeping each request's instant under each of its keys."""
    traffic = Traffic()
    wanted = api_key_header.lower()
    by_client = traffic.by_client
    by_api_key = traffic.by_api_key
    by_prefix = traffic.by_prefix
    all_ms = traffic.all_ms
    # Each address under the key a per-IP limit gives it (an IPv6 client by its /64).
    keyed: dict[str, str] = {}
    for request in read_requests(paths, fmt, traffic.stats):
        t_ms = request.t_us // 1000
        all_ms.append(t_ms)
        client = keyed.get(request.address)
        if client is None:
            client = keyed[request.address] = client_key(request.address, ipv6_prefix)
        times = by_client.get(client)
        if times is None:
            times = by_client[client] = array("q")
        times.append(t_ms)
        prefix = path_prefix(request.target)
        times = by_prefix.get(prefix)
        if times is None:
            times = by_prefix[prefix] = array("q")
        times.append(t_ms)
        if request.headers:
            for name, value in request.headers:
                if name.lower() == wanted and value:
                    times = by_api_key.get(value)
                    if times is None:
                        times = by_api_key[value] = array("q")
                    times.append(t_ms)
                    break
    return traffic


def peak_in_window(times: array[int], window_ms: int) -> int:
    """The most requests any window of ``window_ms`` held (times in order)."""
    count = len(times)
    if count <= 1 or times[-1] - times[0] < window_ms:
        return count
    best = 0
    start = 0
    for end in range(count):
        t = times[end]
        while t - times[start] >= window_ms:
            start += 1
        if end - start + 1 > best:
            best = end - start + 1
    return best


def leaky_need(times: array[int], rate_milli: int) -> int:
    """The least nginx ``burst`` under which a leaky bucket of ``rate_milli`` milli-requests a
    second admits every one of these requests: the engine's arithmetic (``excess`` drained by
    ``rate_milli * ms // 1000``, plus 1000 a request, never below 0; the first of a key
    leaves it at 0). A burst of the result keeps ``excess`` within ``burst * 1000``."""
    if len(times) <= 1:
        return 0
    peak = 0
    excess = 0
    last = times[0]
    for index in range(1, len(times)):
        t = times[index]
        ms = t - last
        if ms < 0:
            ms = 0
        excess = excess - rate_milli * ms // 1000 + 1000
        if excess < 0:
            excess = 0
        if excess > peak:
            peak = excess
        if ms:
            last = t
    return -(-peak // 1000)


def leaky_refused(times: array[int], rate_milli: int, burst: int) -> int:
    """How many of these requests a leaky bucket with ``nodelay`` refuses, as the engine
    would: a refused request leaves the state untouched."""
    if len(times) <= 1:
        return 0
    limit = burst * 1000
    refused = 0
    excess = 0
    last = times[0]
    for index in range(1, len(times)):
        t = times[index]
        ms = t - last
        if ms < 0:
            ms = 0
        after = excess - rate_milli * ms // 1000 + 1000
        if after < 0:
            after = 0
        if after > limit:
            refused += 1
            continue
        excess = after
        if ms:
            last = t
    return refused


__all__ = [
    "WINDOWS",
    "LogError",
    "Traffic",
    "leaky_need",
    "leaky_refused",
    "measure",
    "peak_in_window",
]
