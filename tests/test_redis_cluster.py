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
import time
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from gateway.algorithms.combine import CombinedDecision
from gateway.algorithms.fixed_window import FixedWindow
from gateway.algorithms.leaky_bucket import LeakyBucket
from gateway.algorithms.registry import build_algorithm
from gateway.clock import FakeClock
from gateway.limits.compiled import Check, CompiledLimit, LimitCounters
from gateway.limits.keys import KeyBuilder
from gateway.policy.models import Policy
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


# The instant of the event whose decision runs in this task (``Run.step``).
_event_us: ContextVar[int | None] = ContextVar("event_us", default=None)


class Instants:
    """The store's clock: a script call made for an event reads that event's instant (so calls
    sent together still carry their own, whichever of them a circuit refused), any other the
    last instant set."""

    def __init__(self, start_us: int) -> None:
        self.last_us = start_us

    def set(self, now_us: int) -> None:
        self.last_us = now_us

    def advance(self, seconds: float) -> None:
        self.set(self.last_us + round(seconds * 1e6))

    def now_us(self) -> int:
        event_us = _event_us.get()
        if event_us is not None:
            self.last_us = event_us
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

        async def decide(at_us: int, client: str) -> CombinedDecision:
            _event_us.set(T0_US + at_us)  # this task's: its calls read it
            return await self.store.decide(self.checks(client))

        # The calls start in order within one turn of the loop: one pipeline per node.
        results = await asyncio.gather(
            *[decide(at_us, client) for at_us, client in events], return_exceptions=True
        )
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
    the caller was told failed), before the dead node's circuit opens and after, when only
    its probes go out beside the live node's calls (redis-py failed a whole cluster pipeline
    that could not connect to one node, after the others had run their calls: it now sends
    a pipeline per node). Once the cluster marks the node failed, the live nodes answer
    CLUSTERDOWN: a failure too (on_failure), never a verdict."""
    run = Run(fresh_cluster.url, client, [per_client()], on_failure="deny")
    try:
        await run.store.prepare()
        owners = {name: fresh_cluster.owner(slot_of(run.redis_key(name))) for name in "abcdefgh"}
        dead_name = "a"
        live_name = next(name for name, node in owners.items() if node is not owners["a"])
        await run.step([(0, dead_name), (0, live_name)])  # both keys exist, verdicts exact
        owners[dead_name].stop()
        dead_circuit = run.store.circuits.of(f"127.0.0.1:{owners[dead_name].port}")
        steps = 0
        deadline = asyncio.get_running_loop().time() + 2.0
        # Until the dead node's circuit has opened and probed again (0.5 s, real time).
        while dead_circuit.probes < 2 and asyncio.get_running_loop().time() < deadline:
            steps += 1
            await run.step([(steps * 1000, dead_name), (steps * 1000, live_name)], failures_ok=True)
            await asyncio.sleep(0.02)
        assert dead_circuit.opened >= 1 and dead_circuit.probes >= 1
        assert run.failed == steps  # the dead node's calls only
        assert run.compared == 2 + steps  # the live node's calls were answered, and exactly
        assert_exact(run, whole_trace=False)
        # The cluster notices (cluster-node-timeout 3 s): the live node says CLUSTERDOWN.
        deadline = asyncio.get_running_loop().time() + 15
        with redis.Redis(host="127.0.0.1", port=owners[live_name].port) as plain:
            while "cluster_state:fail" not in plain.execute_command("CLUSTER", "INFO").decode():
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.1)
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


@pytest.fixture
def partial_cluster(tmp_path: Path) -> Iterator[RedisClusterHarness]:
    """Three masters that go on serving their own slots while another is down
    (``cluster-require-full-coverage no``: otherwise, once the cluster marks a master failed,
    every node answers CLUSTERDOWN until a replica takes over)."""
    (tmp_path / "partial").mkdir()
    cluster = RedisClusterHarness(
        tmp_path / "partial", extra_args=("--cluster-require-full-coverage", "no")
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def wait_marked_failed(cluster: RedisClusterHarness, dead: RedisServer, timeout_s: float) -> None:
    """Until every live node flags ``dead`` as failed (cluster-node-timeout, 3 s here)."""
    deadline = time.monotonic() + timeout_s
    address = f"127.0.0.1:{dead.port}"
    while time.monotonic() < deadline:
        flagged = 0
        for node in cluster.live():
            with redis.Redis(host="127.0.0.1", port=node.port) as plain:
                nodes = plain.execute_command("CLUSTER", "NODES")
            text = nodes.decode() if isinstance(nodes, bytes) else str(nodes)
            line = next((ln for ln in text.splitlines() if address in ln), "")
            flagged += "fail" in line.split()[2] if line else 0
        if flagged == len(cluster.live()):
            return
        time.sleep(0.1)
    raise AssertionError(f"{address} was not marked failed in {timeout_s:g} s")


def leased_per_client() -> CompiledLimit:
    policy = Policy.model_validate(
        {
            "limits": {
                "per_client": {
                    "algorithm": "fixed_window",
                    "limit": 5,
                    "window": "1s",
                    "key": ["header:x-client"],
                    "lease": {},
                }
            }
        }
    )
    spec = policy.limits["per_client"]
    return CompiledLimit(
        "per_client", spec, build_algorithm(spec), KeyBuilder(spec.key), None, None, 1.0,
        LimitCounters(),
    )  # fmt: skip


@pytest.mark.reliability
@pytest.mark.parametrize("kind", ["exact", "leased"])
@pytest.mark.parametrize("client", CLIENTS)
async def test_a_dead_master_makes_only_its_own_keys_fall_back(
    partial_cluster: RedisClusterHarness,
    client: str,
    kind: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One of three masters is killed (SIGKILL) under a per-client limit (5 a second, decided
    per request or leased) with ``on_failure: local``. Its clients' keys fall back to the local
    limit once its circuit opens (three failed calls, then a probe now and then); the other
    two masters' keys are decided in Redis all along, every verdict the in-process store's,
    before the cluster notices the dead node and after it marks it failed. Before, one circuit
    for the whole store opened on the dead node's failures and every key fell back."""
    if kind == "leased":
        limit = leased_per_client()
    else:
        limit = compiled("per_client", FixedWindow(5, 1.0), ("header:x-client",))
    clock = FakeClock(T0_US)  # the breaker's and the fallback's
    instants = Instants(T0_US)  # the scripts'
    memory_clock = FakeClock(T0_US)
    memory = MemoryStore(memory_clock)
    memory.configure([limit], [])
    store = RedisStore(
        partial_cluster.url,
        client=client,  # type: ignore[arg-type]
        key_prefix=f"dead{next(_prefixes)}:",
        time_source=instants,
        clock=clock,
        timeout_s=1.0,
        on_failure="local",
    )
    store.configure([limit], [])
    names = [f"client{n}" for n in range(30)]
    where = store.leases.redis_key if kind == "leased" else store.redis_key
    owners = {name: partial_cluster.owner(slot_of(where(Check(limit, name)))) for name in names}
    dead = owners[names[0]]
    live = [name for name in names if owners[name] is not dead]
    assert len({owners[name].port for name in live}) == 2  # keys on both other masters
    mismatches: list[str] = []
    local_live: list[str] = []
    local_dead = 0
    admitted = {"redis": 0, "memory": 0}

    async def step(at_us: int) -> None:
        nonlocal local_dead
        instants.set(at_us)
        clock.set(at_us)
        memory_clock.set(at_us)
        for name in names:
            before = store.counters.local_decisions
            got = await store.decide([Check(limit, name)])
            fell_back = store.counters.local_decisions > before
            if owners[name] is dead:
                local_dead += fell_back
                continue
            want = await memory.decide([Check(limit, name)])
            admitted["redis"] += got.allowed
            admitted["memory"] += want.allowed
            if fell_back:
                local_live.append(f"{at_us - T0_US} {name}")
            elif got.allowed != want.allowed or (
                kind == "exact" and got.retry_after_s != want.retry_after_s
            ):
                mismatches.append(f"{at_us - T0_US} {name}: {got} != {want}")

    try:
        await store.prepare()
        at_us = T0_US
        for _ in range(10):  # 1 s: every key on Redis
            await step(at_us)
            at_us += 100_000
        assert local_dead == 0 and not local_live and not mismatches
        dead.stop()
        for _ in range(20):  # 2 s, before the cluster notices
            await step(at_us)
            at_us += 100_000
        wait_marked_failed(partial_cluster, dead, 20.0)
        for _ in range(20):  # 2 s more, the dead node marked failed
            await step(at_us)
            at_us += 100_000
        failed_calls = store.counters.failed_calls
        state = store.stats.state
    finally:
        await store.close()
    with capsys.disabled():
        print(
            f"\n[{client}, {kind}] a master of 3 killed: {len(live)} clients on the 2 live "
            "masters, "
            f"{admitted['redis']} admitted (in process: {admitted['memory']}), "
            f"{len(local_live)} decided locally; {len(names) - len(live)} on the dead one, "
            f"{local_dead} of {40 * (len(names) - len(live))} decisions local, "
            f"{failed_calls} failed calls"
        )
    assert not local_live, f"{len(local_live)} live keys fell back: {local_live[:5]}"
    assert not mismatches, mismatches[:5]
    assert admitted["redis"] == admitted["memory"]
    # The dead node's keys: all but the calls that opened its circuit and its probes.
    assert local_dead >= 40 * (len(names) - len(live)) - failed_calls
    assert failed_calls <= 3 + 4  # the threshold, then a probe every 0.5, 1, 2 s (fake)
    assert state == "open"


@pytest.fixture
def partial_ha_cluster(tmp_path: Path) -> Iterator[RedisClusterHarness]:
    """Three masters with a replica each, serving their own slots while another is down."""
    (tmp_path / "partial-ha").mkdir()
    cluster = RedisClusterHarness(
        tmp_path / "partial-ha", replicas=1, extra_args=("--cluster-require-full-coverage", "no")
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.reliability
@pytest.mark.parametrize("client", CLIENTS)
async def test_what_a_dead_masters_keys_admitted_locally_is_charged_to_its_successor(
    partial_ha_cluster: RedisClusterHarness, client: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """10 requests an hour per client. Each client is admitted 3 through Redis; then one master
    is killed. The other masters' clients are admitted 7 more through Redis; the dead one's,
    7 more by the local fallback (its share starts from the 3 this replica admitted). Its
    replica takes over its slots; then what the fallback admitted is charged to it before it
    decides those keys again: no client is admitted more than 10 in all, and no key on a live
    master was decided locally. The counts owed were filed under the dead master and are
    filed again under the node serving the key once the client reads the new slot map."""
    window_us = 3_600_000_000
    start_us = T0_US - T0_US % window_us + 1  # one window all along
    limit = compiled("per_client", FixedWindow(10, 3600.0), ("header:x-client",))
    clock = FakeClock(start_us)
    instants = Instants(start_us)
    store = RedisStore(
        partial_ha_cluster.url,
        client=client,  # type: ignore[arg-type]
        key_prefix=f"succ{next(_prefixes)}:",
        time_source=instants,
        clock=clock,
        timeout_s=1.0,
        on_failure="local",
    )
    store.configure([limit], [])
    names = [f"client{n}" for n in range(24)]
    slots = {name: slot_of(store.redis_key(Check(limit, name))) for name in names}
    owners = {name: partial_ha_cluster.owner(slots[name]) for name in names}
    dead = owners[names[0]]
    successor = partial_ha_cluster.replica_of(dead)
    partial_ha_cluster.wait_synced(successor)
    on_dead = {name for name in names if owners[name] is dead}
    admitted = dict.fromkeys(names, 0)
    live_local: list[str] = []

    async def round_of(requests: int) -> None:
        clock.advance(1.0)  # and the circuits may probe (0.5, 1, 2, 4 s)
        instants.set(clock.now_us())
        for name in names:
            for _ in range(requests):
                before = store.counters.local_decisions
                admitted[name] += (await store.decide([Check(limit, name)])).allowed
                if name not in on_dead and store.counters.local_decisions > before:
                    live_local.append(name)

    try:
        await store.prepare()
        await round_of(3)
        with redis.Redis(host="127.0.0.1", port=dead.port) as plain:
            assert plain.execute_command("WAIT", 1, 2000) == 1  # its replica has every write
        dead.stop()
        await round_of(10)
        during = {name: admitted[name] for name in names}
        local_before = store.counters.local_decisions
        partial_ha_cluster.wait_owner(slots[names[0]], successor)
        for _ in range(10):  # until the dead master's keys are decided in Redis again
            local = store.counters.local_decisions
            await round_of(1)
            if store.counters.local_decisions == local:
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("the dead master's keys never went back to Redis")
        await round_of(5)
        carried_back = store.counters.carried_back
        owed = len(store.owed)
    finally:
        await store.close()
    with capsys.disabled():
        print(
            f"\n[{client}] a master killed, its replica promoted: {len(on_dead)} of "
            f"{len(names)} clients on it; admitted by the end of the outage "
            f"{sorted(set(during.values()))}, in all {sorted(set(admitted.values()))}; "
            f"{carried_back} units carried back; "
            f"{store.counters.local_decisions - local_before} local decisions after"
        )
    assert not live_local, live_local[:5]
    assert all(during[name] == 10 for name in names), during
    assert all(count == 10 for count in admitted.values()), admitted
    assert carried_back == 7 * len(on_dead) and owed == 0
