"""Worker leases on the shared store (``store.worker_lease``): workers deciding hot keys from
batches of their quota keep each algorithm's stated bound.

Across real processes (fork), on limits that do not refill within a test: the workers admit
exactly the limit, as without leases, and most decisions come from batches. On one process
driven by a fake clock, a trace of a request every millisecond: windows never admit more than
the limit in a window, buckets never more over a span T than the exact bucket over T +
``interval``, and never fewer than the exact one less the batches' bound.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from gateway.algorithms.base import Algorithm
from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.leaky_bucket import LeakyBucket
from gateway.algorithms.sliding_window import SlidingWindow
from gateway.algorithms.token_bucket import TokenBucket
from gateway.clock import FakeClock
from gateway.limits.compiled import Check
from gateway.stores import SharedStore
from gateway.stores.shared.worker_lease import RESET_CHECK_US, bound_text, lease_kind
from tests.support.conformance import compiled

FORK = multiprocessing.get_context("fork")
UNITS = 64
INTERVAL_S = 0.02


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "state"


# Nothing refills within a test (a request a minute, windows of an hour; and the processes'
# clocks stand still): the count admitted is exact whatever the timing.
NOT_REFILLING: dict[str, tuple[Algorithm[Any], int]] = {
    "leaky_bucket": (LeakyBucket(1, 60, 299, None), 300),
    "token_bucket": (TokenBucket(1, 3600, 300), 300),
    "fixed_window": (FixedWindow(300, 3600.0), 300),
    "sliding_window": (SlidingWindow(300, 3600.0), 300),
}


def _hammer(path: str, kind: str, workers: int, lease: bool, attempts: int, results: Any) -> None:
    """One worker: ``attempts`` requests on one hot key through its own store."""

    async def run() -> tuple[int, int]:
        store = SharedStore(
            Path(path),
            FakeClock(),  # every process at one instant
            workers=workers,
            lease_units=UNITS if lease else 0,
            lease_interval_s=INTERVAL_S,
        )
        limit = compiled("hot", NOT_REFILLING[kind][0], ("global",))
        store.configure([limit], ())
        admitted = 0
        for _ in range(attempts):
            admitted += (await store.decide([Check(limit, "global")])).allowed
        from_batches = 0 if store.leases is None else store.leases.decided
        await store.close()
        return admitted, from_batches

    results.put(asyncio.run(run()))


@pytest.mark.parametrize("lease", [False, True], ids=["exact", "leased"])
@pytest.mark.parametrize("workers", [2, 8])
@pytest.mark.parametrize("kind", sorted(NOT_REFILLING))
def test_workers_on_one_key_admit_exactly_the_limit(
    state_dir: Path, kind: str, workers: int, lease: bool
) -> None:
    """Exact: each admission is decided on the state it is written over, whichever worker
    decides it. Leased: each worker keeps asking after the key is spent, so it spends the
    units it holds (the clock stands still: no batch expires, no window ends, whatever the
    scheduling). Either way the workers admit exactly the limit, leased most of it from
    batches."""
    limit = NOT_REFILLING[kind][1]
    attempts = limit + UNITS  # each worker goes on past the end of the quota
    results = FORK.Queue()
    procs = [
        FORK.Process(target=_hammer, args=(str(state_dir), kind, workers, lease, attempts, results))
        for _ in range(workers)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    outcomes = [results.get(timeout=5) for _ in procs]
    assert sum(admitted for admitted, _ in outcomes) == limit
    from_batches = sum(from_batches for _, from_batches in outcomes)
    assert from_batches > limit // 2 if lease else from_batches == 0


def _trace(algorithm: Algorithm[Any], path: Path, lease: bool, seconds: float = 4.0) -> list[int]:
    """A request every millisecond on one key, through a store that believes it is one of two
    workers; the instants (µs) of the admitted ones."""
    clock = FakeClock()
    store = SharedStore(
        path,
        clock,
        workers=2,
        lease_units=UNITS if lease else 0,
        lease_interval_s=INTERVAL_S,
    )
    limit = compiled("hot", algorithm, ("global",))
    store.configure([limit], ())
    check = [Check(limit, "global")]
    admitted = []
    for _ in range(round(seconds * 1000)):
        if store.decide_now(check).allowed:
            admitted.append(clock.now_us())
        clock.advance(us=1000)
    asyncio.run(store.close())
    return admitted


def _most_in_a_span(instants: Sequence[int], span_us: int) -> int:
    """The most instants within any span of ``span_us`` (both ends included)."""
    most = start = 0
    for end, at in enumerate(instants):
        while at - instants[start] > span_us:
            start += 1
        most = max(most, end - start + 1)
    return most


BUCKETS: dict[str, Algorithm[Any]] = {
    "leaky_bucket": LeakyBucket(100, 1, 399, None),
    "token_bucket": TokenBucket(100, 1, 400),
}


@pytest.mark.parametrize("kind", sorted(BUCKETS))
def test_a_leased_bucket_admits_at_most_what_it_admits_over_the_span_and_the_interval(
    tmp_path: Path, kind: str
) -> None:
    """Over any span T the leased bucket admits at most what the exact one admits over T +
    interval; over the whole trace at least the exact count less two workers' batches."""
    algorithm = BUCKETS[kind]
    exact = _trace(algorithm, tmp_path / "exact", lease=False)
    leased = _trace(algorithm, tmp_path / "leased", lease=True)
    interval_us = round(INTERVAL_S * 1e6)
    for span_us in (10_000, 50_000, 200_000, 1_000_000, 3_000_000):
        assert _most_in_a_span(leased, span_us) <= _most_in_a_span(exact, span_us + interval_us)
    cap = lease_kind(compiled("hot", algorithm), UNITS, 2).cap
    assert cap > 1
    assert len(leased) >= len(exact) - 2 * cap
    assert leased != exact  # batches were taken: the verdicts moved (within the bound)


WINDOWS: dict[str, Algorithm[Any]] = {
    "fixed_window": FixedWindow(200, 1.0),
    "sliding_window": SlidingWindow(200, 1.0),
}


@pytest.mark.parametrize("kind", sorted(WINDOWS))
def test_a_leased_window_never_admits_more_than_the_limit(tmp_path: Path, kind: str) -> None:
    """Each unit is admitted in the window that counted it: per window never more than the
    limit (a sliding window's weighted count at every admission too), and no fewer than the
    exact window on the same trace less two workers' batches."""
    algorithm = WINDOWS[kind]
    leased = _trace(algorithm, tmp_path / "leased", lease=True, seconds=3.5)
    exact = _trace(algorithm, tmp_path / "exact", lease=False, seconds=3.5)
    per_window: dict[int, int] = {}
    for at in leased:
        per_window[at // 1_000_000] = per_window.get(at // 1_000_000, 0) + 1
    assert max(per_window.values()) <= 200
    if isinstance(algorithm, SlidingWindow):
        counted: dict[int, int] = {}
        for at in leased:
            index, elapsed = divmod(at, 1_000_000)
            counted[index] = counted.get(index, 0) + 1
            previous = counted.get(index - 1, 0)
            assert previous * (1_000_000 - elapsed) // 1_000_000 + counted[index] <= 200
    cap = lease_kind(compiled("hot", algorithm), UNITS, 2).cap
    assert len(leased) >= len(exact) - 2 * cap * len(per_window)


def test_what_is_leased_and_the_bound_explain_states() -> None:
    """Windows and buckets in reject or nodelay mode are leased, with their bound; a leaky
    bucket that delays, and a limit too small for a batch per worker, are decided exactly."""
    window = compiled("w", SlidingWindow(1000, 1.0))
    assert lease_kind(window, UNITS, 8).cap == 31  # 1000 // (4 x 8)
    assert "never more than the limit per window" in (bound_text(window, UNITS, 0.01, 8) or "")
    bucket = compiled("b", LeakyBucket(100, 1, 10_000, None))
    assert "rate x 10 ms" in (bound_text(bucket, UNITS, 0.01, 8) or "")
    assert bound_text(compiled("d", LeakyBucket(100, 1, 10_000, 5)), UNITS, 0.01, 8) is None
    assert bound_text(compiled("s", FixedWindow(50, 1.0)), UNITS, 0.01, 8) is None


def _store(path: str) -> SharedStore:
    return SharedStore(
        Path(path), FakeClock(), workers=2, lease_units=UNITS, lease_interval_s=INTERVAL_S
    )


RESET_LIMIT = 400


def _leasing_worker(path: str, held: Any, reset: Any, results: Any) -> None:
    """A worker that holds a batch of the hot key, then decides it on after the reset."""

    async def run() -> tuple[int, int, int]:
        store = _store(path)
        limit = compiled("hot", FixedWindow(RESET_LIMIT, 3600.0), ("global",))
        store.configure([limit], ())
        check = Check(limit, "global")
        assert store.leases is not None
        units = 0
        for _ in range(100):  # the key met again and again: batches, until one has units
            assert (await store.decide([check])).allowed
            lease = store.leases.at_hand(check, store.clock.now_us())
            units = 0 if lease is None else lease.units
            if units >= 4:
                break
        held.set()
        assert reset.wait(30)
        assert isinstance(store.clock, FakeClock)
        store.clock.advance(RESET_CHECK_US / 1e6)
        admitted = 0
        for _ in range(600):
            admitted += (await store.decide([check])).allowed
        await store.close()
        return units, admitted, store.leases.decided

    results.put(asyncio.run(run()))


def _resetting_worker(path: str, held: Any, reset: Any) -> None:
    """Another worker, whose admin listener resets the key (the keys' API's ``forget``)."""
    assert held.wait(30)
    store = _store(path)
    limit = compiled("hot", FixedWindow(RESET_LIMIT, 3600.0), ("global",))
    store.configure([limit], ())
    assert store.forget(limit, "global")
    asyncio.run(store.close())
    reset.set()


def test_a_key_reset_by_one_worker_ends_the_batches_every_worker_holds(state_dir: Path) -> None:
    """The keys' API resets a key through one worker while another holds a batch of it. The
    reset reaches that batch within ``RESET_CHECK_US``: from then on the key is decided on
    its fresh state, so the window admits exactly its limit again, not the limit and the
    batch's units besides."""
    held, reset, results = FORK.Event(), FORK.Event(), FORK.Queue()
    worker = FORK.Process(target=_leasing_worker, args=(str(state_dir), held, reset, results))
    admin = FORK.Process(target=_resetting_worker, args=(str(state_dir), held, reset))
    worker.start()
    admin.start()
    try:
        units, admitted, from_batches = results.get(timeout=60)
    finally:
        for process in (worker, admin):
            process.join(30)
    assert worker.exitcode == 0 and admin.exitcode == 0
    assert units > 0  # the worker held a batch when the key was reset
    assert admitted == RESET_LIMIT  # the fresh window's limit, exactly
    assert from_batches > 300  # and still mostly from batches after the reset
