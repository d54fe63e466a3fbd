"""The in-process store across reloads: refunds and eviction counts of limits a reload replaced."""

from __future__ import annotations

from gateway.stores import MemoryStore


async def test_a_refund_under_a_limit_a_reload_replaced_leaves_the_new_state_alone() -> None:
    """A queued request's charge belongs to the limit it was decided under. If a reload has
    since removed that limit, or given its name another algorithm, the refund gives nothing:
    the old algorithm's arithmetic on the new algorithm's state would corrupt it."""
    from gateway.algorithms.leaky_bucket import LeakyBucket
    from gateway.algorithms.token_bucket import TokenBucket
    from gateway.clock import FakeClock
    from gateway.limits.compiled import Check
    from tests.support.conformance import compiled

    store = MemoryStore(FakeClock())
    old = compiled("shaped", TokenBucket(1, 1, 1, mode="queue"))
    assert (await store.decide([Check(old, "k")])).allowed
    new = compiled("shaped", LeakyBucket(1, 60, 2, None))
    store.configure([new], [old])  # another algorithm under the same name: starts afresh
    assert (await store.decide([Check(new, "k")])).allowed
    before = store.tables["shaped"].peek("k")
    await store.refund([Check(old, "k")], charged_us=None)
    assert store.tables["shaped"].peek("k") == before
    store.configure([], [new])  # the limit removed
    await store.refund([Check(new, "k")])
    assert "shaped" not in store.tables


async def test_evictions_never_go_down_when_a_reload_starts_a_limit_afresh() -> None:
    """/metrics exports evictions as a counter: a reload that gives a limit a new table (a
    different key) or removes it keeps the count the old table reached."""
    import dataclasses

    from gateway.algorithms.fixed_window import FixedWindow
    from gateway.clock import FakeClock
    from gateway.limits.compiled import Check, CompiledLimit
    from tests.support.conformance import compiled

    def two_keys(limit: CompiledLimit) -> CompiledLimit:
        return dataclasses.replace(limit, spec=limit.spec.model_copy(update={"max_keys": 2}))

    store = MemoryStore(FakeClock())
    old = two_keys(compiled("small", FixedWindow(100, 3600.0)))
    for index in range(6):
        assert (await store.decide([Check(old, f"k{index}")])).allowed
    evicted = store.evictions("small")
    assert evicted >= 1
    new = two_keys(compiled("small", FixedWindow(100, 3600.0), key=("header:X-Key",)))
    store.configure([new], [old])  # another key: the limit starts afresh in a new table
    assert store.evictions("small") == evicted
    for index in range(6):
        assert (await store.decide([Check(new, f"k{index}")])).allowed
    assert store.evictions("small") == 2 * evicted
    store.configure([], [new])  # the limit removed
    assert store.evictions("small") == 2 * evicted


def test_every_algorithm_is_decided_through_the_native_base() -> None:
    """The stores' request path calls ``CompiledLimit.decides``: every algorithm the policy
    builds derives from ``Decides`` (compiled, a C call through its method table, not a
    Python method call through the ``Algorithm`` protocol), and is that object itself."""
    from gateway.algorithms.base import Decides
    from gateway.algorithms.calendar_window import CalendarWindow
    from gateway.algorithms.concurrency import Concurrency
    from gateway.algorithms.fixed_window import FixedWindow
    from gateway.algorithms.leaky_bucket import LeakyBucket
    from gateway.algorithms.sliding_log import SlidingLog
    from gateway.algorithms.sliding_window import SlidingWindow
    from gateway.algorithms.token_bucket import token_bucket
    from tests.support.conformance import compiled

    algorithms = [
        LeakyBucket(10),
        FixedWindow(10, 60.0),
        SlidingWindow(10, 60.0),
        SlidingLog(10, 60.0),
        token_bucket(10, 1, 5),
        token_bucket(10, 1, 1, warmup_s=10.0),
        Concurrency(10),
        CalendarWindow(10, "1mo"),
    ]
    for algorithm in algorithms:
        assert isinstance(algorithm, Decides), algorithm
        assert compiled("l", algorithm).decides is algorithm


class _FromElsewhere:
    """An algorithm that implements the ``Algorithm`` protocol without deriving from
    ``Decides`` (a plugin's, say): the parts the store uses, around a leaky bucket."""

    def __init__(self) -> None:
        from gateway.algorithms.leaky_bucket import LeakyBucket

        self.inner = LeakyBucket(1, 1, 2, None)

    @property
    def name(self) -> str:
        return "from_elsewhere"

    def decide(self, state: int | None, now_us: int, cost: int = 1) -> tuple[object, int | None]:
        return self.inner.decide(state, now_us, cost)

    def is_idle(self, state: int, now_us: int) -> bool:
        return self.inner.is_idle(state, now_us)


async def test_an_algorithm_not_derived_from_the_native_base_decides_alike() -> None:
    """One that does not derive from ``Decides`` is decided through the protocol
    (``ByProtocol``), with the same verdicts as the algorithm it stands for."""
    from typing import Any, cast

    from gateway.algorithms.base import Algorithm, ByProtocol
    from gateway.algorithms.leaky_bucket import LeakyBucket
    from gateway.clock import FakeClock
    from gateway.limits.compiled import Check
    from tests.support.conformance import compiled

    outside = compiled("outside", cast(Algorithm[Any], _FromElsewhere()))
    assert isinstance(outside.decides, ByProtocol)
    native = compiled("native", LeakyBucket(1, 1, 2, None))
    clock = FakeClock()
    store = MemoryStore(clock)
    for step in range(8):
        verdicts = [await store.decide([Check(limit, "k")]) for limit in (outside, native)]
        assert verdicts[0].decisions == verdicts[1].decisions, step
        assert verdicts[0].allowed == (step < 3)


def test_the_store_reads_its_clock_through_the_native_base() -> None:
    """The gateway's clocks derive from ``Reads`` (compiled, a C call per decision); a clock
    that only implements the protocol (a test's) is read through it, to the same instants."""
    from gateway.algorithms.fixed_window import FixedWindow
    from gateway.clock import FakeClock, MonotonicClock, ReadByProtocol, Reads
    from gateway.limits.compiled import Check
    from tests.support.conformance import compiled

    class Stepping:
        """A clock of the protocol only: each read a microsecond on."""

        def __init__(self) -> None:
            self.at_us = 3_000_000

        def now_us(self) -> int:
            self.at_us += 1
            return self.at_us

        def unix_us(self) -> int:
            return self.now_us()

    assert isinstance(MonotonicClock(), Reads)
    native = MemoryStore(FakeClock(3_000_001))
    assert native._reads is native.clock
    outside = MemoryStore(Stepping())
    assert isinstance(outside._reads, ReadByProtocol)
    limit = compiled("l", FixedWindow(5, 1.0))
    assert outside.decide_now([Check(limit, "k")]).now_us == 3_000_001
    assert native.decide_now([Check(limit, "k")]).now_us == 3_000_001
