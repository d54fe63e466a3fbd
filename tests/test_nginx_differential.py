"""Differential test: the leaky bucket and ``decide_all`` against a real nginx ``limit_req``.

Deterministic traces (steady over-rate, bursts, bursty-then-idle, several keys, two limits at
once, r/m rates, burst, nodelay, delay=N) are sent to nginx at planned instants. Each response
says what nginx did (``$limit_req_status``: PASSED, DELAYED or REJECTED) and how long it held
the request. The same arrivals, as measured at send time on the same ``CLOCK_MONOTONIC`` nginx
reads, are fed to our model.

Verdicts: nginx judged each request at some millisecond between our send instant and the first
response byte (less the time it held the request). Where the model gives one outcome over that
whole window (widened by ``MARGIN_MS`` each side) the request must agree with nginx; where the
outcome changes inside the window the arrival sits on a decision boundary, and is set aside and
counted.

Arithmetic: nginx's debug log shows the excess (milli-requests) of every zone lookup of every
request, and the zone it blames for a delay or a rejection. The model must reproduce all of it
exactly at some millisecond of the window. The model's state moves on only along such exact
matches, so it follows nginx's own clock readings; while a bucket sits empty its state says
little about which millisecond nginx read, so a few candidate histories are carried until a
later request tells them apart.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.algorithms.combine import CombinedDecision, decide_all
from gateway.algorithms.leaky_bucket import LeakyBucket
from tests.support.nginx_harness import (
    NGX_AGAIN,
    NGX_BUSY,
    NGX_OK,
    Exchange,
    Limit,
    Location,
    NginxRecord,
    Planned,
    Zone,
    nginx_available,
    nginx_records,
    replay,
    running_nginx,
)

pytestmark = [
    pytest.mark.nginx,
    pytest.mark.skipif(not nginx_available(), reason="needs the nginx Debian package"),
]

MARGIN_MS = 2  # "within a few milliseconds of a decision boundary"
MIN_AGREEMENT = 0.99
MAX_SET_ASIDE = 0.15  # more than this set aside would make the comparison meaningless
DELAY_OVERSHOOT_MS = 300  # a shared 2-core machine may run nginx's timers late, never early
MAX_HISTORIES = 256


@dataclass(frozen=True)
class Trace:
    name: str
    location: Location
    plan: list[Planned]


def _headers(client: str, group: str = "g") -> tuple[tuple[str, str], ...]:
    return (("X-Client", client), ("X-Group", group))


def _poisson(rng: random.Random, per_s: float, duration_ms: float) -> list[float]:
    times = []
    now = rng.expovariate(per_s) * 1000
    while now < duration_ms:
        times.append(now)
        now += rng.expovariate(per_s) * 1000
    return times


def build_traces() -> list[Trace]:
    rng = random.Random(20240601)
    client_key = "$http_x_client"
    traces = []

    # Steady over-rate: 27 r/s against 10r/s burst=5, queued (default delay).
    steady = Location("/steady", (Limit(Zone("steady", client_key, "10r/s"), burst=5),))
    traces.append(
        Trace("steady", steady, [Planned(k * 37.0, "/steady", _headers("s")) for k in range(160)])
    )

    # Bursts of 16 against 5r/s burst=10 nodelay, with a trickle under the rate between them.
    bursts = Location("/bursts", (Limit(Zone("bursts", client_key, "5r/s"), 10, nodelay=True),))
    plan = [
        Planned(start + k * 2.0, "/bursts", _headers("b"))
        for start in (0.0, 2500.0, 5300.0, 9000.0)
        for k in range(16)
    ]
    plan += [Planned(300.0 + k * 330.0, "/bursts", _headers("b")) for k in range(36)]
    traces.append(Trace("bursts", bursts, sorted(plan, key=lambda p: p.at_ms)))

    # Bursty then idle: bursts of 7 against 2r/s burst=4 delay=2, idle long enough to recover,
    # with two stragglers while the queue drains.
    idle = Location("/idle", (Limit(Zone("idle", client_key, "2r/s"), 4, delay=2),))
    plan = []
    for start in (0.0, 3800.0, 7900.0, 12100.0):
        plan += [Planned(start + k * 3.0, "/idle", _headers("i")) for k in range(7)]
        plan += [Planned(start + 610.0, "/idle", _headers("i"))]
        plan += [Planned(start + 1330.0, "/idle", _headers("i"))]
    traces.append(Trace("idle", idle, sorted(plan, key=lambda p: p.at_ms)))

    # Several keys in one zone, random arrivals, each client twice the rate.
    keys = Location("/keys", (Limit(Zone("keys", client_key, "3r/s"), burst=2),))
    plan = [
        Planned(at, "/keys", _headers(f"k{client}"))
        for client in range(5)
        for at in _poisson(rng, 6.0, 8000.0)
    ]
    traces.append(Trace("keys", keys, sorted(plan, key=lambda p: p.at_ms)))

    # Two limits at once: per client 4r/s burst=3, per group 6r/s burst=4 delay=2.
    two = Location(
        "/two",
        (
            Limit(Zone("two_client", client_key, "4r/s"), burst=3),
            Limit(Zone("two_group", "$http_x_group", "6r/s"), burst=4, delay=2),
        ),
    )
    plan = [
        Planned(at, "/two", _headers(f"c{client}", "team"))
        for client in range(3)
        for at in _poisson(rng, 3.5, 8000.0)
    ]
    traces.append(Trace("two", two, sorted(plan, key=lambda p: p.at_ms)))

    # Per-minute rates, both truncated by nginx: 40r/m is 666 milli/s, 7r/m is 116.
    per_minute = Location("/pm40", (Limit(Zone("pm40", client_key, "40r/m"), burst=2),))
    plan = [Planned(k * 550.0 + rng.uniform(0, 60), "/pm40", _headers("m")) for k in range(29)]
    traces.append(Trace("pm40", per_minute, plan))
    seven = Location("/pm7", (Limit(Zone("pm7", client_key, "7r/m"), burst=1, nodelay=True),))
    plan = [Planned(k * 1100.0, "/pm7", _headers("m7")) for k in range(18)]
    traces.append(Trace("pm7", seven, plan))
    return traces


def bucket_for(limit: Limit) -> LeakyBucket:
    return LeakyBucket.from_nginx(limit.zone.rate, limit.burst, limit.nodelay, limit.delay)


def header_for(zone: Zone) -> str:
    """The request header an nginx key like ``$http_x_client`` reads."""
    assert zone.key.startswith("$http_")
    return zone.key.removeprefix("$http_").replace("_", "-")


def outcome(result: CombinedDecision) -> str:
    if not result.allowed:
        return "REJECTED"
    return "DELAYED" if result.delay_s > 0 else "PASSED"


@dataclass
class Tally:
    name: str
    requests: int = 0
    agreed: int = 0
    disagreed: list[str] = field(default_factory=list)
    boundary: int = 0
    boundary_unexplained: list[str] = field(default_factory=list)
    observed: dict[str, int] = field(default_factory=dict)
    lookups_checked: int = 0
    excess_checked: int = 0
    excess_mismatch: list[str] = field(default_factory=list)
    delays_checked: int = 0
    delay_mismatch: list[str] = field(default_factory=list)
    max_overshoot_ms: int = 0
    window_ms: list[int] = field(default_factory=list)
    max_histories: int = 1


State = dict[tuple[int, str], Any]  # (limit index, key) -> that key's state in that limit
Candidate = tuple[State, int, CombinedDecision]  # a history, a millisecond, the model's verdict


def blamed_limit(result: CombinedDecision) -> int | None:
    """The limit nginx names in its log line: the first rejecting one, or the longest delay."""
    if result.rejected_by:
        return result.rejected_by[0]
    return result.delayed_by


def nginx_agrees(
    candidate: Candidate,
    observed: str,
    record: NginxRecord,
    buckets: Sequence[LeakyBucket],
    keys: Sequence[tuple[int, str]],
    zone_names: Sequence[str],
) -> bool:
    """Would nginx have logged exactly ``record`` had it judged the request as ``candidate``?"""
    history, now_ms, result = candidate
    if outcome(result) != observed:
        return False
    # nginx looks zones up in order and stops at the first that rejects.
    last = result.rejected_by[0] if result.rejected_by else len(buckets) - 1
    expected_rc = [NGX_AGAIN] * last + [NGX_BUSY if result.rejected_by else NGX_OK]
    if [lookup.index for lookup in record.lookups] != list(range(last + 1)):
        return False
    if [lookup.rc for lookup in record.lookups] != expected_rc:
        return False
    for lookup in record.lookups:
        state = history.get(keys[lookup.index])
        if buckets[lookup.index].excess_milli_at(state, now_ms * 1000) != lookup.excess_milli:
            return False
    blamed = blamed_limit(result)
    return record.blamed_zone == (None if blamed is None else zone_names[blamed])


def request_keys(trace: Trace, planned: Planned) -> list[tuple[int, str]]:
    """The (limit index, key) each limit of the trace's location charges for ``planned``."""
    headers = {name.lower(): value for name, value in planned.headers}
    return [
        (index, headers[header_for(limit.zone)])
        for index, limit in enumerate(trace.location.limits)
    ]


def key_components(trace: Trace) -> dict[tuple[int, str], tuple[int, str]]:
    """Group the trace's keys that appear in one request together (union-find), by a root key."""
    root: dict[tuple[int, str], tuple[int, str]] = {}

    def find(key: tuple[int, str]) -> tuple[int, str]:
        while root.setdefault(key, key) != key:
            key = root[key]
        return key

    for planned in trace.plan:
        first, *others = request_keys(trace, planned)
        find(first)
        for other in others:
            root[find(other)] = find(first)
    return {key: find(key) for key in list(root)}


def compare(trace: Trace, exchanges: Sequence[Exchange], records: dict[str, NginxRecord]) -> Tally:
    buckets = [bucket_for(limit) for limit in trace.location.limits]
    zone_names = [limit.zone.name for limit in trace.location.limits]
    components = key_components(trace)
    # The model states consistent with everything nginx logged so far (usually one or two:
    # which millisecond nginx read is only ambiguous while a bucket sits empty). Kept apart per
    # group of keys that share a request (one client; or every client of a shared group key),
    # so independent clients' ambiguities do not multiply.
    histories: dict[tuple[int, str], list[State]] = {}
    tally = Tally(trace.name)
    for exchange in sorted(exchanges, key=lambda exchange: exchange.send_ns):
        tally.requests += 1
        observed = exchange.limit_req_status
        tally.observed[observed] = tally.observed.get(observed, 0) + 1
        assert exchange.status in (200, 429), exchange
        assert (exchange.status == 429) == (observed == "REJECTED"), exchange
        keys = request_keys(trace, exchange.planned)
        component = components[keys[0]]
        send_ms = exchange.send_ns // 1_000_000
        judged_by_ms = exchange.first_byte_ns // 1_000_000 - exchange.request_time_ms + 1
        window = sorted(
            range(send_ms - MARGIN_MS, max(judged_by_ms, send_ms) + MARGIN_MS + 1),
            key=lambda now_ms: abs(now_ms - send_ms),
        )
        tally.window_ms.append(len(window))
        candidates: list[Candidate] = []
        for history in histories.get(component, [{}]):
            items = [(bucket, history.get(key)) for bucket, key in zip(buckets, keys, strict=True)]
            candidates += [(history, t, decide_all(items, t * 1000)) for t in window]
        outcomes = {outcome(result) for _, _, result in candidates}
        what = f"{trace.name} {exchange.target} sent at {send_ms} (window {len(window)} ms)"
        if len(outcomes) == 1:
            if observed in outcomes:
                tally.agreed += 1
            else:
                tally.disagreed.append(f"{what}: nginx {observed}, model {outcomes}")
        else:
            tally.boundary += 1
            if observed not in outcomes:
                tally.boundary_unexplained.append(f"{what}: nginx {observed}, model {outcomes}")

        # Bit for bit: nginx's logged excess for every zone it looked up, at some millisecond
        # of the window. Those candidates are also where the model's state moves on from.
        record = records.get(exchange.target, NginxRecord())
        tally.excess_checked += 1
        tally.lookups_checked += len(record.lookups)
        consistent = [
            candidate
            for candidate in candidates
            if nginx_agrees(candidate, observed, record, buckets, keys, zone_names)
        ]
        if not consistent:
            seen = {
                (t, index): buckets[index].excess_milli_at(history.get(keys[index]), t * 1000)
                for history, t, _ in candidates[: len(window)]
                for index in range(len(buckets))
            }
            tally.excess_mismatch.append(
                f"{what}: nginx {observed} {record}, model excess by (ms, limit) {seen}"
            )
            consistent = [c for c in candidates if outcome(c[2]) == observed] or candidates[:1]

        if observed == "DELAYED":
            delays_ms = [round(result.delay_s * 1000) for _, _, result in consistent]
            tally.delays_checked += 1
            held_ms = exchange.request_time_ms
            tally.max_overshoot_ms = max(tally.max_overshoot_ms, held_ms - max(delays_ms))
            # nginx's timer fires once its cached clock reaches judged + delay: never early (1 ms
            # for the wall-clock rounding of $request_time), late only by scheduling.
            if not (
                min(delays_ms) - 1 <= held_ms <= max(delays_ms) + DELAY_OVERSHOOT_MS
                and exchange.latency_ms >= min(delays_ms) - 1
            ):
                tally.delay_mismatch.append(
                    f"{what}: model delay {delays_ms} ms, nginx held {held_ms} ms, "
                    f"client waited {exchange.latency_ms:.1f} ms"
                )

        next_histories: dict[tuple[tuple[tuple[int, str], Any], ...], State] = {}
        for history, _, result in consistent:
            updated = dict(history)
            updated.update(zip(keys, result.states, strict=True))
            next_histories.setdefault(tuple(sorted(updated.items())), updated)
            if len(next_histories) == MAX_HISTORIES:
                break
        histories[component] = list(next_histories.values())
        tally.max_histories = max(tally.max_histories, len(next_histories))
    return tally


async def test_leaky_bucket_decides_like_nginx(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    traces = build_traces()
    with running_nginx(tmp_path / "nginx", [trace.location for trace in traces]) as nginx:
        async with asyncio.timeout(50):
            replays = await asyncio.gather(
                *(replay(nginx.port, trace.plan, tag=trace.name) for trace in traces)
            )
        records = nginx_records(nginx.error_log)
    tallies = [
        compare(trace, exchanges, records) for trace, exchanges in zip(traces, replays, strict=True)
    ]

    total = sum(t.requests for t in tallies)
    decided = sum(t.agreed + len(t.disagreed) for t in tallies)
    agreed = sum(t.agreed for t in tallies)
    boundary = sum(t.boundary for t in tallies)
    excess_checked = sum(t.excess_checked for t in tallies)
    excess_bad = [line for t in tallies for line in t.excess_mismatch]
    delay_bad = [line for t in tallies for line in t.delay_mismatch]
    lines = [
        f"{t.name:>7}: {t.requests:4d} requests, nginx {dict(sorted(t.observed.items()))}, "
        f"agreed {t.agreed}, disagreed {len(t.disagreed)}, boundary {t.boundary}, "
        f"excess exact {t.excess_checked - len(t.excess_mismatch)}/{t.excess_checked} "
        f"({t.lookups_checked} lookups), "
        f"delays ok {t.delays_checked - len(t.delay_mismatch)}/{t.delays_checked} "
        f"(max late {t.max_overshoot_ms} ms), histories <= {t.max_histories}"
        for t in tallies
    ]
    windows = sorted(width for t in tallies for width in t.window_ms)
    lines.append(
        f"  total: {total} requests; {agreed}/{decided} non-boundary agree "
        f"({agreed / max(decided, 1):.2%}); {boundary} set aside at a boundary "
        f"({boundary / total:.1%}); nginx's logged excess reproduced exactly for "
        f"{excess_checked - len(excess_bad)}/{excess_checked} requests "
        f"({sum(t.lookups_checked for t in tallies)} zone lookups); judging window median "
        f"{windows[len(windows) // 2]} ms, max {windows[-1]} ms (margin {MARGIN_MS} ms each side)"
    )
    report = "\n".join(lines)
    with capsys.disabled():
        print("\nnginx differential:\n" + report)
    problems = "\n".join(
        [line for t in tallies for line in t.disagreed + t.boundary_unexplained]
        + excess_bad
        + delay_bad
    )

    # Every trace exercised what it is for.
    by_name = {t.name: t.observed for t in tallies}
    for name in ("steady", "bursts", "idle", "keys", "two", "pm40", "pm7"):
        assert by_name[name].get("REJECTED", 0) > 0, (name, report)
    for name in ("steady", "idle", "keys", "two", "pm40"):
        assert by_name[name].get("DELAYED", 0) > 0, (name, report)
    for name in ("bursts", "idle", "pm7"):
        assert by_name[name].get("PASSED", 0) > 0, (name, report)
    assert "DELAYED" not in by_name["bursts"] and "DELAYED" not in by_name["pm7"], report

    assert boundary <= MAX_SET_ASIDE * total, report
    assert agreed >= MIN_AGREEMENT * decided, report + "\n" + problems
    assert not [line for t in tallies for line in t.boundary_unexplained], problems
    assert len(excess_bad) <= (1 - MIN_AGREEMENT) * excess_checked, report + "\n" + problems
    assert len(delay_bad) <= (1 - MIN_AGREEMENT) * sum(t.delays_checked for t in tallies), (
        report + "\n" + problems
    )
