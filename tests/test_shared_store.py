"""The shared store (LMDB) on its own: the same decisions as the pure algorithms, one atomic
check-then-commit across real processes, a writer killed mid-transaction, reloads rescaled once,
and the bound on keys with least-recently-used eviction.

Processes are real (``multiprocessing`` with fork); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.leaky_bucket import LeakyBucket
from gateway.algorithms.registry import build_algorithm
from gateway.algorithms.sliding_window import SlidingWindow
from gateway.algorithms.token_bucket import TokenBucket
from gateway.clock import FakeClock
from gateway.engine.limit_engine import LimitEngine
from gateway.engine.preflight import parse_and_build
from gateway.limits.compiled import Check, CompiledLimit
from gateway.stores import LimitStore, MemoryStore, SharedStore, StoreUnavailableError
from gateway.stores.shared.records import decode_state, encode_state
from tests.support.conformance import (
    T0_US,
    Backend,
    Op,
    compiled,
    operations,
    run_against_python,
    stacks,
)
from tests.support.filesystems import small_tmpfs
from tests.support.policies import policy_for

FORK = multiprocessing.get_context("fork")


class SharedBackend(Backend):
    def make(self, fake_clock: FakeClock | None = None, **options: Any) -> LimitStore:
        # ``kind`` "shared-2w": as a worker of two decides (on a snapshot, then written).
        workers = 2 if self.kind == "shared-2w" else 1
        return SharedStore(Path(tempfile.mkdtemp(dir=self.url)), fake_clock, workers=workers)


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "limits"
    path.mkdir()
    yield path


def bounded(limit: CompiledLimit, max_keys: int) -> CompiledLimit:
    return dataclasses.replace(limit, spec=limit.spec.model_copy(update={"max_keys": max_keys}))


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(stack=stacks, ops=operations, kind=st.sampled_from(["shared", "shared-2w"]))
def test_decisions_match_the_python_algorithms(
    tmp_path: Path, stack: list[str], ops: list[Op], kind: str
) -> None:
    """As the in-process store: it drops idle keys, which no request can tell from kept ones
    while time goes forward, so the clock only goes forward here. Both request paths: one
    write transaction, and a worker's snapshot then write."""
    forward = [(max(step_us, 0), op, key, bound) for step_us, op, key, bound in ops]
    asyncio.run(run_against_python(SharedBackend(kind, str(tmp_path), None), stack, forward))


def test_states_survive_their_encoding() -> None:
    """Packed in 16 bytes when the state fits 64 bits, tagged otherwise (bytes of any length,
    those whose tagged form is 16 bytes long too)."""
    for state in (0, 1, -1, 2**44 + 17, 2**63 - 1, -(2**63), 2**63, 2**130 + 3, -(2**70),
                  b"", b"\x00\x01log", b"7 bytes", b"8 bytes!"):  # fmt: skip
        assert decode_state(encode_state(12345, state)) == (12345, state)
    assert len(encode_state(12345, 2**63 - 1)) == 16


def _hammer(path: str, rounds: int, admitted: Any, workers: int) -> None:
    """One worker: ``rounds`` requests on one key through its own store."""

    async def run() -> int:
        store = SharedStore(Path(path), workers=workers)
        store.configure(_stack(), ())
        count = 0
        for _ in range(rounds):
            checks = [Check(limit, "one") for limit in _stack()]
            count += (await store.decide(checks)).allowed
        await store.close()
        return count

    admitted.put(asyncio.run(run()))


def _stack() -> list[CompiledLimit]:
    # Nothing refills within a test (a minute): the count admitted is exact whatever the timing.
    return [
        compiled("per_ip", LeakyBucket(1, 60, 149, None)),
        compiled("route", SlidingWindow(300, 3600.0)),
        compiled("global", TokenBucket(1, 3600, 200)),
    ]


@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("optimistic", [False, True])
def test_processes_on_one_key_admit_exactly_the_limit(
    state_dir: Path, workers: int, optimistic: bool
) -> None:
    """Each process checks and commits in one write transaction (or decides on a snapshot and
    writes only if nothing it read changed): together they admit exactly what one process
    would (the leaky bucket's burst + 1), never more."""
    admitted = FORK.Queue()
    told = workers if optimistic else 1
    procs = [
        FORK.Process(target=_hammer, args=(str(state_dir), 120, admitted, told))
        for _ in range(workers)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    assert sum(admitted.get(timeout=5) for _ in procs) == 150


class _RacedStore(SharedStore):
    """A worker's store in which another request commits between its snapshot and its write
    (``race``, once): the interleaving two workers meet at random, made to happen."""

    race: list[Check] | None = None
    raced: bool | None = None

    def _read_and_decide(self, txn: Any, checks: Any, now_us: int, write: bool) -> Any:
        result = super()._read_and_decide(txn, checks, now_us, write)
        race, self.race = self.race, None
        if race is not None:
            self.raced = self._decide(race, True, now_us).allowed
        return result


async def test_a_commit_between_a_snapshot_and_its_write_is_decided_again(
    state_dir: Path,
) -> None:
    """A worker decides on a snapshot; when another request commits before it writes, what
    it read is read again under the lock and, being changed, decided again: one request of
    a limit of one is admitted, not two."""
    store = _RacedStore(state_dir, FakeClock(T0_US), workers=2)
    once = compiled("once", FixedWindow(1, 3600.0))
    store.configure([once], ())
    store.race = [Check(once, "k")]
    verdict = await store.decide([Check(once, "k")])
    assert store.raced is True  # the other request, committed first
    assert not verdict.allowed
    assert not (await store.decide([Check(once, "k")])).allowed
    # A commit that touched none of its keys: the snapshot's verdict stands.
    store.race = [Check(once, "other")]
    assert (await store.decide([Check(once, "third")])).allowed
    assert store.raced is True
    assert store.tracked_keys("once") == 3
    await store.close()


def _die_holding_the_write_lock(path: str, ready: Any) -> None:
    async def run() -> None:
        store = SharedStore(Path(path))
        store.configure(_stack(), ())
        assert (await store.decide([Check(limit, "k") for limit in _stack()])).allowed
        env = store._env  # its environment, written to directly
        assert env is not None
        txn = env.begin(write=True)
        txn.put(b"uncommitted", b"x", db=env.open_db(b"meta", txn=txn))
        ready.put(True)
        signal.pause()  # killed here, the writer's lock held and its writes uncommitted

    asyncio.run(run())


def _decide_once(path: str, result: Any) -> None:
    async def run() -> tuple[bool, int]:
        store = SharedStore(Path(path))
        store.configure(_stack(), ())
        verdict = await store.decide([Check(limit, "k") for limit in _stack()])
        return verdict.allowed, verdict.decisions[0].remaining

    result.put(asyncio.run(run()))


def test_a_writer_killed_mid_transaction_leaves_the_lock_and_state_intact(state_dir: Path) -> None:
    """LMDB's writer mutex is robust on Linux: a process SIGKILLed while it holds the write
    lock does not block the others, and what it had not committed is gone."""
    ready = FORK.Queue()
    victim = FORK.Process(target=_die_holding_the_write_lock, args=(str(state_dir), ready))
    victim.start()
    assert ready.get(timeout=20)
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    result = FORK.Queue()
    survivor = FORK.Process(target=_decide_once, args=(str(state_dir), result))
    survivor.start()
    survivor.join(20)
    alive = survivor.is_alive()
    if alive:
        survivor.kill()
    assert not alive, "the write lock of the killed process was never released"
    # The victim's committed request counts (149 of a burst of 149 + 1 left); the second
    # request is this one: 148 left.
    assert result.get(timeout=5) == (True, 148)
    env = lmdb.open(str(state_dir), max_dbs=4)
    try:
        with env.begin() as txn:
            assert txn.get(b"uncommitted", db=env.open_db(b"meta", txn=txn)) is None
    finally:
        env.close()


async def test_a_reload_rescales_once_whichever_worker_adopts_it(state_dir: Path) -> None:
    """The first ``configure`` of a new policy rescales the states (as the in-process store
    does); the same policy adopted again (by the other workers) finds it done."""
    clock = FakeClock(T0_US)
    store, reference = SharedStore(state_dir, clock), MemoryStore(clock)
    old = compiled("win", FixedWindow(10, 3600.0))
    new = compiled("win", FixedWindow(20, 3600.0))  # the same usage, twice the limit
    for each in (store, reference):
        each.configure([old], ())
        for _ in range(4):
            assert (await each.decide([Check(old, "k")])).allowed
        each.configure([new], [old])
    want = (await reference.decide([Check(new, "k")], commit=False)).decisions[0]
    assert want.remaining == 11  # rescaled: 8 of 20 used, and this request
    assert (await store.decide([Check(new, "k")], commit=False)).decisions[0] == want
    store.configure([new], [old])  # a second worker adopting the same policy
    store.configure([new], [])  # a worker restarted on it
    assert (await store.decide([Check(new, "k")], commit=False)).decisions[0] == want
    await store.close()


def _adopt_a_policy_without(path: str, name: str) -> None:
    """Another worker: adopts a policy in which the limit ``name`` is gone."""
    store = SharedStore(Path(path), workers=2)
    store.configure([compiled(f"not-{name}", FixedWindow(1, 3600.0))], ())
    asyncio.run(store.close())


@pytest.mark.parametrize("workers", [1, 2])
async def test_the_request_after_another_workers_reload_sees_it(
    state_dir: Path, workers: int
) -> None:
    """A worker reads the policy's generation again whenever another process committed since
    it last knew it (it skips the read only when nothing else committed): its first request
    after another worker's reload is decided under that reload, here one that removed the
    limit's table, so the limit's states are stored nowhere (none left in the freed table)
    until this worker adopts it."""
    store = SharedStore(state_dir, FakeClock(T0_US), workers=workers)
    once = compiled("once", FixedWindow(1, 3600.0))
    store.configure([once], ())
    freed = store._tables["once"].prefix
    # Its own commit, the latest: "a" has used its one request.
    assert (await store.decide([Check(once, "a")])).allowed
    # Spawned: a forked child would inherit this process's open environment, which LMDB
    # does not allow to be opened twice in one process.
    spawn = multiprocessing.get_context("spawn")
    other = spawn.Process(target=_adopt_a_policy_without, args=(str(state_dir), "once"))
    other.start()
    other.join(60)
    assert other.exitcode == 0
    for key in ("b", "a", "b"):
        assert (await store.decide([Check(once, key)])).allowed
        env = store._env
        assert env is not None
        with env.begin(db=store._state) as txn, txn.cursor() as cursor:
            assert not (cursor.set_range(freed) and cursor.key().startswith(freed))
    assert store.tracked_keys("once") == 0
    await store.close()


@pytest.mark.parametrize("kind", ["memory", "shared", "shared-2w"])
async def test_equal_delays_name_the_later_limit_and_a_rejection_charges_none(
    state_dir: Path, kind: str
) -> None:
    """Each store's own pass over the checks makes the verdict as ``combine`` does: of two
    limits delaying a request equally the later is named (nginx's account loop), and a
    request a later limit rejects leaves the earlier limits' states as they were (a lone
    process on the shared store writes each state as it decides it, then aborts)."""
    store: LimitStore
    if kind == "memory":
        store = MemoryStore(FakeClock(T0_US))
    else:
        store = SharedStore(state_dir, FakeClock(T0_US), workers=2 if kind == "shared-2w" else 1)
    first = compiled("first", LeakyBucket(1, 1, 5, 0))
    second = compiled("second", LeakyBucket(1, 1, 5, 0))
    store.configure([first, second], ())
    checks = [Check(first, "k"), Check(second, "k")]
    assert (await store.decide(checks)).delayed_by is None  # a new key's first request
    verdict = await store.decide(checks)
    assert verdict.delay_s == 1.0 and verdict.delayed_by == 1
    once = compiled("once", FixedWindow(1, 3600.0))
    roomy = compiled("roomy", FixedWindow(2, 3600.0))
    store.configure([once, roomy], [first, second])
    assert (await store.decide([Check(roomy, "a"), Check(once, "a")])).allowed
    for _ in range(3):
        verdict = await store.decide([Check(roomy, "a"), Check(once, "a")])
        assert not verdict.allowed and verdict.rejected_by == (1,)
    assert (await store.decide([Check(roomy, "a")])).allowed  # its second unit, still there
    assert not (await store.decide([Check(roomy, "a")])).allowed
    await store.close()


@pytest.mark.parametrize("workers", [1, 2])
async def test_keys_that_are_not_utf8_and_long_keys_are_stored_apart(
    state_dir: Path, workers: int
) -> None:
    """A header value that was not UTF-8 reaches a key as lone surrogates (decoded with
    ``surrogateescape``); keys over the LMDB bound are stored by their hash. Each is its own
    key, found again by the next request."""
    store = SharedStore(state_dir, FakeClock(T0_US), workers=workers)
    once = compiled("once", FixedWindow(1, 3600.0))
    store.configure([once], ())
    keys = ["caf\udce9", "caf\udce8", "x" * 1000, "x" * 999 + "y", "café"]
    for key in keys:
        assert (await store.decide([Check(once, key)])).allowed, key
    for key in keys:
        assert not (await store.decide([Check(once, key)])).allowed, key
    assert store.tracked_keys("once") == len(keys)
    await store.close()


async def test_a_limit_given_another_key_starts_afresh_and_a_removed_one_is_freed(
    state_dir: Path,
) -> None:
    store = SharedStore(state_dir, FakeClock(T0_US))
    old = compiled("win", FixedWindow(2, 3600.0))
    store.configure([old], ())
    for _ in range(2):
        assert (await store.decide([Check(old, "k")])).allowed
    assert not (await store.decide([Check(old, "k")])).allowed
    other = compiled("win", FixedWindow(2, 3600.0), key=("header:X-Key",))
    store.configure([other], [old])
    assert (await store.decide([Check(other, "k")])).allowed
    assert store.tracked_keys("win") == 1
    store.configure([], [other])
    assert store.tracked_keys("win") == 0
    await store.close()


async def test_a_full_table_evicts_its_least_recently_used_keys(state_dir: Path) -> None:
    clock = FakeClock(T0_US)
    store = SharedStore(state_dir, clock)
    limit = bounded(compiled("small", FixedWindow(100, 3600.0)), 50)
    store.configure([limit], ())
    for index in range(200):
        assert (await store.decide([Check(limit, f"k{index}")])).allowed
        clock.advance(0.2)  # another LRU tick for every key
        if index % 10 == 0:
            # k0 is used again and again: it is never the least recently used.
            assert (await store.decide([Check(limit, "k0")])).allowed
    assert store.tracked_keys("small") == 50
    assert store.evictions("small") == 150
    # The 49 most recent keys and k0 kept, with their counts; the others start afresh.
    for index in range(151, 200):
        verdict = await store.decide([Check(limit, f"k{index}")], commit=False)
        assert verdict.decisions[0].remaining == 98
    assert (await store.decide([Check(limit, "k0")], commit=False)).decisions[0].remaining < 90
    fresh = await store.decide([Check(limit, "k150")], commit=False)
    assert fresh.decisions[0].remaining == 99
    await store.close()


async def test_idle_keys_make_room_without_counting_as_evictions(state_dir: Path) -> None:
    """A full table's least recently used key makes room for a new one; when its state is
    idle (a fresh key would have the same), that is an expiry, no eviction."""
    clock = FakeClock(T0_US)
    store = SharedStore(state_dir, clock)
    limit = bounded(compiled("fast", LeakyBucket(10, 1, 0, None)), 10)
    store.configure([limit], ())
    for index in range(10):
        assert (await store.decide([Check(limit, f"k{index}")])).allowed
    assert store.tracked_keys("fast") == 10  # all busy: nothing expired yet
    clock.advance(1.0)  # every key idle (drained)
    for index in range(10, 15):  # each new key drops two idle ones
        assert (await store.decide([Check(limit, f"k{index}")])).allowed
    assert (store.tracked_keys("fast"), store.evictions("fast")) == (5, 0)
    assert store._counts_of("fast") == (5, 0, 10)  # keys, evictions, expiries
    await store.close()


async def test_idle_keys_expire_before_the_table_is_full(state_dir: Path) -> None:
    """Each new key drops up to two idle least recently used keys (as nginx does), so a
    table of a thousand keys does not fill with clients long gone; busy keys stay, and
    dropping idle ones changes no decision."""
    clock = FakeClock(T0_US)
    store, reference = SharedStore(state_dir, clock), MemoryStore(clock)
    limit = bounded(compiled("fast", LeakyBucket(10, 1, 2, None)), 1000)
    for each in (store, reference):
        each.configure([limit], ())
    for index in range(100):
        for each in (store, reference):
            assert (await each.decide([Check(limit, f"k{index}")])).allowed
        clock.advance(1.0)  # the key just used is idle by the next one's turn
    assert store.tracked_keys("fast") == 1  # the last: the 99 before it expired
    assert store.evictions("fast") == 0
    assert store._counts_of("fast") == (1, 0, 99)
    # Busy keys (used within the last 100 ms) are not dropped by a new key.
    for name in ("a", "b", "a", "c", "d"):
        for each in (store, reference):
            verdict = await each.decide([Check(limit, name)])
        assert verdict.allowed
    assert store.tracked_keys("fast") == 4  # k99 expired; a, b, c, d busy
    for name in ("a", "b", "k5"):
        want = (await reference.decide([Check(limit, name)], commit=False)).decisions[0]
        assert (await store.decide([Check(limit, name)], commit=False)).decisions[0] == want
    await store.close()


async def test_keys_used_lately_are_not_expired_even_when_idle(state_dir: Path) -> None:
    """A key used in the last LRU tick or two stays even if its state has drained already
    (a high rate): dropping it would have its next request count it in again, for nothing."""
    clock = FakeClock(T0_US)
    store = SharedStore(state_dir, clock)
    fast = bounded(compiled("fast", LeakyBucket(1000, 1, 0, None)), 1000)  # idle after 1 ms
    store.configure([fast], ())
    for index in range(5):
        assert (await store.decide([Check(fast, f"k{index}")])).allowed
        clock.advance(0.01)
    assert store._counts_of("fast") == (5, 0, 0)
    clock.advance(1.0)
    assert (await store.decide([Check(fast, "late")])).allowed
    assert store._counts_of("fast") == (4, 0, 2)  # the two oldest, idle and long unused
    await store.close()


def _tiered(store: LimitStore, path: Path) -> CompiledLimit:
    """A policy's limit with two plans (variant tables ``per_key~gold``, ``per_key~silver``),
    configured in ``store``."""
    policy = parse_and_build(
        policy_for(
            "http://127.0.0.1:9",
            "limits:\n  per_key:\n    algorithm: fixed_window\n    limit: 5\n    window: 1h\n"
            "    key: ['header:X-Api-Key']\n    max_keys: 3\n"
            "    plans:\n      gold: {limit: 50}\n      silver: {limit: 20}\n"
            "    overrides:\n      key-gold: gold\n      key-silver: silver\n",
        ),
        str(path),
    ).policy
    limits = LimitEngine(policy, store, build_algorithm).limits
    store.configure(limits, ())
    return limits[0]


@pytest.mark.parametrize("kind", ["memory", "shared"])
async def test_a_limits_counts_include_its_plans_tables(state_dir: Path, kind: str) -> None:
    """Tracked keys and evictions of a limit count its own table and its plans' (one table
    each), as the in-process store counts them."""
    clock = FakeClock(T0_US)
    store: LimitStore = MemoryStore(clock) if kind == "memory" else SharedStore(state_dir, clock)
    limit = _tiered(store, state_dir / "policy.yaml")
    assert limit.tiering is not None and limit.tiering.overrides is not None
    gold, silver = limit.tiering.overrides.variants
    assert (gold.table, silver.table) == ("per_key~gold", "per_key~silver")
    for index in range(5):  # 5 keys in each table of 3: 2 evictions each
        for each in (limit, gold, silver):
            assert (await store.decide([Check(each, f"k{index}")])).allowed
    assert store.tracked_keys("per_key") == 9
    assert store.evictions("per_key") == 6
    await store.close()


async def test_evictions_never_go_down_when_a_reload_starts_a_limit_afresh(
    state_dir: Path,
) -> None:
    """/metrics exports evictions as a counter: a reload that gives a limit a new table (a
    different key) or removes it keeps the count the old table reached, as in process."""
    clock = FakeClock(T0_US)
    store = SharedStore(state_dir, clock)
    old = bounded(compiled("small", FixedWindow(100, 3600.0)), 2)
    store.configure([old], ())
    for index in range(6):
        assert (await store.decide([Check(old, f"k{index}")])).allowed
    assert store.evictions("small") == 4
    new = bounded(compiled("small", FixedWindow(100, 3600.0), key=("header:X-Key",)), 2)
    store.configure([new], [old])  # another key: the limit starts afresh in a new table
    assert store.evictions("small") == 4
    assert store.tracked_keys("small") == 0
    for index in range(6):
        assert (await store.decide([Check(new, f"k{index}")])).allowed
    assert store.evictions("small") == 8
    store.configure([], [new])  # the limit removed
    assert store.evictions("small") == 8
    store.configure([old], [])  # and back
    assert store.evictions("small") == 8
    # A limit whose name begins with another's is not counted with it.
    assert store.evictions("smal") == 0
    await store.close()


async def test_memory_per_key_bounds_a_million_keys(state_dir: Path) -> None:
    """The map is sized from ``max_keys``: the pages 10,000 keys take (the figure per key, with
    keys as long as an IPv6 address) times a million stays within the map a million keys get,
    and churn through twice the bound takes no more pages than the bound (freed pages are
    used again)."""
    from gateway.stores.shared.lmdb_store import MAP_BYTES_BASE, MAP_BYTES_PER_KEY

    clock = FakeClock(T0_US)
    store = SharedStore(state_dir, clock)
    limit = bounded(compiled("per_ip", LeakyBucket(1, 60, 10, None)), 10_000)
    store.configure([limit], ())

    def pages_used() -> int:
        assert store._env is not None
        return int(store._env.info()["last_pgno"]) + 1

    for index in range(30_000):
        key = f"2001:db8:85a3::8a2e:370:{index:x}"
        assert (await store.decide([Check(limit, key)])).allowed
        if index % 1000 == 999:
            clock.advance(0.2)
        if index == 9_999:
            full = pages_used()
    assert store.tracked_keys("per_ip") == 10_000
    assert store.evictions("per_ip") == 20_000
    assert store._env is not None
    per_key = full * store._env.stat()["psize"] / 10_000
    assert pages_used() < 1.5 * full
    await store.close()
    assert per_key < MAP_BYTES_PER_KEY / 4  # room to spare in the map
    assert per_key * 1_000_000 < MAP_BYTES_BASE + MAP_BYTES_PER_KEY * 1_000_000


LONG = 380  # bytes of key: about 1.5 KiB of map a key (state, LRU entry, B+tree)


def _long_key(index: int) -> str:
    return f"{index:0{LONG}d}"


def _write_keys(path: str, keys: int, done: Any) -> None:
    async def run() -> None:
        store = SharedStore(Path(path), workers=2)
        store.configure([bounded(limit, 200_000) for limit in _stack()], ())
        for index in range(keys):
            assert (await store.decide([Check(_stack()[0], _long_key(index))])).allowed
        assert store._env is not None
        done.put(store._env.info()["map_size"])
        await store.close()

    asyncio.run(run())


async def test_the_map_grows_in_steps_each_reserved_first(state_dir: Path) -> None:
    """The map starts at its first size and doubles as keys fill it; every size it takes is
    allocated on the filesystem first (the data file's blocks), so no page LMDB writes
    through the map can lack one."""
    from gateway.stores.shared.space import FIRST_MAP_BYTES

    store = SharedStore(state_dir, FakeClock(T0_US))
    limit = bounded(compiled("per_ip", LeakyBucket(1, 60, 10, None)), 100_000)
    store.configure([limit], ())
    assert store._env is not None
    sizes = [store._env.info()["map_size"]]
    for index in range(15_000):
        assert (await store.decide([Check(limit, _long_key(index))])).allowed
        size = store._env.info()["map_size"]
        if size != sizes[-1]:
            sizes.append(size)
            data = os.stat(state_dir / "data.mdb")
            assert data.st_size == size and data.st_blocks * 512 >= size
    assert store.tracked_keys("per_ip") == 15_000
    assert sizes[:3] == [FIRST_MAP_BYTES, 2 * FIRST_MAP_BYTES, 4 * FIRST_MAP_BYTES], sizes
    assert store.stats.state == "ok" and store.stats.errors == 0
    await store.close()


async def test_a_worker_adopts_the_map_another_grew(state_dir: Path) -> None:
    """Another worker grows the map as its keys fill it; this one goes on deciding, and maps
    as much (the size reserved) when it next begins a transaction."""
    store = SharedStore(state_dir, workers=2)
    store.configure([bounded(limit, 200_000) for limit in _stack()], ())
    assert store._env is not None
    before = store._env.info()["map_size"]
    # Spawned: a forked child would inherit this process's handle on the environment.
    spawn = multiprocessing.get_context("spawn")
    done = spawn.Queue()
    other = spawn.Process(target=_write_keys, args=(str(state_dir), 12_000, done))
    other.start()
    grown = done.get(timeout=120)
    other.join(10)
    assert grown > before
    limit = bounded(_stack()[0], 200_000)
    assert (await store.decide([Check(limit, "k")])).allowed
    assert store._env.info()["map_size"] == grown == os.stat(state_dir / "data.mdb").st_size
    assert store.tracked_keys("per_ip") == 12_001
    await store.close()


def _fill_a_full_disk(path: str, on_failure: str, results: Any) -> None:
    """In a child process (a SIGBUS ends it, not the test run): new keys until the map must
    grow on a filesystem with no room for it, then room made again."""
    from tests.support.filesystems import fill_to

    async def run() -> dict[str, Any]:
        # A fake clock: the thousands of decisions take seconds, and on the real clock an
        # hour's end between the known key's first request and its last four starts it afresh.
        store = SharedStore(Path(path) / "limits", FakeClock(T0_US), on_failure=on_failure)
        limit = bounded(compiled("per_ip", FixedWindow(3, 3600.0)), 100_000)
        store.configure([limit], ())
        filler = fill_to(Path(path), 256 << 10)
        found: dict[str, Any] = {"allowed": 0, "unavailable": 0}
        for index in range(8_000):
            try:
                found["allowed"] += (await store.decide([Check(limit, _long_key(index))])).allowed
            except StoreUnavailableError:
                found["unavailable"] += 1
        # A known key still counts: its state has its pages.
        known = [(await store.decide([Check(limit, _long_key(0))])).allowed for _ in range(4)]
        found.update(
            known=known,
            tracked=store.tracked_keys("per_ip"),
            state=store.stats.state,
            errors=store.stats.errors,
        )
        filler.unlink()
        found["after"] = (await store.decide([Check(limit, "new after room")])).allowed
        found["state_after"] = store.stats.state
        await store.close()
        return found

    results.put(asyncio.run(run()))


@pytest.mark.reliability
@pytest.mark.parametrize("on_failure", ["local", "deny"])
def test_a_full_disk_never_crashes_a_decision(tmp_path: Path, on_failure: str) -> None:
    """On a 20 MiB tmpfs filled but for 256 KiB: the map cannot grow past its first 8 MiB.
    Requests for new keys past that are decided on the state as it is and not written
    (``deny``: refused as the store unavailable), known keys stay exact, the store's state is
    ``fallback`` with the reason; with room again the map grows and the state is ``ok``.
    Before the map was reserved, LMDB wrote a page the tmpfs could not back: SIGBUS."""
    with small_tmpfs(tmp_path / "small", "20m") as small:
        spawn = multiprocessing.get_context("spawn")
        results = spawn.Queue()
        child = spawn.Process(target=_fill_a_full_disk, args=(str(small), on_failure, results))
        child.start()
        child.join(120)
        assert child.exitcode == 0, f"the child ended with {child.exitcode} (-7: SIGBUS)"
        found = results.get(timeout=5)
    print(f"\n{on_failure}: {found}")
    assert 3_000 < found["tracked"] < 8_000  # what 8 MiB holds; the rest had no room
    if on_failure == "deny":
        assert found["allowed"] == found["tracked"]
        assert found["unavailable"] == 8_000 - found["tracked"] == found["errors"]
    else:
        assert found["allowed"] == 8_000 and found["errors"] == 8_000 - found["tracked"]
    assert found["known"] == [True, True, False, False]  # 3 a window, the first counted
    assert found["state"] == "fallback"
    assert found["after"] is True and found["state_after"] == "ok"
