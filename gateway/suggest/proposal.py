"""Limits chosen from measured traffic, each with the evidence it rests on.

Per client address (and per API key when the log carries one) a leaky bucket with ``nodelay``
decides who is refused: its rate is the busiest minute of the key at the chosen share
(``--reject-at-most``), its burst the least that admits every other key at that rate
(``traffic.leaky_need``, the engine's arithmetic). Where the heaviest keys stand apart (one
needs at least twice the next), the line is drawn in that gap, so fewer ordinary keys are
refused; never more than the share. The other limits refuse nobody today: a window per
client just above what the admitted keys sent, a token bucket per busy path prefix and one
for the whole upstream at today's peak (or at ``--protect-upstream``), as ceilings against
a flood.
"""

from __future__ import annotations

import math
import re
from array import array
from dataclasses import dataclass, field
from typing import Final

from gateway.limits.keys import shown_key
from gateway.suggest.traffic import WINDOWS, Traffic, leaky_need, leaky_refused, peak_in_window

# One key needing at least this many times the next is set apart from it.
GAP_RATIO: Final = 2.0
# Path prefixes that get a ceiling of their own: at least this share of the requests.
PREFIX_SHARE: Final = 0.05
MAX_PREFIXES: Final = 5
HEAVIEST_SHOWN: Final = 5
# Token buckets are sized a little above the need: Guava's arithmetic is not nginx's.
TOKEN_MARGIN: Final = 2


@dataclass(frozen=True, slots=True)
class Rate:
    """A rate as a policy writes it: ``N r/s`` or ``N r/m``."""

    requests: int
    per_minute: bool

    @classmethod
    def at_least(cls, per_minute: float) -> Rate:
        """The least rate in nginx syntax at or above ``per_minute`` requests a minute."""
        count = max(1, math.ceil(per_minute - 1e-9))
        if count >= 6000:
            return cls(math.ceil(count / 60), False)
        return cls(count, True)

    @property
    def milli(self) -> int:
        """nginx's rate in milli-requests per second (truncated as nginx truncates)."""
        return self.requests * 1000 // (60 if self.per_minute else 1)

    def __str__(self) -> str:
        return f"{self.requests}r/{'m' if self.per_minute else 's'}"


@dataclass
class Threshold:
    """A line drawn through the keys' values: those above it are refused."""

    values: list[int]  # every key's value, ascending
    value: int
    refused: int
    by_gap: bool


@dataclass
class ProposedLimit:
    name: str
    settings: list[tuple[str, str]]  # YAML lines under the limit's name, as written
    evidence: list[str]
    subject: str  # what its keys are, in words
    chart: Threshold | None = None
    chart_label: str = ""
    refused: list[tuple[str, int]] = field(default_factory=list)  # (key shown, value)
    rate_chart: Threshold | None = None  # the keys' busiest minutes, and the rate's line


@dataclass
class Proposal:
    share: float
    limits: list[ProposedLimit]
    requests: int
    span_ms: int
    first_ms: int
    clients: int
    api_keys: int
    distributions: dict[str, dict[str, dict[str, int]]]  # kind -> window -> percentiles
    per_second: list[int]  # all requests per second, for the page
    global_rate_per_s: float


def percentiles(values: list[int]) -> dict[str, int]:
    """p50, p90, p99 and max of ascending values (nearest rank)."""
    if not values:
        return {"p50": 0, "p90": 0, "p99": 0, "max": 0}
    last = len(values) - 1
    return {
        name: values[min(last, int(q * len(values)))]
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
    } | {"max": values[-1]}


def choose(values: list[int], share: float) -> Threshold:
    """The least value at or under which all but ``share`` of the keys stay; in the widest
    clear gap among the heaviest keys when there is one."""
    count = len(values)
    allowed = math.floor(share * count + 1e-9)
    if count == 0:
        return Threshold(values, 0, 0, False)
    if allowed == 0:
        return Threshold(values, values[-1], 0, False)
    lowest = count - allowed - 1
    best, best_ratio = lowest, 0.0
    for index in range(lowest, count - 1):
        ratio = values[index + 1] / max(values[index], 1)
        if ratio > best_ratio:
            best, best_ratio = index, ratio
    by_gap = best_ratio >= GAP_RATIO
    value = values[best] if by_gap else values[lowest]
    refused = sum(1 for v in values if v > value)
    return Threshold(values, value, refused, by_gap)


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole else "0%"


def _spread(values: list[int]) -> str:
    p = percentiles(values)
    return f"p50 {p['p50']:,}, p90 {p['p90']:,}, p99 {p['p99']:,}, max {p['max']:,}"


def _limit_name(prefix: str) -> str:
    return "prefix_" + (re.sub(r"[^A-Za-z0-9_.-]", "_", prefix.strip("/")) or "root")


def _per_key_bucket(
    name: str,
    subject: str,
    by_key: dict[str, array[int]],
    share: float,
    key_setting: str,
    shown: dict[str, str],
    extra: list[tuple[str, str]],
    of_requests: bool = False,
) -> tuple[ProposedLimit, set[str]]:
    """A leaky bucket per key, and the keys it refuses."""
    keys = sorted(by_key)  # sorted: the same input gives the same output, whatever the order
    per_minute = {k: peak_in_window(by_key[k], 60_000) for k in keys}
    rate_line = choose(sorted(per_minute.values()), share)
    rate = Rate.at_least(rate_line.value)
    needs = {k: leaky_need(by_key[k], rate.milli) for k in keys}
    burst_why = ""
    if of_requests:
        burst_line, burst_why = _burst_for_requests(by_key, keys, needs, rate, share)
    else:
        burst_line = choose(sorted(needs.values()), share)
    refused = {k for k in keys if needs[k] > burst_line.value}
    heaviest = sorted(keys, key=lambda k: (-needs[k], k))[:HEAVIEST_SHOWN]
    one = subject.removesuffix("s")
    evidence = [
        f"{len(keys):,} {subject}; requests in their busiest minute: "
        f"{_spread(sorted(per_minute.values()))}.",
        f"rate {rate}: the busiest minute of the {one} at the {100 - share * 100:g}th percentile"
        + (" (below the few far above the rest)" if rate_line.by_gap else "")
        + ".",
        f"burst {burst_line.value:,}: what each needs at that rate to be refused nothing: "
        f"{_spread(sorted(needs.values()))}"
        + ("; drawn in the gap below the heaviest" if burst_line.by_gap else "")
        + ".",
        f"{len(refused):,} of {len(keys):,} ({_pct(len(refused), len(keys))}) need more and "
        "would be refused at their peaks; the heaviest: "
        + ", ".join(f"{shown[k]} (needs {needs[k]:,})" for k in heaviest)
        + ".",
    ]
    if of_requests:
        evidence[2] = f"burst {burst_line.value:,}: {burst_why}"
    limit = ProposedLimit(
        name,
        [
            ("algorithm", "leaky_bucket"),
            ("rate", str(rate)),
            ("burst", str(burst_line.value)),
            ("nodelay", "true"),
            ("key", key_setting),
            *extra,
        ],
        evidence,
        subject,
        burst_line,
        f"burst each {one} needs at {rate}",
        [(shown[k], needs[k]) for k in sorted(refused, key=lambda k: (-needs[k], k))],
        rate_line,
    )
    return limit, refused


def _burst_for_requests(
    by_key: dict[str, array[int]],
    keys: list[str],
    needs: dict[str, int],
    rate: Rate,
    share: float,
) -> tuple[Threshold, str]:
    """The least burst (at ``rate``) under which the refused requests, counted as the
    engine would refuse them, are at most ``share`` of all: a binary search (a larger burst
    never refuses more)."""
    total = sum(len(by_key[k]) for k in keys)
    budget = math.floor(share * total + 1e-9)

    def refused_at(burst: int) -> int:
        return sum(leaky_refused(by_key[k], rate.milli, burst) for k in keys if needs[k] > burst)

    low, high = 0, max(needs.values(), default=0)  # refused_at(high) is 0
    while low < high:
        middle = (low + high) // 2
        if refused_at(middle) <= budget:
            high = middle
        else:
            low = middle + 1
    burst = low
    values = sorted(needs.values())
    line = Threshold(values, burst, sum(1 for v in values if v > burst), False)
    why = (
        f"the least at which at most {share * 100:g}% of the requests ({budget:,} of "
        f"{total:,}) are refused: {refused_at(burst):,}. What each needs at that rate to be "
        f"refused nothing: {_spread(values)}."
    )
    return line, why


def _window_ceiling(traffic: Traffic, admitted: list[str], span_ms: int) -> ProposedLimit | None:
    """A fixed window per client just above what the admitted clients sent in the longest
    window the log covers (10 min or 1 h): it refuses nobody today."""
    windows = [(w, ms) for w, ms in WINDOWS if ms >= 600_000 and span_ms >= ms]
    if not windows or not admitted:
        return None
    window, window_ms = windows[-1]
    peaks = sorted(peak_in_window(traffic.by_client[k], window_ms) for k in admitted)
    return ProposedLimit(
        f"per_ip_{window}",
        [
            ("algorithm", "fixed_window"),
            ("limit", str(peaks[-1])),
            ("window", window),
            ("key", "[client_ip]"),
        ],
        [
            f"requests of an admitted client in any {window}: {_spread(peaks)}.",
            f"limit {peaks[-1]:,}: the most any of them sent, so it refuses none of today's; "
            "a ceiling on how much one client takes in a longer run.",
        ],
        "clients",
    )


def _token_ceiling(
    name: str, times: array[int], what: str, match: list[tuple[str, str]], upstream: float | None
) -> tuple[ProposedLimit, float]:
    """A token bucket over ``times`` at today's busiest minute (or ``upstream`` r/s), sized
    to admit today's traffic."""
    busiest = peak_in_window(times, 60_000)
    busiest_second = peak_in_window(times, 1_000)
    if upstream is not None:
        rate = Rate.at_least(upstream * 60)
        capacity = max(1, math.ceil(upstream))
        why = [
            f"rate {rate}, burst {capacity}: --protect-upstream (one second's worth at most).",
        ]
    else:
        rate = Rate.at_least(busiest)
        capacity = leaky_need(times, rate.milli) + TOKEN_MARGIN
        why = [
            f"rate {rate}: the busiest minute; burst {capacity}: what today's traffic needs at "
            "that rate, so it refuses none of it: a ceiling against a flood.",
        ]
    limit = ProposedLimit(
        name,
        [
            ("algorithm", "token_bucket"),
            ("rate", str(rate)),
            ("burst", str(capacity)),
            ("key", "[global]"),
            *match,
        ],
        [
            f"{len(times):,} requests {what}; the busiest second held {busiest_second:,}, "
            f"the busiest minute {busiest:,}.",
            *why,
        ],
        "requests",
    )
    return limit, rate.milli / 1000


def propose(
    traffic: Traffic,
    share: float,
    *,
    api_key_header: str = "X-Api-Key",
    protect_upstream: float | None = None,
    of_requests: bool = False,
) -> Proposal:
    all_ms = traffic.all_ms
    span_ms = (all_ms[-1] - all_ms[0]) if all_ms else 0
    limits: list[ProposedLimit] = []
    per_ip, refused = _per_key_bucket(
        "per_ip",
        "clients",
        traffic.by_client,
        share,
        "[client_ip]",
        {k: k for k in traffic.by_client},
        [],
        of_requests,
    )
    limits.append(per_ip)
    admitted = sorted(set(traffic.by_client) - refused)
    window = _window_ceiling(traffic, admitted, span_ms)
    if window is not None:
        limits.append(window)
    if traffic.by_api_key:
        part = f"header:{api_key_header}"
        shown = {k: shown_key((part,), k) for k in traffic.by_api_key}
        per_key, _ = _per_key_bucket(
            "per_api_key",
            "API keys",
            traffic.by_api_key,
            share,
            f"[{part}]",
            shown,
            [("on_missing_key", "skip")],
            of_requests,
        )
        per_key.evidence.append(f"API keys are shown by their hash ({part} values are secrets).")
        limits.append(per_key)
    busy = sorted(
        (
            (prefix, times)
            for prefix, times in traffic.by_prefix.items()
            if prefix != "/" and len(times) >= PREFIX_SHARE * traffic.requests
        ),
        key=lambda item: (-len(item[1]), item[0]),
    )[:MAX_PREFIXES]
    for prefix, times in busy:
        limit, _ = _token_ceiling(
            _limit_name(prefix),
            times,
            f"under {prefix} ({_pct(len(times), traffic.requests)} of all)",
            [("match", f"{{path_prefix: {prefix}}}")],
            None,
        )
        limits.append(limit)
    global_limit, global_rate = _token_ceiling("global", all_ms, "in all", [], protect_upstream)
    limits.append(global_limit)
    distributions: dict[str, dict[str, dict[str, int]]] = {}
    for kind, by_key in (("client", traffic.by_client), ("api_key", traffic.by_api_key)):
        if by_key:
            distributions[kind] = {
                window: percentiles(sorted(peak_in_window(t, ms) for t in by_key.values()))
                for window, ms in WINDOWS
                if window in ("1s", "10s", "1m") or span_ms >= ms
            }
    first = all_ms[0] if all_ms else 0
    per_second = [0] * ((span_ms // 1000) + 1 if all_ms else 0)
    for t in all_ms:
        per_second[(t - first) // 1000] += 1
    return Proposal(
        share,
        limits,
        traffic.requests,
        span_ms,
        first,
        len(traffic.by_client),
        len(traffic.by_api_key),
        distributions,
        per_second,
        global_rate,
    )
