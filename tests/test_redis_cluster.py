"""The Redis store on real clusters whose topology is new or changing, decision by decision.

Every test drives one trace (three clients at about 22, 12.5 and 7.7 requests a second, six
seconds of an injected clock) through a ``RedisStore`` on a cluster and through the in-process
``MemoryStore``, and compares every verdict exactly: a freshly created cluster met by its
first client; a slot migrated between masters under load (ASK, then MOVED); a replica
promoted by ``CLUSTER FAILOVER``, and a killed master (calls fail while the cluster has no
owner for the slot, and are failures, never verdicts). Both clients: ``thin`` and ``redis-py``.

Calls for different clients go out together (one pipeline per node); the calls of one key are
issued in order, each with its own instant, so the exact answer does not depend on timing.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from gateway.algorithms.combine import CombinedDecision
from gateway.algorithms.leaky_bucket import LeakyBucket
from gateway.clock import FakeClock
from gateway.limits.compiled import Check, CompiledLimit
from gateway.stores import MemoryStore, RedisStore, StoreUnavailableError
from gateway.stores.redis.store import StoreReplyError
from gateway.stores.redis.store import _checked as checked
from tests.support.conformance import T0_US, compiled
from tests.support.redis_harness import RedisClusterHarness, RedisServer, key_prefixes

CLIENTS = ("thin", "redis-py")
RATES = {"a": 22.0, "b": 12.5, "c": 7.7}
TRACE_S = 6.0
_prefixes = key_prefixes()


def trace() -> list[tuple[int, str]]:
    """(instant in us from the start, client), in time order."""
    events = []
    for offset, (client, rate) in enumerate(RATES.items()):
        count = int(TRACE_S * rate)
        events += [(round(i * 1e6 / rate) + offset * 997, client) for i in range(count)]
    return sorted(events)


def per_client() -> CompiledLimit:
    # nginx's limit_req rate=10r/s burst=5: every excess request delayed.
    return compiled("per_client", LeakyBucket(10, 1, 5, 0), ("header:x-client",))


def global_limit() -> CompiledLimit:
    return compiled("global", LeakyBucket(25, 1, 10, 5), ("global",))


def summary(verdict: CombinedDecision) -> tuple[bool, float, float]:
    return verdict.allowed, round(verdict.delay_s, 6), round(verdict.retry_after_s, 6)


class Instants:
    """The store's clock: each script call reads the next instant queued (so calls queued
    together still carry their own), the last one once they are used up."""

    def __init__(self, start_us: int) -> None:
        self.queued: deque[int] = deque()
        self.last_us = start_us

    def set(self, now_us: int) -> None:
        self.queued.clear()
        self.last_us = now_us

    def advance(self, seconds: float) -> None:
        self.set(self.last_us + round(seconds * 1e6))

    def now_us(self) -> int:
        if self.queued:
            self.last_us = self.queued.popleft()
        return self.last_us


class Run:
    """One policy's trace through a Redis store and the in-process store, side by side."""

    def __init__(self, url: str, client: str, limits: list[CompiledLimit], **options: object):
        self.limits = limits
        self.clock = Instants(T0_US)
        self.memory_clock = FakeClock(T0_US)
        self.memory = MemoryStore(self.memory_clock)
        self.memory.configure(limits, [])
        options.setdefault("timeout_s", 2.0)  # behaviour, not timeouts, on a busy machine
        self.store = RedisStore(
            url,
            client=client,  # type: ignore[arg-type]
            key_prefix=f"c{next(_prefixes)}:",
            time_source=self.clock,
            **options,  # type: ignore[arg-type]
        )
        self.store.configure(limits, [])
        self.compared = 0
        self.mismatches: list[str] = []
        self.failed = 0
        self.admitted_redis = 0
        self.admitted_memory = 0

    def checks(self, client: str) -> list[Check]:
        return [
            Check(limit, client if "x-client" in limit.spec.key[0] else "") for limit in self.limits
        ]

    def redis_key(self, client: str) -> str:
        return self.store.redis_key(self.checks(client)[0])

    async def step(self, events: list[tuple[int, str]], *, failures_ok: bool = False) -> None:
        """Issue ``events`` (distinct clients) together, then compare each verdict."""
        self.clock.queued.extend(T0_US + at_us for at_us, _ in events)
        # The calls start in order within one turn of the loop: one pipeline per node.
        results = await asyncio.gather(
            *[self.store.decide(self.checks(client)) for _, client in events],
            return_exceptions=True,
        )
        # A call the open circuit refused read none: the calls before it read their own.
        self.clock.queued.clear()
        for (at_us, client), got in zip(events, results, strict=True):
            if isinstance(got, StoreUnavailableError) and failures_ok:
                self.failed += 1  # never charged anywhere: the memory store skips it too
                continue
            if isinstance(got, BaseException):
                raise got
            self.memory_clock.set(T0_US + at_us)
            want = await self.memory.decide(self.checks(client))
            self.compared += 1
            self.admitted_redis += got.allowed
            self.admitted_memory += want.allowed
            if summary(got) != summary(want):
                self.mismatches.append(f"{at_us} {client}: {summary(got)} != {summary(want)}")

    async def close(self) -> None:
        await self.store.close()


def batches(events: list[tuple[int, str]], stacked: bool) -> Iterator[list[tuple[int, str]]]:
    """Consecutive events with distinct keys go together (with the global limit every call
    has the same key: one at a time, so each key's calls run in order)."""
    batch: list[tuple[int, str]] = []
    for event in events:
        if stacked or any(event[1] == other[1] for other in batch):
            if batch:
                yield batch
            batch = []
        batch.append(event)
    if batch:
        yield batch


async def run_trace(
    runs: list[tuple[Run, bool]],
    hooks: dict[int, Callable[[], Awaitable[None] | None]] | None = None,
    *,
    failures_ok: bool = False,
) -> None:
    """The trace through every run at once, each store prepared first as the gateway does
    before it listens; ``hooks[i]`` runs before the i-th event."""
    for run, _ in runs:
        await run.store.prepare()
    events = trace()
    hooks = hooks or {}
    index = 0
    plans = [list(batches(events, stacked)) for _, stacked in runs]
    cursors = [0] * len(runs)
    sent = [0] * len(runs)
    while index < len(events):
        hook = hooks.get(index)
        if hook is not None:
            done = hook()
            if done is not None:
                await done
        # Every run advances to the same event; each sends its own batches.
        target = index + 1
        steps = []
        for n, (run, _) in enumerate(runs):
            while cursors[n] < len(plans[n]) and sent[n] < target:
                sent[n] += len(plans[n][cursors[n]])
                steps.append(run.step(plans[n][cursors[n]], failures_ok=failures_ok))
                cursors[n] += 1
        await asyncio.gather(*steps)
        index = target


def assert_exact(run: Run, *, whole_trace: bool = True) -> None:
    if whole_trace:
        assert run.compared >= len(trace()) - run.failed
    assert not run.mismatches, (
        f"{len(run.mismatches)} of {run.compared} verdicts differ from the in-process store: "
        + "; ".join(run.mismatches[:5])
    )
    # Nothing admitted twice: Redis admitted exactly what the exact answer admits.
    assert run.admitted_redis == run.admitted_memory


def slot_of(key: str) -> int:
    return key_slot(key.encode())


@pytest.fixture
def fresh_cluster(tmp_path: Path) -> Iterator[RedisClusterHarness]:
    """A cluster nobody has used: its own, created for this test."""
    (tmp_path / "cluster").mkdir()
    cluster = RedisClusterHarness(tmp_path / "cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def ha_cluster(tmp_path: Path) -> Iterator[RedisClusterHarness]:
    """Three masters with a replica each, for failovers."""
    (tmp_path / "ha").mkdir()
    cluster = RedisClusterHarness(tmp_path / "ha", replicas=1)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.parametrize("client", CLIENTS)
async def test_the_first_client_of_a_fresh_cluster_decides_as_in_process(
    fresh_cluster: RedisClusterHarness, client: str
) -> None:
    """The cluster has no script loaded and the client no slot map. The store gets ready
    before the first call (slot map, every master connected, the script loaded), so no call
    is sent to the wrong node or before the script is there: none is sent twice, none is
    decided late (with Redis TIME, after calls that arrived later), and every verdict is
    exact (per-client only, and stacked)."""
    alone = Run(fresh_cluster.url, client, [per_client()])
    stacked = Run(fresh_cluster.url, client, [per_client(), global_limit()])
    try:
        await run_trace([(alone, False), (stacked, True)])
    finally:
        await alone.close()
        await stacked.close()
    for run in (alone, stacked):
        assert_exact(run)
        assert run.store.counters.failed_calls == 0
        assert run.store.counters.local_decisions == 0
        assert run.store.counters.recoveries == 0


@pytest.mark.parametrize("client", CLIENTS)
async def test_slots_migrated_under_load_keep_every_verdict_exact(
    fresh_cluster: RedisClusterHarness, client: str
) -> None:
    """Client a's slot, and the stacked limits' one slot, move to another master mid-trace:
    migrating (new keys ASKed), keys moved (ASK), then the slot reassigned (MOVED).

    The thin client follows ASK (``ASKING`` and the call on one connection) and answers every
    call. redis-py follows ASK itself but sends ``ASKING`` on another pooled connection than
    the call, which bounces back until its redirection budget is spent ("TTL exhausted"):
    those calls are failures (``on_failure``), never verdicts."""
    alone = Run(fresh_cluster.url, client, [per_client()], on_failure="deny")
    stacked = Run(fresh_cluster.url, client, [per_client(), global_limit()], on_failure="deny")
    slots = [slot_of(alone.redis_key("a")), slot_of(stacked.redis_key("a"))]
    moves = []
    for slot in slots:
        source = fresh_cluster.owner(slot)
        target = next(node for node in fresh_cluster.nodes if node is not source)
        moves.append((slot, source, target))
    moved: list[int] = []

    def begin() -> None:
        for slot, source, target in moves:
            fresh_cluster.begin_migration(slot, source, target)

    def move() -> None:
        moved.extend(fresh_cluster.move_keys(slot, src, dst) for slot, src, dst in moves)

    def end() -> None:
        for slot, _, target in moves:
            fresh_cluster.end_migration(slot, target)

    events = len(trace())
    try:
        await run_trace(
            [(alone, False), (stacked, True)],
            {events // 4: begin, events // 2: move, 3 * events // 4: end},
            failures_ok=client == "redis-py",
        )
    finally:
        await alone.close()
        await stacked.close()
    assert all(count >= 1 for count in moved)  # the keys did move while in use
    for run, (slot, _, target) in zip((alone, stacked), moves, strict=True):
        assert fresh_cluster.owner(slot) is target
        assert_exact(run)
        if client == "thin":
            assert run.store.counters.failed_calls == 0


@pytest.mark.parametrize("client", CLIENTS)
async def test_failover_and_a_killed_master_never_turn_a_failure_into_a_verdict(
    ha_cluster: RedisClusterHarness, client: str
) -> None:
    """A replica promoted by CLUSTER FAILOVER takes over with every verdict exact; then its
    master is killed: until its replica is promoted the calls fail (503 with on_failure deny),
    never decided from a wrong reply, and afterwards the verdicts are exact again."""
    alone = Run(ha_cluster.url, client, [per_client()], on_failure="deny", timeout_s=0.5)
    stacked = Run(
        ha_cluster.url, client, [per_client(), global_limit()], on_failure="deny", timeout_s=0.5
    )
    slot = slot_of(stacked.redis_key("a"))
    successor: list[RedisServer] = []

    def failover() -> None:
        master = ha_cluster.owner(slot)
        ha_cluster.promote(slot, ha_cluster.replica_of(master))

    def kill() -> None:
        master = ha_cluster.owner(slot)
        successor.append(ha_cluster.replica_of(master))
        with redis.Redis(host="127.0.0.1", port=master.port) as plain:
            assert plain.execute_command("WAIT", 1, 2000) == 1  # its replica has every write
        master.stop()

    events = len(trace())
    try:
        await run_trace(
            [(alone, False), (stacked, True)],
            {events // 3: failover, 2 * events // 3: kill},
            failures_ok=True,
        )
        # The outage lasts until the replica is promoted (cluster-node-timeout 3 s): the rest of
        # the trace may have gone by meanwhile. Now the cluster serves again: so must the store.
        ha_cluster.wait_owner(slot, successor[0])
        deadline = asyncio.get_running_loop().time() + 15
        while asyncio.get_running_loop().time() < deadline:
            before = stacked.failed
            stacked.clock.advance(0.001)
            await stacked.step([(stacked.clock.last_us - T0_US, "a")], failures_ok=True)
            if stacked.failed == before:
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("the store never came back after the failover")
    finally:
        await alone.close()
        await stacked.close()
    for run in (alone, stacked):
        assert_exact(run)
        assert run.store.counters.local_decisions == 0
    assert stacked.failed > 0  # the killed master's slot did fail for a while


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_dead_node_fails_its_own_calls_only_then_clusterdown_is_a_failure(
    fresh_cluster: RedisClusterHarness, client: str
) -> None:
    """Calls for two nodes go out together and one node is dead: its calls fail, the other's
    are answered (a pipeline's failure never takes a neighbour's verdict, nor charges a call
    the caller was told failed). Once the cluster marks the node failed, the live nodes
    answer CLUSTERDOWN: a failure too (on_failure), never a verdict."""
    run = Run(fresh_cluster.url, client, [per_client()], on_failure="deny")
    try:
        await run.store.prepare()
        owners = {name: fresh_cluster.owner(slot_of(run.redis_key(name))) for name in "abcdefgh"}
        dead_name = "a"
        live_name = next(name for name, node in owners.items() if node is not owners["a"])
        await run.step([(0, dead_name), (0, live_name)])  # both keys exist, verdicts exact
        owners[dead_name].stop()
        for at_us in range(100_000, 1_100_000, 100_000):
            await run.step([(at_us, dead_name), (at_us, live_name)], failures_ok=True)
            if run.failed >= 3:  # the circuit opens: everything fails from here
                break
        assert run.failed >= 1
        assert run.compared >= 3  # the live node's calls were answered, and exactly
        assert_exact(run, whole_trace=False)
        # The cluster notices (cluster-node-timeout 3 s): the live node says CLUSTERDOWN.
        deadline = asyncio.get_running_loop().time() + 15
        with redis.Redis(host="127.0.0.1", port=owners[live_name].port) as plain:
            while "cluster_state:fail" not in plain.execute_command("CLUSTER", "INFO").decode():
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.1)
        await asyncio.sleep(run.store.breaker.retry_in_s + 0.1)  # let the circuit probe again
        compared = run.compared
        with pytest.raises(StoreUnavailableError, match=r"CLUSTERDOWN|cluster is down"):
            run.clock.set(T0_US + 2_000_000)
            await run.store.decide(run.checks(live_name))
        assert run.compared == compared
    finally:
        await run.close()


def test_a_reply_that_is_not_its_own_calls_answer_is_an_error_never_a_verdict() -> None:
    """The script ends its reply with the call's number: a reply of another call (shifted in
    a pipeline), of another command, or of another shape raises instead of being read."""
    assert checked([1_000, 1, 0, 0, 5, 0, 7], 7, 6) == [1_000, 1, 0, 0, 5, 0]
    for reply, call in [
        ([1_000, 1, 0, 0, 5, 0, 6], 7),  # another call's
        ([1_000, 1, 0, 0, 5, 0], 7),  # no call number: an older script
        (b"OK", 7),  # another command's
        ([1_000, 1, b"0", 0, 5, 0, 7], 7),
        ([1_000, 7], 7),  # a refund's, read as a decision
    ]:
        with pytest.raises(StoreReplyError):
            checked(reply, call, 6)
